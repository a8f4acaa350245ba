"""The side stream that cache rows move on, one code path for CUDA and the CPU.

Row moves (fetches into the cache, write-backs out of it) run on a stream of
their own so that they overlap with the trainer's compute; on the CPU there is
no stream and the work runs at once. Everything goes through
``torch.get_device_module(device)`` with explicit devices, so the lines that
order work on CUDA run on the CPU too (``torch.cpu``'s streams and events are
no-ops). :func:`side_stream` hands out one :class:`SideStream` per device;
``torchrec_lookahead.testing.streams.DeferredSideStream`` stands in for it in
tests, holding the work back until something waits for it, so that a missing
wait shows as a wrong value on the CPU.

The orderings, as the pipeline uses them:

1. The trainer records an event at a step's issue point (:func:`mark`); the
   side stream waits for it (``wait_for``) before moving rows the trainer's
   optimizer may still be updating.
2. The moves of a step run on the side stream (``run``); an event recorded
   after them (``record``) is what the step's forward waits for
   (``current_waits``).
3. Reading the cache from the trainer's thread outside a step (write-backs
   for ``state_dict``, checkpoints, eval) first waits for every move queued
   so far (``drain``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

__all__ = ["SideStream", "mark", "side_stream"]


class SideStream:
    """A stream for row moves on ``device`` (a no-op stand-in on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._module: Any = torch.get_device_module(device)
        self._stream = self._module.Stream(device)

    def run(self, work: Callable[[], None]) -> None:
        """Do ``work``'s device operations on this stream, in order with earlier work."""
        with self.context():
            work()

    def context(self) -> AbstractContextManager[Any]:
        """A block whose device operations go to this stream (at once, never deferred)."""
        return self._module.stream(self._stream)

    def record(self) -> Any:
        """An event after everything run on this stream so far."""
        event = self._module.Event()
        event.record(self._stream)
        return event

    def wait_for(self, event: Any) -> None:
        """Later work on this stream starts after ``event`` (of another stream)."""
        if event is not None:
            self._stream.wait_event(event)

    def current_waits(self, event: Any) -> None:
        """The calling thread's current stream waits for ``event`` of this stream."""
        if event is not None:
            self._module.current_stream(self.device).wait_event(event)

    def drain(self) -> None:
        """Everything run on this stream so far is done, as the host sees it."""
        self.record().synchronize()


def mark(device: torch.device) -> Any:
    """An event at the calling thread's current point on ``device`` (an issue point)."""
    module: Any = torch.get_device_module(device)
    event = module.Event()
    event.record(module.current_stream(device))
    return event


_STREAMS: dict[torch.device, SideStream] = {}
_MAKE: Callable[[torch.device], SideStream] = SideStream  # the tests' deferred stream swaps in


def side_stream(device: torch.device) -> SideStream:
    """The side stream of ``device`` that row moves run on (one per device and process)."""
    if device not in _STREAMS:
        _STREAMS[device] = _MAKE(device)
    return _STREAMS[device]
