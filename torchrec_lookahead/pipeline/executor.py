"""The plan executor: moves cache rows in a background thread, overlapping with compute."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import torchrec_lookahead.streams as streams

__all__ = ["PlanExecutor"]

Move = Callable[[], None]


class PlanExecutor:
    """Runs each step's row moves in order, in one background thread.

    The trainer calls ``submit`` with the moves of step ``s`` at its issue point
    (the start of step ``s - d``) and ``wait`` for them before step ``s`` runs.
    The moves' device work runs on the device's side stream
    (:mod:`~torchrec_lookahead.streams`), which first waits for the trainer's
    stream to reach the issue point; step ``s`` waits for an event recorded
    after its moves. An exception in the worker is raised again by ``wait``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side = streams.side_stream(device)
        self._jobs: queue.Queue[tuple[int, list[Move], Any] | None] = queue.Queue()
        self._done: dict[int, Any] = {}  # step -> the side stream's event after its moves
        self._submitted = 0  # jobs queued, and how many of them have landed
        self._landed = 0
        self._last: Any = None  # the side stream's event after the last landed job
        self._applied = threading.Condition()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lookahead-executor", daemon=True)
        self._thread.start()

    def submit(self, step: int, moves: list[Move]) -> None:
        """Queue the moves of ``step``; call at its issue point, in step order."""
        self._submitted += 1
        self._jobs.put((step, moves, streams.mark(self.device)))  # the issue point

    def settle(self) -> None:
        """Block until every move submitted so far has landed, and order the trainer's
        stream after them: the cache is then still, e.g. to be rebuilt larger."""
        with self._applied:
            while self._landed < self._submitted and self._error is None:
                self._applied.wait()
            if self._landed < self._submitted:
                raise RuntimeError("the cache executor failed") from self._error
            last = self._last
        if last is not None:
            self._side.current_waits(last)

    def wait(self, step: int) -> float:
        """Block until the moves of ``step`` have landed; returns seconds waited."""
        start = time.perf_counter()
        with self._applied:
            while step not in self._done and self._error is None:
                self._applied.wait()
            if step not in self._done:
                raise RuntimeError("the cache executor failed") from self._error
            event = self._done.pop(step)
        self._side.current_waits(event)
        return time.perf_counter() - start

    def close(self) -> None:
        """Finish the queued moves and stop the worker (idempotent)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def _run(self) -> None:
        # This thread's torch ops run on one intra-op thread: a second OpenMP team, spinning
        # beside the trainer's, slowed the trainer's compute by up to 2x on 2 cores.
        torch.set_num_threads(1)
        while (job := self._jobs.get()) is not None:
            step, moves, issue = job
            try:
                self._side.wait_for(issue)
                for move in moves:
                    move()
                landed = self._side.record()
            except BaseException as error:  # handed to the trainer by wait()
                with self._applied:
                    self._error = error
                    self._applied.notify_all()
                return
            with self._applied:
                self._done[step] = landed
                self._landed += 1
                self._last = landed
                self._applied.notify_all()
