"""DistributedModelParallel with lookahead caching equals plain TorchRec (spawned gloo ranks)."""

from __future__ import annotations

import pytest

from tests.distributed_cases import (
    OPTIMIZERS,
    Case,
    capped_cache_worker,
    hot_rows_worker,
    integration_worker,
    malformed_worker,
    mixed_growth_worker,
    planned_worker,
    row_wise_deduplicated_worker,
    tracing_worker,
    worker,
)
from tests.launch import free_port, spawn
from tests.models import needs_store_buffers


def run_cases(world_size: int, cases: list[Case]) -> None:
    spawn(worker, (world_size, free_port(), cases), nprocs=world_size)


def test_canonical_use_matches_plain_torchrec() -> None:
    """Every sharding type at two ranks, the optimizers in turn, the stage inline (L = 1)
    or on its thread (L = 16), bitwise. Row-wise on the CPU is TorchRec's own row-wise
    path with its CUDA-only gate lifted. (The differential harness, ``make exactness``,
    draws far more combinations: world sizes 1 to 4, per-table settings, events.)"""
    types = ["table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise"]
    optimizers = list(OPTIMIZERS)
    run_cases(
        2,
        [
            Case(t, optimizers[i % 3], 16 if i % 2 else 1, stage_thread=bool(i % 2))
            for i, t in enumerate(types)
        ],
    )


def test_the_sharder_offers_torchrecs_types_and_row_wise_on_the_cpu_when_asked() -> None:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from torchrec_lookahead import LookaheadEmbeddingBagCollectionSharder

    plain = set(EmbeddingBagCollectionSharder().sharding_types("cpu")) - {"data_parallel"}
    assert set(LookaheadEmbeddingBagCollectionSharder().sharding_types("cpu")) == plain
    asked = LookaheadEmbeddingBagCollectionSharder(cpu_row_wise=True).sharding_types("cpu")
    assert set(asked) == plain | {"row_wise", "table_row_wise"}


def test_a_row_wise_plan_with_an_empty_shard_is_refused_before_sharding() -> None:
    import torch
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    from torchrec_lookahead import (
        LookaheadEmbeddingBagCollection,
        LookaheadEmbeddingBagCollectionSharder,
    )

    tables = [
        EmbeddingBagConfig(
            name=f"t{rows}", embedding_dim=8, num_embeddings=rows, feature_names=[f"f{rows}"]
        )
        for rows in (1, 100)
    ]
    module = LookaheadEmbeddingBagCollection(tables, device=torch.device("meta"))
    sharder = LookaheadEmbeddingBagCollectionSharder(cpu_row_wise=True)
    row_wise = {t.name: ParameterConstraints(sharding_types=["row_wise"]) for t in tables}
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=2, compute_device="cpu"), constraints=row_wise
    ).plan(module, [sharder])
    with pytest.raises(ValueError, match=r"table t1: the plan gives ranks \[1\] no rows of it"):
        sharder.shard(module, plan.plan[""], ShardingEnv(world_size=2, rank=0, pg=None))


def test_row_wise_over_gloo_refuses_deduplicated_batches_clearly() -> None:
    spawn(row_wise_deduplicated_worker, (2, free_port()), nprocs=2)


@needs_store_buffers
@pytest.mark.parametrize("world_size", [1, 2])
def test_disk_store_matches_plain_torchrec(world_size: int) -> None:
    run_cases(
        world_size, [Case("column_wise", optimizer, 16, store_dir=True) for optimizer in OPTIMIZERS]
    )


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fp16_and_mixed_tables_match_plain_torchrec(world_size: int) -> None:
    """FP16 tables under every optimizer FBGEMM runs on the CPU, bitwise plain TorchRec's
    (its FP16 TBEs: half-precision rows, FP32 optimizer state), alone and beside an FP32
    table (TorchRec groups a rank's shards by type: a lookahead kernel and cache each).
    Shardings that give every rank rows of a table, so that every rank's cache evicts."""
    mixed = ("FP16", "FP32", "FP16")
    run_cases(
        world_size,
        [
            Case("row_wise", "sgd", 8, steps=30, data_types=("FP16",) * 3),
            Case("column_wise", "adagrad", 16, steps=30, data_types=mixed),
            Case(
                "table_row_wise",
                "rowwise_adagrad",
                4,
                steps=30,
                data_types=mixed,
                stage_thread=False,
            ),
        ],
    )


@pytest.mark.parametrize("world_size", [1, 2])
def test_plans_made_on_the_device_match_plain_torchrec(world_size: int) -> None:
    """``planner="device"`` (the device oracle on CPU tensors, its plans read back by the
    executor) under DMP, inline and on the stage's thread, FP32 and mixed FP16 tables."""
    run_cases(
        world_size,
        [
            Case("row_wise", "rowwise_adagrad", 8, steps=40, planner="device"),
            Case(
                "column_wise",
                "adagrad",
                4,
                steps=40,
                planner="device",
                stage_thread=False,
                data_types=("FP16", "FP32", "FP16"),
            ),
        ],
    )


@pytest.mark.parametrize("world_size", [1, 2])
def test_deduplicated_batches_match_plain_torchrec(world_size: int) -> None:
    run_cases(
        world_size,
        [
            Case("table_wise", "sgd", 16, cache_load_factor=0.05, session=4),
            Case("column_wise", "rowwise_adagrad", 8, cache_load_factor=0.05, session=8),
        ],
    )


def test_mixed_modules_bad_batch_on_one_rank_eval_and_checkpoint(tmp_path) -> None:
    spawn(integration_worker, (2, free_port(), str(tmp_path / "ckpt")), nprocs=2)


def test_a_mixed_multi_hot_model_whose_batches_widen_grows_its_cache_and_stays_exact() -> None:
    """Issue 43: a plain and a lookahead collection, bags of 0 to 2 ids, default cache
    settings, later batches 16 times the first: the caches grow, no batch is refused."""
    spawn(mixed_growth_worker, (2, free_port()), nprocs=2)


def test_malformed_batches_on_one_rank_are_refused_on_every_rank() -> None:
    spawn(malformed_worker, (2, free_port()), nprocs=2)


@pytest.mark.parametrize("stage_thread", [True, False], ids=["threaded", "inline"])
def test_a_window_over_a_capped_cache_on_one_rank_is_refused_on_every_rank(
    stage_thread: bool,
) -> None:
    spawn(capped_cache_worker, (2, free_port(), stage_thread), nprocs=2)


def test_canonical_use_with_the_lookahead_planner_matches_plain_torchrec() -> None:
    spawn(planned_worker, (2, free_port()), nprocs=2)


@needs_store_buffers
def test_replicated_hot_rows_from_a_disk_store_train_like_plain_torchrec() -> None:
    """Hot rows replicated from row-wise shards in a disk store, a deduplicated batch one
    rank refuses, eval through the folded owners: bitwise plain TorchRec's (the
    table-wise cases, schedules, per-table optimizers and mid-run events are in
    ``test_hot_rows.py``)."""
    cases = [Case("row_wise", "rowwise_adagrad", 8, steps=30, stage_thread=True, store_dir=True)]
    spawn(hot_rows_worker, (2, free_port(), cases), nprocs=2)


@pytest.mark.parametrize("hold", [0, 10], ids=["first-batch", "later-batch"])
def test_a_model_traced_while_the_stage_distributes_a_batch_trains_exactly(hold: int) -> None:
    spawn(tracing_worker, (1, free_port(), hold), nprocs=1)


def test_a_disk_store_is_refused_before_any_file_where_fbgemms_tbe_cannot_take_it(
    tmp_path, monkeypatch
) -> None:
    """FBGEMM 1.6 (the lent GPU machine's) has no ``preallocated_host_buffers``: sharding a
    collection with ``store_dir`` says so, and makes no file."""
    import torch
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    import torchrec_lookahead.embedding.cache_group as cache_group
    from torchrec_lookahead import (
        LookaheadEmbeddingBagCollection,
        LookaheadEmbeddingBagCollectionSharder,
    )

    tables = [
        EmbeddingBagConfig(name="t", embedding_dim=8, num_embeddings=100, feature_names=["f"])
    ]
    store = tmp_path / "store"
    module = LookaheadEmbeddingBagCollection(
        tables, device=torch.device("meta"), store_dir=str(store)
    )
    sharder = LookaheadEmbeddingBagCollectionSharder()
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu")).plan(
        module, [sharder]
    )
    before = sorted(tmp_path.rglob("*"))
    monkeypatch.setattr(cache_group, "TBE_TAKES_HOST_BUFFERS", False)
    with pytest.raises(ValueError, match="needs fbgemm_gpu 1.8 or newer"):
        sharder.shard(module, plan.plan[""], ShardingEnv(world_size=1, rank=0, pg=None))
    assert sorted(tmp_path.rglob("*")) == before
