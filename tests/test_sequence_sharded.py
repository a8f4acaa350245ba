"""LookaheadEmbeddingCollectionSharder: sequence tables sharded by DMP (table-, column- and
row-wise, at world sizes 1, 2 and 4, gloo), trained bitwise as plain TorchRec's sharded
EmbeddingCollection (TorchRec's default sharder, TrainPipelineSparseDist), alone and beside
a bag collection; what it refuses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from tests.distributed_cases import assert_equal_states, train
from tests.launch import free_port, spawn
from tests.models import DENSE_LR, LR, OPTIMIZERS, WEIGHTED, batches
from tests.test_sequence import SEQUENCE, SequenceModel, sequence_only
from torchrec_lookahead import (
    LookaheadEmbeddingBagCollection,
    LookaheadEmbeddingCollection,
    LookaheadTrainPipeline,
    lookahead_sharders,
)
from torchrec_lookahead.data.dedup import deduplicate
from torchrec_lookahead.embedding import ShardedLookaheadEmbeddingCollection

STEPS = 24


@dataclass(frozen=True)
class Case:
    sharding_type: str  # the sequence tables' (the bag tables of a mixed model: table-wise)
    optimizer: str
    mixed: bool = False  # a bag collection beside the sequence collection


def build(model: SequenceModel, sharders: list, case: Case, world_size: int):
    """``model`` sharded by DMP with ``sharders`` as ``case`` says, its optimizers and plan."""
    for module in filter(None, (model.sequence, model.pooled)):
        apply_optimizer_in_backward(OPTIMIZERS[case.optimizer][0], module.parameters(), {"lr": LR})
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=[case.sharding_type], compute_kernels=["fused"], min_partition=4
        )
        for t in SEQUENCE
    } | {
        t.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
        for t in WEIGHTED
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        batch_size=32,
        constraints=constraints,
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=DENSE_LR),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), plan


def models(case: Case) -> tuple[SequenceModel, SequenceModel]:
    """Plain TorchRec's model and the lookahead one (tables on meta, for DMP to build)."""
    meta = torch.device("meta")
    plain = SequenceModel(
        EmbeddingCollection(SEQUENCE, device=meta),
        EmbeddingBagCollection(WEIGHTED, is_weighted=True, device=meta) if case.mixed else None,
    )
    look = SequenceModel(
        LookaheadEmbeddingCollection(SEQUENCE, device=meta, cache_load_factor=0.05),
        LookaheadEmbeddingBagCollection(
            WEIGHTED, is_weighted=True, device=meta, cache_load_factor=0.05
        )
        if case.mixed
        else None,
    )
    return plain, look


def check(case: Case, rank: int, world_size: int) -> None:
    data = batches(STEPS, seed=100 + rank)
    data = data if case.mixed else sequence_only(data)
    plain, look = models(case)
    base, base_opt, base_plan = build(plain, get_default_sharders(), case, world_size)
    dmp, opt, plan = build(look, lookahead_sharders(), case, world_size)
    assert str(base_plan) == str(plan), "both models must get the same plan"
    assert isinstance(dmp.module.sequence, ShardedLookaheadEmbeddingCollection)
    dmp.load_state_dict(base.state_dict())  # a plain TorchRec checkpoint

    expected = train(TrainPipelineSparseDist(base, base_opt, torch.device("cpu")), data)
    pipeline = LookaheadTrainPipeline(dmp, opt, torch.device("cpu"), lookahead=2)
    got = train(pipeline, data)
    assert len(got) == len(expected) == STEPS
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"{case}: rank {rank} step {step} output differs"
    assert_equal_states(base.state_dict(), dmp.state_dict(), f"{case} weights")
    assert_equal_states(
        base_opt.state_dict()["state"], opt.state_dict()["state"], f"{case} optimizer"
    )
    # Rows moved through the sequence tables' caches (a cache sized to hold a window of
    # every rank's ids may hold all of this short run's rows: no eviction is asked for).
    metrics = pipeline.cache_metrics()
    sequence = [v for k, v in metrics.items() if ".sequence." in k]
    assert sequence and sum(m.misses for m in sequence) > 0, metrics


def check_refusals(rank: int, world_size: int) -> list[str]:
    """A deduplicated batch on rank 0 only: every rank refuses it, and training goes on."""
    case = Case("row_wise", "sgd")
    data = sequence_only(batches(8, seed=100 + rank))
    _, look = models(case)
    dmp, opt, _ = build(look, lookahead_sharders(), case, world_size)
    stream = list(data)
    if rank == 0:
        features = stream[3].sparse_features
        stream[3] = type(stream[3])(
            stream[3].dense_features, deduplicate(features, features.keys()[:1]), stream[3].labels
        )
    refused: list[str] = []
    got = train(LookaheadTrainPipeline(dmp, opt, torch.device("cpu"), lookahead=2), stream, refused)
    assert len(got) == len(data) - 1, len(got)
    return refused


def _worker(rank: int, world_size: int, port: int, cases: list[Case], out: str) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        for case in cases:
            check(case, rank, world_size)
        if out:
            Path(f"{out}.{rank}").write_text("\n".join(check_refusals(rank, world_size)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("world_size", "cases"),
    [
        (1, [Case("table_wise", "adagrad", mixed=True)]),
        (
            2,
            [
                Case("table_wise", "sgd"),
                Case("column_wise", "adagrad"),
                Case("row_wise", "rowwise_adagrad"),
                Case("row_wise", "adagrad", mixed=True),
            ],
        ),
        (4, [Case("row_wise", "sgd"), Case("column_wise", "rowwise_adagrad", mixed=True)]),
    ],
    ids=["ws1", "ws2", "ws4"],
)
def test_sharded_sequence_tables_train_bitwise_as_torchrecs(
    world_size: int, cases: list[Case]
) -> None:
    spawn(_worker, (world_size, free_port(), cases, ""), nprocs=world_size)


def test_a_deduplicated_batch_is_refused_on_every_rank(tmp_path: Path) -> None:
    out = tmp_path / "refused"
    spawn(_worker, (2, free_port(), [], str(out)), nprocs=2)
    said = [Path(f"{out}.{rank}").read_text() for rank in range(2)]
    assert "deduplicated (variable-stride) batch is not taken" in said[0], said
    assert "another rank refused" in said[1], said
