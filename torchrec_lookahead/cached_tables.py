"""A group of tables cached behind one TBE: their oracles, the cache, and each step's slots.

The unsharded ``LookaheadEmbeddingBagCollection`` owns one group; under
``DistributedModelParallel`` each lookahead kernel (one per grouped shard
config on a rank) owns one. The pipeline drives every group the same way:
``prepare`` a batch's features, ``enter`` them, hand the returned moves to the
executor, ``begin_step`` before the step's forward, which calls ``lookup``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.cache import CacheTable
from torchrec_lookahead.metrics import CacheMetrics
from torchrec_lookahead.oracle import CachePlan, OracleCacher, PreparedBatch

__all__ = ["CacheSizing", "CachedTables", "StepMoves"]

StepMoves = list[partial]  # the row moves of one step, run by the executor


@dataclass(frozen=True)
class CacheSizing:
    """How many cache slots a table (or a shard of it) gets.

    ``cache_rows[name]`` (slots for the whole table) wins over
    ``cache_load_factor`` (a share of the rows); a sharding plan's per-table
    load factor wins over both. A shard gets its share of the table's slots,
    and never fewer than ``min_rows`` (nor more than it has rows): a floor
    that lets small tables be cached whole.
    """

    cache_load_factor: float = 0.1
    cache_rows: Mapping[str, int] = field(default_factory=dict)
    min_rows: int = 1

    def rows(
        self, name: str, num_embeddings: int, local_rows: int, plan_load_factor: float | None = None
    ) -> int:
        if plan_load_factor is not None:
            wanted = math.ceil(plan_load_factor * local_rows)
        elif name in self.cache_rows:
            wanted = math.ceil(self.cache_rows[name] * local_rows / num_embeddings)
        else:
            wanted = math.ceil(self.cache_load_factor * local_rows)
        return min(local_rows, max(self.min_rows, wanted, 1))


class CachedTables:
    """Tables whose rows are cached together in one :class:`CacheTable`.

    Args:
        names: table names (for metrics), in the cache's table order.
        num_rows: rows of each table (of the shard, under sharding).
        feature_tables: the table of each feature, in lookup order; a table's
            features are consecutive.
        cache: the cache table (its TBE has one table per name).
    """

    def __init__(
        self,
        names: Sequence[str],
        num_rows: Sequence[int],
        feature_tables: Sequence[int],
        cache: CacheTable,
    ) -> None:
        self.names = list(names)
        self.num_rows = list(num_rows)
        self.cache = cache
        self._table_of_feature = np.asarray(feature_tables, dtype=np.int64)
        self._oracles: list[OracleCacher] = []
        self._slots: dict[int, torch.Tensor] = {}  # step -> slots of that step's ids
        self._running: torch.Tensor | None = None  # slots of the step being run
        self._dirty = False  # cache rows updated since the last write-back
        self.metrics = [CacheMetrics() for _ in names]
        # step -> (distinct ids, misses) per table: one small entry per step trained
        self.step_counts: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def cache_rows(self) -> list[int]:
        return [len(ids) for ids in self.cache.slot_ids]

    def attach(self, lookahead: int, prefetch_distance: int) -> None:
        """Start a new window: fresh oracles, and an empty cache (written back first)."""
        self.write_back()
        self.cache.clear()
        self._oracles = [
            OracleCacher(capacity, lookahead, prefetch_distance, num_rows=rows)
            for capacity, rows in zip(self.cache_rows, self.num_rows)
        ]
        self._slots.clear()
        self._running = None
        self.step_counts.clear()

    def prepare(self, features: KeyedJaggedTensor) -> list[PreparedBatch]:
        """Check a batch for every table (ids, capacity) without changing anything."""
        if not self._oracles:
            raise RuntimeError("attach() the cached tables to a window before planning")
        ids = self._table_ids(features)
        return [oracle.prepare(table_ids) for oracle, table_ids in zip(self._oracles, ids)]

    def enter(self, prepared: list[PreparedBatch]) -> tuple[int, StepMoves] | None:
        """A prepared batch enters the window; returns the moves of a step now planned."""
        for metrics, batch in zip(self.metrics, prepared):
            metrics.lookups += len(batch.ids)
            metrics.unique_ids += len(batch.unique)
        if prepared:
            distinct = np.array([len(b.unique) for b in prepared])
            self.step_counts[prepared[0].step] = (distinct, np.zeros_like(distinct))
        return self._planned([oracle.push(batch) for oracle, batch in zip(self._oracles, prepared)])

    def finish(self) -> list[tuple[int, StepMoves]]:
        """End of the data: the steps still to plan, with shorter windows."""
        remaining = [oracle.finish() for oracle in self._oracles]
        return [planned for step in zip(*remaining) if (planned := self._planned(list(step)))]

    def begin_step(self, step: int) -> None:
        """The next ``lookup`` runs step ``step``."""
        self._running = self._slots.pop(step)

    @property
    def step_running(self) -> bool:
        return self._running is not None

    def lookup(
        self, offsets: torch.Tensor, num_ids: int, per_sample_weights: torch.Tensor | None
    ) -> torch.Tensor:
        """Pooled embeddings of the running step's batch, through the cache."""
        slots, self._running = self._running, None
        if slots is None or slots.numel() != num_ids:
            raise RuntimeError(
                f"the batch has {num_ids} ids but its plan has "
                f"{None if slots is None else slots.numel()}: forward must run the batches "
                "in the order they were planned, one forward per step"
            )
        self._dirty = True
        return self.cache.forward(slots, offsets, per_sample_weights)

    def write_back(self) -> None:
        """Write updated cache rows back to the store (the rows stay cached)."""
        if self._dirty:
            self.cache.write_back_all()
            self._dirty = False

    def _table_ids(self, features: KeyedJaggedTensor) -> list[np.ndarray]:
        # A table's features are consecutive, so its ids are one slice of the values.
        values = features.values().cpu().numpy()
        per_table = np.zeros(len(self.names) + 1, dtype=np.int64)
        np.add.at(per_table, self._table_of_feature + 1, features.length_per_key())
        edges = np.cumsum(per_table)
        return [values[edges[t] : edges[t + 1]] for t in range(len(self.names))]

    def _planned(self, plans: list[CachePlan | None]) -> tuple[int, StepMoves] | None:
        if not plans or plans[0] is None:
            return None
        step = plans[0].step
        self._slots[step] = torch.from_numpy(np.concatenate([p.slots for p in plans])).to(
            self.cache.device
        )
        self.step_counts[step][1][:] = [plan.num_misses for plan in plans]
        moves = []
        for t, (plan, metrics) in enumerate(zip(plans, self.metrics)):
            metrics.steps += 1
            metrics.misses += plan.num_misses
            metrics.rows_fetched += len(plan.fetch_ids)
            metrics.rows_written_back += len(plan.evict_ids)
            moved = len(plan.fetch_ids) + len(plan.evict_ids)
            metrics.bytes_moved += moved * self.cache.store.bytes_per_row(t)
            if moved:
                moves.append(partial(self.cache.apply, t, plan))
        return step, moves
