"""Preprocessing Criteo days (examples/dlrm/preprocess.py): peak memory and speed.

Generates raw Criteo-like TSV days as a stream (pieces of 2**18 lines, never a
day in memory): 13 integers (a fifth of them empty, some negative) and 26
8-digit hex ids per line, the ids of each column drawn from a Zipf law
(exponent --zipf) over Criteo Kaggle's table sizes times --scale and hashed
to 32 bits, 4% of them empty. Then, for each day size of --lines, each
threshold of --thresholds and each worker count of --workers, runs the
command on the days and measures:

* wall time and lines/s, and the time of each pass (from the state folder's
  markers: convert and count, merge the columns, map the ids);
* peak RSS: the largest high-water mark (``ru_maxrss``) of any process of the
  command (the main one or a forked worker), and the peak over time of the
  private memory (RssAnon) of all its processes together, sampled every 0.1 s;
* distinct ids: the (column, id) pairs of the data, from the command's
  cardinality file at threshold 0 (each column's size is 2 + its distinct ids).

The data and outputs are removed at the end. Writes ``report.json`` into --out and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from common import machine
from tqdm import tqdm

from torchrec_lookahead.data import SyntheticCriteo

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ROOT / "examples" / "dlrm" / "preprocess.py"
PIECE = 2**18
_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)
_DIGITS = 5  # integers below 10**5, as Criteo's mostly are


def write_day(path: Path, lines: int, day: int, scale: float, zipf: float, seed: int) -> int:
    """One raw day of ``lines`` lines, written a piece at a time; returns its bytes.

    Each line is built in a fixed-width byte matrix whose unused cells are then
    dropped (``matrix[keep]``), so no line is formatted in Python."""
    source = SyntheticCriteo(scale=scale, zipf_exponent=zipf, seed=seed)
    written = 0
    with open(path, "wb") as file:
        for piece, start in enumerate(range(0, lines, PIECE)):
            n = min(PIECE, lines - start)
            rng = np.random.default_rng([seed, day, piece])
            ids = np.stack(source.batch(day * 100_000 + piece, n).values, axis=1)
            hashed = (ids.astype(np.uint64) * np.uint64(2654435761) + np.uint64(day)) & np.uint64(
                0xFFFFFFFF
            )
            integers = np.minimum(rng.poisson(np.exp(rng.normal(1.0, 1.6, (n, 13)))), 99_999)
            integers[:, 1] -= rng.integers(0, 3, n)  # the second column has negatives, as Criteo's
            blocks = [_label_cells(rng.integers(0, 2, n))]
            blank = rng.random((n, 13)) < 0.2
            blocks += [_integer_cells(integers[:, c], blank[:, c]) for c in range(13)]
            blank = rng.random((n, 26)) < 0.04
            blocks += [_hex_cells(hashed[:, c], blank[:, c]) for c in range(26)]
            cells = np.concatenate([b[0] for b in blocks], axis=1)
            keep = np.concatenate([b[1] for b in blocks], axis=1)
            cells[:, -1] = ord("\n")  # the last id's tab ends the line
            data = cells[keep].tobytes()
            file.write(data)
            written += len(data)
    return written


def _label_cells(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    cells = np.empty((len(labels), 2), np.uint8)
    cells[:, 0] = ord("0") + labels
    cells[:, 1] = ord("\t")
    return cells, np.ones(cells.shape, bool)


def _integer_cells(values: np.ndarray, blank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cells of a decimal field (sign, up to 5 digits) and its tab; unused cells not kept."""
    n = len(values)
    cells = np.empty((n, _DIGITS + 2), np.uint8)
    keep = np.zeros(cells.shape, bool)
    magnitude = np.abs(values)
    width = np.maximum(1, np.floor(np.log10(np.maximum(magnitude, 1))).astype(int) + 1)
    cells[:, 0] = ord("-")
    keep[:, 0] = (values < 0) & ~blank
    for position in range(_DIGITS):  # cell 1 + position holds the digit of 10**(4 - position)
        digit = magnitude // 10 ** (_DIGITS - 1 - position) % 10
        cells[:, 1 + position] = ord("0") + digit
        keep[:, 1 + position] = (_DIGITS - position <= width) & ~blank
    cells[:, -1] = ord("\t")
    keep[:, -1] = True
    return cells, keep


def _hex_cells(values: np.ndarray, blank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cells of an 8-digit hex id and its tab (the digits not kept when ``blank``)."""
    shifts = np.arange(28, -1, -4, dtype=np.uint64)
    cells = np.empty((len(values), 9), np.uint8)
    cells[:, :8] = _HEX[((values[:, None] >> shifts) & np.uint64(15)).astype(np.intp)]
    cells[:, 8] = ord("\t")
    keep = np.ones(cells.shape, bool)
    keep[:, :8] = ~blank[:, None]
    return cells, keep


def private_memory(pids: set[int], root: int) -> int:
    """RssAnon (KiB) of ``root`` and its descendants now (``pids`` learns them)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    tree = {root}
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grew = True
    pids |= tree
    total = 0
    for pid in tree:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        total += next(
            (int(line.split()[1]) for line in status.splitlines() if line.startswith("RssAnon:")), 0
        )
    return total


def run_command(raw: Path, out: Path, threshold: int, workers: int) -> dict:
    """The command once, under a wrapper process that reports the largest high-water mark
    of RSS among the processes it waited for (the command and its forked workers)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        str(COMMAND),
        "--input_dir",
        str(raw),
        "--output_dir",
        str(out),
        "--frequency_threshold",
        str(threshold),
        "--workers",
        str(workers),
        "--quiet",
    ]
    wrapper = [sys.executable, "-c", WRAPPER, json.dumps(cmd)]
    start = time.time()
    job = subprocess.Popen(wrapper, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: set[int] = set()
    peak_private = 0
    while job.poll() is None:
        peak_private = max(peak_private, private_memory(pids, job.pid))
        time.sleep(0.1)
    seconds = time.time() - start
    stdout, stderr = job.communicate()
    if job.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{stderr[-3000:]}")
    state = out / ".preprocess"
    stamp = {p.name: p.stat().st_mtime for p in state.iterdir()}
    counted = max(t for n, t in stamp.items() if n.endswith(".counted"))
    sizes = [int(s) for s in (out / "num_embeddings_per_feature.txt").read_text().split(",")]
    return {
        "seconds": seconds,
        "pass_seconds": {
            "convert_and_count": counted - start,
            "merge_columns": stamp["tables.done"] - counted,
            "map_ids": stamp["done"] - stamp["tables.done"],
        },
        "peak_rss_mb": int(stdout.split()[-1]) / 1024,
        "peak_private_mb": peak_private / 1024,
        "processes": len(pids) - 1,  # not the wrapper
        "table_sizes": sizes,
    }


WRAPPER = """
import json, resource, subprocess, sys
done = subprocess.run(json.loads(sys.argv[1]), stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(done.returncode)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work-dir", type=Path, default=Path(".cache/preprocess-benchmark"))
    p.add_argument(
        "--lines",
        type=int,
        nargs="+",
        default=[1_000_000, 4_000_000],
        help="lines per day; one data set per value",
    )
    p.add_argument("--days", type=int, default=2)
    p.add_argument("--scale", type=float, default=1.0, help="Criteo Kaggle table sizes times this")
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--thresholds", type=int, nargs="+", default=[0, 15])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for lines in sorted(args.lines):
            raw = args.work_dir / f"raw-{lines}"
            shutil.rmtree(raw, ignore_errors=True)
            raw.mkdir(parents=True)
            generated = time.time()
            size = sum(
                write_day(raw / f"day_{day}", lines, day, args.scale, args.zipf, seed=1)
                for day in tqdm(range(args.days), desc=f"write {lines:,}-line days")
            )
            generated = time.time() - generated
            distinct = None
            for workers in sorted(args.workers):
                for threshold in sorted(args.thresholds):
                    run = run_command(raw, args.work_dir / "out", threshold, workers)
                    if threshold == 0:
                        distinct = sum(s - 2 for s in run["table_sizes"])
                    results.append(
                        {
                            "lines_per_day": lines,
                            "days": args.days,
                            "bytes": size,
                            "workers": workers,
                            "threshold": threshold,
                            "lines_per_s": lines * args.days / run["seconds"],
                            "generate_seconds": generated,
                            **run,
                        }
                    )
            for r in results:
                if r["lines_per_day"] == lines:
                    r["distinct_ids"] = distinct
            shutil.rmtree(raw, ignore_errors=True)
            shutil.rmtree(args.work_dir / "out", ignore_errors=True)
    finally:
        shutil.rmtree(args.work_dir, ignore_errors=True)
    report = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "settings": vars(args),
        "results": results,
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    print_table(report)


def print_table(report: dict) -> None:
    print(
        f"\nPreprocessing Criteo days ({report['machine']['cpu']}, {report['machine']['cores']} "
        f"cores, {report['date']})"
    )
    print(
        f"{'lines/day':>10} {'days':>4} {'GB':>5} {'workers':>7} {'T':>3} {'s':>7} "
        f"{'lines/s':>9} {'pass 1/2/3 s':>17} {'peak RSS MB':>11} {'private MB':>10} "
        f"{'distinct':>10} {'B/distinct':>10}"
    )
    for r in report["results"]:
        passes = "/".join(f"{s:.1f}" for s in r["pass_seconds"].values())
        distinct = r.get("distinct_ids") or 0
        per = r["peak_private_mb"] * 2**20 / distinct if distinct else float("nan")
        rss = f"{r['peak_rss_mb']:,.0f}"
        print(
            f"{r['lines_per_day']:>10,} {r['days']:>4} {r['bytes'] / 1e9:>5.2f} "
            f"{r['workers']:>7} {r['threshold']:>3} {r['seconds']:>7.1f} "
            f"{r['lines_per_s']:>9,.0f} {passes:>17} {rss:>11} "
            f"{r['peak_private_mb']:>10,.0f} {distinct:>10,} {per:>10.0f}"
        )


if __name__ == "__main__":
    main()
