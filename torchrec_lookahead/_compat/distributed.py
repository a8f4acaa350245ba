"""torch.distributed: the data-parallel parts of a model, observing collectives, sharded tensors."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

__all__ = [
    "Shard",
    "ShardedTensor",
    "data_parallel_parts",
    "destroy_group",
    "in_backward",
    "live_groups",
    "observe_collectives",
    "sharded_tensor_from_shards",
]


def destroy_group(group: dist.ProcessGroup | None) -> None:
    """Destroy ``group``, a process group the library made, unless it is already gone
    (``None``, or destroyed with every group: the world destroyed, maybe made anew)."""
    if group is None or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group(group)
    except ValueError:  # "Invalid process group specified": not this world's
        pass


def live_groups() -> set[dist.ProcessGroup]:
    """Every process group torch.distributed holds now, the world's included (its private
    registry: what tests and the differential harness check a pipeline leaves behind)."""
    return set(dist.distributed_c10d._world.pg_names)


def data_parallel_parts(model: torch.nn.Module) -> list[tuple[Any, str]]:
    """Every ``DistributedDataParallel`` in ``model`` and what it holds: ``"dense"`` for
    DMP's (the dense layers), ``"data_parallel"`` for those TorchRec's sharded collections
    wrap their data-parallel tables' lookups in (kept in the private ``_lookups`` list,
    which ``modules()`` does not reach)."""
    from torch.nn.parallel import DistributedDataParallel

    found: list[tuple[Any, str]] = []
    for module in model.modules():
        found += [
            (m, "data_parallel")
            for m in getattr(module, "_lookups", [])
            if isinstance(m, DistributedDataParallel)
        ]
        if isinstance(module, DistributedDataParallel):
            found.append((module, "dense"))
    return found


_OBSERVERS: list[torch.library.Library] = []  # registrations live as long as the process


def observe_collectives(
    names: Sequence[str], observer: Callable[[str, tuple[Any, ...]], None]
) -> None:
    """Call ``observer(name, args)`` on the calling thread before every call of the c10d
    operators ``names`` (``"allreduce_"``, ``"send"``, ...) made through the dispatcher
    with autograd on: ``torch.distributed``'s functions, a process group's methods,
    DDP's reducer (not functional collectives, which run below autograd, nor calls made
    under ``torch.inference_mode``).

    It is a kernel of the ``Autograd`` key (``torch.library``; c10d registers none
    there), which calls the observer and then the operator's kernels below autograd:
    ``torch.distributed`` stays as it is, and only these operators pass through Python,
    not every operator of a thread (as a dispatch mode would). The keyset below
    autograd is private to torch. An error in the observer is warned about once and
    the collective still runs (a rank that skipped one would hang the others).
    Register before other threads issue collectives: the dispatcher's table is not
    safe to change while another thread dispatches. The registration lasts until the
    interpreter exits, so call this once per operator.
    """
    library = torch.library.Library("c10d", "IMPL")
    below_autograd = torch._C._after_autograd_keyset
    failed: list[BaseException] = []

    for name in names:
        op = getattr(torch.ops.c10d, name).default

        def kernel(keyset: Any, *args: Any, _op: Any = op, _name: str = name) -> Any:
            try:
                observer(_name, args)
            except Exception as error:
                if not failed:
                    failed.append(error)
                    warnings.warn(f"observing c10d's {_name} failed: {error!r}", stacklevel=2)
            return _op.redispatch(keyset & below_autograd, *args)

        library.impl(name, kernel, "Autograd", with_keyset=True)
    _OBSERVERS.append(library)


def in_backward() -> bool:
    """Whether this thread runs an autograd backward node now (torch tells only through
    the private ``torch._C._current_autograd_node``)."""
    return torch._C._current_autograd_node() is not None


def sharded_tensor_from_shards(shards: list[Shard], like: ShardedTensor) -> ShardedTensor:
    """A ``ShardedTensor`` of ``shards`` with ``like``'s metadata and process group.
    torch has no public constructor from local shards and global metadata, and keeps
    the group as ``_process_group``; ``ShardedTensor`` itself lives in the private
    ``torch.distributed._shard`` (TorchRec's state dicts are made of them)."""
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, like.metadata(), process_group=like._process_group
    )
