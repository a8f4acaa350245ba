"""What checking a batch costs per step: the stage's structure check (``check_batch``) and,
beside it, the id range check every lookahead module already made.

Batches are the DLRM demo's (26 Criteo-shaped features, one id each, synthetic
Zipf ids at ``--scale``), at each ``--batch-sizes``. Each repeat times every
size in turn (alternating, so drift hits all alike); a figure is the median over
repeats of the mean over ``--calls`` calls. Prints a table, writes
``OUT/report.json``.

    python benchmarks/batch_check.py --out results/batch_check
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, write_report  # noqa: E402

from torchrec_lookahead.checks import check_batch, check_feature_ids  # noqa: E402
from torchrec_lookahead.data import SyntheticCriteo  # noqa: E402
from torchrec_lookahead.data.torchrec_batches import criteo_batch, feature_names  # noqa: E402


def mean_seconds(call, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--scale", type=float, default=0.01)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)

    data = SyntheticCriteo(scale=args.scale)
    weighted = dict.fromkeys(feature_names(data), False)
    rows = list(data.num_embeddings)
    batches = {size: criteo_batch(data, 0, size) for size in args.batch_sizes}

    def structure(size: int) -> None:
        check_batch(batches[size], weighted, "step 0")

    def ids(size: int) -> None:
        features = batches[size].sparse_features
        check_feature_ids(
            features.values().numpy(), features.length_per_key(), features.keys(), rows, "step 0"
        )

    checks = {"structure": structure, "ids": ids}
    samples: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for size in args.batch_sizes:
            for name, check in checks.items():
                check(size)  # warm
                seconds = mean_seconds(lambda: check(size), args.calls)  # noqa: B023
                samples.setdefault((name, size), []).append(seconds)
    results = [
        {
            "check": name,
            "batch_size": size,
            "ids": batches[size].sparse_features.values().numel(),
            "ms": 1000 * statistics.median(times),
            "ms_runs": [1000 * t for t in times],
        }
        for (name, size), times in samples.items()
    ]
    print(f"{'check':>10}{'batch':>8}{'ids':>9}{'ms / batch (median)':>22}")
    for r in results:
        print(f"{r['check']:>10}{r['batch_size']:>8}{r['ids']:>9}{r['ms']:>22.3f}")
    report = {"machine": machine(), "config": vars(args), "results": results}
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
