"""The lookahead stage: reads batches ahead, distributes and plans them off the trainer thread.

A background thread (or, if asked, the trainer itself when it asks for the
next batch) takes batches from the data loader, checks each once
(:func:`~torchrec_lookahead.checks.check_batch`, and each module's
``batch_kind_refusal``), has every rank vote on it under DMP
(:class:`~torchrec_lookahead.votes.ReadingVote`), moves it to the device, lets
every lookahead module ``prepare`` it (under DMP: ``input_dist``, on a process
group of the stage's own) and ``enter`` it, and queues each batch with the
moves of the steps it completed the window of. The trainer thread only takes
batches off the queue in order and applies their plans. The oracle's inner
loops release the GIL, so planning runs beside the step's compute.

Inline (as on CUDA, where each rank's collectives must be issued by one
thread), the reading still runs on a thread of its own: the loader, the
checks on the host batch and its copy to the device are off the trainer's
thread, which only distributes and plans batches already checked, voted on and
on their way to the device (:class:`_Reader`).

A batch that the check or a module refuses (``ValueError``, which
:class:`~torchrec_lookahead.checks.BatchTypeError` is too) changes nothing and is
queued as that error, in its place; any other error ends the stage and is queued
with the batch it happened at. ``close`` stops the thread, also while it
waits on a full queue.

The thread must not slow the step it hides behind: where the trainer's
OpenMP threads want every core, a planning thread of normal priority slows
each step's compute (measured in ``docs/design.md``, "Threads"). So the thread
runs its torch ops on one intra-op thread and, on Linux, under
``SCHED_IDLE``: it gets a core only when the trainer leaves one idle (its
single-threaded Python, waits), and when it falls behind, the trainer's wait
for the next plan leaves a core idle for it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import torchrec_lookahead.streams as streams
from torchrec_lookahead.checks import check_batch
from torchrec_lookahead.idle import run_when_idle
from torchrec_lookahead.steps import LookaheadModule, StepContext, StepPlan
from torchrec_lookahead.votes import ReadingVote

__all__ = ["LookaheadStage", "StageItem"]

# Batches the stage reads and plans ahead of what the trainer has taken (a constant: no
# caller needs another); the window itself, ``lookahead``, is the modules', not this queue's.
QUEUE_DEPTH = 4


@dataclass
class StageItem:
    """What the stage hands the trainer, in data order."""

    context: StepContext | None = None  # a batch that entered the window (None: error / end)
    plans: list[StepPlan] = field(default_factory=list)  # steps planned on entry
    error: BaseException | None = None  # ValueError: the batch was refused, else the stage died
    end: bool = False  # the data ended (``plans`` holds the last steps)
    # An event after the stage's device work for this item: its batch and the slots of the
    # steps it planned (a step's hand-over waits for the item that completed its plan).
    ready: Any = None


class LookaheadStage:
    """Runs the window's reading and planning on a background thread.

    Args:
        modules: the lookahead modules (unsharded or sharded) to plan for.
        features: every feature some embedding module of the model looks up, and
            whether that module is weighted.
        device: where batches go.
        threaded: plan on a background thread of idle priority (default), else
            inline in ``get``, on the trainer's thread.
        rows: each feature of a lookahead module, the rows of its table: a batch's ids
            of it are checked on the host, before the batch moves to ``device``.
        vote: under DMP with several ranks, how the ranks agree on each batch read.
    """

    def __init__(
        self,
        modules: Sequence[LookaheadModule],
        features: Mapping[str, bool],
        device: torch.device,
        threaded: bool = True,
        rows: Mapping[str, int] | None = None,
        vote: ReadingVote | None = None,
    ) -> None:
        self.threaded = threaded
        self._vote = vote
        self._modules = list(modules)
        self._features = dict(features)
        self._rows = dict(rows or {})
        self._device = device
        self._queue: queue.Queue[StageItem] = queue.Queue(maxsize=QUEUE_DEPTH)
        self._lane = streams.new_stream(device, "stage")  # its own stream (none on the CPU)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reader: _Reader | None = None  # inline: the reading thread
        self._iter: Iterator[Any] | None = None
        # Batches that entered the window: the step of the next one. The stage numbers the
        # steps; every other part takes a step's number from its context.
        self._entered = 0
        # CPU seconds the stage's thread spent distributing batches (DMP) and planning
        # them: its cost, whatever the wall time (the thread waits for idle cores).
        self.timings = {"input_dist_s": 0.0, "plan_s": 0.0}

    @property
    def started(self) -> bool:
        return self._iter is not None

    def start(self, dataloader_iter: Iterator[Any]) -> None:
        """Start reading ``dataloader_iter`` (once)."""
        self._iter = dataloader_iter
        if self.threaded:
            self._thread = threading.Thread(target=self._run, name="lookahead-stage", daemon=True)
            self._thread.start()
        else:
            self._reader = _Reader(self._read, self._stop)

    def get(self) -> StageItem:
        """The next item, in data order (blocks until the thread has one)."""
        if not self.threaded:
            assert self._reader is not None, "start() first"
            return self._plan(*self._reader.get())
        assert self._thread is not None, "start() first"
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the lookahead stage stopped without a word") from None

    def hand_over(self, context: StepContext) -> None:
        """Give the trainer ``context``'s step: its stream waits for the stage's work on
        the batch, and every tensor of the context is marked as used on it (the batch,
        what the modules prepared -- a sharded module's distributed input, hot rows --
        and the step's slots: all made on the stage's stream, all read by the step), so
        the caching allocator does not hand their memory out again while the trainer
        may still read it."""
        self._lane.current_waits(context.ready)
        streams.record_use(context, self._device)

    def close(self) -> None:
        """Stop the thread (idempotent). A thread blocked inside the loader or a collective
        is left to finish that call; it is a daemon and queues nothing more."""
        self._stop.set()
        while not self._queue.empty():
            self._queue.get_nowait()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)
        if self._reader is not None:
            self._reader.close()

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        torch.set_num_threads(1)  # no OpenMP team beside the trainer's (see the executor)
        run_when_idle()
        while not self._stop.is_set():
            item = self._next_item()
            last = item.end or (item.error is not None and not isinstance(item.error, ValueError))
            if not self._put(item) or last:
                return

    def _next_item(self) -> StageItem:
        """Read and plan the next batch; the end of data and errors become items."""
        return self._plan(*self._read())

    def _read(self) -> tuple[Any, ValueError | None, BaseException | None]:
        """The next batch, checked on the host and voted on, and on its way to the device;
        or its refusal (this rank's or another's); or the reading's error
        (``StopIteration`` at the end of the data). It may run ahead of the planning
        (inline, on the reader's thread), so messages name the step by :data:`_STEP`,
        which :meth:`_plan` fills in."""
        assert self._iter is not None, "start() first"
        try:
            batch = next(self._iter)
            refusal = self._refusal(batch)
            if self._vote is not None:
                refusal = self._vote.agree(refusal)
            if refusal is None:
                with self._lane.context():  # copied on the stage's stream, beside the trainer's
                    batch = batch.to(self._device, non_blocking=True)
            return batch, refusal, None
        except (StopIteration, Exception) as error:  # the trainer raises it with its step
            return None, None, error

    def _refusal(self, batch: Any) -> ValueError | None:
        """Why this rank cannot take ``batch``: the host checks, then the modules' kinds."""
        try:
            check_batch(batch, self._features, _STEP, self._rows)
        except ValueError as error:
            return error
        features = batch.sparse_features  # there: check_batch checked the structure
        for module in self._modules:
            if (refusal := module.batch_kind_refusal(features)) is not None:
                return refusal
        return None

    def _plan(
        self, batch: Any, refusal: ValueError | None, failure: BaseException | None
    ) -> StageItem:
        """Let a read batch into the window and plan it (a refused one, on every rank,
        goes no further); the end of the data finishes the window."""
        if isinstance(failure, StopIteration):
            return self._finish()
        if failure is not None:
            return StageItem(error=_at_step(failure, self._entered, "reading"))
        if refusal is not None:
            return StageItem(error=_named(refusal, f"step {self._entered}"))
        try:
            with self._lane.context():  # the stage's device work, beside the trainer's
                item = self._enter(batch)
            item.ready = self._lane.record()
            if item.context is not None:
                item.context.ready = item.ready
            return item
        except ValueError as refused:
            return StageItem(error=refused)
        except Exception as error:
            return StageItem(error=_at_step(error, self._entered, "planning"))

    def _enter(self, batch: Any) -> StageItem:
        """Let a batch every rank took into every module's window."""
        start = time.thread_time()
        distributing = self._input_dist_s()
        features = getattr(batch, "sparse_features", None)
        step = self._entered
        prepared = [module.prepare(features, step) for module in self._modules]
        item = StageItem(StepContext(step, batch, dict(zip(self._modules, prepared))))
        for module, module_input in zip(self._modules, prepared):
            plan = module.enter(module_input)
            if plan is not None:
                item.plans.append(plan)
        self._entered += 1
        self._account(start, distributing)
        return item

    def _finish(self) -> StageItem:
        start = time.thread_time()
        distributing = self._input_dist_s()
        item = StageItem(end=True)
        with self._lane.context():  # the last steps' slots, made on the stage's stream too
            for module in self._modules:
                item.plans.extend(module.finish())
        item.ready = self._lane.record()
        self._account(start, distributing)
        return item

    def _account(self, start: float, distributing: float) -> None:
        distributed = self._input_dist_s() - distributing
        self.timings["input_dist_s"] += distributed
        self.timings["plan_s"] += time.thread_time() - start - distributed

    def _input_dist_s(self) -> float:
        return sum(module.input_dist_s for module in self._modules)

    def _put(self, item: StageItem) -> bool:
        """Queue ``item`` unless the stage is closed; False if it was."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False


class _Reader:
    """Runs a stage's reading (``read``: the loader, the host checks, the copy to the
    device) on a thread of its own, a few batches ahead, for a stage that plans inline
    on the trainer's thread. Reads stop at the end of the data, at a reading error, or
    when ``stop`` is set."""

    def __init__(self, read: Any, stop: threading.Event) -> None:
        self._read = read
        self._stop = stop
        self._queue: queue.Queue[tuple[Any, ValueError | None, BaseException | None]] = queue.Queue(
            maxsize=QUEUE_DEPTH
        )
        self._thread = threading.Thread(target=self._run, name="lookahead-reader", daemon=True)
        self._thread.start()

    def get(self) -> tuple[Any, ValueError | None, BaseException | None]:
        """The next read batch, in data order (blocks until the thread has one)."""
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the lookahead reader stopped without a word") from None

    def close(self) -> None:
        while not self._queue.empty():
            self._queue.get_nowait()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10.0)

    def _run(self) -> None:
        torch.set_num_threads(1)  # no OpenMP team beside the trainer's
        while not self._stop.is_set():
            read = self._read()
            while not self._stop.is_set():
                try:
                    self._queue.put(read, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if read[2] is not None:  # the end of the data, or a reading error
                return


# The step a check's message names, filled in when the batch is planned (the reading may
# run ahead of the planning, and a batch refused on any rank takes no step).
_STEP = "step \x00"


def _named(refusal: ValueError, step: str) -> ValueError:
    """``refusal`` (of its own type: ``BatchTypeError`` stays one) naming ``step``."""
    named = type(refusal)(str(refusal).replace(_STEP, step))
    named.__cause__ = refusal.__cause__
    return named


def _at_step(error: BaseException, step: int, doing: str) -> RuntimeError:
    failure = RuntimeError(
        f"the lookahead stage failed {doing} the batch of step {step}: {error!r}"
    )
    failure.__cause__ = error
    return failure
