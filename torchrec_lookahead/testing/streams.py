"""A CPU stand-in for a CUDA side stream that holds its work back until it is waited for.

On a GPU, row moves queued on the side stream land some time later; a reader
that does not wait for them sees the old rows. On the CPU work runs at once,
so a missing wait goes unseen. :class:`DeferredSideStream` queues the work
run on it and does it only when something waits: the event of a later
``record`` (``current_waits``) or everything (``drain``). Exactness tests run
with it (``use_deferred_side_streams``): a missing wait then shows as a wrong
value, as it could on a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

import torchrec_lookahead.streams as streams

__all__ = ["DeferredSideStream", "DeferredStreams", "use_deferred_side_streams"]


class DeferredSideStream(streams.SideStream):
    """A side stream whose work waits in a queue until something waits for it."""

    def __init__(self, device: torch.device) -> None:
        self.device = streams.normalize(device)
        self._queue: list[Callable[[], None]] = []
        self._done = 0  # work items done, in order
        self._lock = threading.RLock()
        self.deferred = 0  # work items that were still queued when something waited

    def run(self, work: Callable[[], None]) -> None:
        with self._lock:
            self._queue.append(work)

    def context(self) -> AbstractContextManager[Any]:
        """A block's work runs at once on the CPU: nothing to direct anywhere."""
        return nullcontext()

    def record(self) -> Any:
        with self._lock:
            return len(self._queue)

    def wait_for(self, event: Any) -> None:
        """The trainer's work is done at once on the CPU: nothing to wait for."""

    def current_waits(self, event: Any) -> None:
        self._do(event)

    def drain(self) -> None:
        self._do(None)

    def _do(self, until: int | None) -> None:
        with self._lock:
            end = len(self._queue) if until is None else until
            self.deferred += max(0, end - self._done)
            while self._done < end:
                work = self._queue[self._done]
                self._done += 1
                work()


class DeferredStreams(streams.StreamBackend):
    """torch's streams, except that side streams defer their work (the stage's do not)."""

    def make(self, device: torch.device, role: str) -> streams.SideStream:
        return DeferredSideStream(device) if role == "side" else super().make(device, role)


@contextmanager
def use_deferred_side_streams() -> Iterator[None]:
    """Side streams made inside this block defer their work (see the module)."""
    with streams.use_backend(DeferredStreams()):
        yield
