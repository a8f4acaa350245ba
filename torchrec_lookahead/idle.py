"""Work that must not take cores from the trainer: run it at idle priority."""

from __future__ import annotations

import os

__all__ = ["run_when_idle"]


def run_when_idle() -> None:
    """Let the calling thread run only on the cycles other threads leave idle (Linux's
    ``SCHED_IDLE``; elsewhere nothing changes). The lookahead stage and the loader's
    workers work ahead of the trainer, off its critical path, so they must not take
    its cores: on a CPU trainer, at normal priority they would."""
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
