"""Streamed ``torch.distributed.checkpoint``: large tensors saved and loaded in row chunks.

DCP writes each tensor, or each local shard of a sharded one, as a single item.
Two of its steps then hold a whole item in memory: the writer copies a tensor
that is a view of a larger buffer (every TorchRec shard of a TBE's weights is
one) before writing it, and the file reader loads a whole saved item before
copying it into place. For a disk store's tables, larger than RAM, neither
fits. :class:`StreamingSavePlanner` saves every tensor larger than
``chunk_bytes`` as row ranges, each its own item (the chunks shards of a
sharded tensor would be), so saving copies one chunk at a time and loading
such a checkpoint reads one chunk at a time, with any load planner.

The result is an ordinary DCP checkpoint: plain TorchRec loads it at any world
size, and this project loads plain TorchRec's (a plain checkpoint's items are
whole shards, so loading one still reads a shard at a time).

Store files are mapped ``MADV_RANDOM`` (the window reads rows ahead), so a
pass over a whole table would fault one page at a time; both planners ask the
kernel for a chunk's pages before DCP touches them
(:func:`~torchrec_lookahead.store.files.will_need`), so checkpoints read and
write store files in large requests.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, SavePlan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    ReadItem,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from torchrec_lookahead.store.files import will_need

DEFAULT_CHUNK_BYTES = 64 << 20


class StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner with every tensor item over ``chunk_bytes`` split
    along its first dimension into items of at most ``chunk_bytes`` (at least one
    row each). Use it wherever ``dcp.save`` takes a ``planner``."""

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        super().__init__()
        self.chunk_bytes = chunk_bytes
        # chunk index -> (the whole item it was cut from, first row in it, rows)
        self._sources: dict[MetadataIndex, tuple[WriteItem, int, int]] = {}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self._sources.clear()
        items = [chunk for item in plan.items for chunk in self._split(item)]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        source = self._sources.get(write_item.index)
        if source is None:
            return super().resolve_data(write_item)
        whole, first, rows = source
        tensor = super().resolve_data(whole)
        assert isinstance(tensor, torch.Tensor), "only tensors are split into chunks"
        # DCP writes the chunks of a tensor one after another: this one's pages and the
        # next one's are read from a store file while this one is copied and written.
        will_need(tensor.narrow(0, first, min(2 * rows, tensor.shape[0] - first)))
        return tensor.narrow(0, first, rows)

    def _split(self, item: WriteItem) -> list[WriteItem]:
        """``item`` as row-range items of at most ``chunk_bytes`` (itself if it is small)."""
        data = item.tensor_data
        if data is None or len(data.chunk.sizes) == 0:
            return [item]
        sizes, offsets = data.chunk.sizes, data.chunk.offsets
        row_bytes = math.prod(sizes[1:]) * data.properties.dtype.itemsize
        rows_per_chunk = max(1, self.chunk_bytes // max(1, row_bytes))
        if sizes[0] <= rows_per_chunk:
            return [item]
        chunks = []
        for first in range(0, sizes[0], rows_per_chunk):
            rows = min(rows_per_chunk, sizes[0] - first)
            chunk = ChunkStorageMetadata(
                offsets=torch.Size([offsets[0] + first, *offsets[1:]]),
                sizes=torch.Size([rows, *sizes[1:]]),
            )
            index = MetadataIndex(item.index.fqn, chunk.offsets)
            self._sources[index] = (item, first, rows)
            piece = TensorWriteData(chunk, data.properties, data.size)
            chunks.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=piece))
        return chunks


class StreamingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that asks for each target's pages before DCP copies
    a saved chunk into them (a store file is then read in large requests, not a page
    per fault). It keeps TorchRec's sharded tensors whole
    (``flatten_sharded_tensors=False``): flattened, a table with no shard on a rank
    loses its key there, and DCP then takes a multi-rank checkpoint for a pre-2.4 one."""

    def __init__(self) -> None:
        super().__init__(flatten_sharded_tensors=False)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        tensor = super().resolve_tensor(read_item)
        will_need(tensor)
        return tensor
