"""Data larger than memory: the DLRM example training from mapped Criteo days.

Generates two synthetic data sets in the ``.npy`` day layout as a stream
(pieces of 2**20 samples, never a whole day in memory): a small one (about
--small-gb) and a large one (about --large-gb, more than this machine's RAM by
default), then trains the example on each with the lookahead cache, shuffled,
at every world size of --world-sizes and every loader worker count of
--workers, alternating the settings in blocks, --repeats times. Per setting
(medians over the repeats): samples/s after step 1, step time, the loader
wait per step (the time the lookahead stage waited for a batch, rank 0) and
its share of the step, and the peak private memory (RssAnon) of every rank
process and of its loader workers, sampled every 0.1 s from outside.

The data sets are removed at the end. Writes ``report.json`` into --out and
prints the table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
from common import machine, run_example
from tqdm import tqdm

from torchrec_lookahead.data import SyntheticCriteo
from torchrec_lookahead.data.npy import RowWriter

SAMPLE_BYTES = 13 * 4 + 26 * 8 + 4  # dense float32, sparse int64, label int32
PIECE = 2**20


def write_days(folder: Path, gigabytes: float, days: int, scale: float, seed: int) -> int:
    """Synthetic days of about ``gigabytes`` in all, written piece by piece; returns the
    sample count. Ids are Criteo-like Zipf draws; labels a logistic function of the
    dense features."""
    folder.mkdir(parents=True)
    per_day = int(gigabytes * 2**30 / SAMPLE_BYTES / days)
    source = SyntheticCriteo(scale=scale, seed=seed)
    weights = np.linspace(-0.8, 0.8, 13)
    bar = tqdm(total=per_day * days, desc=f"write {gigabytes:g} GB", unit="sample", unit_scale=True)
    for day in range(days):
        files = [
            RowWriter(folder / f"day_{day}_{kind}.npy", dtype, columns)
            for kind, dtype, columns in (
                ("dense", np.float32, 13),
                ("sparse", np.int64, 26),
                ("labels", np.int32, 1),
            )
        ]
        for piece, start in enumerate(range(0, per_day, PIECE)):
            n = min(PIECE, per_day - start)
            rng = np.random.default_rng([seed, day, piece])
            sparse = np.stack(source.batch(day * 10_000 + piece, n).values, axis=1)
            dense = np.log(rng.poisson(3.0, (n, 13)) + 2.0).astype(np.float32)
            logits = (dense - dense.mean()) @ weights - 1.3
            labels = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(np.int32)
            for file, rows in zip(files, (dense, sparse, labels.reshape(-1, 1))):
                file.append(rows)
            bar.update(n)
        for file in files:
            file.close()
    bar.close()
    return per_day * days


def peak_private_memory(peaks: dict[int, dict]):
    """A ``watch`` for :func:`run_example`: the most RssAnon seen per process below the
    launcher, with its role (``rank r`` or a worker of ``rank r``)."""

    def sample(launcher: int) -> None:
        parents = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(stat.parent.name)] = int(fields[1])
        for pid, parent in parents.items():
            role = None
            if parent == launcher:
                role = "rank"
            elif parents.get(parent) == launcher:
                role = "worker"
            if role is None:
                continue
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                rank_of = pid if role == "rank" else parent
                rank = _rank(rank_of)
            except (OSError, ValueError):
                continue
            anon = next(
                (
                    int(line.split()[1])
                    for line in status.splitlines()
                    if line.startswith("RssAnon:")
                ),
                None,
            )
            if anon is None:  # exiting: no memory left to count
                continue
            entry = peaks.setdefault(pid, {"role": role, "rank": rank, "kb": 0})
            entry["kb"] = max(entry["kb"], anon)

    return sample


def _rank(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=", 1)[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--data-dir", type=Path, default=Path(".cache/data-benchmark"))
    p.add_argument("--small-gb", type=float, default=1.0)
    p.add_argument("--large-gb", type=float, default=30.0)
    p.add_argument("--days", type=int, default=24, help="per data set, the last for evaluation")
    p.add_argument("--scale", type=float, default=0.01, help="Criteo Kaggle table sizes times this")
    p.add_argument("--batch-size", type=int, default=1024, help="per rank")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--shuffle-chunk", type=int, default=2**17)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "runs"
    work.mkdir(exist_ok=True)
    sizes = {"small": args.small_gb, "large": args.large_gb}
    tables = ",".join(map(str, SyntheticCriteo(scale=args.scale).num_embeddings))
    folders = {name: args.data_dir / f"{name}-{gb:g}gb" for name, gb in sizes.items()}
    samples = {}
    try:
        for name, gb in sizes.items():
            shutil.rmtree(folders[name], ignore_errors=True)
            samples[name] = write_days(folders[name], gb, args.days, args.scale, seed=1)
        settings = [(n, w, k) for n in sizes for w in args.world_sizes for k in args.workers]
        runs: dict[tuple, list[dict]] = {s: [] for s in settings}
        for _ in tqdm(range(args.repeats), desc="repeats"):
            for name, world_size, workers in settings:  # alternating, in blocks
                peaks: dict[int, dict] = {}
                flags = [
                    "--dataset_path",
                    str(folders[name]),
                    "--num_embeddings_per_feature",
                    tables,
                    "--batch_size",
                    str(args.batch_size),
                    "--limit_train_batches",
                    str(args.steps),
                    "--limit_val_batches",
                    "2",
                    "--limit_test_batches",
                    "2",
                    "--shuffle",
                    "--shuffle_chunk",
                    str(args.shuffle_chunk),
                    "--num_workers",
                    str(workers),
                ]
                _, summary = run_example(work, world_size, flags, watch=peak_private_memory(peaks))
                runs[name, world_size, workers].append(measure(summary, peaks, world_size))
    finally:
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    results = [
        summarise(name, sizes[name], samples[name], w, k, runs[name, w, k])
        for name, w, k in settings
    ]
    report = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "settings": vars(args),
        "results": results,
        "goals": goals(results),
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    print_table(report)


def measure(summary: dict, peaks: dict[int, dict], world_size: int) -> dict:
    run = summary["runs"][0]
    ranks = [
        max((e["kb"] for e in peaks.values() if e["role"] == "rank" and e["rank"] == r), default=0)
        / 1024
        for r in range(world_size)
    ]
    workers = [
        max(
            (e["kb"] for e in peaks.values() if e["role"] == "worker" and e["rank"] == r), default=0
        )
        / 1024
        for r in range(world_size)
    ]
    steps = run["step_s"][1:]
    return {
        "samples_per_s": run["samples"] / len(run["step_s"]) * len(steps) / sum(steps),
        "step_ms": 1000 * statistics.median(steps),
        "data_wait_ms": run["data_wait_ms_per_step"],
        "rank_private_mb": ranks,
        "worker_private_mb": workers,
    }


def summarise(
    name: str, gb: float, samples: int, world_size: int, workers: int, runs: list[dict]
) -> dict:
    def median(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    def peak(key: str) -> list[float]:
        return [max(r[key][rank] for r in runs) for rank in range(world_size)]

    step_ms, wait_ms = median("step_ms"), median("data_wait_ms")
    return {
        "data": name,
        "gigabytes": gb,
        "samples": samples,
        "world_size": world_size,
        "num_workers": workers,
        "runs": len(runs),
        "samples_per_s": median("samples_per_s"),
        "step_ms": step_ms,
        "data_wait_ms": wait_ms,
        "data_wait_share": wait_ms / step_ms,
        "rank_private_mb": peak("rank_private_mb"),
        "worker_private_mb": peak("worker_private_mb"),
    }


def goals(results: list[dict]) -> dict:
    """The issue's goals: the large set's rank private memory within 10% of the small
    set's, per world size and worker count; data wait at most 2% of the step with
    workers."""
    memory = {}
    for r in results:
        if r["data"] != "large":
            continue
        same = (r["world_size"], r["num_workers"])
        small = next(
            s
            for s in results
            if s["data"] == "small" and (s["world_size"], s["num_workers"]) == same
        )
        ratio = max(r["rank_private_mb"]) / max(small["rank_private_mb"])
        memory[f"ws{r['world_size']}_workers{r['num_workers']}"] = ratio
    waits = {
        f"{r['data']}_ws{r['world_size']}_workers{r['num_workers']}": r["data_wait_share"]
        for r in results
        if r["num_workers"] >= 1
    }
    return {
        "private_memory_large_over_small": memory,
        "private_memory_within_10_percent": all(v <= 1.10 for v in memory.values()),
        "data_wait_share_with_workers": waits,
        "data_wait_at_most_2_percent": all(v <= 0.02 for v in waits.values()),
    }


def print_table(report: dict) -> None:
    print(
        f"\nData larger than memory ({report['machine']['cpu']}, {report['date']}); medians of "
        f"{report['settings']['repeats']} runs, peak private memory over them"
    )
    print(
        f"{'data':>14} {'ws':>3} {'workers':>7} {'samples/s':>10} {'step ms':>8} "
        f"{'wait ms':>8} {'wait %':>7} {'rank MB':>16} {'worker MB':>16}"
    )
    for r in report["results"]:
        ranks = "/".join(f"{m:,.0f}" for m in r["rank_private_mb"])
        workers = "/".join(f"{m:,.0f}" for m in r["worker_private_mb"])
        print(
            f"{r['gigabytes']:>11g} GB {r['world_size']:>3} {r['num_workers']:>7} "
            f"{r['samples_per_s']:>10,.0f} {r['step_ms']:>8.2f} {r['data_wait_ms']:>8.3f} "
            f"{100 * r['data_wait_share']:>6.2f}% {ranks:>16} {workers:>16}"
        )
    print(json.dumps(report["goals"], indent=1))


if __name__ == "__main__":
    main()
