"""``LookaheadCacheStatistics``: a table's miss rate at any cache size, measured by the oracle.

With lookahead the miss rate at a given cache size is not a guess: running the
oracle over sample batches gives it exactly (for that sample). The statistics
run it at a grid of cache load factors and interpolate between them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from torchrec.distributed.types import CacheStatistics

from torchrec_lookahead.oracle.cacher import as_id_array
from torchrec_lookahead.oracle.misses import oracle_misses
from torchrec_lookahead.settings import check_count

__all__ = ["LOAD_FACTOR_GRID", "LookaheadCacheStatistics"]

LOAD_FACTOR_GRID = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


class LookaheadCacheStatistics(CacheStatistics):
    """Miss rates of the lookahead oracle on sample batches of one table.

    Misses are counted over the second half of the sample (the first half
    warms the cache), per distinct id of a step: the rate a long training run
    settles at, without the first touches of a short sample.

    Every load factor is measured at the cache the module holds for it: its
    share of the rows, raised at the first batch to what ``d + 1`` batches of
    as many ids can touch (ids counted with their repeats, as the module counts
    them), and never below the rows ``d + 1`` consecutive batches use together
    (a module whose window needs more grows its cache there; these statistics
    count it at the window's size). That floor, ``min_rows``, matters most for
    sequence tables (``EmbeddingConfig``), whose samples repeat popular ids: a
    batch of histories holds several times as many ids as distinct rows. With
    the sample's first batch the training run's first, the misses counted here
    are the module's, step for step.

    Args:
        batches: the table's ids in each sample batch (global batches): every id of its
            features, repeats included (a sequence table's: every item of every history).
        num_rows: rows of the table; ids are checked against it.
        lookahead: the pipeline's ``L``.
        prefetch_distance: the pipeline's ``d``.
        name: the table, for error messages.
        grid: cache load factors to measure at.
    """

    def __init__(
        self,
        batches: Sequence[Any],
        num_rows: int,
        lookahead: int,
        prefetch_distance: int = 1,
        name: str = "table",
        grid: Sequence[float] = LOAD_FACTOR_GRID,
    ) -> None:
        if len(batches) < 2:
            raise ValueError(f"{name}: need at least 2 sample batches, got {len(batches)}")
        check_count(f"{name}: prefetch_distance", prefetch_distance, 0)
        bad_grid = [f for f in grid if not 0 < f <= 1]  # NaN too
        if bad_grid:
            raise ValueError(f"{name}: grid load factors must lie in (0, 1], got {bad_grid}")
        steps = [
            as_id_array(b, f"{name}, sample batch {i}", num_rows) for i, b in enumerate(batches)
        ]
        distinct = np.array([len(np.unique(s)) for s in steps])
        if not distinct.sum():
            raise ValueError(f"{name}: the sample batches hold no ids")
        self.num_rows = num_rows
        self._lookups = float(distinct.mean())
        d = prefetch_distance
        workable = max(
            len(np.unique(np.concatenate(steps[max(0, s - d) : s + 1]))) for s in range(len(steps))
        )
        self.min_rows = min(num_rows, max((d + 1) * len(steps[0]), workable))
        self.min_load_factor = self.min_rows / num_rows
        warm = len(steps) // 2
        self.grid = np.array(sorted(set(grid) | {1.0}), dtype=np.float64)
        # The oracle's misses depend on the ids' order, not their values: renumbered in
        # order, the sample's rows are its distinct ids, and the oracle's per-row state
        # grows with those, not with the table (a billion-row table's statistics fit).
        sample_rows, renumbered = np.unique(np.concatenate(steps), return_inverse=True)
        steps = np.split(renumbered.astype(np.int64), np.cumsum([len(s) for s in steps])[:-1])
        at: dict[int, float] = {}  # rate per cache size: load factors under the floor share one
        for clf in self.grid:
            capacity = min(self.capacity(clf), len(sample_rows))  # more slots: the same misses
            if capacity not in at:
                misses = oracle_misses(steps, capacity, lookahead, d, len(sample_rows))
                at[capacity] = misses[warm:].sum() / max(distinct[warm:].sum(), 1)
        rates = np.array([at[min(self.capacity(clf), len(sample_rows))] for clf in self.grid])
        self.rates = np.minimum.accumulate(rates)  # more cache never misses more

    def stable_fingerprint(self) -> tuple[object, ...]:
        """Everything ``expected_miss_rate`` and ``expected_lookups`` answer from, versioned:
        what TorchRec's planner keys a plan by (its later versions call this; earlier ones
        hash ``str(cache_params)``, which prints it)."""
        return (
            "lookahead_cache_statistics",
            1,
            self.num_rows,
            self.min_rows,
            self._lookups,
            tuple(self.grid.tolist()),
            tuple(self.rates.tolist()),
        )

    def __repr__(self) -> str:
        fields = ("num_rows", "min_rows", "lookups", "grid", "rates")
        values = ", ".join(f"{f}={v!r}" for f, v in zip(fields, self.stable_fingerprint()[2:]))
        return f"{type(self).__name__}({values})"

    def capacity(self, clf: float) -> int:
        """The cache rows the module holds for a load factor of ``clf``: its share of the
        rows, at least ``min_rows``, at most every row."""
        return min(self.num_rows, max(math.ceil(clf * self.num_rows), self.min_rows))

    @property
    def expected_lookups(self) -> float:
        """Distinct ids per (global) batch, on average over the sample."""
        return self._lookups

    def expected_miss_rate(self, clf: float) -> float:
        """Misses per distinct id with a cache of ``clf`` of the rows (log-linear between
        measured points; 1 with no cache, 0 with every row cached)."""
        if clf <= 0:
            return 1.0
        if clf >= 1:
            return 0.0
        return float(np.interp(math.log(clf), np.log(self.grid), self.rates))

    @property
    def cacheability(self) -> float:
        """Mean miss rate over the grid: 0 caches perfectly, 1 not at all."""
        return float(self.rates.mean())
