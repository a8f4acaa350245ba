"""Planning cost and accuracy: ``LookaheadCacheStatistics`` on Criteo-sized tables.

Builds the statistics for all 26 tables (Criteo Kaggle sizes times --scale,
Zipf ids) from --sample-batches batches and times it; then runs the oracle over
a --full-batches stream of the same distribution (another seed) and compares
the predicted miss rate with the measured one (second half of the run, per
distinct id) at a few cache sizes. Writes ``report.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from common import machine, pinned_rows_needed
from tqdm import tqdm

from planners import LookaheadCacheStatistics
from torchrec_lookahead.data import SyntheticCriteo
from torchrec_lookahead.oracle.misses import oracle_misses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/planner"))
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--sample-batches", type=int, default=50)
    parser.add_argument("--full-batches", type=int, default=200)
    parser.add_argument("--lookahead", type=int, default=16)
    parser.add_argument("--load-factors", type=float, nargs="+", default=[0.01, 0.05, 0.2])
    args = parser.parse_args()

    sample = SyntheticCriteo(scale=args.scale, seed=1).table_streams(
        args.batch_size, args.sample_batches
    )
    full = SyntheticCriteo(scale=args.scale, seed=2).table_streams(
        args.batch_size, args.full_batches
    )
    rows = SyntheticCriteo(scale=args.scale).num_embeddings

    start = time.perf_counter()
    stats = [
        LookaheadCacheStatistics(stream, n, args.lookahead, 1, f"t{i}")
        for i, (stream, n) in enumerate(
            tqdm(list(zip(sample, rows)), desc="statistics", unit="table")
        )
    ]
    stats_s = time.perf_counter() - start

    errors = []
    for clf in args.load_factors:
        predicted_misses = measured_misses = distinct = 0.0
        for stat, stream, n in zip(stats, full, rows):
            # The module's cache at clf (its floor: what d + 1 first batches can touch),
            # raised to what this stream's window needs if that is more.
            capacity = min(n, max(stat.capacity(clf), pinned_rows_needed(stream, 1)))
            misses = oracle_misses(stream, capacity, args.lookahead, 1, n)
            half = len(stream) // 2
            step_distinct = np.array([len(np.unique(b)) for b in stream[half:]])
            measured_misses += misses[half:].sum()
            predicted_misses += stat.expected_miss_rate(capacity / n) * step_distinct.sum()
            distinct += step_distinct.sum()
        errors.append(
            {
                "load_factor": clf,
                "predicted": predicted_misses / distinct,
                "measured": measured_misses / distinct,
            }
        )

    report = {
        "config": {k: str(v) for k, v in vars(args).items()},
        "machine": machine(),
        "rows": sum(rows),
        "statistics_s": stats_s,
        "accuracy": errors,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    print(
        f"\n{len(rows)} tables, {sum(rows):,} rows: statistics from {args.sample_batches} "
        f"batches of {args.batch_size} in {stats_s:.1f} s"
    )
    print(
        f"{'cache':>7} {'predicted':>10} {'measured':>9} {'error':>7}  "
        f"(full run: {args.full_batches} batches, second half)"
    )
    for e in errors:
        print(
            f"{e['load_factor']:>7.0%} {e['predicted']:>10.3f} {e['measured']:>9.3f} "
            f"{e['predicted'] - e['measured']:>+7.3f}"
        )
    print(f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores")


if __name__ == "__main__":
    main()
