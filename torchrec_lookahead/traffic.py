"""Bytes the embedding collectives send, counted where c10d runs them.

While a :class:`CollectiveBytes` is active, every rank adds up what it sends
to the others through c10d, by kind:

* ``ids``: integer tensors of the embeddings' all-to-alls (ids, lengths,
  splits: the input all-to-all);
* ``pooled``: float tensors they send in a forward (pooled embeddings to their
  samples: all-to-all, all-gather, reduce-scatter);
* ``gradients``: float tensors they send in a backward (gradients back to the
  owners);
* ``hot_sync``: what the replicated hot rows exchange (sent under :func:`label`);
* ``other``: the rest sent under :func:`label` (the vote on a batch: 8 bytes);
* ``data_parallel`` and ``dense``: the gradient all-reduces of a model's
  ``DistributedDataParallel`` parts (TorchRec wraps data-parallel tables in
  their own, DMP the dense layers in one), named by a DDP comm hook
  (:func:`count_data_parallel`).

An all-reduce, broadcast or send outside :func:`label` is bookkeeping, not an
embedding's data (DDP's own, a checkpoint's metadata), and is not counted.

The operators are observed at c10d's dispatch
(:func:`~torchrec_lookahead._compat.observe_collectives`), so
``torch.distributed``'s functions stay torch's own, and every thread that
calls them (the stage's, the hot rows' reducer, DDP's) is seen alike. What a
rank sends: an all-to-all, its input less its own part; a ring all-reduce,
``2 (W - 1) / W`` of the tensor; a broadcast from it, the tensor to each other
rank; a ring all-gather or reduce-scatter, ``(W - 1) / W`` of the whole; a
send, the tensor.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from torchrec_lookahead._compat import data_parallel_parts, in_backward, observe_collectives
from torchrec_lookahead.metrics import EMBEDDING_KINDS, KINDS

__all__ = ["CollectiveBytes", "count_data_parallel", "label"]

_LABEL: contextvars.ContextVar[str | None] = contextvars.ContextVar("traffic_label", default=None)


@contextlib.contextmanager
def label(kind: str) -> Iterator[None]:
    """Count the collectives called inside as ``kind``, and name them so in a profile
    (``## lookahead:<kind> ##``, as TorchRec's comm ops name theirs)."""
    with _counted_as(kind), torch.profiler.record_function(f"## lookahead:{kind} ##"):
        yield


@contextlib.contextmanager
def _counted_as(kind: str) -> Iterator[None]:
    if kind not in KINDS:  # here, not inside the collective, which must never fail
        raise ValueError(f"unknown kind of traffic {kind!r}: one of {KINDS}")
    token = _LABEL.set(kind)
    try:
        yield
    finally:
        _LABEL.reset(token)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _group(script_object: Any) -> dist.ProcessGroup:
    return dist.ProcessGroup.unbox(script_object)


def _all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,  # noqa: A002 (the schema's names)
    process_group: Any,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    *_: Any,
) -> tuple[torch.Tensor, int]:
    group = _group(process_group)
    rows = input.shape[0] if input.dim() else 0
    per_row = _nbytes(input) // rows if rows else 0
    own = (input_split_sizes[group.rank()] if input_split_sizes else rows // group.size()) * per_row
    return input, _nbytes(input) - own


def _all_reduce(
    tensors: list[torch.Tensor], process_group: Any, *_: Any
) -> tuple[torch.Tensor, int]:
    world = _group(process_group).size()
    return tensors[0], sum(2 * (world - 1) * _nbytes(t) // world for t in tensors)


def _broadcast(
    tensors: list[torch.Tensor], process_group: Any, root_rank: int, *_: Any
) -> tuple[torch.Tensor, int]:
    group = _group(process_group)
    sending = group.rank() == root_rank
    return tensors[0], sum((group.size() - 1) * _nbytes(t) for t in tensors) if sending else 0


def _all_gather(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, process_group: Any, *_: Any
) -> tuple[torch.Tensor, int]:
    return input_tensor, (_group(process_group).size() - 1) * _nbytes(input_tensor)


def _reduce_scatter(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, process_group: Any, *_: Any
) -> tuple[torch.Tensor, int]:
    world = _group(process_group).size()
    return input_tensor, (world - 1) * _nbytes(input_tensor) // world


def _send(tensors: list[torch.Tensor], *_: Any) -> tuple[torch.Tensor, int]:
    return tensors[0], sum(_nbytes(t) for t in tensors)


# Per observed c10d operator: its main tensor and the bytes this rank sends, from its
# arguments (schemas as in torch 2.13 and 2.14).
_SENT: dict[str, Callable[..., tuple[torch.Tensor, int]]] = {
    "alltoall_base_": _all_to_all,
    "allreduce_": _all_reduce,
    "broadcast_": _broadcast,
    "_allgather_base_": _all_gather,
    "_reduce_scatter_base_": _reduce_scatter,
    "send": _send,
}
_EMBEDDING_DATA = {"alltoall_base_", "_allgather_base_", "_reduce_scatter_base_"}  # unlabelled


class CollectiveBytes:
    """Bytes this rank sends through c10d's collectives and sends, by kind.

    Use as a context manager around everything to count, on every thread (one at
    a time per process); ``bytes`` holds the totals by kind, ``calls`` the
    operators counted. The first one registers the observer of c10d's operators
    for the process's lifetime; while none is active it counts nothing.
    """

    _active: CollectiveBytes | None = None
    _observing = False
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(KINDS, 0)
        self.calls = dict.fromkeys(KINDS, 0)

    @property
    def embedding_total(self) -> int:
        """Everything the embeddings sent (the dense layers' all-reduce left out)."""
        return sum(self.bytes[kind] for kind in EMBEDDING_KINDS)

    def count(self, kind: str, sent: int) -> None:
        with self._lock:
            self.bytes[kind] += sent
            self.calls[kind] += 1

    def __enter__(self) -> CollectiveBytes:
        with CollectiveBytes._lock:
            if CollectiveBytes._active is not None:
                raise RuntimeError("collectives are being counted already")
            if not CollectiveBytes._observing:
                observe_collectives(list(_SENT), _observe)
                CollectiveBytes._observing = True
            CollectiveBytes._active = self
        return self

    def __exit__(self, *exc: object) -> None:
        with CollectiveBytes._lock:
            CollectiveBytes._active = None


def _observe(op: str, args: tuple[Any, ...]) -> None:
    """Count one c10d operator's bytes in the active counter (called before it runs)."""
    counter = CollectiveBytes._active
    kind = _LABEL.get()
    if counter is None or (kind is None and op not in _EMBEDDING_DATA):
        return
    tensor, sent = _SENT[op](*args)
    if kind is None:
        if not tensor.is_floating_point():
            kind = "ids"
        else:  # a float tensor sent while autograd runs a backward node is a gradient
            kind = "gradients" if in_backward() else "pooled"
    counter.count(kind, sent)


def count_data_parallel(model: torch.nn.Module) -> None:
    """Name the gradient all-reduces of ``model``'s ``DistributedDataParallel`` parts for
    :class:`CollectiveBytes`: ``dense`` for DMP's (the dense layers), ``data_parallel``
    for those TorchRec wraps data-parallel tables in. Installs DDP's own all-reduce hook
    on each (gradients divided by the world size, then summed) under that name."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    for ddp, kind in data_parallel_parts(model):

        def hook(group, bucket, kind=kind):  # noqa: ANN001, ANN202
            # (no annotations: DDP checks them, and this module's are strings)
            with _counted_as(kind):
                return allreduce_hook(group, bucket)

        ddp.register_comm_hook(ddp.process_group, hook)
