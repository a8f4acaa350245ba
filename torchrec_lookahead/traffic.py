"""Bytes the embedding collectives send, counted where ``torch.distributed`` sends them.

:class:`CollectiveBytes` wraps the collectives TorchRec's and this project's
embedding modules call (``all_to_all_single``, ``all_reduce``, ``broadcast``,
``all_gather_into_tensor``, ``reduce_scatter_tensor``) while it is active, and
adds up what each rank sends to the others, by kind:

* ``ids``: integer tensors (ids, lengths, splits: the input all-to-all);
* ``pooled``: float tensors sent in a forward (pooled embeddings to their samples);
* ``gradients``: float tensors sent in a backward (their gradients back to the owners);
* ``hot_sync``: what the replicated hot rows exchange (sent under :func:`label`);
* ``other``: the rest sent under :func:`label` (the vote on a batch: 8 bytes);
* ``data_parallel`` and ``dense``: the gradient all-reduces of a model's
  ``DistributedDataParallel`` parts (TorchRec wraps data-parallel tables in
  their own, DMP the dense layers in one), seen through a DDP comm hook
  (:func:`count_data_parallel`).

What a rank sends: an all-to-all, its input less its own part; a ring
all-reduce, ``2 (W - 1) / W`` of the tensor; a broadcast from it, the tensor
to each other rank; a ring all-gather or reduce-scatter, ``(W - 1) / W`` of
the whole.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from torchrec_lookahead._compat import data_parallel_parts, in_backward
from torchrec_lookahead.metrics import EMBEDDING_KINDS, KINDS

__all__ = [
    "CollectiveBytes",
    "count_data_parallel",
    "count_sent",
    "label",
]

_LABEL: contextvars.ContextVar[str | None] = contextvars.ContextVar("traffic_label", default=None)
_UNCOUNTED = "uncounted"  # a collective counted already (DDP's, by its hook)
# torch's own collectives, which the counter's stand-ins call (kept: a thread may still
# hold a stand-in after the counter closed).
_TORCH: dict[str, Callable[..., Any]] = {
    name: getattr(dist, name)
    for name in (
        "all_to_all_single",
        "all_reduce",
        "broadcast",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
    )
}


@contextlib.contextmanager
def label(kind: str) -> Iterator[None]:
    """Count the collectives called inside as ``kind``, and name them so in a profile
    (``## lookahead:<kind> ##``, as TorchRec's comm ops name theirs)."""
    with _counted_as(kind), torch.profiler.record_function(f"## lookahead:{kind} ##"):
        yield


@contextlib.contextmanager
def _counted_as(kind: str) -> Iterator[None]:
    token = _LABEL.set(kind)
    try:
        yield
    finally:
        _LABEL.reset(token)


def count_sent(kind: str, tensor: torch.Tensor) -> None:
    """Count ``tensor`` as sent to one other rank (a point-to-point send), as ``kind``."""
    counter = CollectiveBytes.active()
    if counter is not None:
        counter.count(kind, _nbytes(tensor))


def _world(group: Any) -> int:
    return dist.get_world_size(group)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class CollectiveBytes:
    """Bytes this rank sends through ``torch.distributed`` collectives, by kind.

    Use as a context manager around everything to count, on every thread (one at
    a time per process); ``bytes`` holds the totals by kind, ``calls`` the
    collectives counted. A collective another thread is entering as the counter
    closes still runs (through torch's own function), uncounted.
    """

    _active: CollectiveBytes | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(KINDS, 0)
        self.calls = dict.fromkeys(KINDS, 0)

    @property
    def embedding_total(self) -> int:
        """Everything the embeddings sent (the dense layers' all-reduce left out)."""
        return sum(self.bytes[kind] for kind in EMBEDDING_KINDS)

    def _add(self, tensor: torch.Tensor, sent: int) -> None:
        kind = _LABEL.get()
        if kind == _UNCOUNTED or CollectiveBytes._active is not self:
            return
        if kind is None:
            if not tensor.is_floating_point():
                kind = "ids"
            else:  # a float tensor sent while autograd runs a backward node is a gradient
                kind = "gradients" if in_backward() else "pooled"
        self.count(kind, sent)

    def count(self, kind: str, sent: int) -> None:
        with self._lock:
            self.bytes[kind] += sent
            self.calls[kind] += 1

    @classmethod
    def active(cls) -> CollectiveBytes | None:
        """The counter counting now, if any."""
        return cls._active

    def _all_to_all_single(
        self,
        output,
        input,
        output_split_sizes=None,
        input_split_sizes=None,  # noqa: ANN001
        group=None,
        **kwargs,
    ):
        world, rank = _world(group), dist.get_rank(group)
        rows = input.shape[0] if input.dim() else 0
        per_row = _nbytes(input) // rows if rows else 0
        own = (input_split_sizes[rank] if input_split_sizes else rows // world) * per_row
        self._add(input, _nbytes(input) - own)
        return _TORCH["all_to_all_single"](
            output, input, output_split_sizes, input_split_sizes, group, **kwargs
        )

    def _all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, **kwargs):  # noqa: ANN001
        world = _world(group)
        self._add(tensor, 2 * (world - 1) * _nbytes(tensor) // world)
        return _TORCH["all_reduce"](tensor, op, group, **kwargs)

    def _broadcast(self, tensor, src=None, group=None, **kwargs):  # noqa: ANN001
        world = _world(group)
        sending = dist.get_rank() == src
        self._add(tensor, (world - 1) * _nbytes(tensor) if sending else 0)
        return _TORCH["broadcast"](tensor, src, group, **kwargs)

    def _all_gather_into_tensor(self, output, input, group=None, **kwargs):  # noqa: ANN001
        self._add(input, (_world(group) - 1) * _nbytes(input))
        return _TORCH["all_gather_into_tensor"](output, input, group, **kwargs)

    def _reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None, **kwargs):  # noqa: ANN001
        world = _world(group)
        self._add(input, (world - 1) * _nbytes(input) // world)
        return _TORCH["reduce_scatter_tensor"](output, input, op, group, **kwargs)

    def __enter__(self) -> CollectiveBytes:
        with CollectiveBytes._lock:
            if CollectiveBytes._active is not None:
                raise RuntimeError("collectives are being counted already")
            CollectiveBytes._active = self
        for name in _TORCH:
            setattr(dist, name, getattr(self, f"_{name}"))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in _TORCH.items():
            setattr(dist, name, original)
        with CollectiveBytes._lock:
            CollectiveBytes._active = None


def count_data_parallel(model: torch.nn.Module) -> None:
    """Count the gradient all-reduces of ``model``'s ``DistributedDataParallel`` parts
    whenever a :class:`CollectiveBytes` is active: ``dense`` for DMP's (the dense
    layers), ``data_parallel`` for those TorchRec wraps data-parallel tables in.
    Installs DDP's own all-reduce hook on each (gradients divided by the world size,
    then summed)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    for ddp, kind in data_parallel_parts(model):

        def hook(group, bucket, kind=kind):  # noqa: ANN001, ANN202
            # (no annotations: DDP checks them, and this module's are strings)
            counter = CollectiveBytes.active()
            if counter is not None:
                world = _world(group)
                counter.count(kind, 2 * (world - 1) * _nbytes(bucket.buffer()) // world)
            with _counted_as(_UNCOUNTED):
                return allreduce_hook(group, bucket)

        ddp.register_comm_hook(ddp.process_group, hook)
