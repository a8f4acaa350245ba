"""Cache simulators: plain-Python references and fast versions of the same policies.

Every policy works on batches: all distinct ids of step ``s`` must be resident
while it runs, misses are fetched on demand, and a victim is never a row of
the current step. Victims are chosen by a priority with a fixed tie-break, so
a fast and a reference version of a policy make the same choices:

* LRU: least recently used first, then smaller id.
* LFU: fewest uses so far (global counts over every occurrence, as FBGEMM's
  LFU cache keeps them), then least recently used, then smaller id.
* Windowed oracle: the rule of :class:`~torchrec_lookahead.oracle.OracleCacher`
  (no use in the window first, then farthest next use, then LRU, then id).
* MIN: the windowed oracle seeing the whole stream with no prefetch distance,
  i.e. Belady's MIN for batched access.

The ``reference_*`` functions are short loops over Python sets, written to be
checked by eye; tests hold the fast versions (and the oracle) to them. Note
that these caches are fully associative; FBGEMM's UVM cache is 32-way set
associative, so its LRU / LFU miss more than these figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchrec_lookahead.oracle import OracleCacher, as_id_array
from torchrec_lookahead.slots import SlotTable, largest_keys

__all__ = [
    "StepOutcome",
    "lfu_misses",
    "lru_misses",
    "min_misses",
    "oracle_misses",
    "reference_lfu",
    "reference_lru",
    "reference_min",
    "reference_windowed",
]


@dataclass(frozen=True)
class StepOutcome:
    """Rows fetched and evicted for one step by a reference simulator."""

    fetched: frozenset[int]
    evicted: frozenset[int]


# --------------------------------------------------------------- references


def _as_sets(batches: Sequence[Any]) -> list[set[int]]:
    return [set(int(i) for i in np.asarray(b).ravel()) for b in batches]


def reference_windowed(
    batches: Sequence[Any], capacity: int, lookahead: int, prefetch_distance: int
) -> list[StepOutcome]:
    """Windowed Belady with pinning, one step at a time (see module docstring)."""
    steps = _as_sets(batches)
    last_use: dict[int, int] = {}  # resident row -> last step that used it
    outcomes = []
    for s, rows in enumerate(steps):
        pinned = set().union(*steps[max(0, s - prefetch_distance) : s + 1])
        if len(pinned) > capacity:
            raise ValueError(f"step {s}: {len(pinned)} pinned rows exceed capacity {capacity}")
        window = steps[s + 1 : s + 1 + lookahead]

        def next_use(row: int, s: int = s, window: list[set[int]] = window) -> int:
            return next((s + 1 + j for j, w in enumerate(window) if row in w), 1 << 62)

        misses = rows - last_use.keys()
        shortfall = len(misses) - (capacity - len(last_use))
        candidates = sorted(
            (r for r in last_use if r not in pinned),
            key=lambda r: (-next_use(r), last_use[r], r),
        )
        evicted = candidates[: max(shortfall, 0)]
        for r in evicted:
            del last_use[r]
        for r in rows:
            last_use[r] = s
        outcomes.append(StepOutcome(frozenset(misses), frozenset(evicted)))
    return outcomes


def reference_min(batches: Sequence[Any], capacity: int) -> list[int]:
    """Belady's MIN for batched access: misses per step."""
    outcomes = reference_windowed(batches, capacity, len(batches), 0)
    return [len(o.fetched) for o in outcomes]


def _reference_demand(batches: Sequence[Any], capacity: int, priority: Any) -> list[int]:
    """Demand caching that evicts the non-current rows with the smallest priority."""
    last_use: dict[int, int] = {}
    counts: dict[int, int] = {}
    misses = []
    for s, batch in enumerate(batches):
        ids = [int(i) for i in np.asarray(batch).ravel()]
        for i in ids:
            counts[i] = counts.get(i, 0) + 1
        rows = set(ids)
        missing = rows - last_use.keys()
        shortfall = len(missing) - (capacity - len(last_use))
        if len(rows) > capacity:
            raise ValueError(f"step {s}: {len(rows)} rows exceed capacity {capacity}")
        victims = sorted(
            (r for r in last_use if r not in rows), key=lambda r: priority(r, last_use, counts)
        )
        for r in victims[: max(shortfall, 0)]:
            del last_use[r]
        for r in rows:
            last_use[r] = s
        misses.append(len(missing))
    return misses


def reference_lru(batches: Sequence[Any], capacity: int) -> list[int]:
    """Batched LRU: misses per step."""
    return _reference_demand(batches, capacity, lambda r, last, counts: (last[r], r))


def reference_lfu(batches: Sequence[Any], capacity: int) -> list[int]:
    """Batched LFU with global counts: misses per step."""
    return _reference_demand(batches, capacity, lambda r, last, counts: (counts[r], last[r], r))


# -------------------------------------------------------------- fast versions


def oracle_misses(
    batches: Sequence[Any],
    capacity: int,
    lookahead: int,
    prefetch_distance: int = 1,
    num_rows: int | None = None,
) -> np.ndarray:
    """Misses per step of :class:`OracleCacher` on ``batches``."""
    oracle = OracleCacher(capacity, lookahead, prefetch_distance, num_rows)
    return np.array([p.num_misses for p in oracle.plan(batches)], dtype=np.int64)


def min_misses(batches: Sequence[Any], capacity: int, num_rows: int | None = None) -> np.ndarray:
    """Belady's MIN: the oracle seeing the whole stream, no prefetch distance."""
    return oracle_misses(batches, capacity, len(batches), 0, num_rows)


def lru_misses(batches: Sequence[Any], capacity: int, num_rows: int | None = None) -> np.ndarray:
    """Batched LRU: the oracle with an empty window sees no next use, so it evicts by recency."""
    return oracle_misses(batches, capacity, 0, 0, num_rows)


def lfu_misses(batches: Sequence[Any], capacity: int, num_rows: int | None = None) -> np.ndarray:
    """Batched LFU with global counts, vectorised per step."""
    table = SlotTable(capacity, num_rows)
    counts = np.zeros(num_rows or 0, dtype=np.int64)
    last_use = np.full(capacity, -1, dtype=np.int64)
    misses = np.zeros(len(batches), dtype=np.int64)
    for s, batch in enumerate(batches):
        ids = as_id_array(batch, f"step {s}", num_rows)
        unique, occurrences = np.unique(ids, return_counts=True)
        if len(unique) > capacity:
            raise ValueError(f"step {s}: {len(unique)} rows exceed capacity {capacity}")
        if len(unique) and unique[-1] >= len(counts):
            counts = np.concatenate(
                [counts, np.zeros(2 * int(unique[-1]) + 1 - len(counts), np.int64)]
            )
            table.grow(len(counts))
        counts[unique] += occurrences
        slots = table.slot_of_id[unique]
        last_use[slots[slots >= 0]] = s  # the step's resident rows are not candidates
        fetch_ids = unique[slots < 0]
        victims = np.empty(0, dtype=np.int64)
        evictions = len(fetch_ids) - table.free
        if evictions > 0:
            candidates = np.flatnonzero(last_use[: table.num_resident] < s)
            cand_ids = table.id_of_slot[candidates]
            # Fewest uses first, then least recently used (largest key is evicted first).
            keys = -(counts[cand_ids] << 32) - last_use[candidates]
            victims = candidates[largest_keys(keys, cand_ids, evictions)]
        _, fetch_slots = table.admit(fetch_ids, victims)
        last_use[fetch_slots] = s
        misses[s] = len(fetch_ids)
    return misses
