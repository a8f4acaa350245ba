"""Replays cache plans on a model of cache and store to check the oracle's contract.

Rows hold version numbers instead of embeddings: every step bumps the version
of each row it uses, in the cache. Training with fully resident tables would
see version ``k`` of a row after ``k`` uses; the replay checks that each step
finds exactly that, so staleness, lost updates, bad slots and illegal
evictions all show up as failures.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from torchrec_lookahead import CachePlan, OracleCacher, PartitionedOracle


def replay(
    batches: Sequence[np.ndarray],
    plans: Sequence[CachePlan],
    final_flush: CachePlan,
    capacity: int | Sequence[int],
    prefetch_distance: int,
) -> None:
    """Assert every rule of the oracle's contract (docs/design.md) on ``plans`` for ``batches``
    (``capacity``: the cache's, or each plan's, for a cache that grows)."""
    d = prefetch_distance
    capacities = [capacity] * len(plans) if isinstance(capacity, int) else list(capacity)
    steps = [set(np.asarray(b).tolist()) for b in batches]
    assert [p.step for p in plans] == list(range(len(batches)))
    truth: dict[int, int] = {}  # row -> version that fully resident training would have
    store: dict[int, int] = {}
    cache: dict[int, list[int]] = {}  # slot -> [row, version]

    def apply(plan: CachePlan) -> None:
        s = plan.step
        capacity = capacities[s]
        free_before = capacity - len(cache)
        needed_now = set().union(*steps[max(0, s - d) : s + 1])
        assert len(plan.evict_ids) == len(plan.evict_slots)
        assert len(plan.fetch_ids) == len(plan.fetch_slots)
        # Evict only when a slot is needed.
        assert len(plan.evict_ids) == max(0, len(plan.fetch_ids) - free_before), s
        for row, slot in zip(plan.evict_ids.tolist(), plan.evict_slots.tolist()):
            assert cache[slot][0] == row, f"plan {s} evicts row {row} from a slot it is not in"
            assert row not in needed_now, f"plan {s} evicts row {row}, used by steps {s - d}..{s}"
            store[row] = cache.pop(slot)[1]
        resident = {r for r, _ in cache.values()}
        for row, slot in zip(plan.fetch_ids.tolist(), plan.fetch_slots.tolist()):
            assert 0 <= slot < capacity and slot not in cache, f"plan {s}: slot {slot} not free"
            assert row not in resident, f"plan {s} fetches row {row}, already resident"
            cache[slot] = [row, store.get(row, 0)]
        assert len(cache) <= capacity
        assert set(plan.fetch_ids.tolist()) == steps[s] - resident, "misses are the absent rows"
        assert len(plan.slots) == len(batches[s])
        for row, slot in zip(np.asarray(batches[s]).tolist(), plan.slots.tolist()):
            assert cache[slot][0] == row, f"plan {s}: id {row} is not at slot {slot}"

    applied = 0
    for t in range(len(batches)):
        while applied < len(plans) and applied - d <= t:  # the issue point of plan(s) is step s-d
            apply(plans[applied])
            applied += 1
        for row, slot in zip(np.asarray(batches[t]).tolist(), plans[t].slots.tolist()):
            assert cache[slot][0] == row, f"step {t}: id {row} evicted before it ran"
            assert cache[slot][1] == truth.get(row, 0), f"step {t}: row {row} is stale"
        for row in steps[t]:
            truth[row] = truth.get(row, 0) + 1
            slot = plans[t].slots[np.asarray(batches[t]).tolist().index(row)]
            cache[int(slot)][1] += 1

    assert len(final_flush.fetch_ids) == 0
    flushed = {}
    for row, slot in zip(final_flush.evict_ids.tolist(), final_flush.evict_slots.tolist()):
        assert cache[slot][0] == row
        flushed[row] = cache[slot][1]
    assert len(flushed) == len(cache), "flush must write back every resident row"
    store.update(flushed)
    assert {r: store.get(r, 0) for r in truth} == truth, "an update was lost"


def plan_growing(
    oracle: OracleCacher | PartitionedOracle, batches: Sequence[np.ndarray]
) -> tuple[list[CachePlan], list[int]]:
    """Plans for ``batches``, the oracle grown to exactly what a window needs whenever it
    needs more slots; and the capacity each plan was made with."""
    plans: list[CachePlan] = []
    capacities: list[int] = []

    def emitted(new: list[CachePlan]) -> None:
        plans.extend(new)
        capacities.extend([oracle.capacity] * len(new))

    for batch in batches:
        prepared, needed = oracle.prepare_sized(batch)
        if needed > oracle.capacity:
            oracle.grow(needed)
        plan = oracle.push(prepared)
        emitted([plan] if plan is not None else [])
    emitted(oracle.finish())
    return plans, capacities
