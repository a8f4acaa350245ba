"""The lookahead oracle: plans a cache's fetches and evictions from future batches.

One :class:`OracleCacher` plans one table. It sees each batch ``L`` steps
before the batch runs and emits a :class:`CachePlan` per step that says which
rows to write back, which to fetch, and in which slot every id of the batch
will be. Its policy is Belady's within the visible window: evict only when a
slot is needed, first rows with no use in the window, then the row whose next
use is farthest. Rules and timing are in ``DESIGN.md`` section 4.

How it stays fast (no Python loop over ids, no sort per batch):

* Deduplication by scatter: every table row remembers the global position of
  its latest occurrence (``_last_occ``). Writing a batch's positions there and
  reading them back finds one representative per distinct id in O(n).
* Next use by chaining: when a row appears again, the window's ring of
  occurrences (``_occ_next``) links its previous occurrence to the new step.
  When a step is planned, each of its rows learns its next use from that link,
  so a resident row's next use is always known per slot (``_next_use``).
* Victims by ``argpartition`` over the slots, with a deterministic tie-break
  (least recently used, then smallest id).

The capacity rule (steps ``s-d..s`` must fit together) is checked when a
batch enters the window, and a batch that breaks it (or has bad ids) is
refused before any state changes, so the caller may handle the error and go on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchrec_lookahead.slots import SlotTable, largest_keys

__all__ = ["CachePlan", "OracleCacher", "PreparedBatch", "as_id_array"]

_NEVER = np.iinfo(np.int32).max  # next use of a row with no use in the window
_EMPTY = np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class CachePlan:
    """What to do to the cache before step ``step`` runs.

    Apply ``evict`` (write back cache -> store) first, then ``fetch``
    (store -> cache). ``slots[i]`` is the cache slot of the batch's ``i``-th id.
    """

    step: int
    slots: np.ndarray
    evict_ids: np.ndarray
    evict_slots: np.ndarray
    fetch_ids: np.ndarray
    fetch_slots: np.ndarray

    @property
    def num_misses(self) -> int:
        return len(self.fetch_ids)


@dataclass(frozen=True)
class PreparedBatch:
    """A batch checked by :meth:`OracleCacher.prepare`, ready to ``push``."""

    oracle: OracleCacher
    step: int
    ids: np.ndarray
    unique: np.ndarray
    unique_pos: np.ndarray  # global positions of one occurrence of each distinct id
    unique_prev: np.ndarray  # each distinct id's latest earlier position (-1: none)
    pinned_rows: int  # distinct ids of steps step-d..step


@dataclass
class _WindowBatch:
    """A batch inside the window: its ids and where its occurrences start."""

    step: int
    ids: np.ndarray  # the batch as given (int64, duplicates kept)
    start: int  # global position of ids[0]
    unique: np.ndarray  # distinct ids (one representative each)
    unique_pos: np.ndarray  # global positions of the representatives


def as_id_array(batch: Any, where: str, num_rows: int | None) -> np.ndarray:
    """Validate a batch of row ids and return it as a 1-D int64 numpy array.

    Accepts numpy arrays, torch tensors and sequences. Raises ``ValueError``
    naming ``where`` (e.g. ``"step 12"``) and the id for negative or
    out-of-range ids.
    """
    if hasattr(batch, "detach"):  # a torch tensor, without importing torch here
        batch = batch.detach().cpu().numpy()
    ids = np.asarray(batch)
    if ids.ndim != 1:
        raise ValueError(f"{where}: a batch must be a 1-D array of ids, got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{where}: ids must be integers, got dtype {ids.dtype}")
    ids = ids.astype(np.int64, copy=True)
    if ids.size:
        low = int(ids.min())
        if low < 0:
            pos = int(np.argmax(ids < 0))
            raise ValueError(f"{where}: negative id {low} (first at position {pos})")
        high = int(ids.max())
        if num_rows is not None and high >= num_rows:
            pos = int(np.argmax(ids >= num_rows))
            raise ValueError(
                f"{where}: id {high} is out of range for a table of {num_rows} rows "
                f"(first bad id at position {pos})"
            )
    return ids


class OracleCacher:
    """Windowed-Belady cache planner for one table.

    Args:
        capacity: cache slots (rows resident at once).
        lookahead: ``L``, how many batches past step ``s`` are visible when
            ``plan(s)`` is made. ``0`` sees only the batch itself (then the
            policy is batched LRU).
        prefetch_distance: ``d``; ``plan(s)`` is applied at the start of step
            ``s - d``, so rows of steps ``s-d..s`` are pinned together.
        num_rows: table size; when given, ids are checked against it.

    Memory: 12 bytes per table row (slot map and latest occurrence), 16 bytes
    per cache slot, and about 40 bytes per id inside the window of ``L + 1``
    batches (``max(L + 1, d + 2)`` batches are kept).
    """

    def __init__(
        self,
        capacity: int,
        lookahead: int,
        prefetch_distance: int = 1,
        num_rows: int | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        if prefetch_distance < 0:
            raise ValueError(f"prefetch_distance must be >= 0, got {prefetch_distance}")
        if num_rows is not None and num_rows < 1:
            raise ValueError(f"num_rows must be at least 1, got {num_rows}")
        self.capacity = capacity
        self.lookahead = lookahead
        self.prefetch_distance = prefetch_distance
        self.num_rows = num_rows

        self._slots = SlotTable(capacity, num_rows)
        self._last_occ = np.full(num_rows or 0, -1, dtype=np.int64)
        self._next_use = np.full(capacity, _NEVER, dtype=np.int32)
        self._last_use = np.full(capacity, -1, dtype=np.int32)
        self._occ_next = np.full(1024, _NEVER, dtype=np.int32)  # ring, by global position
        self._head = 0  # global position of the next id to enter
        self._window: deque[_WindowBatch] = deque()  # entered, some already planned
        self._next_plan = 0  # step of the next plan to emit
        self._pinned_rows = 0  # distinct ids of the newest d+1 batches

    # ------------------------------------------------------------------ API

    @property
    def num_resident(self) -> int:
        return self._slots.num_resident

    @property
    def steps_pushed(self) -> int:
        """Batches that have entered the window so far."""
        return self._window[-1].step + 1 if self._window else self._next_plan

    def plan(self, batches: Iterable[Any]) -> Iterator[CachePlan]:
        """Plans for a stream of batches, in step order, with the end drained."""
        for batch in batches:
            ready = self.push(batch)
            if ready is not None:
                yield ready
        yield from self.finish()

    def prepare(self, batch: Any) -> PreparedBatch:
        """Check the next batch without letting it in; ``push`` it afterwards.

        Raises ``ValueError`` for bad ids or when the rows of steps
        ``step-d..step`` cannot all be resident at once. Changes nothing, so a
        caller planning several tables can check all of them before any moves.
        """
        step = self.steps_pushed
        ids = as_id_array(batch, f"step {step}", self.num_rows)
        self._grow_rows(ids)
        # Distinct rows of steps step-d..step, from those of step-1-d..step-1: rows of
        # step-1-d not used again by step-1 leave, rows of this batch not among them join.
        d = self.prefetch_distance
        pin_start = self._start_of(step - d)
        leaving = 0
        if step - d - 1 >= 0:
            old = self._window[step - d - 1 - self._window[0].step].unique
            leaving = int(np.count_nonzero(self._last_occ[old] < pin_start))

        positions = np.arange(self._head, self._head + len(ids))
        previous = self._last_occ[ids]
        self._last_occ[ids] = positions
        is_rep = self._last_occ[ids] == positions  # exactly one position per distinct id wins
        self._last_occ[ids] = previous  # leave no trace until push
        unique_prev = previous[is_rep]
        pinned = self._pinned_rows + int(np.count_nonzero(unique_prev < pin_start)) - leaving
        if pinned > self.capacity:
            raise ValueError(
                f"step {step}: steps {max(step - d, 0)}..{step} use {pinned} distinct rows, "
                f"which must be resident together (prefetch_distance={d}), but the cache "
                f"has {self.capacity} slots; a capacity of at least {pinned} is needed"
            )
        return PreparedBatch(self, step, ids, ids[is_rep], positions[is_rep], unique_prev, pinned)

    def push(self, batch: Any) -> CachePlan | None:
        """Let the next batch into the window; returns ``plan(step - L)`` once it is due.

        ``batch`` is an array of ids (checked as by ``prepare``) or the result
        of ``prepare`` for this very step.
        """
        prepared = batch if isinstance(batch, PreparedBatch) else self.prepare(batch)
        if prepared.oracle is not self or prepared.step != self.steps_pushed:
            raise ValueError(
                f"a batch prepared for step {prepared.step} cannot enter at step "
                f"{self.steps_pushed} (or it was prepared by another oracle)"
            )
        self._enter(prepared)
        if prepared.step - self.lookahead >= self._next_plan:
            return self._emit()
        return None

    def finish(self) -> list[CachePlan]:
        """End of stream: plans for the steps still waiting, with shorter windows."""
        plans = []
        while self._next_plan < self.steps_pushed:
            plans.append(self._emit())
        return plans

    def flush(self) -> CachePlan:
        """Write-back of every resident row (for checkpoints and the end of training).

        The rows stay resident: a write-back leaves the cache valid. The plan's
        ``step`` is the next step to be planned; it has no fetches.
        """
        occupied = self._slots.occupied_ids()
        return CachePlan(
            step=self._next_plan,
            slots=_EMPTY,
            evict_ids=occupied.copy(),
            evict_slots=np.arange(len(occupied)),
            fetch_ids=_EMPTY,
            fetch_slots=_EMPTY,
        )

    # ------------------------------------------------------------ internals

    def _grow_rows(self, ids: np.ndarray) -> None:
        if self.num_rows is None and ids.size:
            needed = int(ids.max()) + 1
            if needed > len(self._last_occ):
                grown = np.full(max(needed, 2 * len(self._last_occ)), -1, dtype=np.int64)
                grown[: len(self._last_occ)] = self._last_occ
                self._last_occ = grown
                self._slots.grow(len(grown))

    def _start_of(self, step: int) -> int:
        """Global position where batch ``step`` starts (0 before the stream)."""
        if step <= 0 or not self._window:
            return 0
        first = self._window[0].step
        if step - first >= len(self._window):
            return self._head
        return self._window[step - first].start

    def _enter(self, batch: PreparedBatch) -> None:
        step, ids = batch.step, batch.ids
        self._last_occ[batch.unique] = batch.unique_pos
        self._pinned_rows = batch.pinned_rows
        # Record the occurrences; link earlier ones of the same rows still to be planned.
        self._reserve_ring(len(ids))
        ring = len(self._occ_next)
        self._occ_next[np.arange(self._head, self._head + len(ids)) % ring] = _NEVER
        linked = batch.unique_prev >= self._start_of(self._next_plan)
        self._occ_next[batch.unique_prev[linked] % ring] = step
        # Resident rows whose last planned use had no known successor: now it is this step.
        slots = self._slots.slot_of_id[batch.unique]
        slots = slots[slots >= 0]
        self._next_use[slots] = np.minimum(self._next_use[slots], step)

        self._window.append(_WindowBatch(step, ids, self._head, batch.unique, batch.unique_pos))
        self._head += len(ids)
        self._trim_window()

    def _reserve_ring(self, incoming: int) -> None:
        """Grow the occurrence ring so every unplanned occurrence keeps its entry."""
        live_from = self._start_of(self._next_plan)
        needed = self._head + incoming - live_from
        ring = len(self._occ_next)
        if needed <= ring:
            return
        size = ring
        while size < needed:
            size *= 2
        live = np.arange(live_from, self._head)
        grown = np.full(size, _NEVER, dtype=np.int32)
        grown[live % size] = self._occ_next[live % ring]
        self._occ_next = grown

    def _trim_window(self) -> None:
        """Drop batches neither unplanned nor needed for the pinned-row count."""
        keep_from = min(self._next_plan, self.steps_pushed - self.prefetch_distance - 1)
        while self._window and self._window[0].step < keep_from:
            self._window.popleft()

    def _emit(self) -> CachePlan:
        s = self._next_plan
        batch = self._window[s - self._window[0].step]
        table = self._slots

        slot_of_unique = table.slot_of_id[batch.unique]
        fetch_ids = batch.unique[slot_of_unique < 0]
        evictions = len(fetch_ids) - table.free
        victims = _EMPTY
        if evictions > 0:
            occupied = table.num_resident
            last_use = self._last_use[:occupied]
            next_use = self._next_use[:occupied]
            candidates = np.flatnonzero((last_use < s - self.prefetch_distance) & (next_use > s))
            # Farthest next use first (no use in the window is farthest), then least
            # recently used; largest_keys breaks remaining ties by smaller id.
            keys = (next_use[candidates].astype(np.int64) << 32) - last_use[candidates]
            chosen = largest_keys(keys, table.id_of_slot[candidates], evictions)
            if len(chosen) < evictions:  # the pinned-row check on entry rules this out
                raise AssertionError(
                    f"step {s}: {len(candidates)} evictable rows, need {evictions}"
                )
            victims = np.sort(candidates[chosen])
        evict_ids, fetch_slots = table.admit(fetch_ids, victims)

        # The step is planned: its rows were used at s and are next used at their successor.
        batch_slots = table.slot_of_id[batch.unique]
        self._last_use[batch_slots] = s
        self._next_use[batch_slots] = self._occ_next[batch.unique_pos % len(self._occ_next)]
        self._next_plan += 1
        plan = CachePlan(
            step=s,
            slots=table.slot_of_id[batch.ids].astype(np.int64),
            evict_ids=evict_ids,
            evict_slots=victims,
            fetch_ids=fetch_ids,
            fetch_slots=fetch_slots,
        )
        self._trim_window()
        return plan
