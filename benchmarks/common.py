"""What the benchmarks share: the machine they ran on, the smallest workable cache."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np

__all__ = ["machine", "pinned_rows_needed"]


def machine() -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
    }


def pinned_rows_needed(stream: list[np.ndarray], prefetch_distance: int) -> int:
    """Most distinct rows any d+1 consecutive steps use: the smallest workable cache."""
    d = prefetch_distance
    return max(
        len(np.unique(np.concatenate(stream[max(0, s - d) : s + 1]))) for s in range(len(stream))
    )
