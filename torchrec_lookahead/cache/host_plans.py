"""A cache group's plans made on the host: the numba oracle over each batch's ids, copied back.

The default :class:`~torchrec_lookahead.cache.planning.Planning`. Each batch's
ids come to the host, are checked against their tables and split per pool; each
pool's :class:`~torchrec_lookahead.oracle.OracleCacher` (or
:class:`~torchrec_lookahead.oracle.PartitionedOracle`, with
``planning_workers > 1``) plans as the batch enters; a plan's slots go to the
device and its moves to the executor as numpy arrays. A disk store reads ahead
the rows a batch's step may fetch, from the oracles' view of what is resident.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torchrec_lookahead.streams as streams
from torchrec_lookahead.cache.id_passes import pool_ids
from torchrec_lookahead.cache.planning import Planning, check_lengths
from torchrec_lookahead.checks import feature_id_error
from torchrec_lookahead.oracle import OracleCacher, PartitionedOracle
from torchrec_lookahead.oracle.contract import CachePlan, CachePlanner
from torchrec_lookahead.steps import StepMoves

__all__ = ["HostPlanning"]


class HostPlanning(Planning):
    """Plans a group's pools with the numba oracle, on the host (see the module)."""

    def new_oracle(self, slots: int, pool: int) -> CachePlanner[Any]:
        w, layout = self.window, self.layout
        num_rows = layout.pools[pool].num_rows
        first_table = layout.names[layout.pools[pool].tables[0]]
        row_table = self.cache.store.row_table(f"oracle.{first_table}.{pool}")
        if w.planning_workers == 1 or slots < 2:
            return OracleCacher(
                slots, w.lookahead, w.prefetch_distance, num_rows=num_rows, row_table=row_table
            )
        return PartitionedOracle(
            slots,
            w.lookahead,
            w.prefetch_distance,
            num_rows=num_rows,
            partitions=min(w.planning_workers, slots),
            row_table=row_table,
        )

    def prepare(
        self,
        features: KeyedJaggedTensor,
        oracles: Sequence[CachePlanner[Any]],
        positions: Sequence[slice | np.ndarray],
        step: int,
    ) -> list[tuple[Any, int]]:
        layout = self.layout
        values = streams.to_host(features.values()).numpy()
        lengths = np.asarray(features.length_per_key(), dtype=np.int64)
        check_lengths(lengths, len(values), step)  # the compiled pass reads what they say
        ids, bad = pool_ids(values, lengths, layout.feature_rows, layout.feature_offset)
        if bad >= 0:
            keys, rows = features.keys(), layout.feature_rows
            raise feature_id_error(bad, values, lengths, keys, rows, f"step {step}")
        per_pool = [ids[where] for where in positions] if len(layout.pools) > 1 else [ids]
        return [oracle.prepare_sized(batch) for oracle, batch in zip(oracles, per_pool)]

    def enter(
        self,
        step: int,
        lookups: np.ndarray,
        oracles: Sequence[CachePlanner[Any]],
        batches: Sequence[Any],
    ) -> list[Any]:
        pools = self.layout.pools
        distinct = [pool.table_counts(batch.unique) for pool, batch in zip(pools, batches)]
        self.counters.entered(step, lookups, self.layout.per_table(distinct))
        if self.cache.store.reads_ahead:
            self._read_ahead(oracles, batches)
        return [oracle.push(batch) for oracle, batch in zip(oracles, batches)]

    def finish(self, oracles: Sequence[CachePlanner[Any]]) -> list[list[Any]]:
        return [oracle.finish() for oracle in oracles]

    def plan(self, ready: list[CachePlan]) -> tuple[torch.Tensor, StepMoves]:
        """The step's slots, copied to the device; its moves, one per pool that moves rows.
        The plan is counted now (it is on the host already)."""
        pools, step = self.layout.pools, ready[0].step
        slots = np.concatenate([plan.slots for plan in ready]) if len(ready) > 1 else ready[0].slots
        fetched = [pool.table_counts(plan.fetch_ids) for pool, plan in zip(pools, ready)]
        evicted = [pool.table_counts(plan.evict_ids) for pool, plan in zip(pools, ready)]
        self.counters.planned(
            step, self.layout.per_table(fetched), self.layout.per_table(evicted), self.row_bytes
        )
        moves: StepMoves = [
            partial(self.cache.apply, p, plan)
            for p, plan in enumerate(ready)
            if len(plan.fetch_ids) or len(plan.evict_ids)
        ]
        return streams.to_device(torch.from_numpy(slots), self.cache.device), moves

    def _read_ahead(self, oracles: Sequence[CachePlanner[Any]], batches: Sequence[Any]) -> None:
        """Start reading the rows a batch's step may fetch: those not resident now.

        L + d steps before they are needed, so disk latency hides behind the
        window; a row evicted before its step comes is read again on demand.
        """
        rows = [
            (table, ids)
            for pool, oracle, batch in zip(self.layout.pools, oracles, batches)
            for table, ids, _ in pool.by_table(oracle.absent(batch))
        ]
        self.cache.store.read_ahead(rows)
