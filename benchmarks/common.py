"""What the benchmarks share: the machine they ran on, the smallest workable cache,
sequence batches, and running the DLRM example."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "SequenceData",
    "example_flags",
    "machine",
    "pinned_rows_needed",
    "run_example",
    "write_report",
]

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "dlrm" / "dlrm_main.py")


def dlrm_train(collection: Any, dim: int, seed: int, dense_device: Any = None) -> Any:
    """The benchmarks' DLRM over ``collection``: 13 dense features, a [64, ``dim``] dense
    arch and a [64, 32, 1] over arch, its dense weights drawn from ``seed``. (TorchRec is
    imported here, not at the module's top: some orchestrators import this module only.)"""
    import torch
    from torchrec.models.dlrm import DLRM, DLRMTrain

    torch.manual_seed(seed)
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=collection,
            dense_in_features=13,
            dense_arch_layer_sizes=[64, dim],
            over_arch_layer_sizes=[64, 32, 1],
            dense_device=dense_device,
        )
    )


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


def write_report(out: str | Path, report: dict) -> Path:
    """``report`` as ``out/report.json`` (the folder made if need be); says where."""
    path = Path(out) / "report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return path


def over_rounds(
    rounds: list[list[dict]], medians: Sequence[str], kept: Sequence[str] = ()
) -> list[dict]:
    """Each setting's figures over ``rounds`` (each round a list of every setting's result,
    in one order; settings alternate within a round, so drift on the machine spreads over
    all): the first round's result, each key of ``medians`` its median over the rounds, and
    each of ``medians`` and ``kept`` also per round, as ``<key>_rounds`` (a key of ``kept``
    only so)."""
    results = [
        {k: v for k, v in runs[0].items() if k not in kept}
        | {f"{key}_rounds": [r[key] for r in runs] for key in [*medians, *kept]}
        for runs in zip(*rounds)
    ]
    for result in results:
        for key in medians:
            result[key] = statistics.median(result[f"{key}_rounds"])
    return results


def pinned_rows_needed(stream: list[np.ndarray], prefetch_distance: int) -> int:
    """Most distinct rows any d+1 consecutive steps use: the smallest workable cache."""
    d = prefetch_distance
    return max(
        len(np.unique(np.concatenate(stream[max(0, s - d) : s + 1]))) for s in range(len(stream))
    )


@dataclass(frozen=True)
class SequenceData:
    """Sequence batches, as a sequence model (BERT4Rec) reads them: each sample a history
    of items, its length drawn uniformly from ``lengths`` (both ends included), its items
    drawn from ``num_rows`` items of Zipf popularity (``ZipfSampler``: ``zipf_exponent``,
    salted by ``seed``). Batch ``step`` depends only on ``seed`` and ``step``, so a test
    regenerates what a benchmark ran."""

    num_rows: int
    zipf_exponent: float = 1.1
    lengths: tuple[int, int] = (50, 200)
    seed: int = 0

    @cached_property
    def _sampler(self) -> Any:
        from torchrec_lookahead.data import ZipfSampler

        return ZipfSampler(self.num_rows, self.zipf_exponent, salt=self.seed)

    def batch(self, step: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``step``: each sample's history length, and the items, sample after sample."""
        rng = np.random.default_rng([self.seed, step])
        lengths = rng.integers(self.lengths[0], self.lengths[1] + 1, batch_size)
        return lengths, self._sampler.sample(rng, int(lengths.sum()))

    def stream(self, batch_size: int, steps: int) -> list[np.ndarray]:
        """The items of each of the first ``steps`` batches."""
        return [self.batch(step, batch_size)[1] for step in range(steps)]


def example_flags(
    scale: float,
    batch_size: int,
    steps: int,
    data_cache: Path | str | None = None,
    samples_per_day: int | None = None,
) -> list[str]:
    """The example's flags for a benchmark job on its synthetic data: tables at ``scale``
    times Criteo Kaggle's, ``steps`` training batches of ``batch_size`` and one batch of
    each evaluation (what a benchmark times is the training)."""
    flags = ["--scale", str(scale), "--batch_size", str(batch_size)]
    flags += ["--limit_train_batches", str(steps)]
    flags += ["--limit_val_batches", "1", "--limit_test_batches", "1"]
    if data_cache is not None:
        flags += ["--data_cache", str(data_cache)]
    if samples_per_day is not None:
        flags += ["--synthetic_samples_per_day", str(samples_per_day)]
    return flags


def run_example(
    work: Path,
    world_size: int,
    flags: Sequence[str],
    restarts: int = 0,
    watch: Callable[[int], None] | None = None,
) -> tuple[float, dict]:
    """One ``torchrun`` job of the DLRM example, its ``--out`` a new folder below ``work``;
    returns the job's wall seconds and its summary (``summary.json``). ``watch`` is
    called with the launcher's pid every 0.1 s while the job runs."""
    out = Path(tempfile.mkdtemp(dir=work))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world_size}",
        f"--max-restarts={restarts}",
        EXAMPLE,
        "--out",
        str(out),
        *flags,
    ]
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stderr:
        job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
        while job.poll() is None:
            if watch is not None:
                watch(job.pid)
            time.sleep(0.1)
        seconds = time.perf_counter() - start
        if job.returncode != 0:
            stderr.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr.read()[-3000:]}")
    return seconds, json.loads((out / "summary.json").read_text())
