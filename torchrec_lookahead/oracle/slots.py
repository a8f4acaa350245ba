"""The oracle's planning state: flat numpy arrays that the compiled kernels update in place.

One :class:`OracleState` holds everything :mod:`torchrec_lookahead.oracle.kernels`
reads and writes for one table: where each row is, what each resident row is
waiting for, the groups and buckets of candidates, and the window's rings.
It is a named tuple of arrays so that one argument carries it into numba.
This module allocates and grows it; the kernels' module names the record
fields and gives them their meaning.

Slots fill in order and a slot is freed only to be refilled in the same plan,
so the free slots are always the tail ``[resident, capacity)``.

Memory: 16 bytes per table row, 104 bytes per cache slot, and 8 bytes per
distinct id and 16 per step inside the window (rings of powers of two).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from torchrec_lookahead.oracle.records import FREE_GROUPS, GROUPS, NEVER, ROW_FIELDS, SLOT_FIELDS

__all__ = ["GroupHeap", "OracleState", "grow_rings", "grow_rows", "grow_slots", "new_state"]


class GroupHeap(NamedTuple):
    """Groups of candidates with no next use and equal key, in a heap by key; ids pooled."""

    head: np.ndarray  # int64: first slot of each group, -1: none
    heap: np.ndarray  # int64: live groups, a binary heap by key
    pos: np.ndarray  # int64: a live group's index in ``heap``
    free: np.ndarray  # int64: stack of unused group ids
    counters: np.ndarray  # int64: [live groups, free group ids]


class OracleState(NamedTuple):
    """All of one oracle's planning state (field meanings: ``oracle.records``)."""

    rows: np.ndarray  # int64 (table rows, ROW_FIELDS): one record per row
    slots: np.ndarray  # int64 (capacity, SLOT_FIELDS): one record, one cache line, per slot
    link_next: np.ndarray  # int64: next slot in the same group or bucket, -1: last
    groups: GroupHeap
    # per step of the window: a ring indexed by ``step & (size - 1)``
    bucket_head: np.ndarray  # int64: first slot waiting for that step, -1: none
    bucket_size: np.ndarray  # int64
    # per distinct id of the window: a ring indexed by ``position & (size - 1)``
    occ_next: np.ndarray  # int64: step of the id's next occurrence (NEVER: not yet seen)
    counters: np.ndarray  # int64: [resident slots]


def new_state(capacity: int, num_rows: int, rows: np.ndarray | None = None) -> OracleState:
    """An empty cache of ``capacity`` slots for ``num_rows`` rows (tables grow later).

    ``rows``: the per-row table to use, ``(num_rows, ROW_FIELDS)`` int64 filled
    with -1 (for example mapped from a file); a new array by default.
    """
    if rows is None:
        rows = np.full((num_rows, ROW_FIELDS), -1, dtype=np.int64)
    elif rows.shape != (num_rows, ROW_FIELDS) or rows.dtype != np.int64:
        raise ValueError(
            f"a row table must be int64 of shape {(num_rows, ROW_FIELDS)}, "
            f"got {rows.dtype} {rows.shape}"
        )
    return OracleState(
        rows=rows,
        slots=_aligned((capacity, SLOT_FIELDS), -1),
        link_next=np.full(capacity, -1, dtype=np.int64),
        groups=GroupHeap(
            head=np.full(capacity, -1, dtype=np.int64),
            heap=np.empty(capacity, dtype=np.int64),
            pos=np.empty(capacity, dtype=np.int64),
            free=np.arange(capacity, dtype=np.int64),
            counters=np.array([0, capacity], dtype=np.int64),
        ),
        bucket_head=np.full(8, -1, dtype=np.int64),
        bucket_size=np.zeros(8, dtype=np.int64),
        occ_next=np.full(1024, NEVER, dtype=np.int64),
        counters=np.zeros(1, dtype=np.int64),
    )


def grow_rows(state: OracleState, num_rows: int) -> OracleState:
    """Room for row ids below ``num_rows`` (amortised doubling)."""
    size = len(state.rows)
    if num_rows <= size:
        return state
    rows = np.full((max(num_rows, 2 * size), ROW_FIELDS), -1, dtype=np.int64)
    rows[:size] = state.rows
    return state._replace(rows=rows)


def grow_slots(state: OracleState, capacity: int) -> OracleState:
    """``capacity`` slots, the resident rows kept in theirs: the new slots join the free
    tail, and as many group ids (a group holds at least one slot) join the free stack."""
    old = len(state.slots)
    if capacity <= old:
        return state
    slots = _aligned((capacity, SLOT_FIELDS), -1)
    slots[:old] = state.slots
    g = state.groups
    free_ids = int(g.counters[FREE_GROUPS])
    heap = np.empty(capacity, dtype=np.int64)
    pos = np.empty(capacity, dtype=np.int64)
    heap[:old], pos[:old] = g.heap, g.pos
    groups = GroupHeap(
        head=np.concatenate([g.head, np.full(capacity - old, -1, dtype=np.int64)]),
        heap=heap,
        pos=pos,
        # the new ids below the stack's top: the ids taken next stay those taken before
        free=np.concatenate(
            [
                np.arange(old, capacity, dtype=np.int64),
                g.free[:free_ids],
                np.empty(old - free_ids, dtype=np.int64),
            ]
        ),
        counters=np.array([g.counters[GROUPS], free_ids + capacity - old], dtype=np.int64),
    )
    link_next = np.concatenate([state.link_next, np.full(capacity - old, -1, dtype=np.int64)])
    return state._replace(slots=slots, link_next=link_next, groups=groups)


def grow_rings(
    state: OracleState, steps: tuple[int, int], positions: tuple[int, int]
) -> OracleState:
    """Rings big enough for the live ``[first, end)`` ranges of steps and of positions."""
    if steps[1] - steps[0] > len(state.bucket_head):
        state = state._replace(
            bucket_head=_grown_ring(state.bucket_head, *steps, -1),
            bucket_size=_grown_ring(state.bucket_size, *steps, 0),
        )
    if positions[1] - positions[0] > len(state.occ_next):
        state = state._replace(occ_next=_grown_ring(state.occ_next, *positions, NEVER))
    return state


def _grown_ring(ring: np.ndarray, first: int, end: int, fill: int) -> np.ndarray:
    """A ring of the next power-of-two size for ``[first, end)``, with the entries the old
    ring held moved: those of ``[first, first + len(ring))``. The newer ones start at
    ``fill``: in the old ring their places were an older entry's (a step's bucket would
    otherwise start with the list of the step ``len(ring)`` before it, which a stream
    going on after ``finish`` still had)."""
    size = 1 << (end - first - 1).bit_length()
    out = np.full(size, fill, dtype=ring.dtype)
    live = np.arange(first, min(end, first + len(ring)))
    out[live & (size - 1)] = ring[live & (len(ring) - 1)]
    return out


def _aligned(shape: tuple[int, int], fill: int) -> np.ndarray:
    """An int64 array whose rows start on 64-byte cache-line boundaries."""
    buffer = np.full(shape[0] * shape[1] + 8, fill, dtype=np.int64)
    skip = (-buffer.ctypes.data % 64) // 8
    return buffer[skip : skip + shape[0] * shape[1]].reshape(shape)
