"""The lookahead oracle: plans a cache's fetches and evictions from future batches.

One :class:`OracleCacher` plans one table. It sees each batch ``L`` steps
before the batch runs and emits a :class:`CachePlan` per step that says which
rows to write back, which to fetch, and in which slot every id of the batch
will be. Its policy is Belady's within the visible window: evict only when a
slot is needed, first rows with no use in the window, then the row whose next
use is farthest; remaining ties go to the row with fewer uses so far (the
``"frequency"`` tie-break, or skip that with ``"recency"``), then the least
recently used, then the smaller id. Rules and timing: ``docs/design.md``, "The
oracle's contract".

How it stays fast: the per-step work runs in three compiled passes
(:mod:`torchrec_lookahead.oracle.kernels`, numba, GIL released), one call
each per ``prepare``, batch entry and plan, and nothing sorts a batch:

* Deduplication by scatter: every table row remembers the stream position of
  its latest distinct occurrence, so one pass over a batch finds its distinct
  ids, their multiplicities, and each id's index among them.
* Next use by chaining: when a row appears again, its previous occurrence is
  linked to the new step, so each planned row knows its next use at once.
* Victims without a scan: a resident row becomes a candidate when it leaves
  the pinned steps ``s-d..s``, and its tie-break key is then frozen.
  Candidates with a next use wait in that step's bucket, which dissolves when
  the step is planned (its rows are hits); those with no use in the window
  wait in groups of equal key (one per use count and release step) kept in a
  heap. So a plan costs O(1) per id it touches and O(log groups) per group,
  never O(capacity).
* Memory layout: a row's fields share one 16-byte record and a slot's one
  64-byte record, and the passes prefetch them ahead, because a step's cost
  is the cache misses on tables larger than the CPU's caches.

The capacity rule (steps ``s-d..s`` must fit together) is checked when a
batch enters the window, and a batch that breaks it (or has bad ids) is
refused before any state changes, so the caller may handle the error and go on;
or the caller learns the capacity the batch needs (``prepare_sized``) and
calls ``grow`` with it first: the new slots join the free tail.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from torchrec_lookahead.oracle.contract import CachePlan, CachePlanner
from torchrec_lookahead.oracle.kernels import emit_step, enter_batch, prepare_batch
from torchrec_lookahead.oracle.records import RESIDENT, ROW, SLOT
from torchrec_lookahead.oracle.slots import grow_rings, grow_rows, grow_slots, new_state
from torchrec_lookahead.settings import check_count

__all__ = [
    "TIE_BREAKS",
    "OracleCacher",
    "PreparedBatch",
    "as_id_array",
    "as_int64",
    "capacity_error",
    "check_range",
    "checked_settings",
    "load_kernels",
]

TIE_BREAKS = ("frequency", "recency")
_EMPTY = np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class PreparedBatch:
    """A batch checked by :meth:`OracleCacher.prepare`, ready to ``push``."""

    oracle: OracleCacher
    step: int
    ids: np.ndarray  # the batch, int64
    unique: np.ndarray  # its distinct ids, in order of first occurrence
    prev: np.ndarray  # each distinct id's latest earlier stream position (-1: none)
    mult: np.ndarray  # each distinct id's occurrences in the batch
    inverse: np.ndarray  # each id's index into ``unique``
    gaps: list[int]  # gaps[j]: distinct ids last seen in step ``step - j`` (j = 1..d)
    pinned_rows: int  # distinct ids of steps step-d..step
    taken: np.ndarray  # for a hash share: the batch positions of its ids (else empty)


@dataclass
class _WindowBatch:
    """A batch inside the window: what planning and the pinned-row count need of it."""

    step: int
    start: int  # stream position of its first distinct id
    unique: np.ndarray
    mult: np.ndarray
    inverse: np.ndarray
    gaps: list[int]
    slots: np.ndarray | None = None  # slot of each distinct id, once planned


def checked_settings(
    capacity: Any, lookahead: Any, prefetch_distance: Any, num_rows: Any, tie_break: Any
) -> tuple[int, int, int, int | None]:
    """An oracle's settings, checked as the pipeline checks its own: a ``ValueError`` for
    each bad one (nan, inf, 2.0, True, a string, a negative count, an unknown
    ``tie_break``), naming it, before anything is built."""
    counts = (
        check_count("capacity", capacity, 1),
        check_count("lookahead", lookahead, 0),
        check_count("prefetch_distance", prefetch_distance, 0),
        None if num_rows is None else check_count("num_rows", num_rows, 1),
    )
    if not isinstance(tie_break, str) or tie_break not in TIE_BREAKS:
        raise ValueError(f"tie_break must be one of {TIE_BREAKS}, got {tie_break!r}")
    return counts


def as_id_array(batch: Any, where: str, num_rows: int | None) -> np.ndarray:
    """Validate a batch of row ids and return it as a 1-D int64 numpy array.

    Accepts numpy arrays, torch tensors and sequences. Raises ``ValueError``
    naming ``where`` (e.g. ``"step 12"``) and the id for negative or
    out-of-range ids.
    """
    ids = as_int64(batch, where)
    check_range(ids, where, num_rows)
    return ids


def as_int64(batch: Any, where: str) -> np.ndarray:
    """A batch as a 1-D int64 numpy array (no copy when it is one); ids unchecked."""
    if hasattr(batch, "detach"):  # a torch tensor, without importing torch here
        batch = batch.detach().cpu().numpy()
    ids = np.asarray(batch)
    if ids.ndim != 1:
        raise ValueError(f"{where}: a batch must be a 1-D array of ids, got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{where}: ids must be integers, got dtype {ids.dtype}")
    if ids.dtype == np.uint64 and ids.size and ids.max() > np.iinfo(np.int64).max:
        pos = int(np.argmax(ids > np.iinfo(np.int64).max))
        raise ValueError(
            f"{where}: id {ids[pos]} is out of range: ids are int64 (first at position {pos})"
        )
    return np.ascontiguousarray(ids, dtype=np.int64)


def check_range(ids: np.ndarray, where: str, num_rows: int | None) -> None:
    """Raise ``ValueError`` naming ``where`` for a negative id or one not below ``num_rows``."""
    if not ids.size:
        return
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


def capacity_error(
    step: int, prefetch_distance: int, pinned_rows: int, capacity: int
) -> ValueError:
    """The capacity rule's refusal: steps ``step-d..step`` need ``pinned_rows`` slots."""
    d = prefetch_distance
    return ValueError(
        f"step {step}: steps {max(step - d, 0)}..{step} use {pinned_rows} distinct rows, "
        f"which must be resident together (prefetch_distance={d}), but the cache has "
        f"{capacity} slots; a capacity of at least {pinned_rows} is needed"
    )


class OracleCacher(CachePlanner[PreparedBatch]):
    """Windowed-Belady cache planner for one table.

    Args:
        capacity: cache slots (rows resident at once).
        lookahead: ``L``, how many batches past step ``s`` are visible when
            ``plan(s)`` is made. ``0`` sees only the batch itself (then the
            policy is batched LRU, or LFU under the frequency tie-break).
        prefetch_distance: ``d``; ``plan(s)`` is applied at the start of step
            ``s - d``, so rows of steps ``s-d..s`` are pinned together.
        num_rows: table size; when given, ids are checked against it.
        tie_break: order of candidates with the same next use (or none):
            ``"frequency"`` (fewer uses in planned steps first, then least
            recently used, then smaller id) or ``"recency"`` (least recently
            used, then smaller id).
        row_table: makes the per-row table for a number of rows (see
            ``slots.new_state``): a disk store maps it from a file, so that
            the oracle's private memory does not grow with the table.

    A bad setting (a negative count, ``nan``, ``inf``, a float, a bool, an unknown
    ``tie_break``) raises ``ValueError`` naming it, before anything is built.

    Memory: 16 bytes per table row (in ``row_table``'s, if given), 104 bytes
    per cache slot, and about 4 bytes per id plus 28 per distinct id of each
    batch in the window (``max(L + 1, d + 2)`` batches are kept).

    One oracle is not thread-safe, but its compiled passes release the GIL,
    so oracles of different tables plan in parallel on threads.
    """

    def __init__(
        self,
        capacity: int,
        lookahead: int,
        prefetch_distance: int = 1,
        num_rows: int | None = None,
        *,
        tie_break: str = "frequency",
        row_table: Callable[[int], np.ndarray] | None = None,
    ) -> None:
        capacity, lookahead, prefetch_distance, num_rows = checked_settings(
            capacity, lookahead, prefetch_distance, num_rows, tie_break
        )
        self.capacity = capacity
        self.lookahead = lookahead
        self.prefetch_distance = prefetch_distance
        self.num_rows = num_rows
        self.tie_break = tie_break

        self._frequency = tie_break == "frequency"
        rows = None
        if row_table is not None:
            if num_rows is None:
                raise ValueError("a row_table needs num_rows")
            rows = row_table(num_rows)
        self._state = new_state(capacity, num_rows or 0, rows)
        self._window: deque[_WindowBatch] = deque()  # entered, some already planned
        self._head = 0  # stream position of the next distinct id to enter
        self._steps_pushed = 0
        self._next_plan = 0  # step of the next plan to emit
        self._pinned_rows = 0  # distinct ids of the newest d+1 batches
        self._scratch = np.empty((4, 0), dtype=np.int64)  # a hash share's buffers

    # ------------------------------------------------------------------ API

    @property
    def num_resident(self) -> int:
        return int(self._state.counters[RESIDENT])

    @property
    def steps_pushed(self) -> int:
        """Batches that have entered the window so far."""
        return self._steps_pushed

    def prepare(self, batch: Any) -> PreparedBatch:
        """Check the next batch without letting it in; ``push`` it afterwards.

        Raises ``ValueError`` for bad ids or when the rows of steps
        ``step-d..step`` cannot all be resident at once. Changes nothing, so a
        caller planning several tables can check all of them before any moves.
        """
        prepared, _ = self.prepare_sized(batch)
        self._check_capacity(prepared)
        return prepared

    def prepare_sized(self, batch: Any) -> tuple[PreparedBatch, int]:
        """``prepare`` without the capacity check: the batch and the slots its window needs
        (``grow`` to them before ``push``)."""
        prepared = self.prepare_unchecked(batch)
        return prepared, prepared.pinned_rows

    def grow(self, capacity: int) -> None:
        """``capacity`` slots from now on (no fewer than now): the new slots are free, the
        resident rows stay in theirs, so plans made so far stay valid."""
        capacity = check_count("capacity", capacity, self.capacity)
        self._state = grow_slots(self._state, capacity)
        self.capacity = capacity

    def prepare_unchecked(
        self, batch: Any, *, parts: int = 1, part: int = 0, id_limit: int | None = None
    ) -> PreparedBatch:
        """``prepare`` without the capacity check (for planners that check several at once).

        With ``parts > 1`` this oracle plans hash partition ``part`` of a table
        of ``id_limit`` rows (``None``: unknown): it takes only the batch's ids
        of that partition (``oracle.partitions.split_of``), as rows ``id // parts``.
        """
        step = self._steps_pushed
        where = f"step {step}"
        ids = as_int64(batch, where)
        d = self.prefetch_distance
        starts = np.array([self._start_of(step - j) for j in range(1, d + 1)], dtype=np.int64)
        if parts == 1:
            id_limit = self.num_rows

        if parts > 1 and self._scratch.shape[1] < len(ids):
            self._scratch = np.empty((4, len(ids) + len(ids) // 4), dtype=np.int64)

        def run() -> tuple:
            limit = -1 if id_limit is None else id_limit
            rows, head, scratch = self._state.rows, self._head, self._scratch
            return prepare_batch(ids, rows, head, starts, parts, part, limit, scratch)

        found, unique, prev, mult, inverse, gaps, taken = run()
        if found < 0:  # an id outside the tables: bad, or (table size unknown) the tables grow
            check_range(ids, where, id_limit)
            self._state = grow_rows(self._state, int(ids.max()) // parts + 1)
            found, unique, prev, mult, inverse, gaps, taken = run()
        # Distinct rows of steps step-d..step, from those of step-1-d..step-1: rows of
        # step-1-d not used again by step-1 leave, rows of this batch not among them join.
        gaps = gaps.tolist()
        pinned = self._pinned_rows + found - sum(gaps)
        released = step - d - 1
        if released >= 0:
            first = self._window[0].step
            window = self._window
            reused = sum(window[q - first].gaps[q - released] for q in range(released + 1, step))
            pinned -= len(window[released - first].unique) - reused
        return PreparedBatch(self, step, ids, unique, prev, mult, inverse, gaps, pinned, taken)

    def absent(self, prepared: PreparedBatch) -> np.ndarray:
        return prepared.unique[self._state.rows[prepared.unique, SLOT] < 0]

    def push(self, batch: Any) -> CachePlan | None:
        """Let the next batch into the window; returns ``plan(step - L)`` once it is due.

        ``batch`` is an array of ids (checked as by ``prepare``) or the result
        of ``prepare`` for this very step.
        """
        prepared = batch if isinstance(batch, PreparedBatch) else self.prepare(batch)
        if prepared.oracle is not self or prepared.step != self._steps_pushed:
            raise ValueError(
                f"a batch prepared for step {prepared.step} cannot enter at step "
                f"{self._steps_pushed} (or it was prepared by another oracle)"
            )
        self._check_capacity(prepared)  # prepared by prepare_sized, and not grown enough
        self._enter(prepared)
        if prepared.step - self.lookahead >= self._next_plan:
            return self._emit()
        return None

    def finish(self) -> list[CachePlan]:
        """End of stream: plans for the steps still waiting, with shorter windows."""
        plans = []
        while self._next_plan < self._steps_pushed:
            plans.append(self._emit())
        return plans

    def flush(self) -> CachePlan:
        """Write-back of every resident row (for checkpoints and the end of training).

        The rows stay resident: a write-back leaves the cache valid. The plan's
        ``step`` is the next step to be planned; it has no fetches.
        """
        occupied = self._state.slots[: self.num_resident, ROW].copy()
        return CachePlan(
            step=self._next_plan,
            slots=_EMPTY,
            evict_ids=occupied,
            evict_slots=np.arange(len(occupied)),
            fetch_ids=_EMPTY,
            fetch_slots=_EMPTY,
        )

    # ------------------------------------------------------------ internals

    def _check_capacity(self, prepared: PreparedBatch) -> None:
        if prepared.pinned_rows > self.capacity:
            raise capacity_error(
                prepared.step, self.prefetch_distance, prepared.pinned_rows, self.capacity
            )

    def _start_of(self, step: int) -> int:
        """Stream position where batch ``step`` starts (0 before the stream)."""
        if step <= 0 or not self._window:
            return 0
        if step >= self._steps_pushed:
            return self._head
        return self._window[step - self._window[0].step].start

    def _enter(self, batch: PreparedBatch) -> None:
        planned_from = self._start_of(self._next_plan)
        self._state = grow_rings(
            self._state,
            steps=(self._next_plan, batch.step + 1),
            positions=(planned_from, self._head + len(batch.unique)),
        )
        enter_batch(self._state, batch.step, batch.unique, batch.prev, self._head, planned_from)
        entry = _WindowBatch(
            batch.step, self._head, batch.unique, batch.mult, batch.inverse, batch.gaps
        )
        self._window.append(entry)
        self._head += len(batch.unique)
        self._steps_pushed += 1
        self._pinned_rows = batch.pinned_rows
        self._trim_window()

    def _trim_window(self) -> None:
        """Drop batches no longer needed to plan, release rows, or count pinned rows."""
        keep_from = min(self._next_plan, self._steps_pushed) - self.prefetch_distance - 1
        while self._window and self._window[0].step < keep_from:
            self._window.popleft()

    def _emit(self) -> CachePlan:
        s = self._next_plan
        first = self._window[0].step
        batch = self._window[s - first]
        released_step = s - self.prefetch_distance - 1
        released = self._window[released_step - first].slots if released_step >= 0 else _EMPTY
        slots, evict_ids, evict_slots, fetch_ids, fetch_slots, batch.slots = emit_step(
            self._state,
            s,
            batch.unique,
            batch.inverse,
            batch.mult,
            batch.start,
            released,
            released_step,
            self._steps_pushed - 1,
            self._frequency,
        )
        self._next_plan += 1
        self._trim_window()
        return CachePlan(s, slots, evict_ids, evict_slots, fetch_ids, fetch_slots)


def load_kernels() -> None:
    """Load the compiled planning kernels now rather than at the first batch.

    numba loads them from its on-disk cache (or compiles them, the first time
    on a machine) when they are first called, a fraction of a second that would
    otherwise land on the first training step. Planning a few tiny batches,
    evictions included, calls every kernel with the types training uses.
    """
    oracle = OracleCacher(4, 1, 1, num_rows=8)
    for ids in ([0, 1], [2, 3], [4, 5], [0, 6]):
        oracle.push(oracle.prepare(np.array(ids, dtype=np.int64)))
    oracle.finish()
