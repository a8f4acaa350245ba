"""Misses per step of the oracle and of the policies it becomes with other windows.

The oracle with an empty window (``L=0, d=0``) sees no next use, so only its
tie-break orders victims: batched LRU (``"recency"``) or LFU with global counts
(``"frequency"``, as FBGEMM's LFU cache counts). With the whole stream as its
window and no prefetch distance it is Belady's MIN for batched access. The
planner's statistics and the benchmarks count misses with these; the
plain-Python references they are tested against are in
``torchrec_lookahead.testing.simulate``. These caches are fully associative;
FBGEMM's UVM cache is 32-way set associative, so its LRU / LFU miss more.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from torchrec_lookahead.oracle.cacher import OracleCacher

__all__ = ["lfu_misses", "lru_misses", "min_misses", "oracle_misses"]


def oracle_misses(
    batches: Sequence[Any],
    capacity: int,
    lookahead: int,
    prefetch_distance: int = 1,
    num_rows: int | None = None,
    tie_break: str = "frequency",
) -> np.ndarray:
    """Misses per step of :class:`OracleCacher` on ``batches``."""
    oracle = OracleCacher(capacity, lookahead, prefetch_distance, num_rows, tie_break=tie_break)
    return np.array([p.num_misses for p in oracle.plan(batches)], dtype=np.int64)


def min_misses(
    batches: Sequence[Any],
    capacity: int,
    num_rows: int | None = None,
    tie_break: str = "frequency",
) -> np.ndarray:
    """Belady's MIN: the oracle seeing the whole stream, no prefetch distance."""
    return oracle_misses(batches, capacity, len(batches), 0, num_rows, tie_break)


def lru_misses(batches: Sequence[Any], capacity: int, num_rows: int | None = None) -> np.ndarray:
    """Batched LRU: the oracle with an empty window and the recency tie-break."""
    return oracle_misses(batches, capacity, 0, 0, num_rows, "recency")


def lfu_misses(batches: Sequence[Any], capacity: int, num_rows: int | None = None) -> np.ndarray:
    """Batched LFU (global counts): the oracle with an empty window, frequency tie-break."""
    return oracle_misses(batches, capacity, 0, 0, num_rows, "frequency")
