"""The differential harness on the configurations it found diverging, one with sequence
tables, and on its draws.

``make exactness`` runs hundreds of drawn configurations (CI: a fixed set);
here a few run in the suite: those that once diverged, one with sequence tables,
and a handful drawn.
"""

from __future__ import annotations

import pytest

from tests.exactness.configs import Config, TableSpec, draw
from tests.exactness.runner import _run_group

T = TableSpec

# Found by the harness's first runs (docs/design.md, "Checking exactness").
FOUND = [
    # Hot ids split off a window's first batch left t1's cache too small for a later
    # batch with more cold ids: a batch refused where plain TorchRec trains.
    Config(
        seed=1,
        index=2,
        world_size=2,
        tables=(
            T("t0", 1, 4, ("f0",), "table_wise", "adagrad", 0.3, False),
            T("t1", 20, 4, ("f1",), "table_wise", "adagrad", 0.3, False),
            T("t2", 2000, 4, ("f2",), "row_wise", "adagrad", 0.3, False),
            T("t3", 1, 4, ("f3",), "table_wise", "adagrad", 0.3, False),
        ),
        pooling="sum",
        weighted=False,
        batch=16,
        steps=12,
        cache_load_factor=0.11,
        lookahead=16,
        prefetch_distance=0,
        hot="on",
        dedup=False,
        disk_store=False,
        schedule="none",
        events=(),
        stage_thread=True,
    ),
    # A model built anew sums its dense gradients in another order at 4 ranks (in plain
    # TorchRec too): both sides resume. Also a batch one rank refuses.
    Config(
        seed=0,
        index=96,
        world_size=4,
        tables=(
            T("t0", 20000, 8, ("f0",), "table_column_wise", "adagrad", 0.3, True),
            T("t1", 300, 4, ("f1",), "table_wise", "adagrad", 0.3, True),
            T("t2", 1, 8, ("f2",), "column_wise", "adagrad", 0.3, False),
        ),
        pooling="sum",
        weighted=False,
        batch=4,
        steps=12,
        cache_load_factor=0.0394,
        lookahead=1,
        prefetch_distance=1,
        hot="off",
        dedup=False,
        disk_store=False,
        schedule="none",
        events=((3, "resume"), (5, "refuse")),
        stage_thread=False,
    ),
    # Deduplicated batches into row-wise shards over gloo were refused at one rank too,
    # where plain TorchRec trains them (its reduce-scatter has one part there).
    Config(
        seed=7177,
        index=72,
        world_size=1,
        tables=(T("t0", 20, 4, ("f0",), "table_row_wise", "rowwise_adagrad", 0.02, False),),
        pooling="sum",
        weighted=False,
        batch=32,
        steps=22,
        cache_load_factor=0.0778,
        lookahead=8,
        prefetch_distance=1,
        hot="off",
        dedup=True,
        disk_store=False,
        schedule="none",
        events=(),
        stage_thread=False,
    ),
    # Three hash partitions of a 5-row table: a window of all 5 rows needs 6 slots (each
    # partition's share must hold the 2 rows one of them owns), and the cache was refused
    # at all its rows, where plain TorchRec trains.
    Config(
        seed=5,
        index=10,
        world_size=1,
        tables=(T("t0", 5, 16, ("f0",), "table_row_wise", "sgd", 0.3, False),),
        pooling="sum",
        weighted=False,
        batch=8,
        steps=30,
        cache_load_factor=0.17262054878034885,
        lookahead=4,
        prefetch_distance=0,
        hot="budget",
        dedup=False,
        disk_store=False,
        schedule="random",
        events=((22, "reattach"),),
        stage_thread=True,
        planning_workers=3,
    ),
]


@pytest.mark.parametrize(
    "config",
    FOUND,
    ids=[
        "hot-rows-cache-floor",
        "resume-at-4-ranks",
        "dedup-row-wise-one-rank",
        "partitions-of-a-tiny-table",
    ],
)
def test_configurations_the_harness_found_diverging_now_agree(config: Config) -> None:
    result = _run_group(config.world_size, [config])[config.index]
    assert result.get("divergence") is None and not result.get("error"), result
    assert result["worst"] <= config.tolerance


# Sequence tables (an EmbeddingCollection: row- and column-wise, FP32 and FP16, two
# features on one table) beside weighted bag tables, a batch one rank refuses.
SEQUENCE = Config(
    seed=0,
    index=0,
    world_size=2,
    tables=(
        T("t0", 300, 8, ("f0",), "table_wise", "adagrad", 0.1, True),
        T("t1", 2000, 8, ("f1a", "f1b"), "row_wise", "rowwise_adagrad", 0.05, True, sequence=True),
        T("t2", 60, 8, ("f2",), "column_wise", "sgd", 0.1, False, "FP16", sequence=True),
    ),
    pooling="sum",
    weighted=True,
    batch=8,
    steps=12,
    cache_load_factor=0.05,
    lookahead=4,
    prefetch_distance=1,
    hot="off",
    dedup=False,
    disk_store=False,
    schedule="none",
    events=((4, "refuse"),),
    stage_thread=True,
)


def test_a_configuration_with_sequence_tables_agrees() -> None:
    result = _run_group(SEQUENCE.world_size, [SEQUENCE])[SEQUENCE.index]
    assert result.get("divergence") is None and not result.get("error"), result
    assert result["worst"] == 0


def test_sequence_tables_are_drawn_only_as_sequence_tables_train() -> None:
    """A third of the draws or so have sequence tables, half of those beside bag tables;
    never with deduplicated batches or hot rows on their own, all of one width, sharded
    table-, column- or row-wise."""
    configs = [draw(seed, i) for seed in range(3) for i in range(100)]
    sequence = [c for c in configs if c.sequences]
    mixed = [c for c in sequence if c.bags]
    assert 0.25 < len(sequence) / len(configs) < 0.42 and 0.35 < len(mixed) / len(sequence) < 0.65
    for c in sequence:
        assert not c.dedup and (c.hot == "off" or c.bags), c
        assert len({t.dim for t in c.sequences}) == 1, c
        assert {t.sharding for t in c.sequences} <= {"table_wise", "column_wise", "row_wise"}, c
        assert "sequence" in c.describe() and ":seq" in c.describe()


def test_drawn_configurations_agree() -> None:
    """Four draws at world size 2 with hot rows (the seed's first such)."""
    configs = [draw(7, i, hot_rows=True) for i in range(12)]
    configs = [c for c in configs if c.world_size == 2][:4]
    results = _run_group(2, configs)
    bad = {i: r for i, r in results.items() if r.get("divergence") or r.get("error")}
    assert not bad, bad
