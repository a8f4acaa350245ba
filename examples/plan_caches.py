"""Sizing caches with the planner (docs/guides/planner.md), whole: measure, plan, shard, train.

    python examples/plan_caches.py                                       # one rank
    torchrun --standalone --nproc_per_node 2 examples/plan_caches.py     # two ranks, gloo

Measures each table's miss rate from 20 sample batches, has the lookahead
planner size every table's cache within a 1 MiB budget, shards DLRM with that
plan and trains 20 steps. The lines between the markers are the block the
planner guide and the README show (a test keeps the three equal and runs this file).
"""

import os

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import Topology
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from planners import LookaheadCacheStatistics, lookahead_planner, plan_report
from torchrec_lookahead import (
    LookaheadEmbeddingBagCollection,
    LookaheadEmbeddingBagCollectionSharder,
    LookaheadTrainPipeline,
)
from torchrec_lookahead.data import SyntheticCriteo
from torchrec_lookahead.data.torchrec_batches import criteo_batch

if "RANK" not in os.environ:  # one process, no torchrun
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29513")
dist.init_process_group("gloo")
ws, batch_size = dist.get_world_size(), 256
data = SyntheticCriteo(scale=0.01, seed=0)
tables = [
    EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=n, feature_names=[f"cat_{i}"])
    for i, n in enumerate(data.num_embeddings)
]
model = DLRMTrain(
    DLRM(
        embedding_bag_collection=LookaheadEmbeddingBagCollection(
            tables=tables,
            device=torch.device("meta"),
            fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05},
        ),
        dense_in_features=13,
        dense_arch_layer_sizes=[32, 16],
        over_arch_layer_sizes=[32, 1],
    )
)
topology = Topology(world_size=ws, compute_device="cpu")
pg = dist.GroupMember.WORLD
# sample_ids[table]: that table's ids in each of 20 sample batches (global batches: every
# rank's share together), here drawn from the synthetic data; any 1-D id arrays will do.
streams = data.table_streams(ws * batch_size, 20)
sample_ids = {t.name: streams[i] for i, t in enumerate(tables)}

# --- sizing caches with the planner, as the planner guide shows it ---
stats = {
    t.name: LookaheadCacheStatistics(sample_ids[t.name], t.num_embeddings, lookahead=16)
    for t in tables
}
planner, proposal = lookahead_planner(
    topology,
    batch_size,
    tables,
    stats,
    EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    step_compute_ms=10.0,
    cache_budget_bytes=1 << 20,
)
plan = planner.collective_plan(model, [LookaheadEmbeddingBagCollectionSharder()], pg)
print(plan_report(plan, proposal))  # per table: sharding, ranks, cache, misses, traffic, memory
# --- end of the planner block ---

sharders = [LookaheadEmbeddingBagCollectionSharder()]
dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
dense = KeyedOptimizerWrapper(
    dict(in_backward_optimizer_filter(dmp.named_parameters())),
    lambda ps: torch.optim.SGD(ps, lr=0.1),
)
optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
rank_data = SyntheticCriteo(scale=0.01, seed=dist.get_rank())  # each rank its own batches
batches = iter([criteo_batch(rank_data, step, batch_size) for step in range(20)])
with LookaheadTrainPipeline(dmp, optimizer, torch.device("cpu"), lookahead=16) as pipeline:
    steps = 0
    while True:
        try:
            pipeline.progress(batches)
            steps += 1
        except StopIteration:
            break
if dist.get_rank() == 0:
    hit_rate = pipeline.cache_metrics()["total"].hit_rate
    print(f"trained {steps} steps on {ws} rank(s) with the planned caches, hit rate {hit_rate:.3f}")
dist.barrier()
dist.destroy_process_group()
