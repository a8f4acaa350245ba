"""The lookahead stage: reads batches ahead, distributes and plans them off the trainer thread.

Each batch goes through three phases, in data order: it is *read* (taken from
the data loader; checked once on the host,
:class:`~torchrec_lookahead.pipeline.batch_check.BatchCheck`, unless the loader's
workers did, and by each module's ``batch_kind_refusal``; voted on by every rank under
DMP, :class:`~torchrec_lookahead.votes.VoteGroup`; and copied to the device);
*distributed* (each lookahead module's ``distribute``: under DMP, the input
dist, a collective); and *planned* (each module's ``prepare`` and ``enter``:
the window's oracles). The stage queues each batch with the moves of the steps
it completed the window of; the trainer thread takes them off in order and
applies their plans.

Where each phase runs:

- *Threaded* (the default on the CPU): one background thread does all three,
  its collectives on process groups of its own. The oracle's inner loops
  release the GIL, so planning runs beside the step's compute.
- *Inline* (the default on CUDA, where each rank's NCCL collectives must be
  issued by one thread): the trainer's thread distributes each batch in two
  halves, as TorchRec's ``TrainPipelineSparseDist`` does: each time it asks for
  the next batch it starts one batch's input dist and waits for the one it
  started the time before. It does nothing else of the stage's: a thread reads
  (:class:`_Reader`) and another plans (:class:`_Planner`), :data:`PLAN_AHEAD`
  batches ahead of what the trainer takes. The planner votes
  only on a group of its own (a capped cache's verdict, see
  :class:`~torchrec_lookahead.embedding.sharded.ShardedLookaheadModule`).

A batch that the check or a module refuses (``ValueError``, which
:class:`~torchrec_lookahead.checks.BatchTypeError` is too) changes nothing and is
queued as that error, in its place; any other error ends the stage and is queued
with the batch it happened at. ``close`` stops the threads, also while they
wait on a full queue.

The stage's device work runs on two streams of its own: the *lane* (a batch's copy to
the device and its input dist, as TorchRec's copy and data-dist streams) and the
*planning* stream (what planning puts on the device: the ids read back for a host
planner, a device planner's kernels, the steps' slots), which waits for the lane's event
after each batch's input dist. The input dist's own host waits (TorchRec reads split
sizes back, on the trainer's thread when inline) so wait for distributing work only,
not for a device planner's kernels queued beside it.

The stage's threads must not slow the step they hide behind: where the
trainer's OpenMP threads want every core, a planning thread of normal priority
slows each step's compute (measured in ``docs/design.md``, "Threads"). So the
threads that plan run their torch ops on one intra-op thread and, on Linux,
under ``SCHED_IDLE``: they get a core only when the trainer leaves one idle
(its single-threaded Python, waits), and when they fall behind, the trainer's
wait for the next plan leaves a core idle for them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torchrec.distributed.types import Awaitable

import torchrec_lookahead.streams as streams
from torchrec_lookahead.idle import run_normally, run_when_idle
from torchrec_lookahead.pipeline.batch_check import UNNAMED_STEP, BatchCheck, CheckedBatch
from torchrec_lookahead.steps import LookaheadModule, StepContext, StepPlan
from torchrec_lookahead.votes import VoteGroup

__all__ = ["LookaheadStage", "StageItem"]

# Batches the stage reads and plans ahead of what the trainer has taken (a constant: no
# caller needs another); the window itself, ``lookahead``, is the modules', not this queue's.
QUEUE_DEPTH = 4
# Inline: batches the trainer has distributed and handed to the planner, not yet taken
# back planned. Two: the trainer distributes a batch a step before it takes its plan.
PLAN_AHEAD = 2


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


@dataclass
class _Read:
    """A batch read: checked on the host, voted on and on its way to the device; or its
    refusal (this rank's or another's); or the reading's error (``StopIteration`` at the
    end of the data)."""

    batch: Any = None
    refusal: ValueError | None = None
    failure: BaseException | None = None


class LookaheadStage:
    """Reads, distributes and plans the window's batches (see the module for which thread
    does what).

    Args:
        modules: the lookahead modules (unsharded or sharded) to plan for.
        check: the model's host check of each batch, made before the batch moves to
            ``device`` (a :class:`CheckedBatch` from a loader carries its verdict).
        device: where batches go.
        threaded: everything on a background thread of idle priority (default), else
            inline: the trainer distributes each batch in ``get``, beside a reading
            thread and a planning thread.
        vote: under DMP with several ranks, how the ranks agree on each batch read.
    """

    def __init__(
        self,
        modules: Sequence[LookaheadModule],
        check: BatchCheck,
        device: torch.device,
        threaded: bool = True,
        vote: VoteGroup | None = None,
    ) -> None:
        self.threaded = threaded
        self._vote = vote
        self._modules = list(modules)
        self._check = check
        self._device = device
        self._queue: queue.Queue[StageItem] = queue.Queue(maxsize=QUEUE_DEPTH)
        # Its own streams (none on the CPU): copies and input dists; planning.
        self._lane = streams.new_stream(device, "stage")
        self._planning = streams.new_stream(device, "planning")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reader: _Reader | None = None  # inline: the reading thread
        self._planner: _Planner | None = None  # inline: the planning thread
        self._handed = 0  # inline: batches handed to the planner, not yet taken back
        # Inline: batches read whose input dist was started, not yet waited for (one,
        # between calls), with what ``_distribute`` returned.
        self._started: deque[tuple[_Read, list[Awaitable[Any]] | BaseException | None]] = deque()
        self._read_all = False  # inline: the reader gave its last (the end, or its error)
        self._iter: Iterator[Any] | None = None
        # Batches that entered the window: the step of the next one. The stage numbers the
        # steps; every other part takes a step's number from its context.
        self._entered = 0
        # CPU seconds the stage spent distributing batches (DMP) and planning them, on
        # whichever threads: its cost, whatever the wall time (its threads wait for idle
        # cores).
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
            self._planner = _Planner(self._stop)

    def get(self) -> StageItem:
        """The next item, in data order (blocks until there is one)."""
        if not self.threaded:
            return self._get_inline()
        assert self._thread is not None, "start() first"
        item: StageItem = _get_from(self._queue, self._thread, "stage")
        return item

    def hand_over(self, context: StepContext) -> None:
        """Give the trainer ``context``'s step: its stream waits for the stage's work on
        the batch, and every tensor of the context is marked as used on it (the batch,
        what the modules prepared -- a sharded module's distributed input, hot rows --
        and the step's slots: all made on the stage's streams, all read by the step), so
        the caching allocator does not hand their memory out again while the trainer
        may still read it."""
        self._planning.current_waits(context.ready)
        streams.record_use(context, self._device)

    def close(self) -> None:
        """Stop the threads (idempotent). A thread blocked inside the loader or a
        collective is left to finish that call; it is a daemon and queues nothing more."""
        self._stop.set()
        if self._thread is not None:
            _close(self._queue, self._thread)
        for helper in (self._reader, self._planner):
            if helper is not None:
                helper.close()
        self._started.clear()  # input dists started, never to be waited for

    @property
    def stopped(self) -> bool:
        """Whether no thread of the stage runs (after :meth:`close`: none was left inside
        the loader or a collective, so the stage's process groups are free to go)."""
        threads = [self._thread] + [h.thread for h in (self._reader, self._planner) if h]
        return not any(thread is not None and thread.is_alive() for thread in threads)

    # ------------------------------------------------------------ threaded

    def _run(self) -> None:
        torch.set_num_threads(1)  # no OpenMP team beside the trainer's (see the executor)
        run_when_idle()
        while not self._stop.is_set():
            item = self._next_item()
            if not _put_unless(self._queue, item, self._stop) or _is_last(item):
                return

    def _next_item(self) -> StageItem:
        """Read, distribute and plan the next batch; the end of data and errors become
        items."""
        read = self._read()
        return self._plan(read, *self._await(self._distribute(read)))

    # ------------------------------------------------------------ inline

    def _get_inline(self) -> StageItem:
        """Start the next batch's input dist, wait for the one started in the call
        before (TorchRec's split of a batch's input dist over two steps) and hand that
        batch to the planner, until it holds :data:`PLAN_AHEAD`; then take the oldest
        back, planned. All on the trainer's thread. Every rank starts and waits for as
        many batches in each call, whatever its threads' timing (the reader runs ahead,
        so this rarely waits for it): a pipeline closed between calls leaves no rank
        inside a collective that another rank never joins."""
        assert self._reader is not None and self._planner is not None, "start() first"
        while self._handed < PLAN_AHEAD and (self._started or not self._read_all):
            if not self._read_all:
                read = self._reader.get()
                self._read_all = read.failure is not None
                self._started.append((read, self._distribute(read)))
            if len(self._started) > 1 or self._read_all:
                read, distributing = self._started.popleft()
                self._planner.put(partial(self._plan, read, *self._await(distributing)))
                self._handed += 1
        item = self._planner.get()
        self._handed -= 1
        return item

    # ------------------------------------------------------------ the phases

    def _read(self) -> _Read:
        """The next batch, read (see :class:`_Read`). It may run ahead of the planning
        (on the reader's thread), so messages name the step by ``UNNAMED_STEP``, which
        :meth:`_plan` fills in."""
        assert self._iter is not None, "start() first"
        try:
            batch, refusal = self._verdict(next(self._iter))
            if self._vote is not None:
                refusal = self._vote.agree(refusal)
            if refusal is None:
                with self._lane.context():  # copied on the stage's lane, beside the trainer's
                    batch = batch.to(self._device, non_blocking=True)
            return _Read(batch, refusal)
        except (StopIteration, Exception) as error:  # the trainer raises it with its step
            return _Read(failure=error)

    def _verdict(self, read: Any) -> tuple[Any, ValueError | None]:
        """The batch ``read`` and why this rank cannot take it, if it cannot: the host
        check (a loader's worker's, if it made it), then the modules' kinds."""
        if not isinstance(read, CheckedBatch):
            batch, refusal = read, self._check.refusal(read)
        elif read.check == self._check:
            batch, refusal = read.batch, read.refusal
        else:
            raise ValueError(
                "the loader checked its batches for another model (BatchCheck.of a model "
                "with other features or table sizes than this pipeline's): make its "
                "collate_fn with BatchCheck.of(model), model as the pipeline gets it"
            )
        if refusal is not None:
            return batch, refusal
        features = batch.sparse_features  # there: the check checked the structure
        for module in self._modules:
            if (refusal := module.batch_kind_refusal(features)) is not None:
                return batch, refusal
        return batch, None

    def _distribute(self, read: _Read) -> list[Awaitable[Any]] | BaseException | None:
        """Each module's ``distribute`` of a batch every rank took, started (on the stage's
        stream); its error, if one fails; ``None`` for a batch not to distribute."""
        if read.failure is not None or read.refusal is not None:
            return None
        features = getattr(read.batch, "sparse_features", None)
        return self._distributing(lambda: [module.distribute(features) for module in self._modules])

    def _await(
        self, distributing: list[Awaitable[Any]] | BaseException | None
    ) -> tuple[list[Any] | BaseException | None, Any]:
        """What :meth:`_distribute` started, waited for: each module's distributed batch,
        and the lane's event after it (what planning waits for; ``None`` where nothing
        was distributed)."""
        if not isinstance(distributing, list):
            return distributing, None
        distributed = self._distributing(lambda: [started.wait() for started in distributing])
        return distributed, self._lane.record()

    def _distributing(self, call: Callable[[], list[Any]]) -> list[Any] | BaseException:
        """``call`` on the stage's lane, its CPU time counted; its error, if it fails."""
        start = time.thread_time()
        try:
            with self._lane.context():
                return call()
        except Exception as error:
            return error
        finally:
            self.timings["input_dist_s"] += time.thread_time() - start

    def _plan(
        self, read: _Read, distributed: list[Any] | BaseException | None, at: Any = None
    ) -> StageItem:
        """Let a distributed batch into the window and plan it, on the planning stream
        after the lane's event ``at`` (a refused batch, on every rank, goes no further);
        the end of the data finishes the window."""
        if isinstance(read.failure, StopIteration):
            return self._finish()
        if read.failure is not None:
            return StageItem(error=_at_step(read.failure, self._entered, "reading"))
        if read.refusal is not None:
            return StageItem(error=_named(read.refusal, f"step {self._entered}"))
        if isinstance(distributed, BaseException):
            return StageItem(error=_at_step(distributed, self._entered, "distributing"))
        assert distributed is not None
        start = time.thread_time()
        try:
            self._planning.wait_for(at)
            with self._planning.context():  # the stage's planning, beside the trainer's
                streams.record_use([read.batch, distributed], self._device)  # made on the lane
                item = self._enter(read.batch, distributed)
            item.ready = self._planning.record()
            if item.context is not None:
                item.context.ready = item.ready
            return item
        except ValueError as refused:
            return StageItem(error=_named(refused, f"step {self._entered}"))
        except Exception as error:
            return StageItem(error=_at_step(error, self._entered, "planning"))
        finally:
            self.timings["plan_s"] += time.thread_time() - start

    def _enter(self, batch: Any, distributed: list[Any]) -> StageItem:
        """Let a batch every rank took, distributed, into every module's window."""
        step = self._entered
        prepared = [module.prepare(d, step) for module, d in zip(self._modules, distributed)]
        item = StageItem(StepContext(step, batch, dict(zip(self._modules, prepared))))
        for module, module_input in zip(self._modules, prepared):
            plan = module.enter(module_input)
            if plan is not None:
                item.plans.append(plan)
        self._entered += 1
        return item

    def _finish(self) -> StageItem:
        start = time.thread_time()
        item = StageItem(end=True)
        with self._planning.context():  # the last steps' slots, made there too
            for module in self._modules:
                item.plans.extend(module.finish())
        item.ready = self._planning.record()
        self.timings["plan_s"] += time.thread_time() - start
        return item


class _Reader:
    """Runs a stage's reading (``read``: the loader, the host checks, the copy to the
    device) on a thread of its own, a few batches ahead, for an inline stage. Reads stop
    at the end of the data, at a reading error, or when ``stop`` is set."""

    def __init__(self, read: Callable[[], _Read], stop: threading.Event) -> None:
        self._read = read
        self._stop = stop
        self._queue: queue.Queue[_Read] = queue.Queue(maxsize=QUEUE_DEPTH)
        self.thread = threading.Thread(target=self._run, name="lookahead-reader", daemon=True)
        self.thread.start()

    def get(self) -> _Read:
        """The next read batch, in data order (blocks until the thread has one)."""
        return _get_from(self._queue, self.thread, "reader")

    def close(self) -> None:
        _close(self._queue, self.thread)

    def _run(self) -> None:
        torch.set_num_threads(1)  # no OpenMP team beside the trainer's
        while not self._stop.is_set():
            read = self._read()
            if not _put_unless(self._queue, read, self._stop) or read.failure is not None:
                return  # closed, the end of the data, or a reading error


class _Planner:
    """Plans an inline stage's distributed batches on a thread of its own, in the order
    handed: each is a call made on this thread (the stage's ``_plan`` of one batch), its
    item handed back. The thread ends after the end of the data or a fatal error, or
    when ``stop`` is set."""

    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop
        self._inbox: queue.Queue[Callable[[], StageItem]] = queue.Queue()  # bounded by the stage
        self._outbox: queue.Queue[StageItem] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="lookahead-planner", daemon=True)
        self.thread.start()

    def put(self, plan: Callable[[], StageItem]) -> None:
        self._inbox.put(plan)

    def get(self) -> StageItem:
        """The item of the oldest call handed (blocks until it is made)."""
        item: StageItem = _get_from(self._outbox, self.thread, "planner")
        return item

    def close(self) -> None:
        _close(self._outbox, self.thread)

    def _run(self) -> None:
        torch.set_num_threads(1)
        run_when_idle()
        while not self._stop.is_set():
            try:
                plan = self._inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                item = plan()
            except Exception as error:  # the end's planning (the others catch their own)
                item = StageItem(error=error)
            self._outbox.put(item)
            if _is_last(item):
                return


def _is_last(item: StageItem) -> bool:
    """Whether nothing follows ``item``: the end of the data, or an error that ends the
    stage (a refusal, a ``ValueError``, does not)."""
    return item.end or (item.error is not None and not isinstance(item.error, ValueError))


def _put_unless(into: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Queue ``item`` unless ``stop`` is set first; False if it was."""
    while not stop.is_set():
        try:
            into.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _get_from(out: queue.Queue, thread: threading.Thread, name: str) -> Any:
    """The next of ``out``, which ``thread`` fills (blocks until there is one)."""
    while True:
        try:
            return out.get(timeout=1.0)
        except queue.Empty:
            if not thread.is_alive() and out.empty():
                raise RuntimeError(f"the lookahead {name} stopped without a word") from None


def _close(out: queue.Queue, thread: threading.Thread) -> None:
    """Empty ``out`` (so that ``thread`` is not left waiting on it) and join ``thread``."""
    while not out.empty():
        out.get_nowait()
    if thread is not threading.current_thread():
        run_normally(thread)  # it ran at idle priority
        thread.join(timeout=10.0)


def _named(refusal: ValueError, step: str) -> ValueError:
    """``refusal`` (of its own type: ``BatchTypeError`` stays one) naming ``step``: in place
    of :data:`UNNAMED_STEP`, else first, unless it names a step already."""
    text = str(refusal).replace(UNNAMED_STEP, step)
    named = type(refusal)(text if text.startswith("step ") else f"{step}: {text}")
    named.__cause__ = refusal.__cause__
    return named


def _at_step(error: BaseException, step: int, doing: str) -> RuntimeError:
    failure = RuntimeError(
        f"the lookahead stage failed {doing} the batch of step {step}: {error!r}"
    )
    failure.__cause__ = error
    return failure
