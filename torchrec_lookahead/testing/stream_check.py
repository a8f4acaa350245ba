"""A checker of the rule CUDA's stream sanitizer enforces, run on the CPU.

On a GPU, work queued on different streams runs in any order unless an event
orders it. CUDA's sanitizer (``TORCH_CUDA_SANITIZER=1``) reports a kernel that
reads or writes memory another stream wrote (or, for a write, read) with no
event wait between them; the caching allocator adds a second rule: memory
allocated on one stream and used on another must be marked with
``record_stream`` (or the allocating stream must wait for the use) before it is
freed, or it is handed out again while the other stream may still use it.

:class:`StreamChecker` enforces both on the CPU, through the package's own
stream abstraction (:mod:`torchrec_lookahead.streams`): it is the stream
backend while it is active, so it sees every stream the package makes (the
side stream, the stage's) and every event recorded, waited for and
synchronised, and every ``record_stream``; a dispatch mode in every thread sees
every operator, which runs on its thread's current stream (the trainer's
stream, the device's default, outside any stream block). It keeps a vector
clock per stream and, per block of memory, which stream last wrote it and
which read it since (:mod:`~torchrec_lookahead.testing.races`). What an
operator reads and writes comes from its schema
(:mod:`~torchrec_lookahead.testing.operator_access`); index operators
(``index_copy_``, ``index_select``) and FBGEMM's TBE kernels are followed row
by row: the side stream moves rows into the cache while the trainer's step
reads other rows of the same tables, which is ordered by the plan, not by
events.

It checks device memory: CUDA tensors (fake ones, see
:mod:`~torchrec_lookahead.testing.fake_cuda`) when the device is CUDA; on the
CPU, every CPU tensor except host memory the package declares
(``streams.host_side``: the backing store, staging buffers). Use it as a
context manager (a pytest fixture is ``with StreamChecker() as checker: yield
checker``, as in ``tests/test_exactness.py``); leaving the block raises
:class:`StreamError` with every violation found. It also keeps every wait for
an event, by a stream or by the host (:attr:`StreamChecker.waits`), so that a
test can ask what a thread waited for: how much of each stream's work.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

import torchrec_lookahead.streams as streams
from torchrec_lookahead._compat import DispatchMode
from torchrec_lookahead.testing.operator_access import OperatorAccesses, tensors_in
from torchrec_lookahead.testing.races import TrackedStorage, Use
from torchrec_lookahead.testing.threads import Teardown, in_new_threads, on_start

__all__ = ["CheckedStream", "StreamChecker", "StreamError", "Wait"]

aten = torch.ops.aten
TRAINER = 0  # the device's default stream: the trainer's, and any thread's outside a block
_TOKEN_BASE = 1 << 20  # stream ids of the torch.Stream tokens handed to record_stream
_PACKAGE = "torchrec_lookahead"


class StreamError(AssertionError):
    """Device memory used across streams without the ordering CUDA needs."""


class _Event:
    """An event: its stream, and that stream's clock when it was recorded."""

    def __init__(self, checker: StreamChecker, stream: int, clock: dict[int, int]) -> None:
        self._checker = checker
        self.stream = stream
        self.clock = clock

    def synchronize(self) -> None:
        self._checker.synchronize(self)


@dataclass(frozen=True)
class Wait:
    """A wait for an event, as the checker saw it (:attr:`StreamChecker.waits`)."""

    thread: str  # the thread that called it
    waiter: int | None  # the stream made to wait; None: the host (a synchronisation)
    stream: int  # the stream the event was recorded on
    clock: dict[int, int]  # the event's clock: per stream, how much of its work it follows
    site: str  # where in the package it was called

    def follows(self, stream: int) -> int:
        """How many of ``stream``'s operators the waited-for event comes after."""
        return self.clock.get(stream, 0)


class CheckedStream(streams.SideStream):
    """A stream of the checker: work runs at once, attributed to this stream."""

    def __init__(self, checker: StreamChecker, device: torch.device, role: str) -> None:
        self.device = device
        self.role = role
        self._checker = checker
        self.id = checker.new_stream(role)

    def run(self, work: Callable[[], None]) -> None:
        with self.context():
            work()

    def context(self) -> Any:
        return self._checker.on(self.id)

    def record(self) -> Any:
        return self._checker.record(self.id)

    def wait_for(self, event: Any) -> None:
        if event is not None:
            self._checker.wait(self.id, event)

    def current_waits(self, event: Any) -> None:
        if event is not None:
            self._checker.wait(self._checker.current(), event)

    def drain(self) -> None:
        self._checker.synchronize(self.record())


class StreamChecker(streams.StreamBackend):
    """Checks the ordering of device memory across streams (see the module).

    Args:
        device: the device whose memory is checked (``cuda`` with fake CUDA tensors).
        values: the values of an index tensor on that device (for fake tensors:
            ``FakeCuda.real``); by default the tensor itself.
        intra_op_threads: torch's intra-op threads for the entering thread meanwhile.
            Under a dispatch mode, a CPU kernel that runs on several threads crawls
            (FBGEMM's TBE backward: 2.8 ms -> 78 ms, measured on the 2-core machine), and
            the pipeline's own threads run one anyway. ``None`` leaves it as it is.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        values: Callable[[torch.Tensor], torch.Tensor] | None = None,
        intra_op_threads: int | None = 1,
    ) -> None:
        self.device = torch.device(device)
        self._intra_op = intra_op_threads
        self._saved_threads = torch.get_num_threads()
        self.errors: list[str] = []
        self.operators = 0  # operators seen on checked memory
        self.waits: list[Wait] = []  # every event waited for, by a stream or the host
        self._accesses = OperatorAccesses(values or (lambda tensor: tensor))
        self._names = ["the trainer's stream (the default stream)"]
        self._clocks: list[dict[int, int]] = [{TRAINER: 0}]
        self._local = threading.local()
        self._tracks: dict[int, TrackedStorage] = {}
        self._host: set[int] = set()
        self._lock = threading.RLock()
        self._active = False
        self._leave: Teardown | None = None  # the entering thread's watch, to stop
        self._blocks: list[Any] = []
        self._inherited: dict[threading.Thread, dict[int, int]] = {}

    # ------------------------------------------------------------ the block

    def __enter__(self) -> StreamChecker:
        self._active = True
        self._saved_threads = torch.get_num_threads()
        if self._intra_op is not None:
            torch.set_num_threads(self._intra_op)
        backend = streams.use_backend(self)
        backend.__enter__()
        starts = on_start(self._starting)
        starts.__enter__()
        threads = in_new_threads(self._enter_thread)
        threads.__enter__()
        self._blocks = [backend, starts, threads]
        self._leave = self._enter_thread()
        return self

    def __exit__(self, *exc: object) -> None:
        self._active = False
        for block in reversed(self._blocks):
            block.__exit__(None, None, None)
        if self._leave is not None:
            self._leave()
            self._leave = None
        torch.set_num_threads(self._saved_threads)
        if exc[0] is None:
            self.check()

    def _starting(self, thread: threading.Thread) -> None:
        """A thread is being started: it will know what its starter's host knows now (the
        streams it has synchronised with), as on a GPU."""
        with self._lock:
            self._inherited[thread] = dict(self._host_clock())

    def _enter_thread(self) -> Teardown:
        """Watch this thread's operators; returns what stops it, on this thread."""
        with self._lock:
            self._local.host = self._inherited.pop(threading.current_thread(), {})
        mode = _Watch(self)
        mode.__enter__()
        return lambda: mode.__exit__(None, None, None)

    def check(self) -> None:
        """Raise :class:`StreamError` if anything was found so far."""
        if self.errors:
            found = len(self.errors)
            shown = "\n\n".join(self.errors[:5])
            more = f"\n\n... and {found - 5} more" if found > 5 else ""
            raise StreamError(f"{found} stream ordering violation(s):\n\n{shown}{more}")

    # ------------------------------------------------------------ the backend

    def make(self, device: torch.device, role: str) -> streams.SideStream:
        return CheckedStream(self, device, role)

    def mark(self, device: torch.device) -> Any:
        return self.record(self.current())

    def current_device(self, device: torch.device) -> int:
        return 0

    def record_use(self, parts: Iterable[Any], device: torch.device) -> None:
        stream = self.current()
        for part in parts:
            if isinstance(part, torch.Tensor):
                self.record_stream(part, stream)
            else:  # TorchRec's objects call record_stream on their tensors with this token
                part.record_stream(self._token(stream))

    def host_side(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "cpu":
            key = id(tensor.untyped_storage())
            with self._lock:
                self._host.add(key)
                self._tracks.pop(key, None)
            weakref.finalize(tensor.untyped_storage(), self._host.discard, key)

    # ------------------------------------------------------------ streams and events

    def new_stream(self, role: str) -> int:
        with self._lock:
            same = sum(1 for name in self._names if name.startswith(f"the {role} stream"))
            self._names.append(f"the {role} stream" + (f" #{same + 1}" if same else ""))
            self._clocks.append({len(self._clocks): 0})
            return len(self._clocks) - 1

    def current(self) -> int:
        """The calling thread's current stream."""
        return getattr(self._local, "stream", TRAINER)

    @contextmanager
    def on(self, stream: int) -> Iterator[None]:
        """A block whose operators run on ``stream``."""
        previous = self.current()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def record(self, stream: int) -> _Event:
        with self._lock:
            clock = self._clocks[stream]
            _merge(clock, self._host_clock())
            return _Event(self, stream, dict(clock))

    def wait(self, stream: int, event: _Event) -> None:
        with self._lock:
            _merge(self._clocks[stream], event.clock)
            self._log(stream, event)

    def synchronize(self, event: _Event) -> None:
        """The host waits for ``event``: work this thread queues later comes after it."""
        with self._lock:
            _merge(self._host_clock(), event.clock)
            self._log(None, event)

    def _log(self, waiter: int | None, event: _Event) -> None:
        thread = threading.current_thread().name
        self.waits.append(Wait(thread, waiter, event.stream, dict(event.clock), _where()))

    def _host_clock(self) -> dict[int, int]:
        clock = getattr(self._local, "host", None)
        if clock is None:
            clock = self._local.host = {}
        return clock

    def _token(self, stream: int) -> torch.Stream:
        return torch.Stream(stream_id=_TOKEN_BASE + stream, device_index=0, device_type=0)

    # ------------------------------------------------------------ memory

    def checked(self, tensor: Any) -> bool:
        """Whether ``tensor``'s memory is checked (device memory, see the module)."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != self.device.type:
            return False
        return id(tensor.untyped_storage()) not in self._host

    def recorded_streams(self, tensor: torch.Tensor) -> set[str]:
        """The streams ``tensor``'s memory was marked as used on (``record_stream``)."""
        with self._lock:
            track = self._tracks.get(id(tensor.untyped_storage()))
            return {self._names[s] for s in track.recorded} if track is not None else set()

    def streams_named(self, role: str) -> list[int]:
        """The streams made for ``role`` (see :func:`torchrec_lookahead.streams.new_stream`)."""
        with self._lock:
            named = f"the {role} stream"
            return [i for i, name in enumerate(self._names) if name.startswith(named)]

    def stream_name(self, stream: int) -> str:
        """How messages name stream ``stream`` (``TRAINER``: the trainer's)."""
        return self._names[stream]

    def record_stream(self, tensor: torch.Tensor, stream: int) -> None:
        """``tensor.record_stream(stream)``: its memory is not reused before ``stream`` is
        done with what it queued so far."""
        if self.checked(tensor):
            with self._lock:
                self._track(tensor, None).recorded.add(stream)

    def _track(self, tensor: torch.Tensor, made: tuple[int, int, str] | None) -> TrackedStorage:
        storage = tensor.untyped_storage()
        key = id(storage)
        track = self._tracks.get(key)
        if track is None:
            what = f"a {str(tensor.dtype).replace('torch.', '')} tensor {list(tensor.shape)}"
            if made is not None:
                what += f" made by {made[2]} on {self._names[made[0]]}"
            track = self._tracks[key] = TrackedStorage(what, made)
            weakref.finalize(storage, self._freed, key)
        return track

    def _freed(self, key: int) -> None:
        """A storage is freed: every stream that used it is done, or was recorded."""
        with self._lock:
            track = self._tracks.pop(key, None)
            if track is None or track.alloc is None or not self._active:
                return
            made_on = track.alloc[0]
            known = dict(self._clocks[made_on])
            _merge(known, self._host_clock())
            for stream, (seq, op) in track.users.items():
                if stream == made_on or stream in track.recorded or known.get(stream, 0) >= seq:
                    continue
                self.errors.append(
                    f"{track.what} was freed while {self._names[stream]} may still use it "
                    f"(last there: {op}); its memory goes back to {self._names[made_on]}, "
                    f"which may hand it out again at once: record_stream it on "
                    f"{self._names[stream]}, or make {self._names[made_on]} wait for that use\n"
                    f"  freed at: {_where()}"
                )

    # ------------------------------------------------------------ operators

    def operator(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run one operator, checking and recording its accesses to device memory."""
        if func is aten.record_stream.default:
            stream = args[1].stream_id - _TOKEN_BASE if isinstance(args[1], torch.Stream) else 0
            self.record_stream(args[0], stream if stream >= 0 else self.current())
            return None
        whole, rows = self._accesses.of(func, args, kwargs)
        whole = [(t, write) for t, write in whole if self.checked(t)]
        rows = [(t, keys, write) for t, keys, write in rows if self.checked(t)]
        if not whole and not rows:
            out = func(*args, **kwargs)
            self._made(out, func, None)
            return out
        name = self._accesses.name(func)
        with self._lock:
            self.operators += 1
            stream = self.current()
            clock = self._clocks[stream]
            _merge(clock, self._host_clock())
            clock[stream] += 1
            seq = clock[stream]
            use = Use(stream, seq, dict(clock), name)
            found: list[str] = []
            for tensor, write in whole:
                self._track(tensor, None).use_whole(use, write, self._names, found)
            for tensor, keys, write in rows:
                self._track(tensor, None).use_rows(keys, use, write, self._names, found)
            if found:
                where = _where()
                self.errors.extend(f"{message}\n  at: {where}" for message in found)
        out = func(*args, **kwargs)
        self._made(out, func, (stream, seq, name))
        return out

    def _made(self, out: Any, func: Any, made: tuple[int, int, str] | None) -> None:
        """Outputs in new memory: allocated on the current stream, written by ``func``
        (a view's or an in-place operator's output is memory of its input)."""
        if self._accesses.aliased_returns(func):
            return
        outputs = [t for t in tensors_in(out) if self.checked(t)]
        if not outputs:
            return
        with self._lock:
            if made is None:
                stream = self.current()
                clock = self._clocks[stream]
                _merge(clock, self._host_clock())
                clock[stream] += 1
                made = (stream, clock[stream], self._accesses.name(func))
            for tensor in outputs:
                if id(tensor.untyped_storage()) not in self._tracks:
                    track = self._track(tensor, made)
                    track.whole.write = made
                    track.users[made[0]] = (made[1], made[2])


class _Watch(DispatchMode):
    """Every operator of the thread, through :meth:`StreamChecker.operator`."""

    def __init__(self, checker: StreamChecker) -> None:
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if not self.checker._active:
            return func(*args, **kwargs)
        return self.checker.operator(func, args, kwargs)


def _merge(into: dict[int, int], other: dict[int, int]) -> None:
    for stream, seq in other.items():
        if into.get(stream, 0) < seq:
            into[stream] = seq


def _where() -> str:
    """The innermost frames of the package (outside its testing tools) on the stack."""
    frames: list[str] = []
    frame = inspect.currentframe()
    while frame is not None and len(frames) < 3:
        path = frame.f_code.co_filename
        if _PACKAGE in path and "/testing/" not in path:
            frames.append(
                f"{path.split(_PACKAGE + '/')[-1]}:{frame.f_lineno} ({frame.f_code.co_name})"
            )
        frame = frame.f_back
    return " <- ".join(frames) or "outside the package"
