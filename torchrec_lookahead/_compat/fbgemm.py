"""FBGEMM's TBE: what differs between releases, and the table map a cache pool rewrites."""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    SplitTableBatchedEmbeddingBagsCodegen,
)

__all__ = [
    "TBE_TAKES_HOST_BUFFERS",
    "split_pooled_tables",
]


# FBGEMM 1.8 added the TBE's ``preallocated_host_buffers`` (a disk store under DMP hands
# it the store's mapped files as the TBE's host memory); 1.6, the release beside the lent
# GPU machine's torch 2.11, lacks it.
TBE_TAKES_HOST_BUFFERS = (
    "preallocated_host_buffers"
    in inspect.signature(SplitTableBatchedEmbeddingBagsCodegen.__init__).parameters
)


def split_pooled_tables(
    tbe: SplitTableBatchedEmbeddingBagsCodegen,
    feature_tables: Sequence[int],
    feature_pools: Sequence[int],
    slots: Sequence[int],
) -> None:
    """Make FBGEMM update a pool's tables as the separate tables they are in TorchRec.

    FBGEMM finds a TBE's tables from ``hash_size_cumsum`` (one entry per
    feature; features with equal entries share a table) and their storage from
    ``weights_offsets``. A pool is one table of slots, so its tables' features
    would look like features of one shared table, and the CPU update of a
    shared table takes another path (for ``EXACT_ROWWISE_ADAGRAD`` one that
    rounds differently). Here each of the group's tables gets its own entry,
    as wide as its pool, while its features still read and write the pool's
    slots: the update then runs per table exactly as plain TorchRec's does.
    FBGEMM has no constructor argument for this (its table map is the storage
    map), so the buffers it derives from the map are rewritten.
    """
    if getattr(tbe, "enable_raw_embedding_streaming", False):
        raise ValueError(
            "raw embedding streaming (FBGEMM) is not supported with lookahead "
            "caching: it keeps state built from the table map this rewrites"
        )
    entries, total, last = [], 0, None
    for table, pool in zip(feature_tables, feature_pools):
        if last is not None and table != last[0]:
            total += slots[last[1]]
        entries.append(total)
        last = (table, pool)
    total += slots[last[1]] if last is not None else 0
    device = tbe.hash_size_cumsum.device
    tbe.hash_size_cumsum = torch.tensor(entries + [total], dtype=torch.int64, device=device)
    tbe.total_hash_size = total
    tbe.total_hash_size_bits = int(math.log2(total) + 1) if total else 0
