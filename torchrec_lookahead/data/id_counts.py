"""Counting a column's ids in the order they first occur, and mapping ids through the result.

:class:`IdCounts` is a hash table (open addressing, Fibonacci hashing) of a
column's distinct ids with their counts, in first-occurrence order, compiled
with numba and run without the GIL; :meth:`IdCounts.lookup_table` turns it into
the column's lookup table (kept id -> contiguous id) and :func:`lookup_ids` maps
a block of raw ids through one. The three passes of
:mod:`~torchrec_lookahead.data.contiguous` are built on them.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["IdCounts", "lookup_ids", "table_shift"]

_NO_WEIGHTS = np.empty(0, np.int64)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: the product's top bits


@njit(cache=True, nogil=True, inline="always")
def _slot(key, shift):
    return np.int64((np.uint64(key) * _GOLDEN) >> np.uint64(shift))


@njit(cache=True, nogil=True)
def _count(values, weights, start, keys, where, counts, ids, size, shift):
    """Count ``values[start:]`` (each by its ``weights`` entry, or 1 when there are none)
    into the table: a new key takes index ``size`` (and is recorded in ``ids`` when that
    is not empty). Stops before a new key would fill the table past half; returns
    ``(values consumed, size)``."""
    mask = keys.size - 1
    limit = keys.size // 2
    weighted = weights.size > 0
    record = ids.size > 0
    for i in range(start, values.size):
        key = values[i]
        add = weights[i] if weighted else 1
        h = _slot(key, shift)
        while True:
            w = where[h]
            if w < 0:
                if size == limit:
                    return i, size
                keys[h] = key
                where[h] = size
                counts[size] = add
                if record:
                    ids[size] = key
                size += 1
                break
            if keys[h] == key:
                counts[w] += add
                break
            h = (h + 1) & mask
    return values.size, size


@njit(cache=True, nogil=True)
def _rehash(keys, where, mapped, skip, new_keys, new_values, shift):
    """Put every key of one table into another, its value ``mapped[index]`` (the index
    itself when ``mapped`` is empty), leaving out keys whose value is ``skip``."""
    mask = new_keys.size - 1
    remap = mapped.size > 0
    for j in range(keys.size):
        w = where[j]
        if w < 0:
            continue
        value = mapped[w] if remap else w
        if value == skip:
            continue
        h = _slot(keys[j], shift)
        while new_values[h] >= 0:
            h = (h + 1) & mask
        new_keys[h] = keys[j]
        new_values[h] = value


@njit(cache=True, nogil=True)
def lookup_ids(values, keys, table, shift, absent, out):
    """``out[i]``: the value of ``values[i]`` in the table, ``absent`` where it has none;
    returns -1, or the first position with no value when ``absent`` < 0."""
    mask = keys.size - 1
    for i in range(values.size):
        key = values[i]
        h = _slot(key, shift)
        while True:
            value = table[h]
            if value < 0:
                if absent < 0:
                    return i
                out[i] = absent
                break
            if keys[h] == key:
                out[i] = value
                break
            h = (h + 1) & mask
    return -1


# ------------------------------------------------------------------ counting ids


class IdCounts:
    """Distinct int64 ids and how often each occurs, in the order they first occur: an
    open-addressing hash table at most half full, 40-80 bytes per distinct id (48-96
    with ``record_ids``, which keeps the ids in that order)."""

    def __init__(self, record_ids: bool = False, capacity: int = 1024) -> None:
        self.record_ids = record_ids
        self.size = 0
        self._allocate(max(2, 1 << (capacity - 1).bit_length()))

    def _allocate(self, capacity: int) -> None:
        self.keys = np.empty(capacity, np.int64)
        self.where = np.full(capacity, -1, np.int64)  # index of the slot's key; -1: free
        self.counts = np.zeros(capacity // 2, np.int64)
        self.ids = np.empty(capacity // 2 if self.record_ids else 0, np.int64)
        self.shift = 64 - (capacity.bit_length() - 1)

    def add(self, values: np.ndarray, weights: np.ndarray | None = None) -> None:
        """Count ``values`` (1-D int64, any stride), each ``weights[i]`` times if given."""
        weights = _NO_WEIGHTS if weights is None else weights
        start = 0
        while True:
            start, self.size = _count(
                values,
                weights,
                start,
                self.keys,
                self.where,
                self.counts,
                self.ids,
                self.size,
                self.shift,
            )
            if start == len(values):
                return
            self._grow()

    def _grow(self) -> None:
        keys, where, counts, ids = self.keys, self.where, self.counts, self.ids
        self._allocate(2 * keys.size)
        _rehash(keys, where, _NO_WEIGHTS, -2, self.keys, self.where, self.shift)
        self.counts[: self.size] = counts[: self.size]
        self.ids[: ids.size] = ids

    def lookup_table(self, threshold: int) -> tuple[np.ndarray, np.ndarray, int]:
        """``(keys, values, cardinality)``: a table from each id counted at least ``threshold``
        times (every id for a threshold of 0 or 1) to its contiguous id (2, 3, ... in order
        of first occurrence), and the table size that takes them all (ids 0 and 1 included).
        Ids left out are the rare ones, which map to 1."""
        counts = self.counts[: self.size]
        kept = counts >= threshold if threshold > 1 else np.ones(self.size, bool)
        mapped = np.where(kept, 1 + np.cumsum(kept), 1)
        entries = int(kept.sum())
        capacity = max(2, 1 << (2 * entries - 1).bit_length())
        keys = np.zeros(capacity, np.int64)
        values = np.full(capacity, -1, np.int64)
        _rehash(self.keys, self.where, mapped, 1, keys, values, 64 - (capacity.bit_length() - 1))
        return keys, values, 2 + entries


def table_shift(table: np.ndarray) -> int:
    """The hash shift of a lookup table of ``table.size`` slots (a power of two)."""
    return 64 - (table.size.bit_length() - 1)
