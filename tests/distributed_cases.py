"""The canonical use (DESIGN.md section 5) against plain TorchRec, run in spawned gloo ranks.

Each rank builds the baseline (``EmbeddingBagCollection``, default sharder,
``TrainPipelineSparseDist``) and the lookahead model (same code with
``LookaheadEmbeddingBagCollection``, ``LookaheadEmbeddingBagCollectionSharder``
and ``LookaheadTrainPipeline``), loads the baseline's checkpoint into the
lookahead model, trains both on the same per-rank batches, and asserts that
every step's output, every local shard of every table, every optimizer-state
shard and every dense parameter are equal, bitwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import SGD, Adagrad, RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_lookahead import LookaheadEmbeddingBagCollection, LookaheadTrainPipeline
from torchrec_lookahead.data import SyntheticCriteo
from torchrec_lookahead.data.torchrec_batches import criteo_batch, feature_names
from torchrec_lookahead.sharder import LookaheadEmbeddingBagCollectionSharder

OPTIMIZERS = {"sgd": SGD, "adagrad": Adagrad, "rowwise_adagrad": RowWiseAdagrad}
SIZES = (6000, 3000, 1500)
DIM = 32
BATCH = 32


@dataclass(frozen=True)
class Case:
    sharding_type: str
    optimizer: str
    lookahead: int
    steps: int = 100
    cache_load_factor: float = 0.2


def tables() -> list[EmbeddingBagConfig]:
    names = feature_names(SyntheticCriteo(table_sizes=SIZES))
    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=n,
                           feature_names=[names[i]])
        for i, n in enumerate(SIZES)
    ]  # fmt: skip


def build(ebc, sharders, case: Case, world_size: int):
    dlrm = DLRM(embedding_bag_collection=ebc, dense_in_features=13,
                dense_arch_layer_sizes=[32, DIM], over_arch_layer_sizes=[32, 1])  # fmt: skip
    model = DLRMTrain(dlrm)
    apply_optimizer_in_backward(
        OPTIMIZERS[case.optimizer], model.model.sparse_arch.parameters(), {"lr": 0.05}
    )
    constraints = {
        t.name: ParameterConstraints(sharding_types=[case.sharding_type], min_partition=DIM // 2)
        for t in tables()
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        batch_size=BATCH,
        constraints=constraints,
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.1),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), plan


def train(pipeline, batches) -> list[torch.Tensor]:
    it, logits = iter(batches), []
    while True:
        try:
            logits.append(pipeline.progress(it)[1])
        except StopIteration:
            return logits


def local(value):
    if hasattr(value, "local_shards"):
        return [shard.tensor for shard in value.local_shards()]
    return [value] if isinstance(value, torch.Tensor) else []


def assert_equal_states(expected: dict, got: dict, what: str) -> None:
    assert list(expected) == list(got), f"{what}: keys differ"
    for key in expected:
        for a, b in zip(local(expected[key]), local(got[key]), strict=True):
            assert torch.equal(a, b), f"{what}: {key} differs"


def check(case: Case, rank: int, world_size: int) -> None:
    data = SyntheticCriteo(table_sizes=SIZES, zipf_exponent=1.05, seed=100 + rank)
    batches = [criteo_batch(data, s, BATCH) for s in range(case.steps)]
    base, base_opt, base_plan = build(
        EmbeddingBagCollection(tables=tables(), device=torch.device("meta")),
        [EmbeddingBagCollectionSharder()], case, world_size,
    )  # fmt: skip
    sharders = [LookaheadEmbeddingBagCollectionSharder()]
    ebc = LookaheadEmbeddingBagCollection(
        tables=tables(), device=torch.device("meta"), cache_load_factor=case.cache_load_factor
    )
    look, look_opt, look_plan = build(ebc, sharders, case, world_size)
    assert str(base_plan) == str(look_plan), "both models must get the same plan"
    look.load_state_dict(base.state_dict())  # a plain TorchRec checkpoint

    expected = train(TrainPipelineSparseDist(base, base_opt, torch.device("cpu")), batches)
    pipeline = LookaheadTrainPipeline(look, look_opt, torch.device("cpu"), lookahead=case.lookahead)
    got = train(pipeline, batches)
    assert len(got) == len(expected) == case.steps
    for step, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"{case}: rank {rank} step {step} output differs"
    assert_equal_states(base.state_dict(), look.state_dict(), f"{case} weights")
    assert_equal_states(
        base_opt.state_dict()["state"], look_opt.state_dict()["state"], f"{case} optimizer"
    )
    total = pipeline.cache_metrics()["total"]
    assert total.rows_written_back > 0, f"{case}: the cache never evicted; the test is too easy"


def worker(rank: int, world_size: int, port: int, cases: list[Case]) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # no oversubscription
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for case in cases:
            check(case, rank, world_size)
    finally:
        dist.destroy_process_group()
