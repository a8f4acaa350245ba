"""A cache whose window needs more slots than it has grows, exactly; only a cap refuses."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from tests.models import (
    UNWEIGHTED,
    assert_same_training_state,
    batches,
    lookahead_model,
    reference_twin,
    train_dropping_refused,
    train_lookahead,
    train_reference,
)
from torchrec_lookahead import LookaheadEmbeddingBagCollection
from torchrec_lookahead.cache.pools import slot_pools
from torchrec_lookahead.cache.sizing import TableSlots

# A first batch of 2 samples sizes the caches; later batches of 256 need far more rows.
WIDENING = batches(1, batch_size=2) + batches(8, batch_size=256, seed=3)


def growth_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "cache grown" in r.getMessage()]


@pytest.mark.parametrize(
    "optimizer, planning_workers", [("rowwise_adagrad", 1), ("adagrad", 1), ("sgd", 3)]
)
def test_a_window_wider_than_the_cache_grows_it_and_training_stays_exact(
    caplog, optimizer, planning_workers
) -> None:
    """Multi-hot bags (empty ones, repeats), two modules, pools of several tables: every
    cache grows when the 256-sample batches come, keeps its rows and their optimizer
    state, and trains to the end bitwise as all-resident tables do (hash-partitioned
    planning too: each partition grows to its share)."""
    model = lookahead_model(optimizer, cache_load_factor=0.01)
    twin = reference_twin(model, optimizer)
    with caplog.at_level(logging.INFO, logger="torchrec_lookahead"):
        outputs, pipeline = train_lookahead(model, WIDENING, 3, 1, planning_workers)
    expected = train_reference(twin, WIDENING)
    assert len(outputs) == len(WIDENING)
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))
    assert_same_training_state(model, twin)
    metrics = pipeline.cache_metrics()
    lines = growth_lines(caplog)
    assert metrics["total"].growths == len(lines) > 0
    first = re.match(r"tables \[.*\]: cache grown from (\d+) to (\d+) rows at step (\d+)", lines[0])
    assert first and int(first[2]) >= 1.5 * int(first[1]) and int(first[3]) >= 1
    # The rows held now are the grown pools' slots, counted once per table.
    held = sum(
        group.pool_slots[p]
        for m in (model.unweighted, model.weighted)
        for group in m.cached_groups
        for p in range(len(group.pools))
    )
    assert metrics["total"].cache_rows == held


def test_a_cap_refuses_the_window_it_cannot_hold_before_anything_changes() -> None:
    """``max_cache_rows`` is the only reason to refuse: the batch whose window needs more
    rows of ``t1`` is refused naming the size needed, and training goes on as if it had
    never come (bitwise the reference trained without it)."""
    small = batches(12, batch_size=2)
    big = batches(1, batch_size=256, seed=3)[0]
    stream = small[:5] + [big] + small[5:]
    model = lookahead_model("rowwise_adagrad", max_cache_rows={"t1": 60})
    twin = reference_twin(model, "rowwise_adagrad")
    outputs, errors = train_dropping_refused(model, stream)
    assert len(errors) == 1, errors
    needed = re.search(
        r"step 5: .*tables \['t1'\].*at most 60 slots \(max_cache_rows\); "
        r"a capacity of at least (\d+) is needed",
        errors[0],
    )
    assert needed and int(needed[1]) > 60, errors[0]
    expected = train_reference(twin, small)
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))
    assert_same_training_state(model, twin)
    t1 = model.unweighted.cache_metrics()["t1"]
    assert t1.cache_rows <= 60 and t1.growths == 0


def test_caps_are_checked_against_the_other_settings() -> None:
    with pytest.raises(ValueError, match=r"max_cache_rows names unknown tables \['nope'\]"):
        LookaheadEmbeddingBagCollection(UNWEIGHTED, max_cache_rows={"nope": 3})
    with pytest.raises(ValueError, match=r"cache_rows\['t1'\] = 50 is over max_cache_rows"):
        LookaheadEmbeddingBagCollection(UNWEIGHTED, cache_rows={"t1": 50}, max_cache_rows=40)
    with pytest.raises(ValueError, match=r"max_cache_rows\['t0'\] must be at least 8"):
        LookaheadEmbeddingBagCollection(UNWEIGHTED, min_cache_rows=8, max_cache_rows=4)
    capped = LookaheadEmbeddingBagCollection(UNWEIGHTED, max_cache_rows=100)
    assert capped.table_slots() == [100, 100, 100]  # 10% of 4000, 1500, 10000 rows, capped


def test_a_partitioned_pool_grows_past_its_rows_only_where_no_cap_was_set() -> None:
    """5 rows in 3 hash partitions need 6 slots when a window touches all of them (shares
    of 2, 2 and 1 slots; a partition owns up to 2 rows): a pool whose table has no
    ``max_cache_rows`` may grow to 6, one capped at its 5 rows is refused with the hint."""
    pools = slot_pools([5], [4], EmbOptimType.EXACT_SGD)
    uncapped = TableSlots(["t"], [5], pools, [2])
    assert uncapped.growth([2], [6], 3, 0, [3]) == [(6, 6)]
    capped = TableSlots(["t"], [5], pools, [2], [5])
    hint = r"at most 5 slots \(max_cache_rows; planned in 3 hash partitions.*fewer workers\)"
    with pytest.raises(ValueError, match=hint):
        capped.growth([2], [6], 3, 0, [3])
    with pytest.raises(ValueError, match=r"at most 5 slots \(all its rows\)"):  # unsplit
        uncapped.growth([2], [6], 3, 0, [1])
