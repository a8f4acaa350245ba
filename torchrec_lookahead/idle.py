"""Work that must not take cores from the trainer: run it at idle priority."""

from __future__ import annotations

import os
import threading

__all__ = ["run_normally", "run_when_idle"]


def run_when_idle() -> None:
    """Let the calling thread run only on the cycles other threads leave idle (Linux's
    ``SCHED_IDLE``; elsewhere nothing changes). The lookahead stage and the loader's
    workers work ahead of the trainer, off its critical path, so they must not take
    its cores: on a CPU trainer, at normal priority they would."""
    if hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def run_normally(thread: threading.Thread) -> None:
    """Give ``thread`` (one that ran :func:`run_when_idle`) cores as any other thread, to
    stop it: a pipeline closing waits for its threads to end, and on a busy host an
    idle thread may get no cycle before the wait gives up, and still be in torch's code
    when the interpreter exits. Where Linux does not let this process raise a thread's
    priority (``RLIMIT_NICE``), or the thread is gone, nothing changes."""
    if hasattr(os, "SCHED_OTHER") and thread.native_id is not None and thread.is_alive():
        try:
            os.sched_setscheduler(thread.native_id, os.SCHED_OTHER, os.sched_param(0))
        except (PermissionError, ProcessLookupError):
            pass
