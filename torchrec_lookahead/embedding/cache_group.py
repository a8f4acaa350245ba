"""Building a cache group: one place for the unsharded collections and the sharded kernels.

Both hold tables (or this rank's shards of them) of one data type behind one
cache TBE. :func:`build_cache_group` chooses the store (host memory, or a disk
store's files), sizes each table's slots from the module's
:class:`~torchrec_lookahead.steps.CacheSizing` and builds the
:class:`~torchrec_lookahead.cache.group.CacheGroup`; :func:`check_disk_store`
is the one refusal of a disk store where it cannot serve.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torchrec.modules.embedding_configs import DataType

from torchrec_lookahead._compat import TBE_TAKES_HOST_BUFFERS
from torchrec_lookahead.cache.group import CacheGroup
from torchrec_lookahead.settings import CacheSizing
from torchrec_lookahead.store.files import StoreFiles
from torchrec_lookahead.store.stores import HostStore, MmapStore
from torchrec_lookahead.tbe import check_optimizer

__all__ = ["GroupTable", "build_cache_group", "check_disk_store"]


@dataclass(frozen=True)
class GroupTable:
    """A table of a cache group as the group holds it: all of it (unsharded) or this
    rank's shard (``local_rows`` of its ``num_embeddings``)."""

    name: str
    num_embeddings: int
    local_rows: int
    dim: int
    num_features: int
    load_factor: float | None = None  # a sharding plan's, which wins over the module's sizing


def check_disk_store(device: torch.device, tables: Sequence[Any], under_dmp: bool = False) -> None:
    """Refuse a disk store (``store_dir``) for ``tables`` (TorchRec configs) computed on
    ``device``, before anything is built or any file made, where it cannot serve."""
    if device.type not in ("cpu", "meta"):
        raise ValueError(
            f"a disk store runs on the CPU for now, not {device}: its files are mapped host "
            "memory, which FBGEMM's UVM tables cannot be, and pinning them for a GPU would "
            "copy every table into RAM"
        )
    if under_dmp and not TBE_TAKES_HOST_BUFFERS:
        raise ValueError(
            "a disk store (store_dir) under DMP needs fbgemm_gpu 1.8 or newer, whose "
            "TBE takes preallocated_host_buffers; this fbgemm_gpu's does not"
        )
    for table in tables:
        if table.data_type != DataType.FP32:
            raise ValueError(
                f"table {table.name}: a disk store holds FP32 tables for now, not "
                f"{table.data_type.value}; keep it in host memory (no store_dir)"
            )


def build_cache_group(
    tables: Sequence[GroupTable],
    weights: Sequence[torch.Tensor],
    *,
    sizing: CacheSizing,
    fused_params: Mapping[str, Any],
    device: torch.device,
    pooling: PoolingMode,
    data_type: DataType,
    files: StoreFiles | None = None,
    states: Sequence[Sequence[torch.Tensor]] | None = None,
) -> CacheGroup:
    """The cache group of ``tables`` on ``device``, its store their full ``weights``
    (and optimizer ``states``, where a TBE already holds them; else zero state is
    allocated): in host memory, or in ``files`` (a disk store). ``fused_params`` are
    the TBE settings, the fused optimizer among them."""
    params = dict(fused_params)
    params.pop("preallocated_host_buffers", None)  # the store TBE's, not the cache's
    optimizer = params.pop("optimizer")
    names = [t.name for t in tables]
    check_optimizer(optimizer, device, names)
    store: HostStore
    if files is not None:
        store = MmapStore(files, names, weights, states)
    else:
        # On CUDA the tables stay pageable: rows move through pinned staging buffers (the
        # store's), so no table is copied into page-locked memory.
        store = HostStore(weights, pin=device.type == "cuda", states=states)
    cached = CacheGroup(
        names,
        [t.local_rows for t in tables],
        [t.dim for t in tables],
        [k for k, t in enumerate(tables) for _ in range(t.num_features)],
        [sizing.rows(t.name, t.num_embeddings, t.local_rows, t.load_factor) for t in tables],
        store,
        optimizer,
        device,
        pooling,
        params,
        data_type,
        [
            sizing.cap(t.name, t.num_embeddings, t.local_rows)
            if t.name in sizing.max_rows
            else None
            for t in tables
        ],
    )
    if states is None:
        store.allocate_states(cached.cache.state_shapes())
    return cached
