"""PartitionedOracle: the contract per partition, K=1 as a bare oracle, refusals, the hash."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.contract import plan_growing, replay
from tests.test_oracle import tie_breaks, traces
from torchrec_lookahead import CachePlan, OracleCacher
from torchrec_lookahead.oracle.partitioned import PartitionedOracle
from torchrec_lookahead.oracle.partitions import global_ids, split_of


def share(plan: CachePlan, owned: np.ndarray) -> CachePlan:
    """The part of a plan in the slots ``owned``, as indices into ``owned``."""
    local = np.full(int(owned.max()) + 1, -1)
    local[owned] = np.arange(len(owned))

    def own(slots: np.ndarray) -> np.ndarray:
        return np.isin(slots, owned)

    evicted, fetched = own(plan.evict_slots), own(plan.fetch_slots)
    return CachePlan(
        plan.step,
        local[plan.slots[own(plan.slots)]],
        plan.evict_ids[evicted],
        local[plan.evict_slots[evicted]],
        plan.fetch_ids[fetched],
        local[plan.fetch_slots[fetched]],
    )


def replay_per_partition(
    batches, plans, flush, oracle: PartitionedOracle, d: int, capacities=None
) -> None:
    """The contract, checked with the shared replay on each partition's part of the plans.

    A partition owns its slots, so its rows are those whose slots are among them; the
    contract's rules hold for each partition on its own (in particular "evict only when
    a slot is needed": a partition evicts when its own slots are full). ``capacities``:
    the cache's at each plan, for a cache that grew.
    """
    k = oracle.partitions
    capacities = capacities or [oracle.capacity] * len(plans)
    for p in range(k):
        owned = oracle.partition_slots(p)
        own = [np.asarray(b)[np.isin(q.slots, owned)] for b, q in zip(batches, plans)]
        mine = [share(q, owned) for q in plans]
        shares = [c // k + (p < c % k) for c in capacities]  # a partition's share of a capacity
        replay(own, mine, share(flush, owned), shares, d)


@given(traces(), st.integers(1, 4), tie_breaks)
def test_partitioned_plans_meet_the_contract(trace, partitions, tie_break) -> None:
    batches, num_rows, capacity, lookahead, d = trace
    if partitions > capacity:
        return
    oracle = PartitionedOracle(
        capacity, lookahead, d, num_rows, partitions=partitions, tie_break=tie_break
    )
    try:
        plans = list(oracle.plan(batches))
    except ValueError as error:
        assert "a capacity of at least" in str(error)
        return
    replay_per_partition(batches, plans, oracle.flush(), oracle, d)


@given(traces(), tie_breaks)
def test_one_partition_is_the_unpartitioned_oracle(trace, tie_break) -> None:
    batches, num_rows, capacity, lookahead, d = trace
    one = PartitionedOracle(capacity, lookahead, d, num_rows, partitions=1, tie_break=tie_break)
    bare = OracleCacher(capacity, lookahead, d, num_rows, tie_break=tie_break)
    try:
        bare_plans = list(bare.plan(batches))
    except ValueError:
        with pytest.raises(ValueError, match="a capacity of at least"):
            list(one.plan(batches))
        return
    for got, want in zip(one.plan(batches), bare_plans, strict=True):
        for field in ("slots", "evict_ids", "evict_slots", "fetch_ids", "fetch_slots"):
            assert np.array_equal(getattr(got, field), getattr(want, field)), field
    assert np.array_equal(one.flush().evict_ids, bare.flush().evict_ids)


def test_one_partition_reports_absent_rows_as_the_unpartitioned_oracle() -> None:
    """(Its prepared batch is the bare oracle's; ``absent`` used to take it for a
    partitioned one and fail.)"""
    one, bare = PartitionedOracle(8, 2, 1, 20, partitions=1), OracleCacher(8, 2, 1, 20)
    rng = np.random.default_rng(1)
    for _ in range(10):
        batch = rng.integers(0, 20, 4)
        mine, theirs = one.prepare(batch), bare.prepare(batch)
        assert np.array_equal(one.absent(mine), bare.absent(theirs))
        one.push(mine)
        bare.push(theirs)


@pytest.mark.parametrize(
    "bad, message",
    [
        (np.array([1, -3, 2]), "step 1: negative id -3"),
        (np.array([1, 40]), "step 1: id 40 is out of range for a table of 12 rows"),
        (np.arange(12), "partition [0-2] of 3, .* a capacity of at least"),
    ],
)
def test_bad_batch_is_refused_before_any_partition_changes(bad, message) -> None:
    rng = np.random.default_rng(0)
    good = [rng.integers(0, 12, size=5) for _ in range(8)]

    def oracle() -> PartitionedOracle:
        return PartitionedOracle(
            capacity=9, lookahead=2, prefetch_distance=0, num_rows=12, partitions=3
        )

    partitioned = oracle()
    plans = [p for p in [partitioned.push(good[0])] if p is not None]
    with pytest.raises(ValueError, match=message):
        partitioned.push(bad)
    for batch in good[1:]:
        plans += [p for p in [partitioned.push(batch)] if p is not None]
    plans += partitioned.finish()
    replay_per_partition(good, plans, partitioned.flush(), partitioned, 0)
    for got, want in zip(plans, oracle().plan(good), strict=True):
        assert np.array_equal(got.slots, want.slots)
        assert np.array_equal(got.fetch_ids, want.fetch_ids)
        assert np.array_equal(got.evict_ids, want.evict_ids)


def test_a_batch_prepared_sized_is_refused_before_any_partition_changes_until_grown() -> None:
    """``push`` of what ``prepare_sized`` made, not grown for: one partition took the batch
    and another refused it, and the next plans named slots that were never set."""
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 40, size=2) for _ in range(6)]
    partitioned = PartitionedOracle(4, 2, 0, 40, partitions=2)
    plans = [p for p in [partitioned.push(batches[0])] if p is not None]
    prepared, needed = partitioned.prepare_sized(np.arange(8))
    assert needed > partitioned.capacity
    with pytest.raises(ValueError, match=f"a capacity of at least {needed} is needed"):
        partitioned.push(prepared)
    assert partitioned.steps_pushed == 1
    partitioned.grow(needed)
    plans += [p for p in [partitioned.push(prepared)] if p is not None]
    for batch in batches[1:]:
        plans += [p for p in [partitioned.push(batch)] if p is not None]
    plans += partitioned.finish()
    trace = [batches[0], np.arange(8), *batches[1:]]
    replay(trace, plans, partitioned.flush(), partitioned.capacity, 0)


def test_one_partition_refuses_a_window_larger_than_the_cache_in_prepare() -> None:
    """With one partition, ``prepare`` failed an assertion where it should refuse."""
    oracle = PartitionedOracle(3, 1, 0, 40, partitions=1)
    with pytest.raises(ValueError, match="a capacity of at least 5 is needed"):
        oracle.prepare(np.arange(5))
    assert oracle.steps_pushed == 0


@pytest.mark.parametrize(
    "bad, error, message",
    [
        (6.0, TypeError, "capacity must be an integer, got 6.0"),
        ("8", TypeError, "capacity must be an integer, got '8'"),
        (True, TypeError, "capacity must be an integer, got True"),
        (3, ValueError, "capacity must be at least 4, got 3"),
    ],
)
def test_a_bad_growth_is_refused_before_any_slot_changes(bad, error, message) -> None:
    """``grow(6.0)`` extended a partition's slots before its share was refused; a later
    ``grow`` then gave two rows one slot."""
    partitioned = PartitionedOracle(4, 1, 0, 40, partitions=2)
    slots = [partitioned.partition_slots(p).tolist() for p in range(2)]
    with pytest.raises(error, match=re.escape(message)):
        partitioned.grow(bad)
    assert [partitioned.partition_slots(p).tolist() for p in range(2)] == slots
    partitioned.grow(8)
    owned = np.concatenate([partitioned.partition_slots(p) for p in range(2)])
    assert sorted(owned.tolist()) == list(range(8))
    batches = [np.arange(3 * s, 3 * s + 3) % 40 for s in range(12)]  # every slot is used
    plans = list(partitioned.plan(batches))
    replay(batches, plans, partitioned.flush(), 8, 0)  # a slot holds one row at a time


def test_the_capacity_named_in_a_refusal_is_the_least_that_works() -> None:
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 60, size=12) for _ in range(6)]

    def refused_at(capacity: int) -> tuple[int, int] | None:
        oracle = PartitionedOracle(capacity, 2, 1, 60, partitions=3)
        try:
            for batch in batches:
                oracle.push(batch)
        except ValueError as error:
            found = re.search(r"step (\d+):.*at least (\d+)", str(error))
            return int(found[1]), int(found[2])
        return None

    step, needed = refused_at(3)
    assert refused_at(needed) is None or refused_at(needed)[0] > step
    assert refused_at(needed - 1)[0] == step


@pytest.mark.parametrize("partitions", [2, 3, 4])
def test_the_hash_spreads_consecutive_ids_and_keeps_local_rows_dense(partitions) -> None:
    ids = np.arange(partitions * 1000)
    owner = np.array([split_of(i, partitions) for i in ids])
    for p in range(partitions):
        mine = ids[owner == p]
        assert len(mine) == 1000  # every run of `partitions` ids spreads over all of them
        assert np.array_equal(np.sort(mine // partitions), np.arange(1000))
        assert np.array_equal(global_ids(mine // partitions, p, partitions), mine)
    assert len({tuple(owner[b : b + partitions]) for b in range(0, 40, partitions)}) > 1


def test_batches_and_plans_are_in_table_ids_and_batch_order() -> None:
    rng = np.random.default_rng(2)
    batches = [rng.integers(0, 10_000, size=300) for _ in range(10)]
    oracle = PartitionedOracle(2000, 3, 1, partitions=2)  # table size unknown: tables grow
    prepared = oracle.prepare(batches[0])
    assert sorted(prepared.unique.tolist()) == sorted(set(batches[0].tolist()))
    plans = [p for b in [prepared, *batches[1:]] if (p := oracle.push(b)) is not None]
    plans += oracle.finish()
    replay_per_partition(batches, plans, oracle.flush(), oracle, 1)
    assert oracle.num_resident == len(oracle.flush().evict_ids) <= 2000


def test_partitions_must_each_get_a_slot() -> None:
    with pytest.raises(ValueError, match="partitions"):
        PartitionedOracle(3, 1, partitions=4)


@given(traces(), st.integers(2, 4), tie_breaks)
def test_a_partitioned_oracle_grown_mid_stream_meets_the_contract(
    trace, partitions, tie_break
) -> None:
    """Each partition grows to its share of the new capacity, its new slots numbered
    after the old ones: every resident row keeps its slot, and each partition's plans
    keep the contract at its share of the capacity each plan was made with."""
    batches, num_rows, _, lookahead, d = trace
    oracle = PartitionedOracle(
        partitions, lookahead, d, num_rows, partitions=partitions, tie_break=tie_break
    )
    plans, capacities = plan_growing(oracle, batches)
    replay_per_partition(batches, plans, oracle.flush(), oracle, d, capacities)


@pytest.mark.parametrize("rows, partitions", [(5, 3), (7, 2), (16, 4), (1, 3), (10, 4)])
def test_k_shares_of_k_ceil_rows_over_k_slots_hold_any_window(rows, partitions) -> None:
    """Every row in every batch: ``K * ceil(rows / K)`` slots (what a pool planned in K
    partitions may grow to, a few more than its rows) plan it, as a partition owns at most
    ``ceil(rows / K)`` rows, one of each run of K ids."""
    owned = np.bincount([split_of(i, partitions) for i in range(rows)], minlength=partitions)
    assert owned.max() == -(-rows // partitions)
    slots = partitions * -(-rows // partitions)
    oracle = PartitionedOracle(slots, 1, 0, num_rows=rows, partitions=partitions)
    assert oracle.partitions == partitions and OracleCacher(1, 1).partitions == 1
    batches = [np.arange(rows)] * 4
    assert [len(p.slots) for p in oracle.plan(batches)] == [rows] * 4


def test_a_partitioned_cache_of_all_the_rows_can_be_too_small() -> None:
    """Why: 5 rows in 3 partitions own 2, 2 and 1 rows (or another order), and 5 slots
    give shares of 2, 2 and 1, so a share may be one short."""
    batches = [np.arange(5)] * 2
    with pytest.raises(ValueError, match="a capacity of at least 6 is needed"):
        list(PartitionedOracle(5, 1, 0, num_rows=5, partitions=3).plan(batches))
