"""What a planning thread costs the trainer's launches through the GIL, on the CPU.

On a GPU the trainer's thread launches a step's kernels (a few microseconds of Python
and dispatch each, holding the GIL) and then waits for the device (not holding it). A
planning thread beside it takes the GIL whenever it runs Python or dispatches a torch
op: the host planner seldom (its passes are numba, without the GIL), the device
planner for each of its ~200 ops a batch. Where both want the GIL, the trainer's
launches wait. This times a stand-in trainer: --steps steps, each --ops small torch
ops (its launches) and then --device-ms of sleep (its wait for the device, the GIL
released), alone and beside a planning thread that plans one batch as each step
starts (as the lookahead stage does once its queue is full: it plans a batch when the
trainer takes one):

* ``host``: the host planner, an unsharded module's ``prepare`` and ``enter`` at
  ``planning.py``'s shape (--batch-size samples, --fraction cache);
* ``device``: the device oracle's ``push_device`` over batches of --device-ids ids.
  On the CPU (``--device cpu``, the default) they are small, so that its ops cost
  about their dispatch, as a GPU's launches do; with ``--device cuda`` the oracle and
  the trainer's ops run on the GPU, and the batches can have a real batch's ids
  (8,192 samples of 26 features: 212,992).

Per setting: the trainer's launch ms per step (median and 90th percentile over the
steps after --warmup), the same net of the time its thread waited for a core (Linux's
``schedstat``: run-queue wait; what is left is its own work and its waits for the
GIL; on a 2-core VM a woken planner often lands on the trainer's core), and the
planner's wall ms per batch (median). Each repeat runs
every setting in turn; a figure is the median over repeats. Prints a table, writes
``OUT/report.json``. A stand-in trainer: it shows the GIL's share, not a step time.

    python benchmarks/gil.py --out results/gil
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
from common import machine, write_report
from planning import planned_module
from tqdm import tqdm

from torchrec_lookahead import DeviceOracleCacher

SETTINGS = ("alone", "host", "device")


def host_planner(args: argparse.Namespace) -> Callable[[int], None]:
    """Plans the module's batch of ``step`` (the batches reused, the steps counting on)."""
    module, batches = planned_module(args, args.batch_size, args.fraction, 1)

    def plan(step: int) -> None:
        module.enter(module.prepare(batches[step % len(batches)], step))

    return plan


def device_planner(args: argparse.Namespace) -> Callable[[int], None]:
    """Pushes a batch of --device-ids ids into a device oracle on CPU tensors."""
    rows = 64 * args.device_ids
    oracle = DeviceOracleCacher(4 * args.device_ids, args.lookahead, 1, rows, args.device)
    generator = torch.Generator().manual_seed(args.seed)
    batches = [
        torch.randint(0, rows, (args.device_ids,), generator=generator).to(args.device)
        for _ in range(64)
    ]

    def plan(step: int) -> None:
        oracle.push_device(batches[step % len(batches)])

    return plan


def queued_seconds() -> float:
    """Seconds this thread has waited on a run queue for a core (0 where Linux's
    ``schedstat`` is missing)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except OSError:
        return 0.0


def trainer(
    args: argparse.Namespace, step_started: threading.Semaphore
) -> tuple[list[float], list[float]]:
    """Each step's launch seconds (--ops small ops, then --device-ms without the GIL), and
    the same net of the thread's run-queue wait."""
    x = torch.zeros(16, device=args.device)
    launches, net = [], []
    for _ in range(args.steps):
        step_started.release()
        queued, started = queued_seconds(), time.perf_counter()
        for _ in range(args.ops):
            x = x + 1
        launches.append(time.perf_counter() - started)
        net.append(launches[-1] - (queued_seconds() - queued))
        time.sleep(args.device_ms / 1000)
    return launches[args.warmup :], net[args.warmup :]


def run(args: argparse.Namespace, setting: str) -> dict:
    """The trainer's steps beside ``setting``'s planner, one batch planned a step."""
    planning, stop, step_started = [], threading.Event(), threading.Semaphore(0)
    planner = {"host": host_planner, "device": device_planner}.get(setting)
    thread = None
    if planner is not None:
        plan = planner(args)
        plan(0)  # the first batch sizes the cache and loads the kernels

        def plan_as_steps_start() -> None:
            while not stop.is_set():
                if step_started.acquire(timeout=0.05):
                    started = time.perf_counter()
                    plan(len(planning) + 1)
                    if args.device.type == "cuda":
                        torch.cuda.synchronize()  # the batch planned, not only launched
                    planning.append(time.perf_counter() - started)

        thread = threading.Thread(target=plan_as_steps_start, name="planning")
        thread.start()
    try:
        launches, net = trainer(args, step_started)
    finally:
        stop.set()
        if thread is not None:
            thread.join()
    return {
        "launch_ms": 1000 * statistics.median(launches),
        "launch_p90_ms": 1000 * float(np.percentile(launches, 90)),
        "net_ms": 1000 * statistics.median(net),
        "net_p90_ms": 1000 * float(np.percentile(net, 90)),
        "plan_ms": 1000 * statistics.median(planning) if planning else 0.0,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    p.add_argument("--device", type=torch.device, default=torch.device("cpu"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--ops", type=int, default=106, help="launches a step (lookahead's, fake CUDA)")
    p.add_argument("--device-ms", type=float, default=8.0, help="the device's step (H200: 8.7)")
    p.add_argument("--batch-size", type=int, default=8192)
    p.add_argument("--fraction", type=float, default=0.05)
    p.add_argument("--device-ids", type=int, default=32)
    p.add_argument("--scale", type=float, default=0.1)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dim", type=int, default=8, help="row width (planning ignores it)")
    p.add_argument("--lookahead", type=int, default=16)
    p.add_argument("--batches", type=int, default=24, help="host batches, reused in turn")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")

    runs: dict[str, list[dict]] = {s: [] for s in args.settings}
    with tqdm(total=args.repeats * len(args.settings), desc="gil") as progress:
        for _ in range(args.repeats):
            for setting in args.settings:
                progress.set_postfix_str(setting)
                runs[setting].append(run(args, setting))
                progress.update()
    results = [
        {
            "setting": s,
            **{k: statistics.median(r[k] for r in runs[s]) for k in runs[s][0]},
            "launch_ms_runs": [r["launch_ms"] for r in runs[s]],
        }
        for s in args.settings
    ]
    print(f"{'planner':>8}{'launch ms':>11}{'p90':>8}{'net ms':>9}{'p90':>8}{'plan ms':>9}")
    for r in results:
        print(
            f"{r['setting']:>8}{r['launch_ms']:>11.3f}{r['launch_p90_ms']:>8.3f}"
            f"{r['net_ms']:>9.3f}{r['net_p90_ms']:>8.3f}{r['plan_ms']:>9.3f}"
        )
    config = {**vars(args), "device": str(args.device)}
    report = {"machine": machine(), "config": config, "results": results}
    write_report(args.out, report)
    return report


if __name__ == "__main__":
    main()
