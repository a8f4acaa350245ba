"""The ranks agree on a step's hot-row update, summed exactly as the owner would sum it.

Under plain TorchRec a row's owner receives every bag's gradient (divided by
the world size) and FBGEMM's CPU backward adds them one by one, in float32,
in the order of the owner's bags: feature by feature of the row's table, then
rank by rank, then sample by sample (FBGEMM sorts a table's ids with a stable
radix sort, so ties keep that order). The replicas must be given that very
sum: a sum in another order differs in the last bits, and row-wise Adagrad
turns such a difference in a nearly cancelling gradient into a step as large
as the learning rate (found in the DLRM example: weights 0.86 apart after 100
steps).

So the ranks add in that order, passing the partial sums along (an
*ordered reduction*): in round ``k`` (the ``k``-th feature of each hot
table) rank 0 adds its gradients of the round, sends the partial sums to rank
1, which adds its own, and so on; the last rank's sums after the last round
go back to every rank (a broadcast), and every replica applies them through
FBGEMM, a bag per row, which adds each to zero (exact). The message also
carries each hot table's learning rate, read from the rank that owns the
table when its step runs: the owner's fused optimizer is where a schedule
sets it, and other ranks have no optimizer for that table.

Bytes: ``2 (W - 1) / W`` of the union's sums per rank, as a ring all-reduce;
latency ``W - 1`` hops more than one.

Which rows take part (the *union*: rows any rank's batch touches) is agreed
when the batch is split, ``L`` steps ahead: a bit per hot row, OR-reduced
(:func:`start_union`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from numba import njit

from torchrec_lookahead.embedding.hot.split import HotSplit
from torchrec_lookahead.traffic import label

__all__ = ["TouchedReplicas", "ordered_sum", "start_union", "union_of"]


def start_union(split: HotSplit, group: dist.ProcessGroup | None) -> Any:
    """Start OR-reducing ``split``'s touched rows over ``group`` (async); ``None`` for one
    rank. NCCL has no bitwise OR: there a byte per row is MAX-reduced."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    op = dist.ReduceOp.BOR if split.packed else dist.ReduceOp.MAX
    with label("hot_sync"):
        return dist.all_reduce(split.touched, op=op, group=group, async_op=True)


@dataclass(frozen=True)
class TouchedReplicas:
    """The replica rows any rank's batch of a step touches (ascending: ``host`` on the
    host, ``rows`` on the device) and the position among them of each of its hot ids."""

    host: np.ndarray
    rows: torch.Tensor
    positions: torch.Tensor


def union_of(split: HotSplit, exchange: Any, num_rows: int) -> TouchedReplicas:
    """The step's :class:`TouchedReplicas`; waits for ``exchange`` (:func:`start_union`). Made on
    the stage's thread a batch later, so that the step's backward finds it ready."""
    if exchange is not None:
        exchange.wait()
    bits = split.touched.cpu().numpy()
    touched = (np.unpackbits(bits, count=num_rows) if split.packed else bits).astype(bool)
    rows = np.flatnonzero(touched)
    positions = (np.cumsum(touched) - 1)[split.host_rows]
    device = split.rows.device
    return TouchedReplicas(rows, _to_device(rows, device), _to_device(positions, device))


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(np.ascontiguousarray(array))
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


@njit(nogil=True, cache=True)
def _add_in_order(sums: np.ndarray, positions: np.ndarray, grads: np.ndarray) -> None:
    """``sums[positions[i]] += grads[i]`` for ``i`` in order, in float32: the owner's
    FBGEMM adds a row's gradients so (``index_add_`` does too on the CPU, 10x slower)."""
    for i in range(positions.shape[0]):
        row = sums[positions[i]]
        grad = grads[i]
        for d in range(row.shape[0]):
            row[d] += grad[d]


def add_in_order(sums: torch.Tensor, positions: torch.Tensor, grads: torch.Tensor) -> None:
    """Add each of ``grads`` to its row of ``sums``, one after another in their order. On
    CUDA ``index_add_`` (deterministic under deterministic algorithms; FBGEMM's CUDA
    backward sums in an order of its own there, so the result is within rounding)."""
    if sums.device.type != "cpu":
        sums.index_add_(0, positions, grads)
    elif len(positions):
        _add_in_order(sums.numpy(), positions.numpy(), grads.contiguous().numpy())


def ordered_sum(
    rounds: Sequence[tuple[torch.Tensor, torch.Tensor]],
    rows: int,
    dim: int,
    rates: np.ndarray,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> tuple[torch.Tensor, np.ndarray]:
    """Every rank's gradients of a step's union rows, summed in the owners' order.

    Args:
        rounds: per round, this rank's ``(positions, gradients)``: each gradient's row
            among the union's ``rows`` rows, in the order the owner adds them.
        rows, dim: the sums' shape.
        rates: per hot table, the learning rate if this rank owns it, else NaN.
        group: the ranks, in the order the owners add their gradients.
        device: where the sums are made.

    Returns the sums (float32, ``[rows, dim]``) and every table's rate.
    """
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    tables = len(rates)
    message = torch.zeros(rows * dim + 2 * tables, dtype=torch.float32, device=device)
    sums = message[: rows * dim].view(rows, dim)
    carried = message[rows * dim :].view(torch.float64)  # rates, bit for bit
    if rank == 0:
        carried.fill_(float("nan"))
    known = torch.from_numpy(np.asarray(rates, dtype=np.float64)).to(device)

    def peer(r: int) -> int:
        return dist.get_global_rank(group, r % world) if group is not None else 0

    for k, (positions, gradients) in enumerate(rounds):
        if world > 1 and (rank, k) != (0, 0):
            dist.recv(message, src=peer(rank - 1), group=group)
        if k == 0:  # the first owner (in rank order) of each table gives its rate
            torch.where(torch.isnan(carried), known, carried, out=carried)
        add_in_order(sums, positions, gradients)
        if world > 1 and (rank, k) != (world - 1, len(rounds) - 1):
            with label("hot_sync"):
                dist.send(message, dst=peer(rank + 1), group=group)
    if world > 1:
        with label("hot_sync"):
            dist.broadcast(message, src=peer(world - 1), group=group)
    return sums, carried.cpu().numpy().copy()
