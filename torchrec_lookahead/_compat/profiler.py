"""torch.profiler's settings that have no public API: every thread's ops, the device's waits.

``torch.profiler.profile`` records the CPU ops of the thread that entered it; a
lookahead step's stage and executor run on threads of their own, and what a GPU step
waits for is often an event another stream records. Both are fields of
``torch._C._profiler._ExperimentalConfig`` (``profile_all_threads``,
``enable_cuda_sync_events``), present in torch 2.11 to 2.14.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["every_thread_and_wait"]


def every_thread_and_wait() -> Any:
    """An ``experimental_config`` for ``torch.profiler.profile`` that records every
    thread's ops and the device's synchronisations (stream and event waits)."""
    return torch._C._profiler._ExperimentalConfig(
        profile_all_threads=True, enable_cuda_sync_events=True
    )
