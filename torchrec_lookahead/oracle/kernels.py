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
and inline their per-id steps; helpers run per group or per plan (the
victim order, :mod:`~torchrec_lookahead.oracle.victims`; the partition hash,
:mod:`~torchrec_lookahead.oracle.partitions`; the records' layout,
:mod:`~torchrec_lookahead.oracle.records`).

Numba's on-disk cache (``cache=True``) keys a compiled function by its own
file only, yet compiles the helpers it calls and the constants it reads into
it: an edit to a helper module alone would leave these passes stale in the
cache. :data:`HELPERS_DIGEST` is a digest of the helper modules' source, and a
test (``tests/test_oracle.py``) fails until it is updated after any edit to
them; updating it edits this file, which is what makes numba recompile.
"""

from __future__ import annotations

import numpy as np

from torchrec_lookahead.oracle.partitions import block_of, partition_of
from torchrec_lookahead.oracle.records import (
    AHEAD,
    BUCKETED,
    GROUP,
    GROUPED,
    LAST_POS,
    LAST_USE,
    NEVER,
    NEXT_USE,
    PINNED,
    PREV,
    RESIDENT,
    ROW,
    SLOT,
    USES,
    WHERE,
    jit,
    prefetch,
)
from torchrec_lookahead.oracle.victims import drop_group, group_heap_push, new_group, take_victims

# ------------------------------------------------------------ prepare / enter

__all__ = ["HELPERS", "HELPERS_DIGEST", "emit_step", "enter_batch", "prepare_batch"]

# The helper modules compiled into these passes, and the digest of their source the
# cache entries were made from (see the module's docstring; tests/test_oracle.py checks it).
HELPERS = ("records.py", "victims.py", "partitions.py")
HELPERS_DIGEST = "64ec837a4a78d47f"


@jit
def prepare_batch(ids, rows, head, starts, parts, part, limit, scratch):
    """Distinct ids of a batch (or of its share) and what the window needs of them.

    Changes nothing. With ``parts > 1`` only the ids of hash partition
    ``part`` are taken, as local rows (see :func:`split_of`), through
    ``scratch``: four int64 rows at least as long as the batch, the caller's
    to keep from batch to batch (fresh batch-sized buffers fault their pages
    in, on a planning thread at every batch). ``head`` is the
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
    if parts > 1:  # this partition's ids, as local rows
        # Two branch-free loops: every id's block and partition (independent per id,
        # so the hash pipelines), then this partition's ids picked. One loop doing
        # both was several times slower: each pick waited on its id's hash.
        assert scratch.shape[0] >= 4 and scratch.shape[1] >= len(ids)  # no bounds checks
        blocks, owner, picked, local = scratch[0], scratch[1], scratch[2], scratch[3]
        inv = 1.0 / parts
        for i in range(len(ids)):
            row = ids[i]
            outside |= row < 0 or (limit >= 0 and row >= limit)
            block = block_of(row, parts, inv)
            blocks[i] = block
            owner[i] = partition_of(row, block, parts)
        used = 0
        for i in range(len(ids) if not outside else 0):
            picked[used] = i
            local[used] = blocks[i]
            used += owner[i] == part
        taken, local = picked[:used].copy(), local[:used]
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
        prefetch(rows, min(max(local[min(i + AHEAD, n - 1)], 0), len(rows) - 1))
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


@jit
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
        prefetch(rows, unique[min(k + 2 * AHEAD, last)])
        ahead = rows[unique[min(k + AHEAD, last)], SLOT]  # prefetched a while ago
        if ahead >= 0:
            prefetch(slots, ahead)
            prefetch(link_next, ahead)
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
                        drop_group(groups, slots, group)
                    _bucket_add(bucket_head, bucket_size, link_next, slots, step, slot)


# ----------------------------------------------------------------- emit


@jit
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
        prefetch(rows, unique[min(k + AHEAD, n_unique - 1)])
        uslot[k] = rows[unique[k], SLOT]  # a missing row's -1 - uses, for now
        n_fetch += uslot[k] < 0
    from_tail = min(n_fetch, len(slots) - st.counters[RESIDENT])
    evict_slots = np.empty(n_fetch - from_tail, np.int64)
    take_victims(slots, link_next, groups, bucket_head, bucket_size, step, last_step, evict_slots)
    evict_ids = np.empty(len(evict_slots), np.int64)
    for v in range(len(evict_slots)):
        prefetch(slots, evict_slots[min(v + AHEAD, len(evict_slots) - 1)])
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
        ahead = uslot[min(k + AHEAD, n_unique - 1)]
        if ahead >= 0:
            prefetch(slots, ahead)
        if n_fetch:
            prefetch(slots, fetch_slots[min(fetched + AHEAD, n_fetch - 1)])
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


@jit
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
        prefetch(slots, released[min(i + AHEAD, len(released) - 1)])
        prefetch(link_next, released[min(i + AHEAD, len(released) - 1)])
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
            made[h] = new_group(groups)
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
            group_heap_push(groups, slots, group)


@jit
def _bucket_add(bucket_head, bucket_size, link_next, slots, next_use, slot):
    bucket = next_use & (len(bucket_head) - 1)
    link_next[slot] = bucket_head[bucket]
    bucket_head[bucket] = slot
    bucket_size[bucket] += 1
    slots[slot, WHERE] = BUCKETED
