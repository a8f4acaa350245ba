"""Votes: every rank's verdict on a batch, agreed, so that all ranks drop a refused batch together.

Under ``DistributedModelParallel`` a batch that one rank cannot take must be
dropped by every rank, or their collectives fall out of step. The lookahead
stage votes on each batch as it reads it (its structure, its ids, its kind:
checked on the host), before the batch moves to the device or reaches a
collective; a refused batch then costs no collective but the vote, and no
rank ever sends one. What can refuse a batch only after it is distributed (a
cache capped by ``max_cache_rows``) is voted on again there, as the batch is
planned. Each of those votes runs on a :class:`VoteGroup` of its own: the
thread that takes it (the reading's, the planning's) issues no other
collective on that group, so the ranks' collectives meet in one order on each.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from torchrec_lookahead._compat import destroy_group
from torchrec_lookahead.traffic import label

__all__ = ["VoteGroup", "refusals", "vote"]


def vote(error: ValueError | None, group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Raise ``error`` on this rank, and on every other rank of ``group`` a refusal naming
    it, if any rank has one (so all ranks drop a batch together)."""
    if refusals(error, group, device).item():
        raise error or ValueError("another rank refused this batch (see its error)")


def refusals(
    error: ValueError | None, group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    """How many ranks of ``group`` refuse: an all-reduce of a tensor on ``device``, the
    device the group's backend takes (NCCL: CUDA only)."""
    failed = torch.tensor([error is not None], dtype=torch.int64, device=device)
    with label("other"):
        dist.all_reduce(failed, group=group)
    return failed


class VoteGroup:
    """Votes among ``ranks`` on a process group of their own (every rank makes one, in the
    same order: a collective), for one thread to take, batch after batch.

    The group is gloo's where the ranks' own backend is gloo or NCCL: a vote then
    takes a host tensor, so the voting thread waits for no device, and its
    collective runs beside the trainer's NCCL ones on connections of its own (NCCL
    does not promise progress to collectives issued from two threads; gloo's groups
    are independent). Any other backend (the ``cuda:fake`` test group) votes on
    its own kind of group, with tensors on ``device``.
    """

    def __init__(self, ranks: Sequence[int], device: torch.device) -> None:
        on_gloo = dist.get_backend() in ("gloo", "nccl")
        backend = "gloo" if on_gloo else None
        self.group: dist.ProcessGroup | None = dist.new_group(ranks=list(ranks), backend=backend)
        self.device = torch.device("cpu") if on_gloo else device

    def close(self) -> None:
        """Destroy the group (idempotent); no vote after this."""
        destroy_group(self.group)
        self.group = None

    def agree(self, refusal: ValueError | None) -> ValueError | None:
        """The batch's verdict on every rank: this rank's ``refusal``, or, where only
        another rank refused, a refusal saying so; ``None`` if every rank takes it."""
        assert self.group is not None, "the vote's group was closed"
        try:
            vote(refusal, self.group, self.device)
        except ValueError as refused:
            return refused
        return None
