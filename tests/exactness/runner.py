"""Draw configurations, train each both ways, report (``python -m tests.exactness``).

Configurations of one world size run in one spawned group of gloo ranks, one
after another; rank 0 prints a line per configuration as it ends. A rank that
fails (an exception, a hang past the collectives' timeout) ends its group; the
configuration it was on is reported failed and the rest run in a new group.
The last line is ``exactness: K of N configurations agree``; the exit status
is non-zero unless all do.

Environment (or flags): ``EXACTNESS_CONFIGS`` (N, default 20), ``EXACTNESS_SEED``
(default 0), ``EXACTNESS_ONLY`` (comma-separated indices: run just those),
``EXACTNESS_HOT_ROWS=1`` (every configuration with replicated hot rows).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.exactness.compare import compare
from tests.exactness.configs import Config, draw
from tests.launch import free_port, spawn
from torchrec_lookahead._compat import destroy_group, live_groups

TIMEOUT = timedelta(seconds=180)  # a collective waiting longer: a rank failed


def _quiet() -> None:
    """TorchRec's planner and torch warn about their own internals on every model built
    (thousands of lines a run); the harness reports only what it finds."""
    warnings.filterwarnings("ignore")
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger("torch").setLevel(logging.ERROR)


def _worker(rank: int, world_size: int, port: int, configs: list[Config], log: str) -> None:
    _quiet()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=TIMEOUT,
    )
    try:
        for config in configs:
            if rank == 0:
                _append(log, {"index": config.index, "started": True})
            start = time.perf_counter()
            groups = live_groups()
            divergence, worst, growths = compare(config, rank)
            for group in live_groups() - groups:  # its models' own (hot rows'), gone with them
                destroy_group(group)
            found = [None] * world_size
            mine = (
                None if divergence is None else (divergence.step, divergence.what, divergence.gap)
            )
            dist.all_gather_object(found, (mine, worst, growths))
            if rank == 0:
                grown = sum(g for _, _, g in found)
                first = min(
                    (d for d, _, _ in found if d is not None),
                    key=lambda d: d[0] if d[0] >= 0 else 1 << 30,
                    default=None,
                )
                _append(
                    log,
                    {
                        "index": config.index,
                        "divergence": first,
                        "worst": max(w for _, w, _ in found),
                        "growths": grown,
                        "seconds": time.perf_counter() - start,
                    },
                )
                seconds = time.perf_counter() - start
                print(_line(config, first, max(w for _, w, _ in found), grown, seconds), flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _append(log: str, record: dict) -> None:
    with open(log, "a") as f:
        f.write(json.dumps(record) + "\n")


def _line(config: Config, divergence, worst: float, growths: int, seconds: float) -> str:  # noqa: ANN001
    if divergence is None:
        verdict = "bitwise equal" if worst == 0 else f"within {config.tolerance:g} ({worst:.2g})"
    else:
        step, what, gap = divergence
        where = "the end" if step < 0 else f"step {step}"
        first, _, rest = what.partition(" (")
        verdict = f"DIFFERENT at {where}: {first} by {gap:.3g}" + (f" ({rest}" if rest else "")
    grew = f"  (caches grew {growths}x)" if growths else ""
    return f"[{config.index:>4}] {verdict:<28} {seconds:5.1f} s  {config.describe()}{grew}"


def _run_group(world_size: int, configs: list[Config]) -> dict[int, dict]:
    """Run ``configs`` in groups of ``world_size`` ranks; the result of each by index."""
    results: dict[int, dict] = {}
    left = list(configs)
    while left:
        log = tempfile.mktemp(prefix="exactness-", suffix=".jsonl")
        try:
            spawn(_worker, (world_size, free_port(), left, log), nprocs=world_size)
            error = None
        except Exception as caught:  # a rank failed: the group ended
            error = str(caught).strip().splitlines()[-1][:300]
        records = (
            [json.loads(line) for line in Path(log).read_text().splitlines()]
            if Path(log).exists()
            else []
        )
        Path(log).unlink(missing_ok=True)
        for record in records:
            if "divergence" in record:
                results[record["index"]] = record
        started = [r["index"] for r in records if r.get("started")]
        failed = next((i for i in started if i not in results), None)
        if error is not None:
            if failed is None:  # failed before it started any (set-up)
                failed = left[0].index
            results[failed] = {"index": failed, "error": error}
            config = next(c for c in left if c.index == failed)
            print(f"[{failed:>4}] FAILED: {error}  {config.describe()}", flush=True)
        left = [c for c in left if c.index not in results]
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", type=int, default=int(os.environ.get("EXACTNESS_CONFIGS", 20)))
    p.add_argument("--seed", type=int, default=int(os.environ.get("EXACTNESS_SEED", 0)))
    p.add_argument("--only", default=os.environ.get("EXACTNESS_ONLY", ""))
    p.add_argument(
        "--hot-rows",
        action="store_true",
        default=os.environ.get("EXACTNESS_HOT_ROWS", "") not in ("", "0"),
        help="every configuration with replicated hot rows, at 2 or 4 ranks",
    )
    args = p.parse_args(argv)
    indices = (
        [int(i) for i in args.only.split(",") if i.strip()]
        if args.only
        else list(range(args.configs))
    )
    configs = [draw(args.seed, i, args.hot_rows) for i in indices]
    kind = " with hot rows" if args.hot_rows else ""
    print(f"exactness: {len(configs)} configurations{kind} from seed {args.seed}", flush=True)
    start = time.perf_counter()
    results: dict[int, dict] = {}
    for world_size in sorted({c.world_size for c in configs}):
        results.update(_run_group(world_size, [c for c in configs if c.world_size == world_size]))
    bad = [i for i in indices if results[i].get("error") or results[i].get("divergence")]
    for i in bad:
        record = results[i]
        print(
            f"diverged: configuration {i} of seed {args.seed}: "
            f"{record.get('error') or record['divergence']}  (rerun it alone: "
            f"EXACTNESS_SEED={args.seed} EXACTNESS_ONLY={i}"
            f"{' EXACTNESS_HOT_ROWS=1' if args.hot_rows else ''} make exactness)"
        )
    grew = [i for i in indices if results[i].get("growths")]
    print(f"caches grew in {len(grew)} of {len(indices)} configurations")
    sequence = [c for c in configs if c.sequences]
    mixed = sum(bool(c.bags) for c in sequence)
    print(
        f"sequence tables in {len(sequence)} of {len(indices)} configurations "
        f"({mixed} beside bag tables)"
    )
    print(f"took {time.perf_counter() - start:.0f} s")
    print(f"exactness: {len(indices) - len(bad)} of {len(indices)} configurations agree")
    return 1 if bad else 0
