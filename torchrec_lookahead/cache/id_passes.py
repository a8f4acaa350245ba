"""A batch's ids in its pools' id spaces, and counts per table: compiled, GIL released.

The host planner's per-id work besides the oracle's own passes. On a GPU host
the planning thread shares the interpreter with the trainer's thread, which
launches the step; numpy's many short calls (a ``repeat``, comparisons, an
``any``, an add; a ``searchsorted`` and a ``bincount`` per count) each take the
GIL. These passes do the same work in one call each, without it, and in one
sweep over the ids. The range check is :func:`~torchrec_lookahead.checks.check_feature_ids`'s,
compiled (the device planner and the batch check keep that one); its error is
made by :func:`~torchrec_lookahead.checks.feature_id_error` either way.
"""

from __future__ import annotations

import numpy as np

from torchrec_lookahead.oracle.records import jit

__all__ = ["pool_ids", "table_counts"]


@jit
def pool_ids(values, lengths, rows, offsets):
    """``(ids, bad)``: each id of ``values`` plus its feature's ``offsets`` entry, as
    int64, features one after another (``lengths`` ids each, adding up to
    ``len(values)``: not checked here); ``bad`` is -1, or the position of the first
    id that is negative or not below its feature's ``rows`` entry (``ids`` is then
    incomplete)."""
    ids = np.empty(len(values), np.int64)
    start = 0
    for f in range(len(lengths)):
        limit, shift = rows[f], offsets[f]
        for i in range(start, start + lengths[f]):
            value = np.int64(values[i])
            if value < 0 or value >= limit:
                return ids, i
            ids[i] = value + shift
        start += lengths[f]
    return ids, -1


@jit
def table_counts(ids, offsets):
    """How many of ``ids`` fall in each range ``offsets[k] .. offsets[k+1]-1``;
    ``ValueError`` for an id outside every range. Within a run of one range (a
    batch's ids come feature by feature) an id costs two comparisons."""
    counts = np.zeros(len(offsets) - 1, np.int64)
    lo, hi, k = offsets[0], offsets[0], -1
    for i in range(len(ids)):
        value = ids[i]
        if value < lo or value >= hi:
            k = np.searchsorted(offsets, value, side="right") - 1
            if k < 0 or k >= len(counts):
                raise ValueError("an id outside every table of the pool")
            lo, hi = offsets[k], offsets[k + 1]
        counts[k] += 1
    return counts
