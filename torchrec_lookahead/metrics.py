"""Counters: what the cache did per table, what the trainer waited for, and the kinds
of bytes the collectives send (counted by :mod:`~torchrec_lookahead.traffic`; named here,
without torch, for the reports that only read them)."""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["EMBEDDING_KINDS", "KINDS", "CacheMetrics"]

# What the collectives send, by kind (see torchrec_lookahead.traffic), and the embeddings'
# part of it: everything but the dense layers' gradient all-reduce.
KINDS = ("ids", "pooled", "gradients", "hot_sync", "other", "data_parallel", "dense")
EMBEDDING_KINDS = KINDS[:-1]


@dataclass
class CacheMetrics:
    """Counters for one table, or summed over tables (``+``).

    ``unique_ids`` counts distinct ids per step (summed over steps); a distinct
    id is a hit when its row was resident at its step's issue point, else a
    miss, fetched ahead of the step. ``wait_s`` is time the trainer spent
    waiting for plans to land; ``stage_s`` time it spent waiting for the
    lookahead stage (planning on the critical path); ``plan_s`` CPU time the
    stage spent planning (beside the steps on its thread). ``growths`` counts
    the times the cache grew for a window that needed more slots (each counted
    on one table of the pool that grew), ``cache_rows`` the slots the table
    brings to its pool now (summed: the rows the cache holds).
    """

    steps: int = 0
    lookups: int = 0
    unique_ids: int = 0
    misses: int = 0
    rows_written_back: int = 0
    bytes_moved: int = 0
    wait_s: float = 0.0
    stage_s: float = 0.0
    plan_s: float = 0.0
    growths: int = 0
    cache_rows: int = 0

    @property
    def hits(self) -> int:
        return self.unique_ids - self.misses

    @property
    def rows_fetched(self) -> int:
        """Rows copied into the cache: read-only, ``misses`` by another name (every miss
        is fetched ahead of its step; the reports' ``rows_fetched_per_step`` reads it)."""
        return self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.unique_ids if self.unique_ids else 0.0

    def __add__(self, other: CacheMetrics) -> CacheMetrics:
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        summed["steps"] = max(self.steps, other.steps)
        return CacheMetrics(**summed)
