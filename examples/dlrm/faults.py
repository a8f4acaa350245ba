"""Restarts and failures under torchrun: the attempt, its store, and killing a rank on purpose."""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch.distributed as dist

__all__ = ["attempt_store", "fail_here", "first_attempt"]


def first_attempt() -> bool:
    """Whether this is torchrun's first start of the worker group (or a plain run)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0


def fail_here(args: argparse.Namespace, rank: int, where: str, step: int) -> None:
    """Kill this process as a lost machine dies (SIGKILL: no clean-up) if ``--fail_at_step``
    names this point (``where``: ``step`` or ``checkpoint``) and rank, on the first attempt."""
    if (step, where, rank) == (args.fail_at_step, args.fail_in, args.fail_rank) and first_attempt():
        print(
            f"rank {rank}: killed at step {step} ({where}, --fail_at_step)",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGKILL)


def attempt_store() -> dict:
    """Under torchrun, the agent's store with keys of this restart only.

    torchrun keeps one store for all restarts of the worker group (its shared
    TCPStore, pytorch/pytorch#135712), and process groups publish their
    addresses there under the same keys every time: a restarted rank could read
    the address of a rank that died and fail to connect (or hang). A prefix per
    restart keeps the attempts apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return {}
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
    )
    return {
        "store": dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", agent),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }
