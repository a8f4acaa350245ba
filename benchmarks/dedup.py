"""Deduplicated batches (RecD): samples/s with and without ``--dedup`` at several session sizes.

Runs the DLRM example (``examples/dlrm/dlrm_main.py``) on synthetic data whose
sessions of k samples share the user-side features (13 of 26 sparse, 6 of 13
dense), once plain and once with ``--dedup``, alternating in blocks (this
machine drifts), and reports the median samples/s of each, the ids looked up
and planned per step and rank before and after deduplication, and the sparse
bytes per step and rank the all-to-alls carry (ids and lengths at 8 bytes,
pooled rows at 4 bytes a float; computed from the batches' shapes).

Writes ``report.json`` and ``dedup.png`` into --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from common import machine, run_example
from tqdm import tqdm


def sparse_bytes(ids: int, bags: int, dim: int) -> int:
    return ids * 8 + bags * (8 + 4 * dim)


def measure(args: argparse.Namespace, work: Path) -> list[dict]:
    base = ["--scale", str(args.scale), "--batch_size", str(args.batch_size),
            "--embedding_dim", str(args.embedding_dim),
            "--dense_arch_layer_sizes", f"64,{args.embedding_dim}",
            "--limit_train_batches", str(args.steps), "--limit_val_batches", "1",
            "--limit_test_batches", "1", "--data_cache", str(args.data_cache),
            "--synthetic_samples_per_day", str(args.samples_per_day)]  # fmt: skip
    samples = {(k, mode): [] for k in args.sessions for mode in ("plain", "dedup")}
    counts = {}
    runs = [(r, k, mode) for r in range(args.repeats) for k in args.sessions
            for mode in ("plain", "dedup")]  # fmt: skip
    for _, k, mode in tqdm(runs, desc="runs", unit="run"):
        flags = [*base, "--session_size", str(k)] + (["--dedup"] if mode == "dedup" else [])
        _, summary = run_example(work, args.world_size, flags)
        run = summary["runs"][0]
        samples[k, mode].append(run["samples"] / run["seconds"])
        if mode == "dedup":
            counts[k] = (run["dedup"], len(run["step_s"]))
    rows = []
    for k in args.sessions:
        dedup, steps = counts[k]
        before = sparse_bytes(dedup["ids_before"], dedup["bags_before"], args.embedding_dim)
        after = sparse_bytes(dedup["ids_after"], dedup["bags_after"], args.embedding_dim)
        plain, deduped = (statistics.median(samples[k, m]) for m in ("plain", "dedup"))
        rows.append({
            "session_size": k,
            "plain_samples_per_s": plain,
            "dedup_samples_per_s": deduped,
            "speedup": deduped / plain,
            "plain_all": samples[k, "plain"],
            "dedup_all": samples[k, "dedup"],
            "ids_per_step_plain": dedup["ids_before"] / steps,
            "ids_per_step_dedup": dedup["ids_after"] / steps,
            "sparse_mb_per_step_plain": before / steps / 2**20,
            "sparse_mb_per_step_dedup": after / steps / 2**20,
        })  # fmt: skip
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["plain_samples_per_s"] for r in rows], 0.4, label="plain")
    ax.bar([i + 0.2 for i in x], [r["dedup_samples_per_s"] for r in rows], 0.4, label="--dedup")
    ax.set_xticks(list(x), [f"k = {r['session_size']}" for r in rows])
    ax.set_ylabel("samples/s (median)")
    ax.set_title("DLRM with lookahead caching, sessions of k samples")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/dedup"))
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=2048, help="per rank")
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--scale", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--samples-per-day", type=int, default=524288)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-cache", type=Path, default=Path(".cache/dlrm-data"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        rows = measure(args, Path(work))
    report = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine(),
        "results": rows,
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    plot(rows, args.out / "dedup.png")
    print(f"\nDeduplicated batches, world size {args.world_size}, batch {args.batch_size} per "
          f"rank, embedding dim {args.embedding_dim}, {args.steps} steps (medians over "
          f"{args.repeats} runs; ids and sparse MB per step and rank)")  # fmt: skip
    print("{:>4} {:>12} {:>12} {:>8} {:>10} {:>10} {:>10} {:>10}".format(
        "k", "plain s/s", "dedup s/s", "speedup", "ids plain", "ids dedup", "MB plain",
        "MB dedup"))  # fmt: skip
    for r in rows:
        print("{:>4} {:>12,.0f} {:>12,.0f} {:>8.2f} {:>10,.0f} {:>10,.0f} {:>10.2f} {:>10.2f}"
              .format(r["session_size"], r["plain_samples_per_s"], r["dedup_samples_per_s"],
                      r["speedup"], r["ids_per_step_plain"], r["ids_per_step_dedup"],
                      r["sparse_mb_per_step_plain"], r["sparse_mb_per_step_dedup"]))  # fmt: skip
    print(f"\nwrote {args.out / 'report.json'} and {args.out / 'dedup.png'}")


if __name__ == "__main__":
    main()
