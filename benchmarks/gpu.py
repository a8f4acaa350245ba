"""Step time on one GPU: every table in HBM, FBGEMM's UVM cache, and lookahead caching.

DLRM on Criteo-shaped synthetic batches (26 tables of Criteo Kaggle's sizes
times --scale, Zipf ids), row-wise Adagrad, under ``DistributedModelParallel``
at world size 1 over NCCL, table-wise. The settings:

* ``fused``: TorchRec with every table in HBM (the limit), ``TrainPipelineSparseDist``;
* ``uvm-lru`` / ``uvm-lfu``: TorchRec's ``fused_uvm_caching`` (FBGEMM's LRU or LFU
  cache of --cache-fractions of each table in HBM, the rest in UVM) with
  ``PrefetchTrainPipelineSparseDist`` (one batch prefetched into the cache);
* ``lookahead`` / ``lookahead-device``: this project's sharder and pipeline at the same
  fractions, its plans made on the host (the numba oracle) or on the device.

A figure is the median step time of --steps steps after --warmup; with --repeats, the
median over rounds that run every setting in turn. A step's time is the device's,
between CUDA events recorded on the trainer's stream after consecutive steps: nothing
waits for the device between steps, as in training, so a pipeline's work on other
streams and threads overlaps the next step as it would there (``--sync-each-step``
synchronises the device around each step instead, the measure of the first two leases;
it charges a step with its launch time and with side work that would overlap). The data
runs on past the last step timed, so no timed step is one of the window's draining
steps, which enter no batch. Also reported: the steady steps' times; the peak HBM the
setting allocated (above what an earlier setting left); for lookahead, per step after
warm-up, the bytes its cache moved (rows and their optimizer state, both ways), how long
the trainer waited for the stage's planned batch, and the stage threads' CPU time (input
dist and planning), which say whether the stage bounds the step. For every setting, per
step after warm-up (medians), the host's CPU as ``host_cost.py`` counts it on the CPU
(``thread_cpu.py``): the trainer thread's, and every thread's the setting started
(lookahead's reader, planner and executor), issue 40's two host goals measured on a GPU
host; a thread that waits for the device spins, so its wait counts. Prints one table,
writes ``OUT/report.json``. Needs a GPU (``make gpu-check`` runs it; its runs on an H200
are in ``docs/results.md``).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import dlrm_train, machine, over_rounds, write_report
from thread_cpu import StepCpu
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.train_pipelines import PrefetchTrainPipelineSparseDist
from torchrec.distributed.types import CacheAlgorithm, CacheParams
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_lookahead import (
    LookaheadEmbeddingBagCollection,
    LookaheadEmbeddingBagCollectionSharder,
    LookaheadTrainPipeline,
)
from torchrec_lookahead._compat import every_thread_and_wait
from torchrec_lookahead.data import SyntheticCriteo
from torchrec_lookahead.data.torchrec_batches import criteo_batch, feature_names

ALGORITHMS = {"uvm-lru": CacheAlgorithm.LRU, "uvm-lfu": CacheAlgorithm.LFU}
STAGE_THREAD = {"default": None, "inline": False, "thread": True}  # --stage: stage_thread=


# Lookahead's settings, by where its plans are made (LookaheadTrainPipeline's planner=).
PLANNED = {"lookahead": "host", "lookahead-device": "device"}
KINDS = ["fused", *ALGORITHMS, *PLANNED]
# A setting's figures reported as their median over rounds (with --repeats).
MEDIANS = ("step_ms", "trainer_cpu_ms", "other_threads_cpu_ms")


def settings(fractions: list[float], kinds: list[str]) -> list[tuple[str, float | None]]:
    """(kind, cache fraction) for each measured setting: fused (no cache) once, then every
    cached kind at one fraction before the next, so a run stopped early has whole fractions."""
    return [(k, None) for k in KINDS if k == "fused" and k in kinds] + [
        (k, f) for f in fractions for k in KINDS if k != "fused" and k in kinds
    ]


def build(kind: str, fraction: float | None, args: argparse.Namespace, device: torch.device):
    data = SyntheticCriteo(scale=args.scale, zipf_exponent=args.zipf, seed=args.seed)
    tables = [
        EmbeddingBagConfig(
            name=f"t_{name}", embedding_dim=args.dim, num_embeddings=rows, feature_names=[name]
        )
        for name, rows in zip(feature_names(data), data.num_embeddings)
    ]
    meta = torch.device("meta")
    if kind in PLANNED:
        ebc = LookaheadEmbeddingBagCollection(tables, device=meta, cache_load_factor=fraction)
        sharders = [LookaheadEmbeddingBagCollectionSharder()]
    else:
        ebc = EmbeddingBagCollection(tables, device=meta)
        sharders = [EmbeddingBagCollectionSharder()]
    model = dlrm_train(ebc, args.dim, args.seed, device)
    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.05})
    kernel = "fused" if kind == "fused" else "fused_uvm_caching"
    cache = None
    if kind in ALGORITHMS:
        cache = CacheParams(algorithm=ALGORITHMS[kind], load_factor=fraction)
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=["table_wise"], compute_kernels=[kernel], cache_params=cache
        )
        for t in tables
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cuda"),
        batch_size=args.batch_size,
        constraints=constraints,
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.1),
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    if kind in PLANNED:
        pipeline = LookaheadTrainPipeline(
            dmp,
            optimizer,
            device,
            lookahead=args.lookahead,
            planning_workers=args.planning_workers if PLANNED[kind] == "host" else 1,
            stage_thread=STAGE_THREAD[args.stage],
            planner=PLANNED[kind],
        )
        return pipeline, data
    if kind in ALGORITHMS:
        return PrefetchTrainPipelineSparseDist(dmp, optimizer, device), data
    return TrainPipelineSparseDist(dmp, optimizer, device), data


def measure(
    kind: str, fraction: float | None, args: argparse.Namespace, device: torch.device
) -> dict:
    gc.collect()  # the last setting's model and pipeline (reference cycles) leave HBM
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    cpu = StepCpu()  # the threads the setting starts, not the process group's
    pipeline, data = build(kind, fraction, args, device)
    # Every timed step is a steady one: lookahead's window holds L + d + 1 batches (d = 1),
    # so the data runs that far past the last step taken. A step after the data ran out
    # (the window draining) enters no batch and would flatter lookahead.
    ahead = args.lookahead + 2
    total = args.steps + args.profile_steps + ahead
    batches = iter([criteo_batch(data, s, args.batch_size) for s in range(total)])
    split = Split(pipeline if kind in PLANNED else None)
    timed = step_times_synchronised if args.sync_each_step else step_times_by_events
    times = timed(pipeline, batches, args, split, cpu)
    steady = times[args.warmup :]
    result = {
        "setting": kind,
        "cache_fraction": fraction,
        "steps": len(times),
        "step_ms": 1000 * statistics.median(steady),
        "samples_per_s": args.batch_size / statistics.median(steady),
        "peak_hbm_mb": (torch.cuda.max_memory_allocated(device) - left) / 2**20,
        "bytes_moved_per_step": split.bytes_per_step(len(steady)),
        "steady_step_ms": [1000 * t for t in steady],
        **split.per_step_ms(len(steady)),
        **cpu.summary(args.warmup),
    }
    if args.profile_steps:
        name = kind if fraction is None else f"{kind}_{fraction:g}"
        trace = Path(args.out) / f"trace_{name}.json.gz"
        result["profile"] = profile(pipeline, batches, args.profile_steps, device, trace)
        result["trace"] = trace.name
    if isinstance(pipeline, LookaheadTrainPipeline):
        pipeline.close()  # its stage still holds the batches past the last step
    return result


def step_times_by_events(
    pipeline: Any, batches: Iterator[Any], args: argparse.Namespace, split: Split, cpu: StepCpu
) -> list[float]:
    """Seconds per step, from CUDA events recorded after each step on the trainer's
    stream; the device is synchronised once, after the last. ``cpu`` counts each step's
    CPU by thread."""
    marks = [torch.cuda.Event(enable_timing=True)]
    marks[0].record()
    for step in range(args.steps):
        if step == args.warmup:
            split.start()
        with cpu.step():
            pipeline.progress(batches)
        marks.append(torch.cuda.Event(enable_timing=True))
        marks[-1].record()
    marks[-1].synchronize()
    return [before.elapsed_time(after) / 1000 for before, after in zip(marks, marks[1:])]


def step_times_synchronised(
    pipeline: Any, batches: Iterator[Any], args: argparse.Namespace, split: Split, cpu: StepCpu
) -> list[float]:
    """Seconds per step, the device synchronised before and after each (the wait for it
    counted in ``cpu``'s step, by a thread that spins)."""
    times = []
    for step in range(args.steps):
        if step == args.warmup:
            split.start()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with cpu.step():
            pipeline.progress(batches)
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def profile(
    pipeline: Any, batches: Iterator[Any], steps: int, device: torch.device, trace: Path
) -> str:
    """Where ``steps`` more steps' time goes, by operator: torch.profiler's table (every
    thread's CPU ops and the device's kernels), sorted by device time. Its timeline,
    every stream's kernels beside the host's ops (where a stream waits, and on what),
    goes to ``trace`` (Chrome's trace format, gzipped: open it in Perfetto; with
    --repeats, the last round's)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    # Every thread's ops (the stage's, the executor's), and the device's waits on events.
    config = every_thread_and_wait()
    with torch.profiler.profile(activities=activities, experimental_config=config) as prof:
        for _ in range(steps):
            pipeline.progress(batches)
        torch.cuda.synchronize(device)
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    return prof.key_averages().table(sort_by="self_device_time_total", row_limit=30)


HEADER = (
    f"{'setting':>17}{'cache':>8}{'step ms':>10}{'samples/s':>12}{'peak HBM MB':>13}"
    f"{'MiB moved':>11}{'stage wait':>12}{'stage CPU':>11}{'trainer CPU':>13}{'other CPU':>11}"
)


def line(r: dict) -> str:
    """One setting's row of the table under HEADER."""
    share = "-" if r["cache_fraction"] is None else f"{r['cache_fraction']:.0%}"
    stage_cpu = sum(v for k, v in r.items() if k.startswith("stage_cpu_"))
    wait, cpu = (f"{r['stage_ms']:.2f}", f"{stage_cpu:.2f}") if "stage_ms" in r else ("-", "-")
    moved = r["bytes_moved_per_step"]
    mib = "-" if moved is None else f"{moved / 2**20:.2f}"
    return (
        f"{r['setting']:>17}{share:>8}{r['step_ms']:>10.2f}{r['samples_per_s']:>12,.0f}"
        f"{r['peak_hbm_mb']:>13,.0f}{mib:>11}{wait:>12}{cpu:>11}"
        f"{r['trainer_cpu_ms']:>13.2f}{r['other_threads_cpu_ms']:>11.2f}"
    )


def summarised(rounds: list[list[dict]], batch_size: int) -> list[dict]:
    """Each setting's figures over ``rounds`` (each a list of every setting's ``measure``
    result, in one order): the median round's of :data:`MEDIANS`, and per round those and
    the steady steps' times (see ``common.over_rounds``)."""
    results = over_rounds(rounds, MEDIANS, kept=["steady_step_ms"])
    for r in results:
        r["samples_per_s"] = batch_size * 1000 / r["step_ms"]
    return results


class Split:
    """Where a lookahead step's time goes, per step after warm-up: the trainer's wait for
    the stage's next planned batch and for rows to land, and the stage thread's own CPU
    (input dist and planning). Empty for the other settings."""

    def __init__(self, pipeline: LookaheadTrainPipeline | None) -> None:
        self._pipeline = pipeline
        self._at_start: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        assert self._pipeline is not None
        stage = {f"stage_cpu_{k}": v for k, v in self._pipeline.stage_timings.items()}
        moved = float(self._pipeline.cache_metrics()["total"].bytes_moved)
        return {**self._pipeline.timings, **stage, "bytes_moved": moved}

    def start(self) -> None:
        if self._pipeline is not None:
            self._at_start = self._now()

    def per_step_ms(self, steps: int) -> dict[str, float]:
        if self._pipeline is None or not self._at_start or not steps:
            return {}
        now = self._now()
        return {
            k.removesuffix("_s") + "_ms": 1000 * (now[k] - self._at_start.get(k, 0.0)) / steps
            for k in now
            if k.endswith("_s")
        }

    def bytes_per_step(self, steps: int) -> float | None:
        """Bytes the cache moved between device and store per step after warm-up (rows and
        their optimizer state, fetched and written back); None for the other settings."""
        if self._pipeline is None or not self._at_start or not steps:
            return None
        return (self._now()["bytes_moved"] - self._at_start["bytes_moved"]) / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--scale", type=float, default=0.1)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--lookahead", type=int, default=16)
    p.add_argument(
        "--stage",
        choices=list(STAGE_THREAD),
        default="default",
        help="lookahead's stage: the library's default (inline on CUDA), or on its thread",
    )
    p.add_argument("--planning-workers", type=int, default=1, help="lookahead's planning threads")
    p.add_argument(
        "--settings",
        nargs="+",
        choices=KINDS,
        default=KINDS,
        help="the settings measured (a short lease can trim them)",
    )
    p.add_argument("--cache-fractions", type=float, nargs="+", default=[0.02, 0.05, 0.10])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="rounds over every setting, alternated")
    p.add_argument(
        "--sync-each-step",
        action="store_true",
        help="synchronise the device around each step (the earlier leases' measure)",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="steps profiled after the timed ones (torch.profiler's table in the JSON, "
        "its timeline in OUT/trace_<setting>.json.gz)",
    )
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        p.error("--warmup must be at least 0 and below --steps")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here; it needs a GPU", file=sys.stderr)
        return 1
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    rounds: list[list[dict]] = []
    print(HEADER, flush=True)
    try:  # every setting once per round, so drift on the machine spreads over all of them
        for _ in range(args.repeats):
            rounds.append([])
            for kind, fraction in settings(args.cache_fractions, args.settings):
                result = measure(kind, fraction, args, device)
                rounds[-1].append(result)
                print(line(result), flush=True)  # a run stopped early keeps these
                print(result.get("profile", ""), end="", flush=True)
    finally:
        dist.destroy_process_group()
    results = summarised(rounds, args.batch_size)
    print(f"medians over {args.repeats} round(s)\n{HEADER}")
    for r in results:
        print(line(r))
    report = {
        "machine": machine(),
        "gpu": torch.cuda.get_device_name(device),
        "config": vars(args),
        "results": results,
    }
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
