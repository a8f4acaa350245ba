"""The lookahead run against plain TorchRec's: weights, optimizer state, bytes, digests."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from torchrec_lookahead.embedding import ShardedHotRowsEmbeddingBagCollection
from torchrec_lookahead.metrics import KINDS

__all__ = [
    "largest_difference",
    "local_tensors",
    "mean_over_ranks",
    "replica_metrics",
    "weights_digest",
    "weights_gap",
]


def mean_over_ranks(sent: dict[str, int], steps: int, device: torch.device) -> dict[str, float]:
    """Bytes sent per step and rank, by kind: the mean over ranks (a collective)."""
    totals = torch.tensor([float(sent[k]) for k in KINDS], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    return {k: v / steps / dist.get_world_size() for k, v in zip(KINDS, totals.tolist())}


def replica_metrics(dmp):  # noqa: ANN201
    """What the lookahead model's replicated hot rows served (None without them)."""
    return next(
        (
            m.replica_metrics
            for m in dmp.modules()
            if isinstance(m, ShardedHotRowsEmbeddingBagCollection)
        ),
        None,
    )


def weights_gap(look, base, device: torch.device) -> float:
    """The largest difference between the two models' weights and optimizer state (each a
    ``(model, optimizer)``), over every rank: NaN against a number is an infinite
    difference, NaN against NaN none (``max`` alone would drop a NaN)."""
    gap = 0.0
    pairs = [(look[0].state_dict(), base[0].state_dict())]
    pairs += [
        (a, b)
        for a, b in zip(
            look[1].state_dict()["state"].values(),
            base[1].state_dict()["state"].values(),
            strict=True,
        )
    ]
    for mine, theirs in pairs:
        for a, b in zip(mine.values(), theirs.values(), strict=True):
            for x, y in zip(local_tensors(a), local_tensors(b), strict=True):
                if x.numel():
                    gap = max(gap, largest_difference(x.float(), y.float()))
    worst = torch.tensor([gap], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())


def largest_difference(x: torch.Tensor, y: torch.Tensor) -> float:
    """``|x - y|``'s largest element; equal values (infinities, NaN against NaN) differ by
    0, NaN against a number by inf."""
    same = (x == y) | (x.isnan() & y.isnan())
    difference = torch.where(same, 0.0, (x - y).abs())
    return float(difference.nan_to_num(nan=float("inf"), posinf=float("inf")).max())


def local_tensors(value) -> list[torch.Tensor]:  # noqa: ANN001
    """This rank's tensors of a state-dict value: a sharded table's local shards, or itself."""
    return [s.tensor for s in value.local_shards()] if hasattr(value, "local_shards") else [value]


def weights_digest(dmp) -> str:
    """A hash of every table's shards and every dense parameter, over all ranks (in rank
    order): equal digests mean equal weights everywhere."""
    digest = hashlib.sha256()
    for key, value in dmp.state_dict().items():
        for tensor in local_tensors(value):
            digest.update(key.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, digest.hexdigest())
    return hashlib.sha256("".join(per_rank).encode()).hexdigest()
