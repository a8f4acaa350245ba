"""What the host planner pays per batch: the lookahead stage's ``prepare`` and ``enter``.

On a GPU a planning thread makes each batch's plan beside the trainer's thread (the
ids' check and pool ids, the oracle's three compiled passes, the per-table counts,
the step's slots); where that takes longer than a step, the trainer waits for it (on
an H200 at ``gpu.py``'s shape, 1.4-1.9 ms a step: ``docs/results.md``). This drives
an unsharded ``LookaheadEmbeddingBagCollection`` on CPU tensors through those two
calls, batch after batch, at ``gpu.py``'s shape (26 tables of Criteo Kaggle's sizes
times --scale, Zipf ids, L = 16, d = 1), and reports per batch:

* CPU ms of the calling thread and wall ms (with ``--workers`` > 1 the partitions'
  threads add CPU the first does not show; the wall time is what a step waits);
* minor page faults of the process (every thread): a batch-sized buffer allocated
  afresh faults its pages in, a microsecond or so each;
* interpreter calls of the calling thread (Python functions and builtins, counted
  with ``sys.setprofile`` on batches between the timed ones): each holds the GIL,
  which the trainer's thread needs to launch its step; the compiled passes run
  without it. An exact count.

Planning does not depend on the rows' width, so the tables are --dim wide (small, to
keep the store small). Each repeat runs every setting in turn (alternating, so drift
hits all alike); a figure is the median over repeats of the median over the batches
after --warmup. Prints a table, writes ``OUT/report.json``.

    python benchmarks/planning.py --out results/planning
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from typing import Any

import torch
from common import machine, write_report
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from tqdm import tqdm

from torchrec_lookahead import LookaheadEmbeddingBagCollection
from torchrec_lookahead.data import SyntheticCriteo
from torchrec_lookahead.data.torchrec_batches import criteo_batch, feature_names
from torchrec_lookahead.settings import WindowSettings


def setting_name(batch_size: int, fraction: float, workers: int) -> str:
    """A setting as the progress bar shows it."""
    return f"{batch_size} samples, {fraction:.0%} cache, {workers} worker(s)"


def planned_module(
    args: argparse.Namespace, batch_size: int, fraction: float, workers: int
) -> tuple[LookaheadEmbeddingBagCollection, list[KeyedJaggedTensor]]:
    """An unsharded module at the shape of ``args`` (--scale, --zipf, --seed, --dim,
    --lookahead), its window open, and --batches batches of ``batch_size`` samples."""
    data = SyntheticCriteo(scale=args.scale, zipf_exponent=args.zipf, seed=args.seed)
    tables = [
        EmbeddingBagConfig(
            name=f"t_{name}", embedding_dim=args.dim, num_embeddings=rows, feature_names=[name]
        )
        for name, rows in zip(feature_names(data), data.num_embeddings)
    ]
    module = LookaheadEmbeddingBagCollection(
        tables,
        device=torch.device("cpu"),
        cache_load_factor=fraction,
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05},
    )
    module.open_window(WindowSettings(args.lookahead, 1, planning_workers=workers))
    batches = [criteo_batch(data, s, batch_size).sparse_features for s in range(args.batches)]
    return module, batches


def run(args: argparse.Namespace, batch_size: int, fraction: float, workers: int) -> dict:
    """Plan --batches batches once; per-batch CPU and wall seconds, and calls counted."""
    module, batches = planned_module(args, batch_size, fraction, workers)
    cpu, wall, calls, faults = [], [], [], []
    count = [0]

    def counter(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            count[0] += 1

    for step, features in enumerate(batches):
        counted = step >= args.warmup and step % 2  # every other batch: counted, not timed
        count[0] = 0
        if counted:
            sys.setprofile(counter)
        started, started_wall = time.thread_time(), time.perf_counter()
        started_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        module.enter(module.prepare(features, step))
        spent, spent_wall = time.thread_time() - started, time.perf_counter() - started_wall
        faulted = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - started_faults
        sys.setprofile(None)
        if counted:
            calls.append(count[0])
        elif step >= args.warmup:
            cpu.append(spent)
            wall.append(spent_wall)
            faults.append(faulted)
    return {
        "ids_per_batch": int(batches[0].values().numel()),
        "cpu_ms": 1000 * statistics.median(cpu),
        "wall_ms": 1000 * statistics.median(wall),
        "calls": int(statistics.median(calls)),
        "faults": statistics.median(faults),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--scale", type=float, default=0.1)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dim", type=int, default=8, help="row width (planning ignores it)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--fractions", type=float, nargs="+", default=[0.02, 0.05, 0.1])
    p.add_argument("--workers", type=int, nargs="+", default=[1])
    p.add_argument("--lookahead", type=int, default=16)
    p.add_argument("--batches", type=int, default=60)
    p.add_argument("--warmup", type=int, default=20, help="batches before any is timed")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.batches < args.warmup + 2:
        p.error("--batches must exceed --warmup by at least 2 (one timed, one counted)")

    settings = [(b, f, w) for b in args.batch_sizes for f in args.fractions for w in args.workers]
    runs: dict[tuple[int, float, int], list[dict]] = {s: [] for s in settings}
    with tqdm(total=args.repeats * len(settings), desc="planning") as progress:
        for _ in range(args.repeats):
            for setting in settings:
                progress.set_postfix_str(setting_name(*setting))
                runs[setting].append(run(args, *setting))
                progress.update()
    results = [
        {
            "batch_size": b,
            "cache_fraction": f,
            "workers": w,
            "ids_per_batch": runs[(b, f, w)][0]["ids_per_batch"],
            "cpu_ms": statistics.median(r["cpu_ms"] for r in runs[(b, f, w)]),
            "wall_ms": statistics.median(r["wall_ms"] for r in runs[(b, f, w)]),
            "calls": int(statistics.median(r["calls"] for r in runs[(b, f, w)])),
            "faults": statistics.median(r["faults"] for r in runs[(b, f, w)]),
            "cpu_ms_runs": [r["cpu_ms"] for r in runs[(b, f, w)]],
            "wall_ms_runs": [r["wall_ms"] for r in runs[(b, f, w)]],
        }
        for b, f, w in settings
    ]
    print(
        f"{'batch':>7}{'ids':>9}{'cache':>7}{'workers':>9}{'CPU ms':>9}{'wall ms':>9}"
        f"{'calls':>7}{'faults':>8}"
    )
    for r in results:
        print(
            f"{r['batch_size']:>7}{r['ids_per_batch']:>9}{r['cache_fraction']:>7.0%}"
            f"{r['workers']:>9}{r['cpu_ms']:>9.2f}{r['wall_ms']:>9.2f}{r['calls']:>7}"
            f"{r['faults']:>8.0f}"
        )
    report = {"machine": machine(), "config": vars(args), "results": results}
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
