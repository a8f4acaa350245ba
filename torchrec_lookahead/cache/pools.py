"""Slot pools: the tables of a cache group that share one set of cache slots.

Tables whose rows have the same width share a pool: one table of the cache's
TBE, one oracle over one id space in which table ``k`` of the pool owns ids
``offsets[k] .. offsets[k+1]-1`` (its rows, shifted). Planning a pool costs
one oracle call per step whatever the number of tables, and the slots go
where the misses are (Belady across tables) instead of a fixed split per
table. FBGEMM's own UVM cache is shared by the tables of a TBE the same way.

Sharing needs the fused optimizer's update of a row not to depend on the
table layout. The cache TBE still shows FBGEMM each table of a pool as a
table of its own (see ``_compat.split_pooled_tables``), so the update runs
per table as in plain TorchRec; checked bitwise for EXACT_SGD, EXACT_ADAGRAD
and EXACT_ROWWISE_ADAGRAD. Under any other optimizer each table keeps a pool
of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from torchrec_lookahead.cache.id_passes import table_counts

__all__ = ["SHARING_OPTIMIZERS", "SlotPool", "slot_pools"]

# Optimizers whose FBGEMM update is checked bitwise the same when tables share a pool.
SHARING_OPTIMIZERS = frozenset(
    {EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD, EmbOptimType.EXACT_ROWWISE_ADAGRAD}
)


@dataclass(frozen=True)
class SlotPool:
    """Tables (indices into the group) sharing one cache table of ``dim``-wide rows."""

    tables: tuple[int, ...]
    offsets: np.ndarray  # offsets[k]: first pool id of tables[k]; offsets[-1]: pool rows
    dim: int

    @property
    def num_rows(self) -> int:
        return int(self.offsets[-1])

    def by_table(self, ids: np.ndarray) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """``(table, row ids in that table, positions in ids)`` for each table ``ids`` touch."""
        if len(self.tables) == 1:
            if len(ids):
                yield self.tables[0], ids, np.arange(len(ids))
            return
        local = np.searchsorted(self.offsets, ids, side="right") - 1
        order = np.argsort(local, kind="stable")
        bounds = np.searchsorted(local[order], np.arange(len(self.tables) + 1))
        for k, table in enumerate(self.tables):
            if bounds[k] < bounds[k + 1]:
                positions = order[bounds[k] : bounds[k + 1]]
                yield table, ids[positions] - self.offsets[k], positions

    def table_counts(self, ids: np.ndarray) -> np.ndarray:
        """How many of ``ids`` fall in each table of the pool."""
        if len(self.tables) == 1:
            return np.array([len(ids)])
        return table_counts(ids, self.offsets)


def slot_pools(
    num_rows: Sequence[int], dims: Sequence[int], optimizer: EmbOptimType
) -> list[SlotPool]:
    """One pool per row width (per table where ``optimizer`` cannot share), in table order."""
    shared = optimizer in SHARING_OPTIMIZERS
    by_dim: dict[object, list[int]] = {}
    for table, dim in enumerate(dims):
        by_dim.setdefault(dim if shared else table, []).append(table)
    return [
        SlotPool(
            tuple(tables),
            np.concatenate([[0], np.cumsum([num_rows[t] for t in tables])]).astype(np.int64),
            dims[tables[0]],
        )
        for tables in by_dim.values()
    ]
