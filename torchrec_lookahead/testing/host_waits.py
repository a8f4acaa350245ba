"""What a GPU's host would pay, counted on the CPU under fake CUDA: host waits and device ops.

On a GPU, the host issues device work asynchronously; it waits only where it
needs the device's data (``.item()``, ``tolist``, a copy to pageable memory, a
data-dependent shape such as ``nonzero``), where it copies from pageable memory, and where
it synchronises a stream, an event or the device. :class:`HostCounter` counts these per
thread under :class:`~torchrec_lookahead.testing.fake_cuda.FakeCuda`, from outside the
code it watches:

* a dispatch mode above the fake CUDA one sees every operator a thread issues; one
  that touches a CUDA tensor is a *device op* (views included), and some of those are
  *host waits* (see :data:`WAIT_OPS`, :data:`VALUE_READ_OPS` and the copies' rules, as in
  :class:`~torchrec_lookahead.testing.fake_cuda.Transfer`);
* ``torch.cuda``'s streams, events and synchronisations are stood in for (a CPU build
  has none): synchronising a stream, an event or the device is a host wait; recording
  an event, a stream's wait, ``record_stream`` are *stream ops*;
* ``tolist`` of a CUDA tensor is one wait (a fake tensor reads itself element by element):
  ``FakeTensor.tolist`` is replaced meanwhile.

Three calls fake CUDA does not rewrite into the operators they stand for are rewritten
here: ``Tensor.copy_`` of a CUDA tensor (its binding asks for the CUDA device guard a CPU
build lacks), indexing with two index tensors (DLRM's interaction, ``x[:, i, j]``) and
``set_`` of a CUDA storage (the store's view of back-to-back tables; run on the fake
tensor only, its shadow follows the storage).

Each wait is kept with its call site: the innermost frame of the code under watch
(TorchRec, FBGEMM, this package; not torch, nor the testing doubles). The thread CPU
time spent inside device ops (fake CUDA runs each twice: fake, and on the shadows; the
shadows do what the GPU would) is kept apart, as *emulation*: what the host would not pay.
"""

from __future__ import annotations

import collections
import inspect
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from torchrec_lookahead._compat import (
    ITEM,
    PIN_MEMORY,
    TO_COPY,
    UNIQUE,
    DispatchMode,
    FakeTensor,
    is_fake,
    outside_dispatch_mode,
)
from torchrec_lookahead.testing.fake_cuda import FakeCuda
from torchrec_lookahead.testing.threads import Teardown, in_new_threads

__all__ = ["VALUE_READ_OPS", "WAIT_OPS", "HostCounter", "Tally"]

aten = torch.ops.aten

# Operators on a CUDA tensor that make the host wait for the device: a value read back,
# or an output whose shape depends on the data.
WAIT_OPS = {
    ITEM: "item",
    aten.equal.default: "equal",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    UNIQUE: "unique",
    aten.unique_consecutive.default: "unique",
    aten.unique_dim.default: "unique",
}
# Operators whose CUDA kernel reads its 0-d value tensor back (``value.item()``) when that
# value is on the device: the fill's value is a host scalar in the kernel.
VALUE_READ_OPS = {
    aten.index_fill_.int_Tensor,
    aten.index_fill.int_Tensor,
    aten.masked_fill_.Tensor,
    aten.masked_fill.Tensor,
}
_STREAM_OPS = {aten.record_stream.default}
# Frames of these files are not call sites: torch itself and the doubles.
_NOT_SITES = ("/torch/", "/testing/", "/contextlib.py", "/threading.py")


@dataclass
class Tally:
    """One thread's counts (see the module)."""

    device_ops: int = 0
    stream_ops: int = 0
    waits: collections.Counter[str] = field(default_factory=collections.Counter)
    sites: collections.Counter[str] = field(default_factory=collections.Counter)
    emulation_s: float = 0.0

    @property
    def host_waits(self) -> int:
        return sum(self.waits.values())

    def copy(self) -> Tally:
        return Tally(
            self.device_ops,
            self.stream_ops,
            collections.Counter(self.waits),
            collections.Counter(self.sites),
            self.emulation_s,
        )

    def minus(self, earlier: Tally) -> Tally:
        """What was counted since ``earlier`` (a copy of this tally)."""
        return Tally(
            self.device_ops - earlier.device_ops,
            self.stream_ops - earlier.stream_ops,
            self.waits - earlier.waits,
            self.sites - earlier.sites,
            self.emulation_s - earlier.emulation_s,
        )


class HostCounter:
    """Counts, per thread, the device ops, stream ops and host waits under ``fake``.

    Enter it inside ``fake``'s block (its modes go above fake CUDA's); threads started
    inside count too. ``torch.cuda``'s stream API is replaced meanwhile (see the module).
    """

    def __init__(self, fake: FakeCuda) -> None:
        self.fake = fake
        self._tallies: dict[int, Tally] = {}  # threading.get_ident() -> its tally
        self._names: dict[int, str] = {}
        self._stack = ExitStack()

    def __enter__(self) -> HostCounter:
        self._stack.enter_context(_cuda_runtime(self))
        self._stack.callback(self._enter_thread())
        self._stack.enter_context(in_new_threads(self._enter_thread))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _enter_thread(self) -> Teardown:
        """Count this thread's operators; returns what stops it, on this thread."""
        dispatch, functions = _Count(self), _CountFunctions(self)
        dispatch.__enter__()
        functions.__enter__()

        def leave() -> None:
            functions.__exit__(None, None, None)
            dispatch.__exit__(None, None, None)

        return leave

    def tally(self) -> Tally:
        """The calling thread's tally (live)."""
        ident = threading.get_ident()
        found = self._tallies.get(ident)
        if found is None:
            found = self._tallies.setdefault(ident, Tally())
            self._names[ident] = threading.current_thread().name
        return found

    def name(self, thread: int) -> str:
        """The name of ``thread`` (an ident) when it first counted."""
        return self._names.get(thread, "")

    def by_thread(self) -> dict[str, Tally]:
        """Every thread's tally so far, by thread name."""
        return {self._names[ident]: tally.copy() for ident, tally in list(self._tallies.items())}

    def wait(self, kind: str) -> None:
        """Count a host wait of ``kind`` on the calling thread, at its call site."""
        tally = self.tally()
        tally.waits[kind] += 1
        tally.sites[f"{kind} @ {_call_site()}"] += 1

    # ------------------------------------------------------------ operators

    def operator(self, func: Any, args: tuple, kwargs: dict) -> Any:
        start = time.thread_time()  # a device op's time, this mode's own included
        leaves = list(_leaves((args, kwargs)))
        device = kwargs.get("device")
        on_device = any(is_fake(leaf) for leaf in leaves) or (
            device is not None and torch.device(device).type == self.fake.device.type
        )
        if not on_device or func is PIN_MEMORY:  # page-locking host memory for a device
            return func(*args, **kwargs)
        tally = self.tally()
        if func in _STREAM_OPS:
            tally.stream_ops += 1
        else:
            tally.device_ops += 1
            kind = self._wait_kind(func, args, kwargs)
            if kind is not None:
                self.wait(kind)
        try:
            if func is aten.set_.source_Storage_storage_offset and is_fake(args[0]):
                # The store joins back-to-back tables (a view of a storage): fake CUDA's
                # shadows take no storage, but the shadow follows the storage anyway, so
                # the fake tensor mode alone runs it (fake CUDA's mode set aside).
                with outside_dispatch_mode():
                    return func(*args, **kwargs)
            return func(*args, **kwargs)
        finally:
            tally.emulation_s += time.thread_time() - start

    def _wait_kind(self, func: Any, args: tuple, kwargs: dict) -> str | None:
        """The host wait ``func`` makes on a GPU, or ``None``."""
        if func in WAIT_OPS:
            return WAIT_OPS[func]
        if func in VALUE_READ_OPS and is_fake(args[-1]):  # the value comes last
            return "item"
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            return "repeat_interleave"
        if func is TO_COPY:
            source, non_blocking = args[0], bool(kwargs.get("non_blocking", False))
            if is_fake(source):  # to the host (or within the device: no wait)
                host = torch.device(kwargs.get("device") or source.device).type == "cpu"
                return "D2H copy" if host and not non_blocking else None
            return self._h2d(source, non_blocking)
        if func is aten.copy_.default:
            target, source = args[0], args[1]
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if is_fake(source) and not is_fake(target):
                blocking = not (non_blocking and self.fake.is_pinned(target))
                return "D2H copy" if blocking else None
            if is_fake(target) and not is_fake(source) and source.device.type == "cpu":
                return self._h2d(source, non_blocking)
        return None

    def _h2d(self, source: torch.Tensor, non_blocking: bool) -> str | None:
        if not self.fake.is_pinned(source):
            return "pageable H2D copy"
        return None if non_blocking else "blocking H2D copy"


def _call_site() -> str:
    """The innermost frame of the watched code, ``path:line (function)`` with the path from
    the package (or from ``site-packages``); if that is not this package's, ``via`` the
    innermost frame that is."""
    site, frame = "", inspect.currentframe()  # this module's frames are skipped (testing/)
    while frame is not None:
        name = frame.f_code.co_filename
        if not any(part in name for part in _NOT_SITES):
            short = name.split("site-packages/")[-1]
            at = short.find("torchrec_lookahead/")
            where = f"{short[at:] if at >= 0 else short}:{frame.f_lineno} ({frame.f_code.co_name})"
            if at >= 0:
                return f"{site} via {where}" if site else where
            site = site or where
        frame = frame.f_back
    return site or "?"


class _Count(DispatchMode):
    def __init__(self, owner: HostCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        return self.owner.operator(func, args, kwargs or {})


class _CountFunctions(TorchFunctionMode):
    """Two calls fake CUDA does not rewrite into the operators they stand for."""

    def __init__(self, owner: HostCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = getattr(func, "__name__", "")
        if name == "__getitem__" and is_fake(args[0]) and _several_index_tensors(args[1]):
            # fake CUDA rewrites one index tensor; DLRM's interaction takes two (x[:, i, j]):
            # the operator a GPU build dispatches them to
            indices = [None if isinstance(k, slice) else k for k in args[1]]
            return aten.index.Tensor(args[0], indices)
        return func(*args, **(kwargs or {}))


def _several_index_tensors(key: Any) -> bool:
    """Whether ``key`` is full slices (``:``) and two or more index tensors."""
    if not isinstance(key, tuple):
        return False
    tensors = [k for k in key if isinstance(k, torch.Tensor)]
    rest = [k for k in key if not isinstance(k, torch.Tensor)]
    return len(tensors) > 1 and all(k == slice(None) for k in rest)


# ------------------------------------------------------------ torch.cuda, stood in for


class _Stream(torch.Stream):
    """A CUDA stream of the counter: its operations counted, none done."""

    counter: HostCounter
    priority: int  # the priority it was made at
    _ids = iter(range(1, 1 << 30))

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> _Stream:
        stream_id = kwargs.get("stream_id")
        stream_id = next(cls._ids) if stream_id is None else stream_id
        stream = super().__new__(cls, stream_id=stream_id, device_index=0, device_type=1)
        stream.priority = priority  # as asked (CUDA's would clamp it to its range)
        return stream

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        self.counter.tally().stream_ops += 1

    def wait_stream(self, stream: Any) -> None:
        self.counter.tally().stream_ops += 1

    def record_event(self, event: Any = None) -> Any:
        event = event or _Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.counter.wait("stream synchronize")

    def query(self) -> bool:
        return True


class _Event:
    """A CUDA event of the counter."""

    counter: HostCounter

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        self.counter.tally().stream_ops += 1

    def wait(self, stream: Any = None) -> None:
        self.counter.tally().stream_ops += 1

    def synchronize(self) -> None:
        self.counter.wait("event synchronize")

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: Any) -> float:
        return 0.0


_DEFAULT = threading.local()  # the calling thread's current stream


def _current_stream(device: Any = None) -> _Stream:
    current = getattr(_DEFAULT, "stream", None)
    if current is None:
        current = _DEFAULT.stream = _Stream(stream_id=0)
    return current


@contextmanager
def _on_stream(stream: Any) -> Iterator[None]:
    saved = _current_stream()
    _DEFAULT.stream = stream if stream is not None else saved
    try:
        yield
    finally:
        _DEFAULT.stream = saved


@contextmanager
def _cuda_runtime(counter: HostCounter) -> Iterator[None]:
    """``torch.cuda``'s streams, events, synchronisations and device queries, counted."""
    _Stream.counter = _Event.counter = counter
    doubles: dict[str, Any] = {
        "Stream": _Stream,
        "Event": _Event,
        "current_stream": _current_stream,
        "default_stream": _current_stream,
        "stream": _on_stream,
        "synchronize": lambda device=None: counter.wait("device synchronize"),
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "device_count": lambda: 1,
        "get_device_capability": lambda device=None: (9, 0),
    }
    saved = {name: getattr(torch.cuda, name) for name in doubles}
    for name, double in doubles.items():
        setattr(torch.cuda, name, double)
    tolist = FakeTensor.tolist

    def read_back(tensor: torch.Tensor) -> Any:
        """One wait, the shadow's values (a fake tensor reads itself element by element,
        each an operator of its own)."""
        counter.wait("tolist")
        return counter.fake.real(tensor).tolist()

    FakeTensor.tolist = read_back  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        FakeTensor.tolist = tolist  # type: ignore[method-assign]
        for name, original in saved.items():
            setattr(torch.cuda, name, original)
        _DEFAULT.__dict__.clear()


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    else:
        yield value
