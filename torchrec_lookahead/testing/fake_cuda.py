"""Fake CUDA tensors with real data behind them, for checking the CUDA path on a CPU build.

torch's ``FakeTensorMode`` makes CUDA tensors without CUDA: they carry shape,
dtype and device but no data, and operators check their devices as they do on
a GPU (a CUDA table indexed with a CPU index raises). A whole training step
also needs data, though: the stage reads a batch's ids back from the device to
plan it, FBGEMM reads counters with ``.item()``. :class:`FakeCuda` gives every
fake CUDA tensor a *shadow*, real memory on the CPU that each operator also
runs on, and keeps the host side real:

* an operator on CPU tensors only runs for real, as it would on the host;
* an operator that touches a CUDA tensor runs twice: under ``FakeTensorMode``
  (the device checks, the output's metadata) and on the shadows (the values);
  what it returns on the CPU (``.cpu()``, ``.item()``) is the real result;
* page-locked memory is emulated (a CPU build has none): ``pin_memory`` and
  ``is_pinned`` work, so the copies between host and device can be told apart
  (:attr:`FakeCuda.transfers`: pinned or pageable, blocking or not);
* indexing a CUDA tensor from Python (``t[1:3]``), which torch's CPU build
  refuses before any operator runs, is rewritten into the operators it stands
  for (so are ``.to``, ``.cuda``, ``.cpu``, ``contiguous`` and ``nonzero``);
  ``tolist`` reads the shadow
  (:mod:`~torchrec_lookahead.testing.fake_cuda_calls`);
* random fills of a CUDA tensor draw on the shadow (a CPU build has no CUDA
  generator), and FBGEMM's unified-memory tensors (UVM) are device memory of
  the size asked for (their meta kernel makes an empty one); FBGEMM's
  ``keyed_jagged_index_select_dim1``, which has a CUDA kernel only, runs on
  the shadows through FBGEMM's CPU ``permute_1D_sparse_data``
  (:mod:`~torchrec_lookahead.testing.fake_fbgemm`);
* a collective of CUDA tensors (on the ``cuda:fake`` process-group backend,
  which takes CUDA tensors only, as NCCL does, and moves no data) acts on the
  shadows as in a world whose every rank holds this rank's tensors: an
  all-gather gathers copies, an all-to-all gets this rank's own chunk from
  every rank, a sum is the world size times the value. A collective of CPU
  tensors runs for real, and fails there as under NCCL.

FBGEMM's training kernels (``split_embedding_*``) do not run on the shadows:
the CPU kernels read a CPU table layout, and a CUDA table is laid out for the
GPU. Their outputs' shadows are zero, and the kernels that a CPU build of
FBGEMM ships without a fake kernel get one (:data:`STUBBED`, from
:mod:`~torchrec_lookahead.testing.fake_fbgemm`). Autograd cannot record fake
CUDA tensors on a CPU build (the process aborts: autograd asks the missing
CUDA device guard for the current stream), so an operator that would record
one raises instead; steps run forward-only (``torch.no_grad()``).

Private torch names live in :mod:`torchrec_lookahead._compat`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchrec_lookahead._compat import (
    DATA_DEPENDENT,
    PIN_MEMORY,
    TO_COPY,
    UNIQUE,
    DispatchMode,
    fake_cuda_tensors,
    is_fake,
    real_tensors,
)
from torchrec_lookahead.testing.fake_cuda_calls import FakeCudaCalls
from torchrec_lookahead.testing.fake_fbgemm import (
    HOST_TWINS,
    STUBBED,
    UNIFIED_MEMORY,
    is_training_kernel,
    register_stubs,
)
from torchrec_lookahead.testing.threads import Teardown, in_new_threads

__all__ = ["STUBBED", "FakeCuda", "Transfer"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Transfer:
    """A copy between host memory and the device."""

    to_device: bool  # host to device (else device to host)
    pinned: bool  # the host side is page-locked
    non_blocking: bool
    thread: str

    @property
    def blocking(self) -> bool:
        """Whether the host waits for it: a copy from or to pageable memory, or one not
        asked to be asynchronous."""
        return not (self.pinned and self.non_blocking)


class FakeCuda:
    """A block in which ``device`` (``cuda:0``) tensors are fake, with real shadows.

    Use as a context manager; threads started inside the block use it too. The
    tensors made inside must not outlive it.
    """

    def __init__(self, device: torch.device | str = "cuda:0") -> None:
        self.device = torch.device(device)
        self.transfers: list[Transfer] = []
        self._fake = fake_cuda_tensors()
        self._lock = threading.RLock()  # one fake mode, used by every thread: one at a time
        self._shadows: dict[int, torch.Tensor] = {}  # id(fake storage) -> its bytes, real
        self._pinned: set[int] = set()  # id(storage) of emulated page-locked host memory
        self._active = False
        self._leave: Teardown | None = None  # the entering thread's modes, to exit
        self._threads: Any = None

    # ------------------------------------------------------------ the block

    def __enter__(self) -> FakeCuda:
        register_stubs()
        self._active = True
        self._leave = self._enter_thread()
        self._threads = in_new_threads(self._enter_thread)
        self._threads.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._active = False
        self._threads.__exit__(None, None, None)
        if self._leave is not None:
            self._leave()
            self._leave = None

    def _enter_thread(self) -> Teardown:
        """Route this thread's operators through the block (its modes are thread-local);
        returns what exits them, on this thread. The fake tensor mode stays entered below
        ours: torch skips initialising CUDA for a device argument only while one is (a CPU
        build has no CUDA to initialise)."""
        with self._lock:
            calls = FakeCudaCalls(self.device, self.real, lambda: self._active)
            modes = (self._fake, _Dispatch(self), calls)
            for mode in modes:
                mode.__enter__()

        def leave() -> None:
            with self._lock:
                for mode in reversed(modes):
                    mode.__exit__(None, None, None)

        return leave

    # ------------------------------------------------------------ shadows

    def real(self, tensor: torch.Tensor) -> torch.Tensor:
        """The real values of a fake tensor (its shadow, a view of real CPU memory)."""
        storage = tensor.untyped_storage()
        key = id(storage)
        buffer = self._shadows.get(key)
        if buffer is None:
            with self._lock, real_tensors():
                buffer = self._shadows.get(key)
                if buffer is None:
                    buffer = torch.zeros(storage.nbytes(), dtype=torch.uint8)
                    self._shadows[key] = buffer
                    weakref.finalize(storage, self._shadows.pop, key, None)
        with real_tensors():
            return buffer.view(tensor.dtype).as_strided(
                tensor.shape, tensor.stride(), tensor.storage_offset()
            )

    def _values(self, tensor: torch.Tensor) -> torch.Tensor:
        """The real values of ``tensor``: its shadow if fake, else itself."""
        return self.real(tensor) if is_fake(tensor) else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is (emulated) page-locked host memory."""
        return not is_fake(tensor) and id(tensor.untyped_storage()) in self._pinned

    def _pin(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self._pinned.add(id(storage))
        weakref.finalize(storage, self._pinned.discard, id(storage))
        return tensor

    # ------------------------------------------------------------ operators

    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run one operator: for real on the host, fake and on shadows on the device."""
        leaves = list(_leaves((args, kwargs)))
        fakes = [leaf for leaf in leaves if is_fake(leaf)]
        device = kwargs.get("device")
        onto = device is not None and torch.device(device).type == self.device.type
        if not fakes and not onto:
            return self._host(func, args, kwargs)
        if func is aten.record_stream.default:
            return None  # no caching allocator here; a stream checker sees these calls
        if func in UNIFIED_MEMORY:  # FBGEMM's UVM: memory of the device (its meta kernel is empty)
            like, sizes = args[0], args[1]
            with self._lock:
                return torch.empty(sizes, dtype=like.dtype, device=self.device)
        self._note_transfer(func, args, kwargs, onto)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        recorded = func is not aten.detach.default and any(t.requires_grad for t in tensors)
        if recorded and torch.is_grad_enabled():
            raise RuntimeError(
                f"{func} would record fake CUDA tensors for autograd, which aborts a CPU build "
                "of torch (it has no CUDA device guard): run fake CUDA steps under "
                "torch.no_grad()"
            )
        dependent, fake_out = func in _SHAPE_FROM_DATA, None
        if func in _RANDOM_IN_PLACE:  # a CPU build has no CUDA generator: the shadow draws
            fake_out = args[0]
        elif not dependent:
            with self._lock:  # the fake mode (entered below this one) is not thread-safe
                try:
                    fake_out = func(*args, **kwargs)
                except DATA_DEPENDENT:
                    dependent = True
        if func.namespace == "c10d":
            _collective_on_shadows(func, args, self._values)
            return _map2(fake_out, None, self._pair)
        real_out = None if is_training_kernel(func) else self._on_shadows(func, args, kwargs)
        if dependent:
            return _map(real_out, self._adopt)
        return _map2(fake_out, real_out, self._pair)

    def _host(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A host operator, for real; page-locked memory emulated."""
        if func is aten.is_pinned.default:
            return self.is_pinned(args[0])
        with real_tensors():
            if func is PIN_MEMORY:
                return self._pin(args[0].clone())
            if kwargs.get("pin_memory"):
                return self._pin(func(*args, **{**kwargs, "pin_memory": False}))
            return func(*args, **kwargs)

    def _on_shadows(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` on the shadows (the device's tensors replaced by their real values)."""

        def real(value: Any) -> Any:
            if is_fake(value):
                return self.real(value)
            if isinstance(value, torch.device) and value.type == self.device.type:
                return torch.device("cpu")
            return value

        real_args = _map(args, real)
        real_kwargs = {key: _map(value, real) for key, value in kwargs.items()}
        if "device" in real_kwargs and real_kwargs["device"] is not None:
            if torch.device(real_kwargs["device"]).type == self.device.type:
                real_kwargs["device"] = torch.device("cpu")
        real_kwargs.pop("pin_memory", None)
        with real_tensors():
            return HOST_TWINS.get(func, func)(*real_args, **real_kwargs)

    def _pair(self, fake: Any, real: Any) -> Any:
        """An output: a device tensor stays fake (its shadow filled if new); a host one is
        the real result."""
        if not isinstance(fake, torch.Tensor):
            return fake
        if fake.device.type == self.device.type:
            if id(fake.untyped_storage()) not in self._shadows and isinstance(real, torch.Tensor):
                shadow = self.real(fake)
                with real_tensors():
                    shadow.copy_(real)
            return fake
        if not isinstance(real, torch.Tensor):
            raise RuntimeError("a host tensor came out of an operator that did not run")
        return real

    def _adopt(self, real: Any) -> Any:
        """An output whose shape depends on the data (``nonzero``, ``.item()``): made from
        the real result, on the device."""
        if not isinstance(real, torch.Tensor):
            return real
        with self._lock:
            fake = torch.empty_strided(
                real.shape, real.stride(), dtype=real.dtype, device=self.device
            )
        with real_tensors():
            self.real(fake).copy_(real)
        return fake

    def _note_transfer(self, func: Any, args: tuple, kwargs: dict, onto: bool) -> None:
        """Log a copy between host and device (see :class:`Transfer`)."""
        thread = threading.current_thread().name
        if func is TO_COPY:
            source, non_blocking = args[0], bool(kwargs.get("non_blocking", False))
            if onto and not is_fake(source):
                self.transfers.append(Transfer(True, self.is_pinned(source), non_blocking, thread))
            elif is_fake(source) and kwargs.get("device") is not None:  # none: a dtype cast
                if torch.device(kwargs["device"]).type == "cpu":
                    self.transfers.append(Transfer(False, False, non_blocking, thread))
        elif func is aten.copy_.default:
            target, source = args[0], args[1]
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if is_fake(target) and not is_fake(source) and source.device.type == "cpu":
                self.transfers.append(Transfer(True, self.is_pinned(source), non_blocking, thread))
            elif is_fake(source) and not is_fake(target):
                self.transfers.append(Transfer(False, self.is_pinned(target), non_blocking, thread))

    def blocking_transfers(self) -> list[Transfer]:
        """The copies so far that made the host wait (see :attr:`Transfer.blocking`)."""
        return [t for t in self.transfers if t.blocking]


# Operators whose output shape depends on the data: made from the real result (the fake
# tensor mode refuses them, some with an error of the CPU build's own).
_SHAPE_FROM_DATA = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten.repeat_interleave.Tensor,
    UNIQUE,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
}


# Random fills in place: their output is their input (the values come from the shadow).
_RANDOM_IN_PLACE = {
    aten.uniform_.default,
    aten.normal_.default,
    aten.bernoulli_.float,
    aten.random_.default,
    aten.random_.to,
    aten.exponential_.default,
}


def _collective_on_shadows(
    func: Any, args: tuple, values: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """A collective's effect on the shadows (``values``) in a world of ranks alike (see the
    module): what every rank would receive if every rank sent what this one sends."""
    objects = [a for a in args if isinstance(a, torch.ScriptObject)]
    group = dist.ProcessGroup.unbox(objects[0])
    rank, world = group.rank(), group.size()
    reduce_op: Any = objects[1] if len(objects) > 1 else None  # a boxed ReduceOp
    times = world if reduce_op is not None and reduce_op.op() == dist.ReduceOp.SUM.value else 1
    name = func.name().split("::")[1]
    with real_tensors():
        if name in ("allreduce_", "allreduce_coalesced_"):
            for tensor in args[0]:
                values(tensor).mul_(times)
        elif name == "allgather_":
            for out in args[0][0]:
                values(out).copy_(values(args[1][0]))
        elif name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
            pairs = [(args[0], args[1])] if name == "_allgather_base_" else zip(args[0], args[1])
            for out, inp in pairs:
                mine = values(inp).reshape(-1)
                for chunk in values(out).view(-1).chunk(world):
                    chunk.copy_(mine)
        elif name == "alltoall_base_":
            out, inp, out_splits, in_splits = values(args[0]), values(args[1]), args[3], args[4]
            mine = inp.split(in_splits or inp.shape[0] // world)[rank]
            for chunk in out.split(out_splits or out.shape[0] // world):
                chunk.copy_(mine)
        elif name == "alltoall_":
            for out in args[0]:
                values(out).copy_(values(args[1][rank]))
        elif name == "reduce_scatter_":
            values(args[0][0]).copy_(values(args[1][0][rank]) * times)
        elif name == "_reduce_scatter_base_":
            out = values(args[0])
            out.copy_(values(args[1]).reshape(-1).chunk(world)[rank].view_as(out) * times)
        elif name not in ("broadcast_", "barrier"):  # a broadcast from a rank alike: as it is
            raise NotImplementedError(f"{func} of fake CUDA tensors")


class _Dispatch(DispatchMode):
    """Every operator of the thread, through :meth:`FakeCuda.dispatch`."""

    def __init__(self, owner: FakeCuda) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if not self.owner._active:
            return func(*args, **kwargs)
        return self.owner.dispatch(func, args, kwargs)


# ------------------------------------------------------------ nested values


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    else:
        yield value


def _map(value: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(value, (list, tuple)):
        mapped = [_map(item, fn) for item in value]
        return mapped if isinstance(value, list) else type(value)(mapped)
    return fn(value)


def _map2(first: Any, second: Any, fn: Callable[[Any, Any], Any]) -> Any:
    """``fn`` over the leaves of two values of one structure (``second`` may be ``None``)."""
    if isinstance(first, (list, tuple)):
        seconds = second if isinstance(second, (list, tuple)) else [None] * len(first)
        mapped = [_map2(a, b, fn) for a, b in zip(first, seconds)]
        return mapped if isinstance(first, list) else type(first)(mapped)
    return fn(first, second)
