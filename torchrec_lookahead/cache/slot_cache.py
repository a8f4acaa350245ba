"""The cache table: a FBGEMM TBE of cache slots, one table per slot pool, and row moves."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torchrec.modules.embedding_configs import DataType

import torchrec_lookahead.streams as streams
from torchrec_lookahead._compat import split_pooled_tables
from torchrec_lookahead.cache.pools import SlotPool
from torchrec_lookahead.oracle.contract import CachePlan
from torchrec_lookahead.store.stores import HostStore
from torchrec_lookahead.tbe import set_learning_rate, training_tbe
from torchrec_lookahead.variable_batch import padded_lookup

__all__ = ["SlotCache"]

StoreWrite = Callable[[], None]  # the host's part of a write-back into host memory


def _host_index(ids: np.ndarray) -> torch.Tensor:
    """``ids`` as an index tensor in host memory (moved to a device by ``streams.to_device``,
    on the stream that reads it)."""
    return streams.host_side(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)))


class SlotCache:
    """A TBE whose table ``p`` holds the slots of pool ``p``, backed by a :class:`HostStore`.

    The TBE runs the lookups and the fused optimizer exactly as TorchRec's
    ``fused`` kernel does, only on slot numbers instead of row ids. Rows move
    in and out with their optimizer state through FBGEMM's public per-table
    views (``split_embedding_weights`` / ``split_optimizer_states``), taken as
    ``.data`` so that a move may run while a step's backward is still pending:
    the plan guarantees the moved slots are not the ones that step uses. A
    pool's ids are its tables' rows, offset (see :class:`SlotPool`); the store
    is addressed per table. Rows are cached in the tables' ``data_type`` (the
    store's), their optimizer state in the type FBGEMM keeps for it.

    ``slot_ids[p][k]`` is the pool id in slot ``k`` of pool ``p`` (-1 if
    empty), as applied so far; it is what :meth:`write_back_all` and
    :meth:`refresh` act on.
    """

    def __init__(
        self,
        pools: Sequence[SlotPool],
        slots: Sequence[int],
        feature_tables: Sequence[int],
        optimizer: EmbOptimType,
        store: HostStore,
        device: torch.device,
        pooling: PoolingMode = PoolingMode.SUM,
        fbgemm_params: dict[str, Any] | None = None,
        data_type: DataType = DataType.FP32,
    ) -> None:
        self.device = device
        self.store = store
        self.pools = list(pools)
        pool_of_table = {t: p for p, pool in enumerate(self.pools) for t in pool.tables}
        self._feature_tables = list(feature_tables)
        self._feature_pools = [pool_of_table[t] for t in feature_tables]
        self._feature_dims = [self.pools[p].dim for p in self._feature_pools]
        self._optimizer = optimizer
        self._pooling = pooling
        self._fbgemm_params = dict(fbgemm_params or {})
        self._data_type = data_type
        self._lock = threading.Lock()
        self._side = streams.side_stream(device)  # where rows move, beside the trainer's work
        self.resize(slots)

    @property
    def slots(self) -> list[int]:
        """Slots of each pool."""
        return [len(ids) for ids in self.slot_ids]

    def resize(self, slots: Sequence[int]) -> None:
        """Build the TBE with ``slots[p]`` slots for pool ``p``; the cache must be empty."""
        with self._lock:
            if any(bool((ids >= 0).any()) for ids in getattr(self, "slot_ids", [])):
                raise RuntimeError("a cache holding rows cannot be resized")
            self._build(slots)
            # The TBE was made on the calling thread's stream (the stage's, at a window's
            # first batch): rows move into it on the side stream only after it is made.
            self._side.wait_for(streams.mark(self.device))

    def grow(self, slots: Sequence[int]) -> None:
        """A larger TBE, ``slots[p]`` slots (no fewer than now) for pool ``p``, holding the
        cached rows and their optimizer state in their slots, and the old TBE's learning
        rate and step count: training goes on as if it had been this size all along.

        Called on the trainer's thread between steps with no move in flight (the
        pipeline settles its executor first), so the copies see every update; they run
        on the trainer's stream, which the next moves wait for.
        """
        with self._lock:
            if any(n < len(ids) for n, ids in zip(slots, self.slot_ids)):
                raise ValueError(f"a cache of {self.slots} slots cannot grow to {list(slots)}")
            old, ids = self.tbe, self.slot_ids
            rows = [[w, *states] for w, states in zip(self._weights, self._states)]
            self._build(slots)
            for p, (held, tensors) in enumerate(zip(ids, rows)):
                for new, got in zip([self._weights[p], *self._states[p]], tensors):
                    new[: len(held)].copy_(got)
                self.slot_ids[p][: len(held)] = held
            set_learning_rate(self.tbe, old.get_learning_rate())
            self.tbe.iter.copy_(old.iter)
            # The old TBE's memory may come from another stream's pool (the stage's, which
            # built it): it must not go back there before the copies above have read it.
            streams.record_use([rows, old.iter], self.device)
            self._side.wait_for(streams.mark(self.device))

    def _build(self, slots: Sequence[int]) -> None:
        """A TBE of ``slots[p]`` empty slots for pool ``p``, with its row views."""
        self.tbe = training_tbe(
            slots,
            [pool.dim for pool in self.pools],
            self._optimizer,
            self._fbgemm_params,
            self.device,
            self._pooling,
            feature_table_map=self._feature_pools,
            data_type=self._data_type,
        )
        split_pooled_tables(self.tbe, self._feature_tables, self._feature_pools, slots)
        self._weights = [w.data for w in self.tbe.split_embedding_weights()]
        states = (
            self.tbe.split_optimizer_states() if self._optimizer != EmbOptimType.EXACT_SGD else []
        )
        self._states = [[s.data for s in pool] for pool in states] or [[] for _ in slots]
        self.slot_ids = [streams.host_side(torch.full((n,), -1, dtype=torch.int64)) for n in slots]

    def state_shapes(self) -> list[list[torch.Size]]:
        """Per table, the per-row shape of each optimizer state tensor (its pool's)."""
        shapes = [[s.shape[1:] for s in pool] for pool in self._states]
        by_table = {t: shapes[p] for p, pool in enumerate(self.pools) for t in pool.tables}
        return [by_table[t] for t in range(len(by_table))]

    def forward(
        self,
        slots: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
        batch_size_per_feature_per_rank: list[list[int]] | None = None,
        **vbe_output: Any,
    ) -> torch.Tensor:
        """Pooled rows at ``slots``; a deduplicated batch gives its bags per feature and
        rank, and under TorchRec's merging of several kernels ``vbe_output`` /
        ``vbe_output_offsets`` (see :mod:`~torchrec_lookahead.variable_batch`)."""
        if batch_size_per_feature_per_rank is None:
            return self.tbe(slots, offsets, per_sample_weights=per_sample_weights)
        if self.device.type != "cpu":  # FBGEMM's variable-batch kernels
            return self.tbe(
                slots,
                offsets,
                per_sample_weights=per_sample_weights,
                batch_size_per_feature_per_rank=batch_size_per_feature_per_rank,
                **vbe_output,
            )
        if vbe_output.get("vbe_output") is not None:
            raise ValueError(
                "a preallocated vbe_output is not supported on the CPU (nor by "
                "FBGEMM's CPU TBE): one kernel per lookup, please"
            )
        return padded_lookup(
            self.tbe,
            slots,
            offsets,
            per_sample_weights,
            batch_size_per_feature_per_rank,
            self._feature_dims,
        )

    def apply(self, pool: int, plan: CachePlan) -> None:
        """Write back ``plan``'s evicted rows, then fetch its rows.

        The evicted slots are read before the fetched rows land in them (both on the
        side stream, in that order). A store in host memory is written once the read
        rows reach the host, after the fetches are issued: the executor's host waits
        for the side stream (and with it for the trainer's issue point) only then, not
        before its fetches. The fetched rows are not the evicted ones (a step's rows
        are not its victims), so they do not read what is still to be written."""
        with self._lock:
            store_rows = None
            if len(plan.evict_ids):
                store_rows = self._write_back(pool, plan.evict_ids, plan.evict_slots)
            if len(plan.fetch_ids):
                self._fetch(pool, plan.fetch_ids, plan.fetch_slots)
            if store_rows is not None:
                store_rows()

    def write_back_all(self) -> None:
        """Write every occupied slot back to the store; the rows stay cached. Called on the
        trainer's thread: the reads wait for its updates and for every move queued, and
        the trainer's stream then waits for the writes (a store on the device, under DMP
        on CUDA, is written on the side stream)."""
        with self._lock:
            self._side.wait_for(streams.mark(self.device))
            store_rows = []
            for p, ids in enumerate(self.slot_ids):
                slots = torch.nonzero(ids >= 0).flatten()
                if len(slots):
                    store_rows.append(
                        self._copy_out(p, ids[slots].numpy(), streams.host_side(slots))
                    )
            for write in store_rows:
                if write is not None:
                    write()
            self._side.current_waits(self._side.record())

    def clear(self) -> None:
        """Forget every cached row (write them back first if they were updated)."""
        with self._lock:
            for ids in self.slot_ids:
                ids.fill_(-1)

    def refresh(self, states: bool = False) -> None:
        """Reload occupied slots from the store (after the store was overwritten):
        their weights, and their optimizer state too when ``states``. On the side stream,
        after the moves queued before; the trainer's stream then waits for it."""
        with self._lock:
            self._side.wait_for(streams.mark(self.device))
            for p, ids in enumerate(self.slot_ids):
                slots = torch.nonzero(ids >= 0).flatten()
                if len(slots):
                    land = partial(self._land, p, ids[slots].numpy(), streams.host_side(slots))
                    self._side.run(partial(land, states))
            self._side.current_waits(self._side.record())

    # The moves below hold the lock (taken by the public methods above).

    def _write_back(self, pool: int, ids: np.ndarray, slots: np.ndarray) -> StoreWrite | None:
        slot_index = _host_index(slots)
        store_rows = self._copy_out(pool, ids, slot_index)
        self.slot_ids[pool][slot_index] = -1
        return store_rows

    def _copy_out(self, pool: int, ids: np.ndarray, slots: torch.Tensor) -> StoreWrite | None:
        """The rows in ``slots`` (a host index) to the store, read on the side stream after
        every move queued before (a fetch into these slots may not have landed yet).

        A store on the device (TorchRec's UVM tables under DMP on CUDA) takes the rows
        straight from the cache there: one crossing of the host link, the UVM write, and
        no wait on the host; returns None. A store in host memory gets them through host
        memory (pinned staging on a GPU): returns the host's part, to call when nothing
        more is to be queued first, which waits for the side stream and writes them."""
        tensors = (self._weights[pool], *self._states[pool])
        store, parts = self._store_parts(pool, ids)
        if self.store.on_device:

            def move() -> None:
                index = streams.to_device(slots, self.device)
                _scatter(store, parts, [cached.index_select(0, index) for cached in tensors])

            self._side.run(move)
            return None
        cpu = torch.device("cpu")
        staged = [self.store.staging_rows(len(slots), t, cpu) for t in tensors]

        def read() -> None:
            index = streams.to_device(slots, self.device)
            for host, cached in zip(staged, tensors):
                if cached.device.type == "cpu":
                    torch.index_select(cached, 0, index, out=host)
                else:
                    host.copy_(cached.index_select(0, index), non_blocking=True)

        self._side.run(read)

        def write() -> None:
            self._side.drain()  # the rows are in host memory now
            _scatter(store, parts, staged)

        return write

    def _store_parts(
        self, pool: int, ids: np.ndarray
    ) -> tuple[HostStore, list[tuple[int, np.ndarray, np.ndarray]]]:
        """Where a pool's ``ids`` live: a store and ``(table, rows, positions in ids)`` per
        table; one table when the pool's tables lie back to back in the store (a pool's ids
        are its tables' rows one after another, so they are that table's rows)."""
        tables = self.pools[pool].tables
        joined = self.store.joined(tables) if len(tables) > 1 else None
        if joined is not None:
            return joined, [(0, ids, np.arange(len(ids)))]
        return self.store, list(self.pools[pool].by_table(ids))

    def _gather(self, pool: int, ids: np.ndarray) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Rows ``ids`` of a pool from the store, in order: weights and optimizer state, in
        buffers where the store keeps them (host memory, pinned on a GPU; the device, for
        a store there). A pool of several tables gathers per table into one buffer."""
        store, parts = self._store_parts(pool, ids)
        gathered = [
            (positions, *store.gather(table, _host_index(local)))
            for table, local, positions in parts
        ]
        if len(gathered) == 1:
            return gathered[0][1], gathered[0][2]
        _, first, first_states = gathered[0]
        weights = store.staging_rows(len(ids), first)
        states = [store.staging_rows(len(ids), s) for s in first_states]
        for positions, got, got_states in gathered:
            where = streams.to_device(_host_index(positions), got.device)
            weights.index_copy_(0, where, got)
            for dst, src in zip(states, got_states):
                dst.index_copy_(0, where, src)
        return weights, states

    def _fetch(self, pool: int, ids: np.ndarray, slots: np.ndarray) -> None:
        """Rows ``ids`` into ``slots``, landed on the side stream (see :meth:`_land`)."""
        slot_index = _host_index(slots)
        self._side.run(partial(self._land, pool, ids, slot_index, True))
        self.slot_ids[pool][slot_index] = _host_index(ids)

    def _land(self, pool: int, ids: np.ndarray, slots: torch.Tensor, states: bool) -> None:
        """Rows ``ids`` of a pool from the store into cache ``slots`` (a host index): their
        weights, and their optimizer state when ``states``. Run on the side stream, so that
        every device operation of the move is ordered there: the gather from a store on
        the device, the copies of the slot index and of the rows to the device, and the
        row copies into the cache (a copy made on the trainer's stream and read here would
        race with it, and its memory could be handed out again too early)."""
        weights, rows = self._gather(pool, ids)
        index = streams.to_device(slots, self.device)
        targets = [(self._weights[pool], weights)]
        if states:
            targets += list(zip(self._states[pool], rows))
        for cached, got in targets:
            cached.index_copy_(0, index, streams.to_device(got, cached.device))


def _scatter(
    store: HostStore,
    parts: list[tuple[int, np.ndarray, np.ndarray]],
    rows: list[torch.Tensor],
) -> None:
    """``rows`` (weights, then optimizer state; one per id of ``parts``) into ``store``."""
    count = sum(len(positions) for _, _, positions in parts)
    for table, local, positions in parts:
        part = rows
        if len(positions) != count:
            where = streams.to_device(_host_index(positions), rows[0].device)
            part = [r.index_select(0, where) for r in rows]
        store.scatter(table, _host_index(local), part[0], part[1:])
