"""Checking CUDA code on the CPU: torch's fake tensors, every operator dispatched to Python."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import TorchDispatchMode as DispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils._python_dispatch import _pop_mode_temporarily as outside_dispatch_mode

__all__ = [
    "DATA_DEPENDENT",
    "DispatchMode",
    "FakeTensor",
    "ITEM",
    "PIN_MEMORY",
    "TO_COPY",
    "UNIQUE",
    "fake_cuda_tensors",
    "fake_store",
    "has_fake_kernel",
    "is_fake",
    "modes_entered",
    "op_schema",
    "outside_dispatch_mode",
    "real_tensors",
]


def modes_entered() -> tuple[int, int]:
    """How many dispatch modes and torch function modes the calling thread is in (torch
    keeps both stacks per thread, behind private names)."""
    return len(_get_current_dispatch_mode_stack()), len(_get_current_function_mode_stack())


def fake_cuda_tensors() -> Any:
    """torch's ``FakeTensorMode`` (tensors without data, CUDA ones on a CPU build; device
    mismatches raise as on a GPU): the tests check the CUDA path with it. It lives in the
    private ``torch._subclasses``. This one may serve several threads (the pipeline's)."""
    return _PerThreadFakeTensorMode(allow_non_fake_inputs=True)


class _PerThreadFakeTensorMode(FakeTensorMode):
    """``FakeTensorMode`` whose ``in_kernel_invocation`` flag is the calling thread's.

    While a fake kernel runs, torch sets the flag on the mode and every fake tensor of
    the mode then reports the ``meta`` device; torch keeps the matching dispatch state per
    thread, but the flag per mode, so another thread's tensors turned ``meta`` meanwhile.
    """

    @property
    def in_kernel_invocation(self) -> bool:
        return bool(getattr(self._flag(), "value", False))

    @in_kernel_invocation.setter
    def in_kernel_invocation(self, value: bool) -> None:
        self._flag().value = value

    def _flag(self) -> threading.local:
        flag = self.__dict__.get("_per_thread")
        if flag is None:
            flag = self.__dict__["_per_thread"] = threading.local()
        return flag


# Checking CUDA code on the CPU (torchrec_lookahead.testing): torch's fake tensors and the
# dispatch of every operator to Python. Neither has a public home: FakeTensorMode lives in
# the private ``torch._subclasses``, TorchDispatchMode (``DispatchMode`` here) in
# ``torch.utils._python_dispatch``, an operator's schema (which arguments it writes) in
# ``OpOverload._schema``.

DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)
"""What a fake tensor's operator raises when its output depends on the data."""

# ATen's underscored operators the fake CUDA tool handles itself: the copy every ``.to()``
# comes down to (issued directly: a CPU build's binding of ``.to`` asks the CUDA device guard
# it lacks first), the page-locking copy behind ``pin_memory()`` (emulated: a CPU build has
# no page-locked memory) and ``unique`` (its output's shape depends on the data).
TO_COPY = torch.ops.aten._to_copy.default
PIN_MEMORY = torch.ops.aten._pin_memory.default
UNIQUE = torch.ops.aten._unique2.default
ITEM = torch.ops.aten._local_scalar_dense.default  # what Tensor.item() dispatches to


def is_fake(value: Any) -> bool:
    """Whether ``value`` is a fake tensor (no data; see :func:`fake_cuda_tensors`)."""
    return isinstance(value, FakeTensor)


def real_tensors() -> Any:
    """A block in which no fake tensor mode is active: factories make real tensors."""
    return unset_fake_temporarily()


def op_schema(func: Any) -> Any:
    """An operator's schema: its arguments, and which of them it writes (``alias_info``)."""
    return func._schema


def has_fake_kernel(name: str) -> bool:
    """Whether operator ``name`` (``"namespace::op"``) has a kernel for fake tensors: a
    CUDA build of FBGEMM registers them for its TBE kernels, a CPU build does not."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta")


def fake_store() -> Any:
    """torch's store for the ``cuda:fake`` process-group backend (takes CUDA tensors only,
    as NCCL does; no communication), from the private ``torch.testing._internal``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()
