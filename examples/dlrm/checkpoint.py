"""Atomic checkpoints with ``torch.distributed.checkpoint``; folders handled through iopath."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from iopath.common.file_io import PathManager

PATHS = PathManager()


def save(root: str, step: int, state: dict[str, Any]) -> str:
    """Write ``state`` as ``root/step_<step>`` on every rank; readers never see it half-written.

    Ranks write into a hidden folder; once all have finished, rank 0 renames it
    and then points ``root/latest`` at it (a file replaced atomically).
    """
    final = os.path.join(root, f"step_{step:08d}")
    partial = os.path.join(root, f".step_{step:08d}.partial")
    if dist.get_rank() == 0:
        PATHS.mkdirs(root)
    dist.barrier()
    dcp.save(state, checkpoint_id=partial)
    dist.barrier()
    if dist.get_rank() == 0:
        if PATHS.exists(final):
            PATHS.rm(final)
        os.replace(partial, final)
        pointer = os.path.join(root, ".latest.partial")
        with PATHS.open(pointer, "w") as f:
            f.write(os.path.basename(final))
        os.replace(pointer, os.path.join(root, "latest"))
    dist.barrier()
    return final


def latest(root: str) -> str | None:
    """The newest complete checkpoint under ``root``, if any."""
    pointer = os.path.join(root, "latest")
    if not PATHS.exists(pointer):
        return None
    with PATHS.open(pointer) as f:
        return os.path.join(root, f.read().strip())


def load(path: str, state: dict[str, Any]) -> None:
    """Fill ``state`` (already shaped like the checkpoint) from ``path`` in place."""
    dcp.load(state, checkpoint_id=path)
