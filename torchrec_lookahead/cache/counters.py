"""What a group's cache did, per table: the counts behind its :class:`CacheMetrics`.

:class:`~torchrec_lookahead.cache.group.CacheGroup` records each batch as it
enters the window (ids looked up, distinct ids), counts each step as its plan is made
(misses, that is rows fetched; rows written back; bytes moved both ways; where the
device plans, the distinct ids too, read back with the plan by the executor) and
each growth of a pool (counted to the table that took the most of it). The totals
are of the steps planned: a batch's lookups and distinct ids join them with its
plan, so that a hit rate read mid-run sets misses against the ids of the same
steps (the window's batches not yet planned would inflate it). Each step's
distinct ids and misses are kept apart too, for the pipeline's per-step report,
until the next window starts.
"""

from __future__ import annotations

import numpy as np

from torchrec_lookahead.metrics import CacheMetrics

__all__ = ["COUNTERS", "TableCounters"]

COUNTERS = (
    "lookups",
    "unique_ids",
    "misses",
    "rows_written_back",
    "bytes_moved",
    "growths",
)


class TableCounters:
    """The counters of a group's ``tables`` tables, and its steps planned."""

    def __init__(self, tables: int) -> None:
        self.totals = {k: np.zeros(tables, dtype=np.int64) for k in COUNTERS}
        self.steps = 0
        # step -> (distinct ids, misses) per table: one small entry per step trained
        self.step_counts: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._lookups: dict[int, np.ndarray] = {}  # per step entered, until it is planned

    def entered(self, step: int, lookups: np.ndarray, distinct: np.ndarray | None) -> None:
        """The batch of ``step`` entered the window: its ids and distinct ids per table
        (``None``: counted with its plan, where the device planned it)."""
        self._lookups[step] = lookups
        counted = np.zeros_like(lookups) if distinct is None else distinct
        self.step_counts[step] = (counted, np.zeros_like(counted))

    def planned(
        self,
        step: int,
        fetched: np.ndarray,
        evicted: np.ndarray,
        row_bytes: np.ndarray,
        distinct: np.ndarray | None = None,
    ) -> None:
        """The plan of ``step`` is made (on the device: applied): the rows it fetches and
        evicts per table, each table's rows ``row_bytes`` wide (with their optimizer state),
        and the batch's distinct ids if ``entered`` did not have them."""
        if distinct is not None:
            self.step_counts[step][0][:] = distinct
        self.totals["lookups"] += self._lookups.pop(step)
        self.totals["unique_ids"] += self.step_counts[step][0]
        self.step_counts[step][1][:] = fetched
        self.totals["misses"] += fetched
        self.totals["rows_written_back"] += evicted
        self.totals["bytes_moved"] += (fetched + evicted) * row_bytes
        self.steps += 1

    def new_window(self) -> None:
        """A new window starts: the steps of the last one, planned or not, are let go (the
        totals stay)."""
        self.step_counts.clear()
        self._lookups.clear()

    def grown(self, table: int) -> None:
        """A pool grew; ``table`` took the most of it."""
        self.totals["growths"][table] += 1

    def metrics(self, table_slots: list[int]) -> list[CacheMetrics]:
        """Counters per table (a table's misses are its rows fetched into its pool)."""
        return [
            CacheMetrics(
                steps=self.steps,
                cache_rows=table_slots[t],
                **{k: int(v[t]) for k, v in self.totals.items()},
            )
            for t in range(len(table_slots))
        ]
