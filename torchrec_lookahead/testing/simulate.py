"""Cache simulators: plain-Python references and fast versions of the same policies.

Every policy works on batches: all distinct ids of step ``s`` must be resident
while it runs, misses are fetched on demand, and a victim is never a row of
the current step. Victims are chosen by a priority with a fixed tie-break, so
a fast and a reference version of a policy make the same choices:

* LRU: least recently used first, then smaller id.
* LFU: fewest uses so far (global counts over every occurrence, as FBGEMM's
  LFU cache keeps them), then least recently used, then smaller id.
* Windowed oracle: the rule of :class:`~torchrec_lookahead.oracle.OracleCacher`
  (no use in the window first, then farthest next use, then the tie-break:
  ``"frequency"`` is LFU's order, ``"recency"`` LRU's).
* MIN: the windowed oracle seeing the whole stream with no prefetch distance,
  i.e. Belady's MIN for batched access.

The fast versions are :mod:`torchrec_lookahead.oracle.misses` (the oracle
itself, with an empty or a whole-stream window); the ``reference_*`` functions
here are short loops over Python sets, written to be checked by eye; tests
hold the fast versions (and the oracle) to them. Note
that these caches are fully associative; FBGEMM's UVM cache is 32-way set
associative, so its LRU / LFU miss more than these figures.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchrec_lookahead.oracle.cacher import TIE_BREAKS

__all__ = [
    "StepOutcome",
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
    batches: Sequence[Any],
    capacity: int,
    lookahead: int,
    prefetch_distance: int,
    tie_break: str = "frequency",
) -> list[StepOutcome]:
    """Windowed Belady with pinning, one step at a time (see module docstring).

    ``tie_break`` orders candidates with the same next use (or none):
    ``"frequency"`` by uses in the steps before (duplicates counted), then last
    use, then id; ``"recency"`` by last use, then id.
    """
    if tie_break not in TIE_BREAKS:
        raise ValueError(f"tie_break must be one of {TIE_BREAKS}, got {tie_break!r}")
    steps = _as_sets(batches)
    last_use: dict[int, int] = {}  # resident row -> last step that used it
    uses: Counter[int] = Counter()  # row -> occurrences in the steps planned so far
    frequency = tie_break == "frequency"
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
            key=lambda r: (-next_use(r), uses[r] if frequency else 0, last_use[r], r),
        )
        evicted = candidates[: max(shortfall, 0)]
        for r in evicted:
            del last_use[r]
        for r in rows:
            last_use[r] = s
        uses.update(int(i) for i in np.asarray(batches[s]).ravel())
        outcomes.append(StepOutcome(frozenset(misses), frozenset(evicted)))
    return outcomes


def reference_min(batches: Sequence[Any], capacity: int, tie_break: str = "frequency") -> list[int]:
    """Belady's MIN for batched access: misses per step."""
    outcomes = reference_windowed(batches, capacity, len(batches), 0, tie_break)
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
