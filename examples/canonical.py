"""The canonical use (docs/design.md), whole: lookahead caching under DistributedModelParallel.

    python examples/canonical.py                                       # one rank
    torchrun --standalone --nproc_per_node 2 examples/canonical.py     # two ranks, gloo

Trains DLRM for 40 steps on synthetic Criteo-shaped batches (each rank its
own) with 5% of every table cached, then prints each table's shape in the
full, current state dict. The lines between the markers are the block
docs/design.md shows (a test keeps the two equal and runs this file).
"""

import os

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_lookahead import (
    LookaheadEmbeddingBagCollection,
    LookaheadEmbeddingBagCollectionSharder,
    LookaheadTrainPipeline,
)
from torchrec_lookahead.data import SyntheticCriteo
from torchrec_lookahead.data.torchrec_batches import criteo_batch

if "RANK" not in os.environ:  # one process, no torchrun
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29512")
dist.init_process_group("gloo")
ws, B = dist.get_world_size(), 256
data = SyntheticCriteo(scale=0.01, seed=dist.get_rank())  # each rank its own batches
sizes = data.num_embeddings
dataloader = [criteo_batch(data, step, B) for step in range(40)]
torch.manual_seed(0)

# --- the canonical use, as docs/design.md shows it ---
tables = [
    EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=n, feature_names=[f"cat_{i}"])
    for i, n in enumerate(sizes)
]
ebc = LookaheadEmbeddingBagCollection(
    tables=tables, device=torch.device("meta"), cache_load_factor=0.05
)
model = DLRMTrain(
    DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=13,
        dense_arch_layer_sizes=[32, 16],
        over_arch_layer_sizes=[32, 1],
    )
)
apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.05})
sharders = [LookaheadEmbeddingBagCollectionSharder()]
plan = EmbeddingShardingPlanner(
    topology=Topology(world_size=ws, compute_device="cpu"), batch_size=B
).collective_plan(model, sharders, dist.GroupMember.WORLD)
dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
dense = KeyedOptimizerWrapper(
    dict(in_backward_optimizer_filter(dmp.named_parameters())),
    lambda ps: torch.optim.SGD(ps, lr=0.1),
)
opt = CombinedOptimizer([dmp.fused_optimizer, dense])
pipeline = LookaheadTrainPipeline(dmp, opt, torch.device("cpu"), lookahead=16)
it = iter(dataloader)  # yields torchrec.datasets.utils.Batch
while True:
    try:
        pipeline.progress(it)
    except StopIteration:
        break
state = dmp.state_dict()  # full, current tables
# --- end of the canonical use ---

if dist.get_rank() == 0:
    hit_rate = pipeline.cache_metrics()["total"].hit_rate
    print(f"trained {len(dataloader)} steps on {ws} rank(s), cache hit rate {hit_rate:.3f}")
    for key, value in state.items():
        if "embedding_bags" in key:
            print(key, tuple(value.size()))
dist.barrier()
dist.destroy_process_group()
