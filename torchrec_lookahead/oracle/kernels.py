"""The oracle's per-step work, compiled with numba and run without the GIL.

Three passes per step, one call each, so the Python driver in
:mod:`torchrec_lookahead.oracle.cacher` does no per-id work:

* :func:`prepare_batch`: checks the ids, deduplicates them by scatter into the
  row table, and counts what the pinned-row check needs. It writes the table
  and restores it before returning, so it changes nothing.
* :func:`enter_batch`: a batch joins the window. Each row's previous
  occurrence learns that its next use is this step; a resident candidate
  without a next use moves to the bucket of this step.
* :func:`emit_step`: plans one step: rows leaving the pinned steps become
  candidates, misses are found, victims are taken in policy order, fetched
  rows get slots, and the step's rows are pinned with their next use.

Victim order (the oracle's contract, docs/design.md). A resident row becomes a
candidate when it leaves the pinned steps, and its key (uses so far, last use) is then
frozen. Candidates with a next use wait in the bucket of that step, which
dissolves when the step is planned (its rows are hits). Candidates with no
use in the window wait in groups of equal key: the rows released by one plan
share their last use, so a plan adds one group per distinct use count. Only
groups enter a heap, so the per-id work is O(1): a list insert, or an unlink
when a later batch uses the row. Evictions drain groups in key order, then
buckets from the farthest step down; only the one group or bucket taken in
part is ordered further, by a linear-time selection.

Speed comes from memory, not arithmetic: a step touches a few random rows of
tables larger than the caches. So a row's fields are one 16-byte record and a
slot's one 64-byte record (a cache line each). And, a numba detail: passing
arrays to a call, or reading a named-tuple field inside a branch, costs
atomic reference counting, so hot loops read the state's arrays from locals
and inline their per-id steps; helpers run per group or per plan. All
compiled code lives in this one module because numba's on-disk cache
(``cache=True``) only notices changes to the function's own file.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = [
    "NEVER",
    "RESIDENT",
    "ROW",
    "ROW_FIELDS",
    "SLOT",
    "SLOT_FIELDS",
    "emit_step",
    "enter_batch",
    "global_ids",
    "place",
    "prepare_batch",
    "split_of",
]

NEVER = 1 << 62  # next use of a row with no use in the window
# OracleState.rows columns: latest stream position (-1: none); slot if resident, else -1 - uses
LAST_POS, SLOT, ROW_FIELDS = 0, 1, 2
# OracleState.slots columns: the resident row's last and next use, its uses in planned
# steps (frozen while it waits as a candidate), where it waits, the previous slot in its
# group, its group, and the row itself; padded to a cache line (the next slot in a group
# or bucket is in the dense OracleState.link_next, which eviction walks)
LAST_USE, NEXT_USE, USES, WHERE, PREV, GROUP, ROW, SLOT_FIELDS = 0, 1, 2, 3, 4, 5, 6, 8
PINNED, GROUPED, BUCKETED = 0, 1, 2  # values of WHERE
RESIDENT = 0  # OracleState.counters: [slots used]
GROUPS, FREE_GROUPS = 0, 1  # GroupHeap.counters: [live groups, free group ids]
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: Fibonacci hashing's multiplier

_jit = njit(nogil=True, cache=True)
_AHEAD = 64  # loop iterations between a prefetch and the use of its row or slot


@intrinsic
def _prefetch(typingctx, array, index):
    """Start loading ``array[index]`` (its first column) into the caches."""

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        at = [args[1]] + [ir.Constant(ir.IntType(64), 0)] * (aryty.ndim - 1)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, at, wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])  # read, keep, data
        return context.get_dummy_value()

    return types.void(array, index), codegen


# ------------------------------------------------------------ prepare / enter


@_jit
def prepare_batch(ids, rows, head, starts, parts, part, limit):
    """Distinct ids of a batch (or of its share) and what the window needs of them.

    Changes nothing. With ``parts > 1`` only the ids of hash partition
    ``part`` are taken, as local rows (see :func:`split_of`). ``head`` is the
    position the first distinct id will take in the stream of distinct ids;
    ``starts[j-1]`` is where step ``step-j`` starts (``j = 1..d``, 0 for
    steps before the stream). Returns ``(n, unique, prev, mult, inverse,
    gaps, taken)``: ``n`` distinct ids (-1 if an id is negative, not below
    ``limit`` when that is not -1, or its row is past the table), in order of
    first occurrence, each one's latest earlier position (-1: none) and
    multiplicity; each taken id's index into ``unique``; ``gaps[j]``:
    distinct ids last seen in step ``step-j``; the batch positions taken
    (empty when ``parts == 1``: all of them).
    """
    taken = np.empty(0, np.int64)
    local = ids
    outside = False
    if parts > 1:  # this partition's ids, as local rows: a branch-free pass
        taken = np.empty(len(ids), np.int64)
        local = np.empty(len(ids), np.int64)
        inv = 1.0 / parts
        used = 0
        for i in range(len(ids)):
            row = ids[i]
            if row < 0 or (limit >= 0 and row >= limit):
                outside = True
                break
            block = _block_of(row, parts, inv)
            taken[used] = i
            local[used] = block
            used += _partition_of(row, block, parts) == part
        taken, local = taken[:used].copy(), local[:used]
    n = len(local)
    unique = np.empty(n, np.int64)
    prev = np.empty(n, np.int64)
    mult = np.zeros(n, np.int32)
    inverse = np.empty(n, np.int32)
    found = 0
    for i in range(n if not outside else 0):
        row = local[i]
        if row < 0 or row >= len(rows):
            outside = True
            break
        _prefetch(rows, min(max(local[min(i + _AHEAD, n - 1)], 0), len(rows) - 1))
        pos = rows[row, LAST_POS]
        if pos >= head:  # seen earlier in this batch
            k = pos - head
        else:
            k = found
            unique[k] = row
            prev[k] = pos
            rows[row, LAST_POS] = head + k
            found += 1
        mult[k] += 1
        inverse[i] = k
    gaps = np.zeros(len(starts) + 1, np.int64)
    for k in range(found):
        rows[unique[k], LAST_POS] = prev[k]  # leave no trace
        for j in range(len(starts)):
            if prev[k] >= starts[j]:
                gaps[j + 1] += 1
                break
    # Copies, so that the batches kept in the window hold no batch-sized buffers.
    unique, mult = unique[:found].copy(), mult[:found].copy()
    return -1 if outside else found, unique, prev[:found], mult, inverse, gaps, taken


@_jit
def enter_batch(st, step, unique, prev, head, planned_from):
    """Batch ``step`` joins the window: record its distinct ids, link earlier uses to it.

    ``planned_from`` is the stream position where the first unplanned step
    starts: an earlier occurrence at or after it learns its next use from the
    occurrence ring when its step is planned; one before it belongs to a
    planned step, so its row (if resident) learns the next use now.
    """
    rows, slots, link_next, groups = st.rows, st.slots, st.link_next, st.groups
    group_head = groups.head
    bucket_head, bucket_size = st.bucket_head, st.bucket_size
    occ_next = st.occ_next
    mask = len(occ_next) - 1
    last = len(unique) - 1
    for k in range(len(unique)):
        _prefetch(rows, unique[min(k + 2 * _AHEAD, last)])
        ahead = rows[unique[min(k + _AHEAD, last)], SLOT]  # prefetched a while ago
        if ahead >= 0:
            _prefetch(slots, ahead)
            _prefetch(link_next, ahead)
        row = unique[k]
        pos = prev[k]
        rows[row, LAST_POS] = head + k
        occ_next[(head + k) & mask] = NEVER
        if pos >= planned_from:
            occ_next[pos & mask] = step
        elif pos >= 0:
            slot = rows[row, SLOT]
            if slot >= 0:
                slots[slot, NEXT_USE] = step
                if slots[slot, WHERE] == GROUPED:  # unlink it from its group
                    group = slots[slot, GROUP]
                    before, after = slots[slot, PREV], link_next[slot]
                    if before >= 0:
                        link_next[before] = after
                    else:
                        group_head[group] = after
                    if after >= 0:
                        slots[after, PREV] = before
                    if group_head[group] < 0:
                        _drop_group(groups, slots, group)
                    _bucket_add(bucket_head, bucket_size, link_next, slots, step, slot)


# ----------------------------------------------------------------- emit


@_jit
def emit_step(st, step, unique, inverse, mult, head, released, released_step, last_step, freq):
    """Plan ``step``; returns ``(slots, evict_ids, evict_slots, fetch_ids, fetch_slots, uslot)``.

    ``released`` are the slots of step ``released_step = step-d-1``'s distinct
    ids, which leave the pinned steps now; ``last_step`` is the newest step in
    the window; ``freq`` selects the frequency tie-break. ``uslot`` is the
    slot of each distinct id, kept until its rows are released.
    """
    rows, slots, link_next, groups = st.rows, st.slots, st.link_next, st.groups
    bucket_head, bucket_size = st.bucket_head, st.bucket_size
    _release(slots, link_next, groups, bucket_head, bucket_size, step, released, released_step)
    n_unique = len(unique)
    uslot = np.empty(n_unique, np.int64)
    n_fetch = 0
    for k in range(n_unique):
        _prefetch(rows, unique[min(k + _AHEAD, n_unique - 1)])
        uslot[k] = rows[unique[k], SLOT]  # a missing row's -1 - uses, for now
        n_fetch += uslot[k] < 0
    from_tail = min(n_fetch, len(slots) - st.counters[RESIDENT])
    evict_slots = np.empty(n_fetch - from_tail, np.int64)
    _take_victims(slots, link_next, groups, bucket_head, bucket_size, step, last_step, evict_slots)
    evict_ids = np.empty(len(evict_slots), np.int64)
    for v in range(len(evict_slots)):
        _prefetch(slots, evict_slots[min(v + _AHEAD, len(evict_slots) - 1)])
        evict_ids[v] = slots[evict_slots[v], ROW]
        rows[evict_ids[v], SLOT] = -1 - slots[evict_slots[v], USES]

    # Fetched rows fill the free tail, then the victims' slots; every row of the
    # step is then pinned, used now and next used at its successor.
    occ_next = st.occ_next
    mask = len(occ_next) - 1
    fetch_ids = np.empty(n_fetch, np.int64)
    fetch_slots = np.empty(n_fetch, np.int64)
    for j in range(n_fetch):
        fetch_slots[j] = st.counters[RESIDENT] + j if j < from_tail else evict_slots[j - from_tail]
    fetched = 0
    for k in range(n_unique):
        ahead = uslot[min(k + _AHEAD, n_unique - 1)]
        if ahead >= 0:
            _prefetch(slots, ahead)
        if n_fetch:
            _prefetch(slots, fetch_slots[min(fetched + _AHEAD, n_fetch - 1)])
        row = unique[k]
        slot = uslot[k]
        if slot < 0:
            uses = -1 - slot
            slot = fetch_slots[fetched]
            fetch_ids[fetched] = row
            fetched += 1
            uslot[k] = slot
            rows[row, SLOT] = slot
            slots[slot, ROW] = row
            slots[slot, USES] = uses
        slots[slot, WHERE] = PINNED
        slots[slot, LAST_USE] = step
        slots[slot, NEXT_USE] = occ_next[(head + k) & mask]
        if freq:
            slots[slot, USES] += mult[k]
    st.counters[RESIDENT] += from_tail
    bucket = step & (len(bucket_head) - 1)
    bucket_head[bucket] = -1  # its rows were this step's hits
    bucket_size[bucket] = 0

    batch_slots = np.empty(len(inverse), np.int64)
    for i in range(len(inverse)):
        batch_slots[i] = uslot[inverse[i]]
    return batch_slots, evict_ids, evict_slots, fetch_ids, fetch_slots, uslot


@_jit
def _release(slots, link_next, groups, bucket_head, bucket_size, step, released, released_step):
    """Rows of step ``released_step`` not used since, nor by ``step``, become candidates."""
    group_head = groups.head
    # This plan's groups by use count (they all share the last use): open addressing.
    size = 2
    while size < 2 * len(released):
        size *= 2
    keys = np.full(size, -1, np.int64)
    made = np.empty(size, np.int64)
    for i in range(len(released)):
        _prefetch(slots, released[min(i + _AHEAD, len(released) - 1)])
        _prefetch(link_next, released[min(i + _AHEAD, len(released) - 1)])
        slot = released[i]
        next_use = slots[slot, NEXT_USE]
        if slots[slot, LAST_USE] != released_step or next_use <= step:
            continue  # used again since, or by this step
        if next_use != NEVER:
            _bucket_add(bucket_head, bucket_size, link_next, slots, next_use, slot)
            continue
        uses = slots[slot, USES]
        h = uses & (size - 1)
        while keys[h] >= 0 and keys[h] != uses:
            h = (h + 1) & (size - 1)
        fresh = keys[h] < 0
        if fresh:
            keys[h] = uses
            made[h] = _new_group(groups)
        group = made[h]
        first = group_head[group]
        link_next[slot] = first
        slots[slot, PREV] = -1
        if first >= 0:
            slots[first, PREV] = slot
        group_head[group] = slot
        slots[slot, GROUP] = group
        slots[slot, WHERE] = GROUPED
        if fresh:  # its key is readable now that it has a row
            _group_heap_push(groups, slots, group)


@_jit
def _bucket_add(bucket_head, bucket_size, link_next, slots, next_use, slot):
    bucket = next_use & (len(bucket_head) - 1)
    link_next[slot] = bucket_head[bucket]
    bucket_head[bucket] = slot
    bucket_size[bucket] += 1
    slots[slot, WHERE] = BUCKETED


# --------------------------------------------------------------- victims


@_jit
def _take_victims(slots, link_next, groups, bucket_head, bucket_size, step, last_step, victims):
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
            _drop_group(groups, slots, group)
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


@_jit
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


@_jit
def _key(slots, slot):
    """A candidate's eviction key: ``(uses, last use, id)``, the smallest goes first."""
    return slots[slot, USES], slots[slot, LAST_USE], slots[slot, ROW]


@_jit
def _less(a, b):
    """Key order of candidates ``(uses, last use, id)``: fewer uses, older, smaller id."""
    if a[0] != b[0]:
        return a[0] < b[0]
    if a[1] != b[1]:
        return a[1] < b[1]
    return a[2] < b[2]


# ------------------------------------------------------------ group heap
# ``g`` is OracleState.groups; a group's key is that of its first row, in ``slots``.


@_jit
def _new_group(g):
    """A group id from the free stack, with no rows yet."""
    g.counters[FREE_GROUPS] -= 1
    group = g.free[g.counters[FREE_GROUPS]]
    g.head[group] = -1
    return group


@_jit
def _group_heap_push(g, slots, group):
    size = g.counters[GROUPS]
    g.heap[size] = group
    g.counters[GROUPS] = size + 1
    _group_sift(g, slots, size)


@_jit
def _drop_group(g, slots, group):
    """Take a group (emptied, or evicted whole) out of the heap and free its id."""
    i = g.pos[group]
    size = g.counters[GROUPS] - 1
    g.counters[GROUPS] = size
    if i < size:
        g.heap[i] = g.heap[size]
        _group_sift(g, slots, i)
    g.free[g.counters[FREE_GROUPS]] = group
    g.counters[FREE_GROUPS] += 1


@_jit
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


# ------------------------------------------------------------- partitions


@_jit
def _rotation(block, parts):
    """A hash of ``block`` in ``0..parts-1``: Fibonacci hashing, then multiply-shift."""
    mixed = (np.uint64(block) * _GOLDEN) >> np.uint64(32)
    return np.int64((mixed * np.uint64(parts)) >> np.uint64(32))


@_jit
def split_of(row, parts):
    """The hash partition of table id ``row`` (below 2**52).

    Id ``b * parts + o`` (``0 <= o < parts``) goes to partition ``(o + h(b)) %
    parts`` as local row ``b``: each run of ``parts`` consecutive ids is spread
    over all partitions, in an order a hash of the run varies, and every
    partition's local rows are dense.
    """
    return _partition_of(row, _block_of(row, parts, 1.0 / parts), parts)


@_jit
def _block_of(row, parts, inv):
    """``row // parts`` without a division (slow here): estimate, then correct by one."""
    block = np.int64(row * inv)
    block -= block * parts > row
    block += (block + 1) * parts <= row
    return block


@_jit
def _partition_of(row, block, parts):
    p = row - block * parts + _rotation(block, parts)
    return p - parts if p >= parts else p


@_jit
def global_ids(local, part, parts):
    """The table ids of partition ``part``'s local rows (inverse of :func:`split_of`)."""
    out = np.empty(len(local), np.int64)
    for i in range(len(local)):
        offset = part - _rotation(local[i], parts)
        out[i] = local[i] * parts + (offset + parts if offset < 0 else offset)
    return out


@_jit
def place(out, positions, values, offset):
    """``out[positions] = values + offset``: a partition's slots into the batch's."""
    for i in range(len(positions)):
        out[positions[i]] = values[i] + offset
