"""The plan executor: moves cache rows in a background thread, overlapping with compute."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

__all__ = ["PlanExecutor"]

Move = Callable[[], None]


class PlanExecutor:
    """Runs each step's row moves in order, in one background thread.

    The trainer calls ``submit`` with the moves of step ``s`` at its issue point
    (the start of step ``s - d``) and ``wait`` for them before step ``s`` runs. On
    CUDA the moves run on a side stream that first waits for the trainer's
    stream to reach the issue point, and step ``s`` waits for an event
    recorded after its moves; on CPU the trainer's thread is the only ordering
    needed. An exception in the worker is raised again by ``wait``.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._jobs: queue.Queue[tuple[int, list[Move], torch.cuda.Event | None] | None] = (
            queue.Queue()
        )
        self._done: dict[int, torch.cuda.Event | None] = {}  # step -> event (CUDA) or None
        self._applied = threading.Condition()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lookahead-executor", daemon=True)
        self._thread.start()

    def submit(self, step: int, moves: list[Move]) -> None:
        """Queue the moves of ``step``; call at its issue point, in step order."""
        issue: torch.cuda.Event | None = None
        if self._cuda:
            issue = torch.cuda.Event()
            issue.record()  # the trainer's stream has reached the issue point
        self._jobs.put((step, moves, issue))

    def wait(self, step: int) -> float:
        """Block until the moves of ``step`` have landed; returns seconds waited."""
        start = time.perf_counter()
        with self._applied:
            while step not in self._done and self._error is None:
                self._applied.wait()
            if step not in self._done:
                raise RuntimeError("the cache executor failed") from self._error
            event = self._done.pop(step)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
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
                with torch.cuda.stream(self._stream):
                    if issue is not None and self._stream is not None:
                        self._stream.wait_event(issue)
                    for move in moves:
                        move()
                    landed: torch.cuda.Event | None = None
                    if self._stream is not None:
                        landed = torch.cuda.Event()
                        landed.record(self._stream)
                        self._stream.synchronize()  # write-backs are in host memory now
            except BaseException as error:  # handed to the trainer by wait()
                with self._applied:
                    self._error = error
                    self._applied.notify_all()
                return
            with self._applied:
                self._done[step] = landed
                self._applied.notify_all()
