"""The partition hash of :class:`~torchrec_lookahead.oracle.partitioned.PartitionedOracle`.

Rows are split over ``K`` partitions by a fixed hash of their block (Fibonacci
hashing), so hot rows spread over the partitions; each partition plans its rows
as local ids ``id // K``.
"""

from __future__ import annotations

import numpy as np

from torchrec_lookahead.oracle.records import (
    GOLDEN,
    jit,
)


@jit
def _rotation(block, parts):
    """A hash of ``block`` in ``0..parts-1``: Fibonacci hashing, then multiply-shift."""
    mixed = (np.uint64(block) * GOLDEN) >> np.uint64(32)
    return np.int64((mixed * np.uint64(parts)) >> np.uint64(32))


@jit
def split_of(row, parts):
    """The hash partition of table id ``row`` (below 2**52).

    Id ``b * parts + o`` (``0 <= o < parts``) goes to partition ``(o + h(b)) %
    parts`` as local row ``b``: each run of ``parts`` consecutive ids is spread
    over all partitions, in an order a hash of the run varies, and every
    partition's local rows are dense.
    """
    return partition_of(row, block_of(row, parts, 1.0 / parts), parts)


@jit
def block_of(row, parts, inv):
    """``row // parts`` without a division (slow here): estimate, then correct by one."""
    block = np.int64(row * inv)
    block -= block * parts > row
    block += (block + 1) * parts <= row
    return block


@jit
def partition_of(row, block, parts):
    p = row - block * parts + _rotation(block, parts)
    return p - parts if p >= parts else p


@jit
def global_ids(local, part, parts):
    """The table ids of partition ``part``'s local rows (inverse of :func:`split_of`)."""
    out = np.empty(len(local), np.int64)
    for i in range(len(local)):
        offset = part - _rotation(local[i], parts)
        out[i] = local[i] * parts + (offset + parts if offset < 0 else offset)
    return out


@jit
def place(out, positions, values, offset):
    """``out[positions] = values + offset``: a partition's slots into the batch's."""
    for i in range(len(positions)):
        out[positions[i]] = values[i] + offset
