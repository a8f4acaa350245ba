"""Backing stores: the full tables and their optimizer state, off the compute device."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

import torchrec_lookahead.streams as streams
from torchrec_lookahead.oracle.records import ROW_FIELDS
from torchrec_lookahead.store.files import StoreFiles

__all__ = ["ORACLE_ROW_BYTES", "HostStore", "MmapStore"]

ORACLE_ROW_BYTES = ROW_FIELDS * 8  # per table row, in the oracles' row tables of a disk store


class HostStore:
    """Every row of every table, with its optimizer state, in host memory.

    The weight tensors are the module's own full-table parameters (shared, not
    copied), so ``state_dict()`` reads the store directly once the cache has
    been written back. Optimizer state is allocated when the fused optimizer
    is known (:meth:`allocate_states`), zero and FP32 like FBGEMM's (for FP16
    tables too), or wraps existing state tensors (``states[t]``, per table).
    With a CUDA cache (``pin``),
    rows move through pinned staging buffers, so copies to and from the device
    can be async while the tables themselves stay pageable (pinning whole tables
    would copy each into page-locked memory, rounded up by the caching host
    allocator). Under DMP on CUDA the store is FBGEMM's UVM TBE: its tensors
    are CUDA tensors (:attr:`on_device`), rows are gathered and scattered on
    their device, on the caller's current stream, and host rows reach it through
    pinned staging too.
    """

    reads_ahead = False  # whether read_ahead does anything (callers skip finding rows if not)

    def __init__(
        self,
        weights: Sequence[torch.Tensor],
        pin: bool = False,
        states: Sequence[Sequence[torch.Tensor]] | None = None,
    ) -> None:
        self.weights = [streams.host_side(w.detach()) for w in weights]
        self.states = [
            [streams.host_side(s.detach()) for s in table]
            for table in states or [[]] * len(weights)
        ]
        self._pin = pin or self.on_device  # rows to and from a GPU go through pinned staging
        self._joined: dict[tuple[int, ...], HostStore | None] = {}  # joined's, per tables

    @property
    def on_device(self) -> bool:
        """Whether the tables are device memory (FBGEMM's UVM TBE under DMP on CUDA):
        their rows are then read and written by the device, on a stream."""
        return bool(self.weights) and self.weights[0].device.type not in ("cpu", "meta")

    def read_ahead(self, rows: Sequence[tuple[int, np.ndarray]]) -> None:
        """``(table, ids)``: rows to be gathered soon (a hint; host memory needs none)."""

    def row_table(self, name: str) -> Callable[[int], np.ndarray] | None:
        """How oracles over this store make their per-row tables (``None``: in RAM)."""
        return None

    @property
    def num_tables(self) -> int:
        return len(self.weights)

    def allocate_states(self, shapes: Sequence[Sequence[torch.Size]]) -> None:
        """Zero optimizer state per table; ``shapes[t]`` are its per-row state shapes."""
        self._joined.clear()
        self.states = [
            [
                streams.host_side(self._zeros(t, k, (len(w), *shape)))
                for k, shape in enumerate(table_shapes)
            ]
            for t, (w, table_shapes) in enumerate(zip(self.weights, shapes))
        ]

    def _zeros(self, table: int, index: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float32)

    def gather(self, table: int, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Rows ``ids`` of ``table``: weights and optimizer state, copied into new buffers
        on each tensor's device (pinned host memory when the store is pinned, so they can
        go to the device async; a UVM or device tensor, under DMP on CUDA, is read there)."""
        return self._rows(self.weights[table], ids), [
            self._rows(s, ids) for s in self.states[table]
        ]

    def staging_rows(
        self, count: int, like: torch.Tensor, device: torch.device | None = None
    ) -> torch.Tensor:
        """An empty buffer of ``count`` rows shaped like those of ``like``, on ``device``
        (default: ``like``'s), pinned if the store is and the buffer is host memory."""
        device = device or like.device
        pin = self._pin and device.type == "cpu"
        shape = (count, *like.shape[1:])
        buffer = torch.empty(shape, dtype=like.dtype, device=device, pin_memory=pin)
        return streams.host_side(buffer) if device.type == "cpu" else buffer

    def _rows(self, source: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        index = streams.to_device(ids, source.device)
        return torch.index_select(source, 0, index, out=self.staging_rows(len(ids), source))

    def joined(self, tables: Sequence[int]) -> HostStore | None:
        """``tables`` as one table (their rows one after another, weights and each state),
        when they lie back to back in memory, as the tables of one FBGEMM TBE do; else None.

        A pool of such tables then moves its rows with one gather or scatter per
        tensor instead of one per table (the per-table calls dominated writing
        back a 26-table cache). Found once per ``tables``, until the optimizer state
        is reallocated: every move asks for it, and the tensors do not move.
        """
        key = tuple(tables)
        if key not in self._joined:
            columns = zip(*([self.weights[t], *self.states[t]] for t in key))
            found = [_back_to_back(list(tensors)) for tensors in columns]
            joined = [tensor for tensor in found if tensor is not None]
            whole = len(joined) == len(found)
            self._joined[key] = HostStore(joined[:1], self._pin, [joined[1:]]) if whole else None
        return self._joined[key]

    def scatter(
        self, table: int, ids: torch.Tensor, weights: torch.Tensor, states: Sequence[torch.Tensor]
    ) -> None:
        """Overwrite rows ``ids`` of ``table`` with ``weights`` and optimizer ``states``
        (each moved to its tensor's device first: from host memory through pinned memory,
        without blocking, on the caller's current stream)."""
        for dst, src in zip((self.weights[table], *self.states[table]), (weights, *states)):
            index = streams.to_device(ids, dst.device)
            dst.index_copy_(0, index, streams.to_device(src, dst.device))

    def bytes_per_row(self, table: int) -> int:
        """Bytes one row of ``table`` moves: its weights (in the table's type) and state."""
        tensors = (self.weights[table], *self.states[table])
        return sum(t[0].numel() * t.element_size() for t in tensors)


def _back_to_back(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One tensor over ``tensors`` (equal row shapes) if each starts where the last ends."""
    first = tensors[0]
    end = first.data_ptr()
    for tensor in tensors:
        same = tensor.shape[1:] == first.shape[1:] and tensor.dtype == first.dtype
        if not (same and tensor.is_contiguous() and tensor.data_ptr() == end):
            return None
        end += tensor.numel() * tensor.element_size()
    rows = sum(len(t) for t in tensors)
    shape = (rows, *first.shape[1:])
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]  # contiguous
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape, strides)


class MmapStore(HostStore):
    """Every row of every table, with its optimizer state, in files on disk, mapped.

    The weight (and state) tensors are views of :class:`~torchrec_lookahead.store.files.StoreFiles`
    tensors: the module's parameters under the unsharded module, the store
    TBE's buffers under DMP. Gathers and scatters are those of
    :class:`HostStore` on the mappings; the kernel pages rows in and writes
    them back. :meth:`read_ahead` starts the disk reads of rows a coming step
    may fetch, as soon as its batch enters the window.

    Args:
        files: the store's files.
        names: table names, for the files of optimizer state made by
            :meth:`allocate_states`.
        weights, states: views of ``files`` tensors, per table.
    """

    reads_ahead = True

    def __init__(
        self,
        files: StoreFiles,
        names: Sequence[str],
        weights: Sequence[torch.Tensor],
        states: Sequence[Sequence[torch.Tensor]] | None = None,
    ) -> None:
        super().__init__(weights, pin=False, states=states)
        self.files = files
        self._names = list(names)
        self._regions: dict[int, list[tuple[int, int, int]]] = {}  # table -> (fd, base, row bytes)

    def allocate_states(self, shapes: Sequence[Sequence[torch.Size]]) -> None:
        """As :meth:`HostStore.allocate_states`, in store files; the disk must hold them and
        the oracles' row tables (made at the first batch) before any is written."""
        state_bytes = sum(
            4 * len(w) * int(np.prod(shape))
            for w, table in zip(self.weights, shapes)
            for shape in table
        )
        oracle_bytes = ORACLE_ROW_BYTES * sum(len(w) for w in self.weights)
        self.files.check_space(
            state_bytes + oracle_bytes, "the optimizer state and the oracles' row tables"
        )
        super().allocate_states(shapes)

    def _zeros(self, table: int, index: int, shape: tuple[int, ...]) -> torch.Tensor:
        return self.files.tensor(f"{self._names[table]}.state{index}", shape)

    def row_table(self, name: str) -> Callable[[int], np.ndarray] | None:
        """Makes an oracle's per-row table (``OracleCacher(row_table=...)``) in store
        files ``name.0``, ``name.1``, ... (one per call): its private memory then
        does not grow with the table either. They are scratch: an earlier oracle's
        under ``name`` (another pipeline's, perhaps partitioned otherwise) are removed."""
        self.files.remove_series(name)
        made = itertools.count()

        def make(num_rows: int) -> np.ndarray:
            shape = (num_rows, ROW_FIELDS)
            table = self.files.tensor(f"{name}.{next(made)}", shape, torch.int64)
            return table.fill_(-1).numpy()

        return make

    def read_ahead(self, rows: Sequence[tuple[int, np.ndarray]]) -> None:
        regions = []
        for table, ids in rows:
            if table not in self._regions:
                self._regions[table] = [
                    (*self.files.region(tensor), 4 * tensor[0].numel())
                    for tensor in (self.weights[table], *self.states[table])
                ]
            ids = np.sort(ids)
            regions += [(fd, base, ids, size) for fd, base, size in self._regions[table]]
        self.files.read_ahead(regions)
