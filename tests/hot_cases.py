"""Replicated hot rows against plain TorchRec, bitwise, in spawned gloo ranks.

Every case trains plain TorchRec (``EmbeddingBagCollection``, TorchRec's
sharder and ``TrainPipelineSparseDist``) and the lookahead model with hot rows
from the same weights on the same batches, and requires every step's output,
every table shard, every optimizer-state shard and every dense parameter to be
equal, bitwise: on the CPU the replicas' update is the owners' update, summed
in the owners' order (``torchrec_lookahead/embedding/hot/sync.py``). Each case
may also change the learning rate every step, give each table its own
optimizer and rate, close the pipeline and attach another, or load a
checkpoint while the pipeline runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from tests.distributed_cases import (
    OPTIMIZERS,
    Case,
    RowWiseOnCpuSharder,
    _in_process_group,
    build,
    hot_ids,
    local,
    rank_data_and_baseline,
    tables,
)
from torchrec_lookahead import (
    HotRowsEmbeddingBagCollection,
    HotRowsEmbeddingBagCollectionSharder,
    LookaheadTrainPipeline,
)
from torchrec_lookahead.embedding import ShardedHotRowsEmbeddingBagCollection

# Per table (t0, t1, t2): an optimizer and a learning rate of its own.
PER_TABLE = (("rowwise_adagrad", 0.05), ("adagrad", 0.2), ("sgd", 0.02))


@dataclass(frozen=True)
class HotCase:
    sharding_type: str = "table_wise"
    optimizer: str = "rowwise_adagrad"
    steps: int = 40
    lookahead: int = 8
    hot_per_table: int = 64
    schedule: bool = False  # (a) the rate changes every step: warm-up, then decay to 0
    per_table: bool = False  # (d) PER_TABLE's optimizers and rates
    reattach_at: int | None = None  # (c) close the pipeline after this step, attach another
    reload_at: tuple[int, int] | None = None  # (e) (j, k): after step k load step j's state
    mismatched_hot_rows: bool = False  # (b) rank 1 replicates other rows
    eval_first: bool = False  # (g) an eval forward before the first step, outside the pipeline


def rate(step: int) -> float:
    """The schedule's factor at ``step``: a warm-up over 5 steps, constant, then down to 0."""
    return min(1.0, (step + 1) / 5) * max(0.0, min(1.0, (30 - step) / 10))


def per_table_optimizers(model) -> None:  # noqa: ANN001
    bags = model.model.sparse_arch.embedding_bag_collection.embedding_bags
    for t, (optimizer, lr) in zip(tables(), PER_TABLE):
        apply_optimizer_in_backward(OPTIMIZERS[optimizer], [bags[t.name].weight], {"lr": lr})


def check_hot_case(case: HotCase, rank: int, world_size: int) -> None:
    torch.manual_seed(rank)
    base_case = Case(case.sharding_type, case.optimizer, case.lookahead, steps=case.steps)
    batches, _ = rank_data_and_baseline(base_case, rank, world_size)
    hooks = per_table_optimizers if case.per_table else None

    def plain():  # noqa: ANN202
        ebc = EmbeddingBagCollection(tables=tables(), device=torch.device("meta"))
        return build(ebc, [RowWiseOnCpuSharder()], base_case, world_size, configure=hooks)

    base, base_opt, base_plan = plain()
    hot = hot_ids(world_size, case.hot_per_table)
    if case.mismatched_hot_rows and rank == 1:
        # As many rows, one of them another (its bit and gradient would land in the wrong row).
        hot = {name: [max(ids) + 1, *ids[1:]] for name, ids in hot.items()}
    ebc = HotRowsEmbeddingBagCollection(
        tables=tables(), device=torch.device("meta"), cache_load_factor=0.1, hot_rows=hot
    )
    sharders = [HotRowsEmbeddingBagCollectionSharder(cpu_row_wise=True)]
    look, look_opt, look_plan = build(ebc, sharders, base_case, world_size, configure=hooks)
    assert str(base_plan) == str(look_plan)
    look.load_state_dict(base.state_dict())

    def pipeline():  # noqa: ANN202
        return LookaheadTrainPipeline(look, look_opt, torch.device("cpu"), case.lookahead)

    if case.mismatched_hot_rows:
        try:
            pipeline()
        except ValueError as error:
            assert "hold other hot rows" in str(error), error
            return
        raise AssertionError("ranks with different hot rows trained")

    if case.eval_first:  # TorchRec's dists made from a plain batch; the steps' are variable
        for model in (base, look):
            model.eval()
        with torch.no_grad():
            expected, got = base(batches[0])[1][1], look(batches[0])[1][1]
        for model in (base, look):
            model.train()
        assert torch.equal(expected, got), f"{case}: rank {rank}: the first eval differs"

    snapshot = plain() if case.reload_at else None
    base_rates = [g["lr"] for g in base_opt.param_groups]
    look_rates = [g["lr"] for g in look_opt.param_groups]
    base_pipe = TrainPipelineSparseDist(base, base_opt, torch.device("cpu"))
    look_pipe = pipeline()
    base_it, look_it = iter(batches), iter(batches)
    for step in range(case.steps):
        if case.schedule:
            for groups, rates in (
                (base_opt.param_groups, base_rates),
                (look_opt.param_groups, look_rates),
            ):
                for group, lr in zip(groups, rates):
                    group["lr"] = lr * rate(step)
        expected = base_pipe.progress(base_it)[1]
        got = look_pipe.progress(look_it)[1]
        assert torch.equal(expected, got), (
            f"{case}: rank {rank} step {step}: outputs differ by "
            f"{float((expected - got).abs().max()):.3g}"
        )
        if case.reattach_at == step:
            look_pipe.close()
            look_pipe = pipeline()
            look_it = iter(batches[step + 1 :])
        if snapshot is not None and step == case.reload_at[0]:
            snapshot[0].load_state_dict(base.state_dict())
            snapshot[1].load_state_dict(base_opt.state_dict())
        if snapshot is not None and step == case.reload_at[1]:
            for model, optimizer in ((base, base_opt), (look, look_opt)):
                model.load_state_dict(snapshot[0].state_dict())
                optimizer.load_state_dict(snapshot[1].state_dict())
    base_pipe.detach()
    look_pipe.close()
    assert_same(base.state_dict(), look.state_dict(), f"{case} weights")
    assert_same(
        base_opt.state_dict()["state"], look_opt.state_dict()["state"], f"{case} optimizer state"
    )
    sharded = next(m for m in look.modules() if isinstance(m, ShardedHotRowsEmbeddingBagCollection))
    assert sharded.replica_metrics.hot_share > 0.3, sharded.replica_metrics
    for mine in sharded.replica_rows():
        everyone = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(everyone, mine)
        assert all(torch.equal(mine, other) for other in everyone), "replicas differ"


def assert_same(expected: dict, got: dict, what: str) -> None:
    assert list(expected) == list(got), f"{what}: keys differ"
    for key in expected:
        for a, b in zip(local(expected[key]), local(got[key]), strict=True):
            if not torch.equal(a, b):
                gap = float((a.float() - b.float()).abs().max())
                raise AssertionError(f"{what}: {key} differs by {gap:.3g}")


def hot_worker(rank: int, world_size: int, port: int, cases: list[HotCase]) -> None:
    def body() -> None:
        for case in cases:
            check_hot_case(case, rank, world_size)

    _in_process_group(rank, world_size, port, body)
