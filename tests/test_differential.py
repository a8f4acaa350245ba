"""The differential harness on the configurations it found diverging, and on its draws.

``make exactness`` runs hundreds of drawn configurations (CI: a fixed set);
here a few run in the suite: those that once diverged, and a handful drawn.
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
]


@pytest.mark.parametrize(
    "config", FOUND, ids=["hot-rows-cache-floor", "resume-at-4-ranks", "dedup-row-wise-one-rank"]
)
def test_configurations_the_harness_found_diverging_now_agree(config: Config) -> None:
    result = _run_group(config.world_size, [config])[config.index]
    assert result.get("divergence") is None and not result.get("error"), result
    assert result["worst"] <= config.tolerance


def test_drawn_configurations_agree() -> None:
    """Four draws at world size 2 with hot rows (the seed's first such)."""
    configs = [draw(7, i, hot_rows=True) for i in range(12)]
    configs = [c for c in configs if c.world_size == 2][:4]
    results = _run_group(2, configs)
    bad = {i: r for i, r in results.items() if r.get("divergence") or r.get("error")}
    assert not bad, bad
