"""Python calls on fake CUDA tensors that a CPU build of torch refuses, made of operators.

Under :class:`~torchrec_lookahead.testing.fake_cuda.FakeCuda`, every operator
on a CUDA tensor runs fake and on its shadow. Some Python calls never reach
an operator on a CPU build of torch: their bindings ask the missing CUDA
device guard first, and fail. :class:`FakeCudaCalls`, a function mode, runs
them as the operators they stand for:

* indexing (``t[1:3]``, ``t[idx] = v``): ints, slices, ``None``, ``...`` and
  one index tensor (or list), through ``select``, ``slice``, ``index`` and
  ``index_put_``;
* moves (``.to``, ``.cuda``, ``.cpu``) and ``torch.tensor`` / ``torch.as_tensor``
  made on the device, through ``_to_copy``;
* ``contiguous``, ``nonzero`` (``as_tuple`` too), and ``tolist``, which reads
  the shadow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from torchrec_lookahead._compat import TO_COPY, is_fake

__all__ = ["FakeCudaCalls"]

aten = torch.ops.aten


class FakeCudaCalls(TorchFunctionMode):
    """Python indexing and ``tolist`` of device tensors, which a CPU build refuses before
    dispatching (it asks the missing CUDA device guard first).

    Args:
        device: the fake device (``cuda:0``).
        real: the real values of a fake tensor (its shadow).
        active: whether the fake CUDA block is still open (else calls run as they are).
    """

    def __init__(
        self,
        device: torch.device,
        real: Callable[[torch.Tensor], torch.Tensor],
        active: Callable[[], bool],
    ) -> None:
        super().__init__()
        self.device = device
        self.real = real
        self.active = active

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not self.active() or not args:
            return func(*args, **kwargs)
        if name == "copy_" and any(is_fake(a) for a in args[:2]):
            # Tensor.copy_'s binding asks the CUDA device guard a CPU build lacks first
            return aten.copy_.default(*args, **kwargs)
        if is_fake(args[0]):
            if name == "__getitem__":
                return _getitem(args[0], args[1])
            if name == "__setitem__":
                return _setitem(args[0], args[1], args[2])
            if name == "tolist":
                return self.real(args[0]).tolist()
            if name == "nonzero":
                found = aten.nonzero.default(args[0])
                return found.unbind(1) if kwargs.get("as_tuple") else found
            if name == "contiguous":
                layout = args[1] if len(args) > 1 else kwargs.get("memory_format")
                layout = layout or torch.contiguous_format
                if args[0].is_contiguous(memory_format=layout):
                    return args[0]
                return aten.clone.default(args[0], memory_format=layout)
        if isinstance(args[0], torch.Tensor) and name in ("to", "cuda", "cpu"):
            moved = _move(self.device, args[0], name, args[1:], kwargs)
            if moved is not None:
                return moved
        elif name in ("tensor", "as_tensor") and "device" in kwargs:
            device = torch.device(kwargs["device"])
            if device.type == self.device.type:
                host = func(*args, **{**kwargs, "device": "cpu"})
                return TO_COPY(host, device=device)
        return func(*args, **kwargs)


def _move(
    fake_device: torch.device, tensor: torch.Tensor, name: str, args: tuple, kwargs: dict
) -> torch.Tensor | None:
    """``Tensor.to`` (``.cuda``, ``.cpu``) where the device is involved, through operators
    (a CPU build's binding asks the missing CUDA device guard first); else ``None``."""
    device, dtype, non_blocking, copy = _to_arguments(name, args, kwargs)
    fake = is_fake(tensor)
    if not fake and (device is None or device.type != fake_device.type):
        return None
    if device is None or device.type == tensor.device.type:
        if not copy and dtype in (None, tensor.dtype):
            return tensor
        return TO_COPY(tensor, dtype=dtype or tensor.dtype)
    return TO_COPY(tensor, dtype=dtype or tensor.dtype, device=device, non_blocking=non_blocking)


def _to_arguments(
    name: str, args: tuple, kwargs: dict
) -> tuple[torch.device | None, torch.dtype | None, bool, bool]:
    """The device, dtype, ``non_blocking`` and ``copy`` of a ``Tensor.to`` (``.cuda``,
    ``.cpu``) call."""
    device: torch.device | None = None
    if name != "to":
        device = torch.device(name if name == "cpu" else "cuda")
    dtype: torch.dtype | None = None
    flags: list[bool] = []
    for value in args:
        if isinstance(value, bool):
            flags.append(value)
        elif isinstance(value, int):
            device = torch.device("cuda", value)
        elif isinstance(value, (torch.device, str)):
            device = torch.device(value)
        elif isinstance(value, torch.dtype):
            dtype = value
        elif isinstance(value, torch.Tensor):
            device, dtype = value.device, value.dtype
    non_blocking = bool(kwargs.get("non_blocking", flags[0] if flags else False))
    copy = bool(kwargs.get("copy", flags[1] if len(flags) > 1 else False))
    if kwargs.get("device") is not None:
        device = torch.device(kwargs["device"])
    if kwargs.get("dtype") is not None:
        dtype = kwargs["dtype"]
    return device, dtype, non_blocking, copy


def _getitem(tensor: torch.Tensor, key: Any) -> torch.Tensor:
    """``tensor[key]`` through operators: ints, slices, ``None``, ``...`` and one index
    tensor (or list)."""
    keys = key if isinstance(key, tuple) else (key,)
    explicit = sum(1 for k in keys if k is not None and k is not Ellipsis)
    out, dim, advanced = tensor, 0, 0
    for k in keys:
        if k is Ellipsis:
            dim += tensor.dim() - explicit
        elif k is None:
            out, dim = out.unsqueeze(dim), dim + 1
        elif isinstance(k, bool):
            raise NotImplementedError("indexing a fake CUDA tensor with a bool")
        elif isinstance(k, int):
            out = out.select(dim, k)
        elif isinstance(k, slice):
            start, stop, step = k.indices(out.shape[dim])
            out, dim = aten.slice.Tensor(out, dim, start, max(start, stop), step), dim + 1
        else:
            index = (
                k if isinstance(k, torch.Tensor) else TO_COPY(torch.tensor(k), device=tensor.device)
            )
            advanced += 1
            if advanced > 1:
                raise NotImplementedError("indexing a fake CUDA tensor with two index tensors")
            out = aten.index.Tensor(out, [None] * dim + [index])
            dim += index.dim() if index.dtype != torch.bool else 1
    return out


def _setitem(tensor: torch.Tensor, key: Any, value: Any) -> None:
    """``tensor[key] = value`` through operators (keys as for :func:`_getitem`; an index
    tensor only alone)."""
    if isinstance(key, (torch.Tensor, list)):
        index = (
            key
            if isinstance(key, torch.Tensor)
            else TO_COPY(torch.tensor(key), device=tensor.device)
        )
        if not isinstance(value, torch.Tensor):
            value = torch.full((), value, dtype=tensor.dtype, device=tensor.device)
        aten.index_put_(tensor, [index], value)
        return
    view = _getitem(tensor, key)
    if isinstance(value, torch.Tensor):
        view.copy_(value)
    else:
        view.fill_(value)
