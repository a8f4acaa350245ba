"""The oracle's victim order, compiled: candidates in groups of equal key, a heap of groups.

Candidates with no use in the window wait in groups of equal key (uses so far,
last use); only groups enter a heap, so the per-id work is O(1). Evictions drain
groups in key order, then buckets of candidates with a next use, from the
farthest step down; only the one group or bucket taken in part is ordered
further, by a linear-time selection. Called by :func:`~torchrec_lookahead.oracle.kernels.emit_step`.
"""

from __future__ import annotations

import numpy as np

from torchrec_lookahead.oracle.records import (
    FREE_GROUPS,
    GROUPS,
    LAST_USE,
    PREV,
    ROW,
    USES,
    jit,
)


@jit
def take_victims(slots, link_next, groups, bucket_head, bucket_size, step, last_step, victims):
    """Fill ``victims`` in policy order: no use in the window, then farthest next use."""
    group_head = groups.head
    taken = 0
    while taken < len(victims) and groups.counters[GROUPS] > 0:
        group = groups.heap[0]
        first = taken
        slot = group_head[group]
        while slot >= 0 and taken < len(victims):
            victims[taken] = slot
            taken += 1
            slot = link_next[slot]
        if slot < 0:  # the whole group fitted
            drop_group(groups, slots, group)
        else:  # the group's rows with the smallest ids (all else ties) fill the rest
            group_head[group] = _take_first(slots, link_next, group_head[group], victims[first:])
            taken = len(victims)
    later = last_step
    while taken < len(victims):
        if later <= step:  # prepare_batch's pinned-row count rules this out
            raise AssertionError("fewer evictable rows than the plan needs")
        bucket = later & (len(bucket_head) - 1)
        if bucket_size[bucket] <= len(victims) - taken:
            slot = bucket_head[bucket]
            while slot >= 0:
                victims[taken] = slot
                taken += 1
                slot = link_next[slot]
            bucket_head[bucket] = -1
            bucket_size[bucket] = 0
        else:  # the bucket's first rows in key order fill the rest
            bucket_size[bucket] -= len(victims) - taken
            rest = _take_first(slots, link_next, bucket_head[bucket], victims[taken:])
            bucket_head[bucket] = rest
            taken = len(victims)
        later -= 1


@jit
def _take_first(slots, link_next, head, out):
    """Move the first ``len(out)`` rows, in key order, of the list at ``head`` into ``out``.

    Returns the head of the list of the rows left. Hoare quickselect: linear
    time on average, for the one group or bucket a plan takes in part.
    """
    n = 0
    slot = head
    while slot >= 0:
        n += 1
        slot = link_next[slot]
    members = np.empty(n, np.int64)
    slot = head
    for i in range(n):
        members[i] = slot
        slot = link_next[slot]
    k = len(out)
    lo, hi = 0, n - 1
    while lo < hi:
        pivot = _key(slots, members[(lo + hi) >> 1])
        i, j = lo, hi
        while i <= j:
            while _less(_key(slots, members[i]), pivot):
                i += 1
            while _less(pivot, _key(slots, members[j])):
                j -= 1
            if i <= j:
                members[i], members[j] = members[j], members[i]
                i += 1
                j -= 1
        if k - 1 <= j:
            hi = j
        elif k - 1 >= i:
            lo = i
        else:
            break
    for i in range(k):
        out[i] = members[i]
    for i in range(k, n):  # relink the rest, in order
        slots[members[i], PREV] = members[i - 1] if i > k else -1
        link_next[members[i]] = members[i + 1] if i + 1 < n else -1
    return members[k] if k < n else -1


@jit
def _key(slots, slot):
    """A candidate's eviction key: ``(uses, last use, id)``, the smallest goes first."""
    return slots[slot, USES], slots[slot, LAST_USE], slots[slot, ROW]


@jit
def _less(a, b):
    """Key order of candidates ``(uses, last use, id)``: fewer uses, older, smaller id."""
    if a[0] != b[0]:
        return a[0] < b[0]
    if a[1] != b[1]:
        return a[1] < b[1]
    return a[2] < b[2]


# ------------------------------------------------------------ group heap
# ``g`` is OracleState.groups; a group's key is that of its first row, in ``slots``.


@jit
def new_group(g):
    """A group id from the free stack, with no rows yet."""
    g.counters[FREE_GROUPS] -= 1
    group = g.free[g.counters[FREE_GROUPS]]
    g.head[group] = -1
    return group


@jit
def group_heap_push(g, slots, group):
    size = g.counters[GROUPS]
    g.heap[size] = group
    g.counters[GROUPS] = size + 1
    _group_sift(g, slots, size)


@jit
def drop_group(g, slots, group):
    """Take a group (emptied, or evicted whole) out of the heap and free its id."""
    i = g.pos[group]
    size = g.counters[GROUPS] - 1
    g.counters[GROUPS] = size
    if i < size:
        g.heap[i] = g.heap[size]
        _group_sift(g, slots, i)
    g.free[g.counters[FREE_GROUPS]] = group
    g.counters[FREE_GROUPS] += 1


@jit
def _group_sift(g, slots, i):
    """Move the group at heap index ``i`` up or down to its place."""
    heap, pos, head = g.heap, g.pos, g.head
    size = g.counters[GROUPS]
    group = heap[i]
    key = _key(slots, head[group])
    while i > 0:
        up = heap[(i - 1) >> 1]
        if not _less(key, _key(slots, head[up])):
            break
        heap[i] = up
        pos[up] = i
        i = (i - 1) >> 1
    while 2 * i + 1 < size:
        child = 2 * i + 1
        down = heap[child]
        if child + 1 < size:
            other = heap[child + 1]
            if _less(_key(slots, head[other]), _key(slots, head[down])):
                child += 1
                down = other
        if not _less(_key(slots, head[down]), key):
            break
        heap[i] = down
        pos[down] = i
        i = child
    heap[i] = group
    pos[group] = i
