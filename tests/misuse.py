"""What a user who forgets a step gets: run by tests/test_misuse.py in fresh processes.

    python tests/misuse.py sharder       # each way to forget the sharder (one rank)
    torchrun --nproc_per_node 2 tests/misuse.py refusal [with]   # a refusal nobody catches

``sharder`` prints one line per way, ``<way>: <error type>: <message>`` (or ``<way>:
trained`` if it trained). ``refusal`` trains until a batch with an out-of-range id at step
5, which the loop (the README's) does not catch: the process must end with the
traceback and exit code 1.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead import (
    LookaheadEmbeddingBagCollection,
    LookaheadEmbeddingBagCollectionSharder,
    LookaheadTrainPipeline,
)
from torchrec_lookahead.data import SyntheticCriteo
from torchrec_lookahead.data.torchrec_batches import criteo_batch

BATCH = 64


def model(data: SyntheticCriteo, device: str, **settings: object) -> DLRMTrain:
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=8, num_embeddings=n, feature_names=[f"cat_{i}"]
        )
        for i, n in enumerate(data.num_embeddings)
    ]
    ebc = LookaheadEmbeddingBagCollection(
        tables=tables, device=torch.device(device), cache_load_factor=0.2, **settings
    )
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=13,
            dense_arch_layer_sizes=[16, 8],
            over_arch_layer_sizes=[8, 1],
        )
    )


def train(dmp: torch.nn.Module, batches: list[Batch]) -> None:
    """The README's loop: catches only the end of the data."""
    dense = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n]
    pipeline = LookaheadTrainPipeline(dmp, torch.optim.SGD(dense, lr=0.1), torch.device("cpu"), 2)
    it = iter(batches)
    while True:
        try:
            pipeline.progress(it)
        except StopIteration:
            break


def forget_the_sharder(data: SyntheticCriteo, batches: list[Batch]) -> None:
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    for way in ("meta", "in-backward", "fused_params", "plan"):
        try:
            if way == "meta":
                dmp = DistributedModelParallel(model(data, "meta"), device=torch.device("cpu"))
            elif way == "in-backward":
                plain = model(data, "cpu")
                apply_optimizer_in_backward(
                    RowWiseAdagrad, plain.model.sparse_arch.parameters(), {"lr": 0.05}
                )
                dmp = DistributedModelParallel(plain, device=torch.device("cpu"))
            elif way == "fused_params":
                plain = model(data, "cpu", fused_params=fused)
                dmp = DistributedModelParallel(plain, device=torch.device("cpu"))
            else:  # planned with the lookahead sharder, DMP given none
                meta = model(data, "meta", fused_params=fused)
                sharders = [LookaheadEmbeddingBagCollectionSharder()]
                topology = Topology(world_size=1, compute_device="cpu")
                plan = EmbeddingShardingPlanner(topology=topology, batch_size=BATCH).plan(
                    meta, sharders
                )
                dmp = DistributedModelParallel(meta, device=torch.device("cpu"), plan=plan)
            train(dmp, batches)
            print(f"{way}: trained", flush=True)
        except Exception as error:  # noqa: BLE001 -- reported, then the next way
            print(f"{way}: {type(error).__name__}: {error}", flush=True)


def refuse_uncaught(data: SyntheticCriteo, batches: list[Batch], with_block: bool) -> None:
    features = batches[5].sparse_features
    values = features.values().clone()
    values[0] = 10**9  # out of range for every table
    batches[5].sparse_features = KeyedJaggedTensor(
        features.keys(), values, lengths=features.lengths()
    )
    meta = model(data, "meta")
    apply_optimizer_in_backward(RowWiseAdagrad, meta.model.sparse_arch.parameters(), {"lr": 0.05})
    sharders = [LookaheadEmbeddingBagCollectionSharder()]
    topology = Topology(world_size=dist.get_world_size(), compute_device="cpu")
    plan = EmbeddingShardingPlanner(topology=topology, batch_size=BATCH).collective_plan(
        meta, sharders, dist.GroupMember.WORLD
    )
    dmp = DistributedModelParallel(meta, device=torch.device("cpu"), plan=plan, sharders=sharders)
    if with_block:
        dense = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n]
        with LookaheadTrainPipeline(
            dmp, torch.optim.SGD(dense, lr=0.1), torch.device("cpu"), 2
        ) as pipeline:
            it = iter(batches)
            while True:
                pipeline.progress(it)
    train(dmp, batches)


def main() -> None:
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
    dist.init_process_group("gloo")
    data = SyntheticCriteo(scale=0.001, seed=dist.get_rank())
    batches = [criteo_batch(data, step, BATCH) for step in range(10)]
    torch.manual_seed(0)
    if sys.argv[1] == "sharder":
        forget_the_sharder(data, batches)
    else:
        refuse_uncaught(data, batches, with_block=sys.argv[2:] == ["with"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
