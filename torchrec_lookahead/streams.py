"""Streams, events and device copies: one code path for CUDA and the CPU.

Row moves (fetches into the cache, write-backs out of it) run on a stream of
their own so that they overlap with the trainer's compute; the lookahead stage
has a stream of its own too. On the CPU there is no stream and the work runs at
once. Everything goes through ``torch.get_device_module(device)`` with
explicit devices, so the lines that order work on CUDA run on the CPU too
(``torch.cpu``'s streams and events are no-ops). Every stream, event and
``record_stream`` of the package goes through this module, behind one
:class:`StreamBackend`; the test doubles in ``torchrec_lookahead.testing``
swap in their own (:func:`use_backend`): a side stream that holds its work
back until something waits for it, and a checker of the ordering rules below.

The orderings, as the pipeline uses them:

1. The trainer records an event at a step's issue point (:func:`mark`); the
   side stream waits for it (``wait_for``) before moving rows the trainer's
   optimizer may still be updating.
2. All device work of a step's moves runs on the side stream (``run``): the
   copies of slot indices and rows to the device as well as the row copies
   themselves, so that no tensor made on one stream is read on another
   unordered. An event recorded after them (``record``) is what the step's
   forward waits for (``current_waits``).
3. Reading the cache from the trainer's thread outside a step (write-backs
   for ``state_dict``, checkpoints, eval) first waits for every move queued
   so far (``drain``).
4. Tensors made on one stream and used on another (the stage's batch, its
   distributed input, the step's slots) are marked as used there
   (:func:`record_use`), so that the caching allocator does not hand their
   memory out again while that stream may still read it.
5. The stage plans on a stream of its own (``role="planning"``), which waits
   for the event its lane (``role="stage"``: copies, input dists) records after
   each batch's input dist; the lane never waits for it, so the input dist's
   host waits do not wait for planning.
6. A plan made on the device is read back on a stream of its own
   (:func:`readback_stream`) that waits for the stage's event after the plan and
   nothing else: on the side stream, after the issue point, the host's read
   would wait for the trainer's previous step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

__all__ = [
    "PRIORITIES",
    "SideStream",
    "StreamBackend",
    "host_side",
    "mark",
    "new_stream",
    "normalize",
    "readback_stream",
    "record_use",
    "side_stream",
    "to_device",
    "to_host",
    "use_backend",
]


def normalize(device: torch.device | str) -> torch.device:
    """``device`` with its index (the current device's where it has none): ``cuda`` and
    ``cuda:0`` name one device, and get one side stream. The CPU has no index."""
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return torch.device(device.type)
    if device.index is None:
        return torch.device(device.type, _BACKEND.current_device(device))
    return device


class SideStream:
    """A stream of ``device`` for work beside the trainer's (a no-op stand-in on the CPU),
    at ``priority`` (lower is sooner, as CUDA's; 0 is the default stream's)."""

    def __init__(self, device: torch.device, priority: int = 0) -> None:
        self.device = normalize(device)
        self._module: Any = torch.get_device_module(self.device)
        if self.device.type == "cpu":
            self._stream = self._module.Stream()
        else:
            self._stream = self._module.Stream(self.device, priority=priority)

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


class StreamBackend:
    """How the package makes streams and events and marks tensors used on a stream:
    torch's own. Test doubles subclass it (see :func:`use_backend`)."""

    def make(self, device: torch.device, role: str) -> SideStream:
        """A new stream of ``device`` for ``role`` (``"side"``: row moves; ``"stage"``,
        ``"planning"``: the stage's; ``"readback"``), at the role's priority
        (:data:`PRIORITIES`)."""
        return SideStream(device, PRIORITIES.get(role, 0))

    def mark(self, device: torch.device) -> Any:
        """An event at the calling thread's current point on ``device``."""
        module: Any = torch.get_device_module(device)
        event = module.Event()
        event.record(module.current_stream(device))
        return event

    def current_device(self, device: torch.device) -> int:
        """The index of the calling thread's current device of ``device``'s type."""
        return int(torch.get_device_module(device).current_device())

    def record_use(self, parts: Iterable[Any], device: torch.device) -> None:
        """Mark ``parts`` (tensors, or objects with TorchRec's ``record_stream``) as used
        on the calling thread's current stream of ``device``. The CPU's memory has no
        streams, and its tensors no ``record_stream``: nothing to do there (``parts`` is
        not even walked)."""
        if device.type == "cpu":
            return
        stream = torch.get_device_module(device).current_stream(device)
        for part in parts:
            if not isinstance(part, torch.Tensor) or part.device.type == device.type:
                part.record_stream(stream)

    def host_side(self, tensor: torch.Tensor) -> None:
        """``tensor`` is host memory (see :func:`host_side`)."""


# The stage's streams (a batch's copy to the device and its input dist; its planning: a
# device planner's plan, the steps' slots) are made at a higher priority than the
# trainer's, as TorchRec's ``TrainPipelineSparseDist`` makes its copy and data-dist
# streams (priority -1): the few kernels a step soon waits for are scheduled before the
# model's queued ones. The side stream's moves are issued ``d`` steps ahead, at the
# default priority, as TorchRec's prefetch stream is. The read-back stream's few small
# copies go at -1 too: CUDA draws streams of each priority from a pool of its own, so it
# is never the side stream, whose wait for the trainer it exists to avoid.
PRIORITIES = {"stage": -1, "planning": -1, "readback": -1}

_BACKEND = StreamBackend()
_STREAMS: dict[tuple[torch.device, str], SideStream] = {}  # per device and role


def side_stream(device: torch.device | str) -> SideStream:
    """The side stream of ``device`` that row moves run on (one per device and process)."""
    return _shared(device, "side")


def readback_stream(device: torch.device | str) -> SideStream:
    """The stream of ``device`` that device plans are read back on (one per device and
    process: each new stream is drawn from CUDA's small pool in turn, so one per window
    could come round to the side stream itself)."""
    return _shared(device, "readback")


def _shared(device: torch.device | str, role: str) -> SideStream:
    key = (normalize(device), role)
    if key not in _STREAMS:
        _STREAMS[key] = _BACKEND.make(key[0], role)
    return _STREAMS[key]


def new_stream(device: torch.device | str, role: str) -> SideStream:
    """A stream of ``device`` of its own (the lookahead stage's: ``role="stage"`` and
    ``"planning"``)."""
    return _BACKEND.make(normalize(device), role)


def mark(device: torch.device | str) -> Any:
    """An event at the calling thread's current point on ``device`` (an issue point)."""
    return _BACKEND.mark(normalize(device))


def record_use(value: Any, device: torch.device | str) -> None:
    """Mark every tensor found in ``value`` as used on the calling thread's current
    stream of ``device`` (``record_stream``), so that memory allocated on another stream
    is not handed out again while this one may still read it.

    ``value`` is searched through: tensors; objects with TorchRec's ``record_stream``
    (``Batch``, ``KeyedJaggedTensor``, the sharded modules' contexts); dataclasses
    (their fields), mappings (their values), lists and tuples. Anything else holds
    nothing the step reads from device memory.
    """
    _BACKEND.record_use(_parts(value, set()), normalize(device))  # walked where needed


def _parts(value: Any, seen: set[int]) -> Iterator[Any]:
    """The tensors and ``record_stream`` objects in ``value`` (each once)."""
    if value is None or isinstance(value, (str, bytes, int, float, bool)) or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor) or callable(getattr(value, "record_stream", None)):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _parts(getattr(value, field.name), seen)
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _parts(item, seen)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _parts(item, seen)


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device``, copied without blocking the host: pageable host memory
    goes through a page-locked copy first (a copy from pageable memory is synchronous),
    which the caching host allocator keeps until the device has read it. The copy is
    ordered on the calling thread's current stream. On its own device: ``tensor``."""
    device = torch.device(device)
    if tensor.device.type == device.type and device.index in (None, tensor.device.index):
        return tensor
    if device.type != "cpu" and tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in host memory, once the calling thread's current stream has made it:
    copied into page-locked memory without blocking (a copy into pageable memory is
    staged through a pinned buffer by the driver, several times slower), then the host
    waits for an event recorded after the copy on that stream. On the CPU: ``tensor``.

    The buffer goes back to the caching host allocator when the result is freed, and
    the allocator knows of no use of it but this copy: copy out what a stream will read
    later (a view of it handed to :func:`to_device` is copied without a new buffer, and
    its memory could be handed out again while that copy waits)."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host_side(host).copy_(tensor, non_blocking=True)
    mark(tensor.device).synchronize()
    return host


def host_side(tensor: torch.Tensor) -> torch.Tensor:
    """Declare ``tensor`` host memory (the backing store, staging buffers, bookkeeping):
    host code reads and writes it in its own order, not a stream's. Where the device is
    the CPU, its memory and the device's are the same; a stream checker then leaves
    this tensor's memory unchecked. Returns ``tensor``."""
    _BACKEND.host_side(tensor)
    return tensor


@contextmanager
def use_backend(backend: StreamBackend) -> Iterator[StreamBackend]:
    """Streams made inside this block come from ``backend`` (test doubles); the side
    streams made before are set aside meanwhile, and back afterwards."""
    global _BACKEND
    saved, original = dict(_STREAMS), _BACKEND
    _STREAMS.clear()
    _BACKEND = backend
    try:
        yield backend
    finally:
        _BACKEND = original
        _STREAMS.clear()
        _STREAMS.update(saved)
