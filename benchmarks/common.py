"""What the benchmarks share: the machine they ran on, the smallest workable cache, and
running the DLRM example."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["machine", "pinned_rows_needed", "run_example"]

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "dlrm" / "dlrm_main.py")


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


def run_example(
    work: Path, world_size: int, flags: Sequence[str], restarts: int = 0
) -> tuple[float, dict]:
    """One ``torchrun`` job of the DLRM example, its ``--out`` a new folder below ``work``;
    returns the job's wall seconds and its summary (``summary.json``)."""
    out = Path(tempfile.mkdtemp(dir=work))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={world_size}", f"--max-restarts={restarts}", EXAMPLE,
           "--out", str(out), *flags]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return seconds, json.loads((out / "summary.json").read_text())
