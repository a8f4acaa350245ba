"""The cache table: a FBGEMM TBE sized to the cache slots, and row moves against a store."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from torchrec_lookahead.oracle import CachePlan
from torchrec_lookahead.store import HostStore

__all__ = ["CacheTable"]


def _as_index(ids: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(device)


class CacheTable:
    """A TBE whose table ``t`` has ``slots[t]`` rows, backed by a :class:`HostStore`.

    The TBE runs the lookups and the fused optimizer exactly as TorchRec's
    ``fused`` kernel does, only on slot numbers instead of row ids. Rows move
    in and out with their optimizer state through FBGEMM's public per-table
    views (``split_embedding_weights`` / ``split_optimizer_states``), taken as
    ``.data`` so that a move may run while a step's backward is still pending:
    the plan guarantees the moved slots are not the ones that step uses.

    ``slot_ids[t][k]`` is the row in slot ``k`` (-1 if empty), as applied so
    far; it is what :meth:`write_back_all` and :meth:`refresh` act on.
    """

    def __init__(
        self,
        slots: Sequence[int],
        dims: Sequence[int],
        feature_table_map: Sequence[int],
        optimizer: EmbOptimType,
        store: HostStore,
        device: torch.device,
        pooling: PoolingMode = PoolingMode.SUM,
        fbgemm_params: dict[str, Any] | None = None,
    ) -> None:
        on_cuda = device.type == "cuda"
        location = EmbeddingLocation.DEVICE if on_cuda else EmbeddingLocation.HOST
        compute = ComputeDevice.CUDA if on_cuda else ComputeDevice.CPU
        self.device = device
        self.store = store
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(n, d, location, compute) for n, d in zip(slots, dims)],
            feature_table_map=list(feature_table_map),
            optimizer=optimizer,
            pooling_mode=pooling,
            device=device,
            **(fbgemm_params or {}),
        )
        self._weights = [w.data for w in self.tbe.split_embedding_weights()]
        states = self.tbe.split_optimizer_states() if optimizer != EmbOptimType.EXACT_SGD else []
        self._states = [[s.data for s in table] for table in states] or [[] for _ in slots]
        self.slot_ids = [torch.full((n,), -1, dtype=torch.int64) for n in slots]
        self._lock = threading.Lock()

    def state_shapes(self) -> list[list[torch.Size]]:
        """Per table, the per-row shape of each optimizer state tensor."""
        return [[s.shape[1:] for s in table] for table in self._states]

    def forward(
        self,
        slots: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.tbe(slots, offsets, per_sample_weights=per_sample_weights)

    def apply(self, table: int, plan: CachePlan) -> None:
        """Write back ``plan``'s evicted rows, then fetch its rows."""
        with self._lock:
            if len(plan.evict_ids):
                self._write_back(table, plan.evict_ids, plan.evict_slots)
            if len(plan.fetch_ids):
                self._fetch(table, plan.fetch_ids, plan.fetch_slots)

    def write_back_all(self) -> None:
        """Write every occupied slot back to the store; the rows stay cached."""
        with self._lock:
            for t, ids in enumerate(self.slot_ids):
                slots = torch.nonzero(ids >= 0).flatten()
                if len(slots):
                    self._copy_out(t, ids[slots], slots)

    def clear(self) -> None:
        """Forget every cached row (write them back first if they were updated)."""
        with self._lock:
            for ids in self.slot_ids:
                ids.fill_(-1)

    def refresh(self, states: bool = False) -> None:
        """Reload occupied slots from the store (after the store was overwritten):
        their weights, and their optimizer state too when ``states``."""
        with self._lock:
            for t, ids in enumerate(self.slot_ids):
                slots = torch.nonzero(ids >= 0).flatten()
                if not len(slots):
                    continue
                on_device = slots.to(self.device)
                sources = [(self._weights[t], self.store.weights[t])]
                if states:
                    sources += list(zip(self._states[t], self.store.states[t]))
                for cached, stored in sources:
                    cached.index_copy_(
                        0, on_device, stored.index_select(0, ids[slots]).to(self.device)
                    )

    # The three moves below hold the lock (taken by the public methods above).

    def _write_back(self, table: int, ids: np.ndarray, slots: np.ndarray) -> None:
        slot_index = _as_index(slots, torch.device("cpu"))
        self._copy_out(table, _as_index(ids, torch.device("cpu")), slot_index)
        self.slot_ids[table][slot_index] = -1

    def _copy_out(self, table: int, ids: torch.Tensor, slots: torch.Tensor) -> None:
        on_device = slots.to(self.device)
        rows = [t.index_select(0, on_device) for t in (self._weights[table], *self._states[table])]
        if self.device.type == "cuda":  # through pinned staging buffers, then wait for them
            staged = [self.store.staging(r) for r in rows]
            for host, dev in zip(staged, rows):
                host.copy_(dev, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
            rows = staged
        self.store.scatter(table, ids, rows[0], rows[1:])

    def _fetch(self, table: int, ids: np.ndarray, slots: np.ndarray) -> None:
        row_index = _as_index(ids, torch.device("cpu"))
        weights, states = self.store.gather(table, row_index)
        slot_index = _as_index(slots, self.device)
        self._weights[table].index_copy_(0, slot_index, weights.to(self.device, non_blocking=True))
        for dst, src in zip(self._states[table], states):
            dst.index_copy_(0, slot_index, src.to(self.device, non_blocking=True))
        self.slot_ids[table][slot_index.cpu()] = row_index
