"""The lookahead oracle made of device ops: a step's plan with no host sync, for the GPU.

:class:`DeviceOracleCacher` keeps :class:`~torchrec_lookahead.oracle.OracleCacher`'s
contract (``docs/design.md``, "The oracle's contract") and its victim order, so its
misses equal the numba oracle's at every step, but its state is torch tensors on a
device and a step's plan is a fixed sequence of tensor ops over static shapes: no
Python loop over ids, slots or the window's batches, no ``.item()``, ``nonzero`` or
``torch.unique``. On CUDA the host only queues kernels, so planning overlaps the
step it plans for. It runs on CPU tensors too (how it is tested).

How a step is planned without the numba oracle's heaps and linked lists (those
are pointer chasing, one row at a time; a device wants whole-array passes):

* Deduplication by sort: sort the batch, flag each value unlike its
  predecessor, number them by a cumulative sum, scatter the distinct ids to
  their numbers. The output is padded (``-1``) to the window's width, so its
  shape does not depend on the data.
* The rows a window's steps ``step-d..step`` use together (the capacity rule's
  count) by counting, not sorting: the rows of the ``d`` steps entered last are
  kept as a number; a batch adds its rows whose latest occurrence is older than
  them, and when it enters, step ``step-d``'s rows whose latest occurrence it
  still is leave.
* The window is a ring of ``max(L, d) + 1`` rows of padded distinct ids (and
  their multiplicities, and the batch's ids themselves), one row per step, at the
  row a device step counter names.
* Next use by chaining, as the numba oracle does: each row remembers its latest
  occurrence (its step and place in the ring). When a batch enters, an earlier
  occurrence in a step not yet planned learns, in the ring, that this step is its
  next use; one in a planned step belongs to a row whose slot (if resident) has
  no next use yet, and the slot learns it. Planning a step hands each of its
  rows' slots the next use its ring entry holds. So a step costs two scatters
  over the batch's distinct ids, not a pass over the whole ring.
* Victims by stable sorts over the slots, least significant key first: row id,
  last use, uses so far (frequency tie-break only), then a small exact key
  that puts free slots first, then candidates with no use in the window, then
  candidates by farthest next use, and non-candidates last. The keys are packed
  in pairs into 64 bits, (last use, row) and (rank, uses), so it takes two
  sorts where the values fit (tables under 2**32 rows; a sort per key past
  that). The first
  ``misses`` slots of that order receive the fetched rows: free slots first,
  then the victims', so the victims are a contiguous run of it. Sorting the
  whole cache costs ``O(C log C)`` per step where the heaps cost ``O(log)``
  per touched row, but it is a handful of kernels with no data-dependent
  control flow.

Per-row and per-slot arrays are stored one past their index: entry 0 belongs
to the padding (row or slot ``-1``), and absorbs writes of padded entries, so
no masked write needs a data-dependent shape.

Capturable: once the window is full, a step (``push_device`` of a batch padded to the
ring's width with ``-1``) is the same sequence of kernels over the same memory at every
step. The steps it enters and plans are counters on the device, not numbers the host
bakes into kernel arguments, so a CUDA graph captured from one step replays any later
one (``tests/test_device_oracle.py`` traces three steps and compares them). A wider batch
or ``grow`` reallocates the state: capture again after either.

Which calls sync with the host: :meth:`~DeviceOracleCacher.push_device` and
:meth:`~DeviceOracleCacher.finish_device` never do (their :class:`DevicePlan` holds
device tensors; bad ids and broken capacity set sticky device flags instead of
raising). The contract path (``prepare``, ``push``, ``plan``, ``finish``,
``flush``, ``absent``, ``num_resident``) reads back what it must to raise its
errors and to trim the plans to exact lengths: a range check and the
pinned-row count per batch, and each plan's counts and arrays.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn.functional import pad

from torchrec_lookahead.oracle.cacher import (
    as_int64,
    capacity_error,
    check_range,
    checked_settings,
)
from torchrec_lookahead.oracle.contract import CachePlan, CachePlanner
from torchrec_lookahead.settings import check_count

__all__ = ["DeviceOracleCacher", "DevicePlan", "DevicePreparedBatch", "trimmed_plan"]

_NEVER = 1 << 62  # next use of a slot whose row has none in the window
# The victim order's packed sort keys (int64, non-negative): (last use + 1, row + 1) and
# (rank, uses), with the bounds under which they fit.
_ROW_BITS, _USES_BITS = 32, 40
_ROW_LIMIT = (1 << _ROW_BITS) - 1  # table rows
_STEP_LIMIT = (1 << (63 - _ROW_BITS)) - 1  # steps planned
_USES_LIMIT = 1 << _USES_BITS  # ids entered (a row's uses are fewer)
_RANK_LIMIT = 1 << (63 - _USES_BITS)
_INTEGERS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_EMPTY = np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class DevicePlan:
    """One step's plan as device tensors of static shapes, made with no host sync.

    ``evict_*`` and ``fetch_*`` have the window's width; entries from
    ``num_evict`` / ``num_fetch`` on are padding (``-1``). Apply the evictions,
    then the fetches, as for a :class:`~torchrec_lookahead.steps.CachePlan`.
    """

    step: int
    slots: torch.Tensor  # int64, one per id of the batch, in its order
    evict_ids: torch.Tensor
    evict_slots: torch.Tensor
    fetch_ids: torch.Tensor
    fetch_slots: torch.Tensor
    num_evict: torch.Tensor  # 0-d int64
    num_fetch: torch.Tensor  # 0-d int64: the step's misses
    # 0-d bool, sticky: a batch entered so far broke the capacity rule, or had an id
    # outside the table (made padding: its slot is -1). Either way the plans are void.
    overflow: torch.Tensor
    bad_ids: torch.Tensor

    @property
    def counts(self) -> torch.Tensor:
        """``[num_evict, num_fetch]``, on the device."""
        return torch.stack([self.num_evict, self.num_fetch])

    def moves(self, num_evict: int, num_fetch: int) -> torch.Tensor:
        """The evicted ids and slots, then the fetched ids and slots, trimmed to the counts
        (read back first) in one tensor: one copy to the host."""
        return torch.cat(
            [
                self.evict_ids[:num_evict],
                self.evict_slots[:num_evict],
                self.fetch_ids[:num_fetch],
                self.fetch_slots[:num_fetch],
            ]
        )

    def to_cache_plan(self, with_slots: bool = True) -> CachePlan:
        """The plan trimmed to its lengths, as numpy arrays (syncs: reads the counts and
        the flags, then copies the moves in one piece, and the slots unless ``with_slots``
        is False: a cache's lookup takes them on the device). ``ValueError`` if the plan
        is void (a flag is set)."""
        flags = torch.stack([self.overflow, self.bad_ids]).to(self.num_fetch.dtype)
        num_evict, num_fetch, overflow, bad_ids = torch.cat([self.counts, flags]).tolist()
        if overflow or bad_ids:
            cause = "broke the capacity rule" if overflow else "had an id outside the table"
            raise ValueError(
                f"the plan of step {self.step} is void: a batch entered without a sync {cause}"
            )
        moves = self.moves(num_evict, num_fetch).cpu().numpy()
        slots = self.slots.cpu().numpy() if with_slots else _EMPTY
        return trimmed_plan(self.step, num_evict, num_fetch, moves, slots)


def trimmed_plan(
    step: int, num_evict: int, num_fetch: int, moves: np.ndarray, slots: np.ndarray = _EMPTY
) -> CachePlan:
    """Step ``step``'s :class:`CachePlan` from what :meth:`DevicePlan.moves` gave, on the host."""
    evict_ids, evict_slots, fetch_ids, fetch_slots = np.split(
        moves, np.cumsum([num_evict, num_evict, num_fetch])
    )
    return CachePlan(step, slots, evict_ids, evict_slots, fetch_ids, fetch_slots)


@dataclass(frozen=True)
class DevicePreparedBatch:
    """A batch deduplicated and counted on the device, ready to enter the window."""

    oracle: DeviceOracleCacher
    step: int
    ids: torch.Tensor  # the batch, int64, bad ids (sync-free path only) made -1
    distinct: torch.Tensor  # its distinct ids ascending, padded with -1 to ``width``
    mult: torch.Tensor  # each distinct id's occurrences (0: padding)
    pinned_rows: torch.Tensor  # 0-d: distinct ids of steps step-d..step
    bad: torch.Tensor  # 0-d bool: the batch had an id outside the table

    @property
    def unique(self) -> np.ndarray:
        """The batch's distinct ids (syncs)."""
        distinct = self.distinct.cpu().numpy()
        return distinct[distinct >= 0]


class DeviceOracleCacher(CachePlanner[DevicePreparedBatch]):
    """Windowed-Belady cache planner for one table, planned by device ops.

    Same arguments, contract and victim order as
    :class:`~torchrec_lookahead.oracle.OracleCacher` (``tie_break`` included);
    ``device`` holds the state and makes the plans (default: CUDA if available,
    else the CPU). Batches are 1-D integer tensors (numpy arrays and sequences
    are taken too); a batch on another device is copied to ``device``.

    ``num_rows=None``: the table grows to the largest id seen, on the contract
    path (which reads the largest id back). The sync-free path checks ids
    against the table size known so far, so pass ``num_rows`` for it.

    Memory: 24 bytes per table row (its slot, its latest occurrence and its uses,
    int64; 16 bytes with ``tie_break="recency"``, which needs no uses), 24 per cache
    slot (its row, last use and next use) plus ``O(capacity)`` temporaries per step,
    and a ring of ``max(L, d) + 1`` steps of 32 bytes per entry (a distinct id, its
    count, its next use, an id of the batch), as wide as the longest batch so far
    (rounded up to a power of two).
    """

    def __init__(
        self,
        capacity: int,
        lookahead: int,
        prefetch_distance: int = 1,
        num_rows: int | None = None,
        device: torch.device | str | None = None,
        *,
        tie_break: str = "frequency",
    ) -> None:
        capacity, lookahead, prefetch_distance, num_rows = checked_settings(
            capacity, lookahead, prefetch_distance, num_rows, tie_break
        )
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.capacity = capacity
        self.lookahead = lookahead
        self.prefetch_distance = prefetch_distance
        self.num_rows = num_rows
        self.tie_break = tie_break
        # "cuda" as the tensors made on it say it ("cuda:0", the current device), so that
        # push_device takes them.
        self.device = torch.empty(0, device=device).device

        self._frequency = tie_break == "frequency"
        self._rows = 0  # table rows with state
        self._row_slot = self._full(1, -1)  # [1 + rows]: slot of each row, -1: absent
        self._row_uses = self._full(1, 0) if self._frequency else None  # occurrences planned
        self._slot_row = self._full(1 + capacity, -1)  # [1 + C]: row in each slot, -1: free
        self._slot_last = self._full(1 + capacity, -1)  # last planned use of each slot's row
        self._slot_next = self._full(1 + capacity, _NEVER)  # its next use after that one
        # [1 + rows]: each row's latest occurrence entered, step << 32 | place in its
        # ring row (-1: none)
        self._row_latest = self._full(1, -1)
        self._grow_rows(num_rows or 0)
        self._span = max(lookahead, prefetch_distance) + 1  # steps the ring keeps
        self._width = 0
        self._ring_ids = self._full((self._span, 0), -1)  # padded distinct ids per step
        self._ring_mult = self._full((self._span, 0), 0)
        self._ring_batch = self._full((self._span, 0), -1)  # each step's ids, padded
        # [1 + span * width]: each ring entry's next use (entry 0: a dump for entries
        # with no occurrence in a step not yet planned)
        self._ring_next = self._full(1, _NEVER)
        self._positions = self._full(0, 0)  # arange(width)
        self._window_rows = self._full((), 0)  # rows of the d steps entered last, together
        self._lengths: deque[int] = deque()  # how many ids each step entered, not planned, has
        self._steps_pushed = 0  # on the host, for the plans' step numbers and the checks
        self._ids_entered = 0  # on the host: bounds a row's uses (see _victim_order)
        self._next_plan = 0
        self._entering = self._full(1, 0)  # the same two counters, on the device
        self._planning = self._full(1, 0)
        self._overflow = torch.zeros((), dtype=torch.bool, device=self.device)
        self._bad = torch.zeros((), dtype=torch.bool, device=self.device)

    # ------------------------------------------------------------ contract path

    @property
    def num_resident(self) -> int:
        """Rows resident now (syncs)."""
        return int((self._slot_row[1:] >= 0).sum().item())

    @property
    def steps_pushed(self) -> int:
        """Batches that have entered the window so far."""
        return self._steps_pushed

    def prepare(self, batch: Any) -> DevicePreparedBatch:
        """Check the next batch without letting it in; ``push`` it afterwards.

        Raises ``ValueError`` as ``OracleCacher.prepare`` does, for bad ids or
        when steps ``step-d..step`` cannot be resident together; changes
        nothing but the size of the per-row state. Syncs once (see ``prepare_sized``).
        """
        prepared, pinned = self.prepare_sized(batch)
        if pinned > self.capacity:
            raise capacity_error(prepared.step, self.prefetch_distance, pinned, self.capacity)
        return prepared

    def prepare_sized(self, batch: Any) -> tuple[DevicePreparedBatch, int]:
        """``prepare`` without the capacity check: the batch and the slots its window needs
        (``grow`` to them before ``push``). Syncs once: the id range and the pinned rows,
        read together."""
        step = self._steps_pushed
        where = f"step {step}"
        ids = self._as_ids(batch, where)
        prepared = self._prepare(ids, step, torch.zeros_like(self._bad))
        if not ids.numel():
            return prepared, int(prepared.pinned_rows.item())
        low, high, pinned = torch.stack([ids.min(), ids.max(), prepared.pinned_rows]).tolist()
        if low < 0 or (self.num_rows is not None and high >= self.num_rows):
            check_range(ids.cpu().numpy(), where, self.num_rows)  # raises, naming the id
        self._grow_rows(high + 1)
        return prepared, pinned

    def grow(self, capacity: int) -> None:
        """``capacity`` slots from now on (no fewer than now): the new slots are free, the
        resident rows stay in theirs, so plans made so far stay valid."""
        capacity = check_count("capacity", capacity, self.capacity)
        more = self._full(capacity - self.capacity, -1)
        self._slot_row = torch.cat([self._slot_row, more])
        self._slot_last = torch.cat([self._slot_last, more])
        self._slot_next = torch.cat([self._slot_next, more.fill_(_NEVER)])
        self.capacity = capacity

    def push(self, batch: Any) -> CachePlan | None:
        """Let the next batch (or what ``prepare`` made of it) in; ``plan(step - L)`` once due.
        A prepared batch's pinned rows are read back (a sync) and checked again: one of
        ``prepare_sized`` is refused if the cache was not grown for it."""
        if isinstance(batch, DevicePreparedBatch):
            prepared, pinned = self._checked(batch), int(batch.pinned_rows.item())
            if pinned > self.capacity:
                raise capacity_error(prepared.step, self.prefetch_distance, pinned, self.capacity)
        else:
            prepared = self.prepare(batch)
        plan = self._enter(prepared)
        return None if plan is None else plan.to_cache_plan()

    def finish(self) -> list[CachePlan]:
        """End of stream: plans for the steps still waiting, with shorter windows."""
        return [plan.to_cache_plan() for plan in self.finish_device()]

    def flush(self) -> CachePlan:
        """Write-back of every resident row (syncs); the rows stay resident."""
        rows = self._slot_row[1:].cpu().numpy()
        occupied = np.flatnonzero(rows >= 0)
        return CachePlan(
            step=self._next_plan,
            slots=_EMPTY,
            evict_ids=rows[occupied],
            evict_slots=occupied,
            fetch_ids=_EMPTY,
            fetch_slots=_EMPTY,
        )

    def absent(self, prepared: DevicePreparedBatch) -> np.ndarray:
        """The prepared batch's distinct ids not resident now (syncs)."""
        distinct = prepared.distinct
        absent = (distinct >= 0) & (self._row_slot.gather(0, distinct + 1) < 0)
        return distinct.cpu().numpy()[absent.cpu().numpy()]

    # ---------------------------------------------------------- sync-free path

    def prepare_device(self, ids: torch.Tensor) -> DevicePreparedBatch:
        """``prepare_sized`` with no host sync and no check: ``ids``, a 1-D int64 tensor on
        ``device``, must lie in the table (its caller checked them). The slots the
        window needs are ``pinned_rows``, a 0-d device tensor; ``grow`` to them, then
        ``push_device`` the prepared batch."""
        return self._prepare(ids, self._steps_pushed, torch.zeros_like(self._bad))

    def push_device(self, ids: torch.Tensor | DevicePreparedBatch) -> DevicePlan | None:
        """``push`` with no host sync: ``ids`` is a 1-D int64 tensor on ``device`` (or what
        ``prepare_sized`` made of the next batch, checked and grown for then).

        ``-1`` is padding (a batch padded to a fixed length has padded slots, ``-1``).
        Other ids outside the table become padding too and set ``DevicePlan.bad_ids``; a
        batch that breaks the capacity rule sets ``DevicePlan.overflow``. Both
        flags are sticky and void the plans: read them when the executor syncs
        anyway, and stop.
        """
        if isinstance(ids, DevicePreparedBatch):
            return self._enter(self._checked(ids))
        if ids.ndim != 1 or ids.dtype != torch.int64 or ids.device != self.device:
            raise ValueError(
                f"push_device takes a 1-D int64 tensor on {self.device}, "
                f"got {ids.dtype} of shape {tuple(ids.shape)} on {ids.device}"
            )
        bad = (ids < -1) | (ids >= self._rows)
        prepared = self._prepare(torch.where(bad, -1, ids), self._steps_pushed, bad.any())
        return self._enter(prepared)

    def finish_device(self) -> list[DevicePlan]:
        """``finish`` with no host sync: the plans still due."""
        plans = []
        while self._next_plan < self._steps_pushed:
            plans.append(self._plan())
        return plans

    # ---------------------------------------------------------------- internals

    def _full(self, shape: int | tuple[int, ...], value: int) -> torch.Tensor:
        return torch.full(
            (shape,) if isinstance(shape, int) else shape,
            value,
            dtype=torch.int64,
            device=self.device,
        )

    def _as_ids(self, batch: Any, where: str) -> torch.Tensor:
        """A batch as a 1-D int64 tensor on the device (``as_int64``'s checks and errors)."""
        if not (isinstance(batch, torch.Tensor) and batch.ndim == 1 and batch.dtype in _INTEGERS):
            batch = torch.from_numpy(as_int64(batch, where))  # raises for a bad shape or type
        return batch.to(self.device, torch.int64)

    def _checked(self, prepared: DevicePreparedBatch) -> DevicePreparedBatch:
        """``prepared``, if this oracle made it for its next step."""
        if prepared.oracle is not self or prepared.step != self._steps_pushed:
            raise ValueError(
                f"a batch prepared for step {prepared.step} cannot enter at step "
                f"{self._steps_pushed} (or it was prepared by another oracle)"
            )
        return prepared

    def _grow_rows(self, rows: int) -> None:
        """Per-row state for ids below ``rows`` (amortised doubling)."""
        if rows <= self._rows:
            return
        size = rows if self.num_rows is not None else max(rows, 2 * self._rows)
        more = self._full(size - self._rows, -1)
        self._row_slot = torch.cat([self._row_slot, more])
        self._row_latest = torch.cat([self._row_latest, more])
        if self._row_uses is not None:
            self._row_uses = torch.cat([self._row_uses, more.zero_()])
        self._rows = size

    def _prepare(self, ids: torch.Tensor, step: int, bad: torch.Tensor) -> DevicePreparedBatch:
        """Deduplicate ``ids`` (-1: padding) and count the rows of steps ``step-d..step``."""
        width = max(self._width, 1 << max(len(ids) - 1, 0).bit_length())
        ordered = torch.sort(ids).values
        first = _firsts(ordered)
        number = first.cumsum(0)  # each id's 1 + index among the distinct ids (padding: 0)
        distinct = self._full(1 + width, -1).scatter_(0, number * first, ordered)[1:]
        mult = self._full(1 + width, 0).index_add_(0, number, torch.ones_like(ordered))[1:]
        # Rows of steps step-d..step: those of step-d..step-1, and this step's whose latest
        # occurrence is older (or none; ids past the rows known have none, and ids out of
        # the table are refused after this, on the contract path).
        latest = self._row_latest.gather(0, (distinct + 1).clamp(0, self._rows)) >> 32
        window = (self._entering - self.prefetch_distance).clamp(min=0)
        new = (distinct >= 0) & ((latest < window) | (distinct >= self._rows))
        pinned = self._window_rows + new.sum()
        return DevicePreparedBatch(self, step, ids, distinct, mult, pinned.view(()), bad)

    def _enter(self, batch: DevicePreparedBatch) -> DevicePlan | None:
        """Batch ``step`` joins the ring; returns ``plan(step - L)`` once it is due."""
        width = len(batch.distinct)
        if width > self._width:  # a longer batch than any before: widen the ring
            more = (0, width - self._width)
            self._ring_ids = pad(self._ring_ids, more, value=-1)
            self._ring_mult = pad(self._ring_mult, more)
            self._ring_batch = pad(self._ring_batch, more, value=-1)
            ring_next = pad(self._ring_next[1:].view(self._span, self._width), more, value=_NEVER)
            self._ring_next = torch.cat([self._ring_next[:1], ring_next.flatten()])
            self._positions = torch.arange(width, device=self.device)
            self._width = width
        step, at = self._entering, self._entering % self._span
        distinct = _padded(batch.distinct, self._width, -1)
        for ring, entries, fill in [
            (self._ring_ids, distinct, -1),
            (self._ring_mult, batch.mult, 0),
            (self._ring_batch, batch.ids, -1),
        ]:
            ring.index_copy_(0, at, _padded(entries, self._width, fill)[None])
        self._chain(distinct, step, at)
        # The rows of steps step-d+1..step: step-d's leave where it was their latest.
        d = self.prefetch_distance
        leaving = self._ring_ids.index_select(0, (step - d) % self._span).view(-1)
        latest = self._row_latest.gather(0, leaving + 1) >> 32
        self._window_rows.copy_(batch.pinned_rows - ((leaving >= 0) & (latest == step - d)).sum())
        self._overflow |= batch.pinned_rows > self.capacity
        self._bad |= batch.bad
        self._lengths.append(len(batch.ids))
        self._ids_entered += len(batch.ids)
        self._steps_pushed += 1
        self._entering += 1
        if batch.step - self.lookahead >= self._next_plan:
            return self._plan()
        return None

    def _chain(self, distinct: torch.Tensor, step: torch.Tensor, at: torch.Tensor) -> None:
        """The distinct ids of ``step`` (at ring row ``at``) are the next use of their rows'
        latest earlier occurrences: in the ring where that step is not planned yet, else
        in the row's slot (if resident; it had no next use)."""
        now, key = step.expand(self._width), distinct + 1
        self._ring_next.index_fill_(0, self._ring_entries(at), _NEVER)
        latest = torch.where(distinct >= 0, self._row_latest.gather(0, key), -1)
        earlier = latest >> 32  # its step (-1: none)
        unplanned = earlier >= self._planning
        entry = 1 + (earlier % self._span) * self._width + (latest & 0xFFFFFFFF)
        self._ring_next.index_copy_(0, torch.where(unplanned, entry, 0), now)
        slot = self._row_slot.gather(0, key)
        planned = (earlier >= 0) & (slot >= 0) & unplanned.logical_not()
        self._slot_next.index_copy_(0, torch.where(planned, slot + 1, 0), now)
        self._row_latest.index_copy_(0, key, (now << 32) + self._positions)

    def _ring_entries(self, row: torch.Tensor) -> torch.Tensor:
        """Where ring row ``row``'s entries sit in ``_ring_next``."""
        return 1 + row * self._width + self._positions

    def _plan(self) -> DevicePlan:
        """Plan the next step: victims in policy order, fetches into free slots, then theirs."""
        s, d, span = self._planning, self.prefetch_distance, self._span
        row = s % span
        distinct = self._ring_ids.index_select(0, row).view(-1)
        mult = self._ring_mult.index_select(0, row).view(-1)
        row_slot, slot_row = self._row_slot, self._slot_row[1:]
        resident_at = row_slot.gather(0, distinct + 1)  # -1: a miss, or padding
        missing = (distinct >= 0) & (resident_at < 0)
        num_fetch = missing.sum()

        # A candidate's next use after its last planned one is its next use after ``s``:
        # it has no use in between (``_chain`` keeps them).
        next_use = self._slot_next[1:]

        # Victim order: free slots, candidates with no next use, candidates by farthest next
        # use, the rest; ties by (uses, last use, row). Stable sorts, least significant first.
        hit = torch.zeros(1 + self.capacity, dtype=torch.bool, device=self.device)
        hit = hit.index_fill_(0, resident_at + 1, True)[1:]
        last_use = self._slot_last[1:]
        candidate = (slot_row >= 0) & (last_use < s - d) & hit.logical_not()
        rank = torch.where(next_use == _NEVER, 1, (s + (span + 2)) - next_use)  # in 1..span+1
        rank = torch.where(candidate, rank, span + 2)
        rank = torch.where(slot_row >= 0, rank, 0)
        uses = self._row_uses.gather(0, slot_row + 1) if self._row_uses is not None else None
        order = self._victim_order(rank, uses, last_use, slot_row)

        # The first ``num_fetch`` slots of the order take the fetched rows: free ones first,
        # then the victims', a run of ``num_evict`` from ``num_free`` on.
        positions, last = self._positions, self.capacity - 1
        num_free = (slot_row < 0).sum()
        num_evict = (num_fetch - num_free).clamp(min=0)
        evicting = positions < num_evict
        evict_slots = torch.where(
            evicting, order.gather(0, (num_free + positions).clamp(max=last)), -1
        )
        evict_ids = torch.where(evicting, self._slot_row.gather(0, evict_slots + 1), -1)
        fetch_slots = torch.where(
            positions < num_fetch, order.gather(0, positions.clamp(max=last)), -1
        )
        fetch_ids = self._full(1 + self._width, -1)
        fetch_ids = fetch_ids.scatter_(0, missing.cumsum(0) * missing, distinct)[1:]

        # Apply: evicted rows leave, fetched rows arrive, the step's rows are used now.
        row_slot.index_fill_(0, evict_ids + 1, -1)
        row_slot.index_copy_(0, fetch_ids + 1, fetch_slots)
        self._slot_row.index_copy_(0, fetch_slots + 1, fetch_ids)
        used = row_slot.gather(0, distinct + 1) + 1
        # Not index_fill_(…, s): on CUDA, index_fill_ reads a tensor value back to the host.
        self._slot_last.index_copy_(0, used, s.expand(len(used)))
        next_uses = self._ring_next.index_select(0, self._ring_entries(row))
        self._slot_next.index_copy_(0, used, next_uses)
        if self._row_uses is not None:
            # Distinct ids, so a gather and a copy (padding rewrites entry 0 as it is):
            # index_add_ would send every padding entry's atomic add to that one address.
            key = distinct + 1
            self._row_uses.index_copy_(0, key, self._row_uses.gather(0, key) + mult)
        ids = self._ring_batch.index_select(0, row).view(-1)[: self._lengths.popleft()]
        step = self._next_plan
        self._next_plan += 1
        self._planning += 1
        return DevicePlan(
            step=step,
            slots=row_slot.gather(0, ids + 1),
            evict_ids=evict_ids,
            evict_slots=evict_slots,
            fetch_ids=fetch_ids,
            fetch_slots=fetch_slots,
            num_evict=num_evict,
            num_fetch=num_fetch,
            overflow=self._overflow.clone(),
            bad_ids=self._bad.clone(),
        )

    def _victim_order(
        self,
        rank: torch.Tensor,
        uses: torch.Tensor | None,
        last_use: torch.Tensor,
        slot_row: torch.Tensor,
    ) -> torch.Tensor:
        """The slots by ``(rank, uses, last use, row)``, ties by slot: two stable sorts of
        keys packed in 64 bits, ``(last use, row)`` then ``(rank, uses)``, where the values
        fit (the host knows their bounds: the steps planned, the table's rows, the ids
        entered); else one stable sort per key, least significant first."""
        packable = (
            self._rows < _ROW_LIMIT
            and self._next_plan < _STEP_LIMIT
            and self._ids_entered < _USES_LIMIT
            and self._span + 2 < _RANK_LIMIT
        )
        if packable:  # -1 (a free slot's row and last use) packs as 0
            low = ((last_use + 1) << _ROW_BITS) + (slot_row + 1)
            high = rank << _USES_BITS if uses is None else (rank << _USES_BITS) + uses
            order = torch.sort(low, stable=True).indices
            return order.gather(0, torch.sort(high.gather(0, order), stable=True).indices)
        order = torch.sort(slot_row, stable=True).indices
        for key in [last_use, *([] if uses is None else [uses]), rank]:
            order = order.gather(0, torch.sort(key.gather(0, order), stable=True).indices)
        return order


def _padded(entries: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    """``entries`` padded with ``fill`` to ``width`` (no op where they have it already)."""
    return entries if len(entries) == width else pad(entries, (0, width - len(entries)), value=fill)


def _firsts(ordered: torch.Tensor) -> torch.Tensor:
    """Where sorted ids (padding ``-1`` first) hold a distinct id's first occurrence."""
    return (ordered >= 0) & (ordered != pad(ordered, (1, 0), value=-2)[:-1])
