"""Training through failures: what a lost rank costs, and what a checkpoint costs.

Runs the DLRM example (``examples/dlrm/dlrm_main.py``) under ``torchrun
--standalone --max-restarts 3`` and measures two things:

* **Checkpoint stall**: the time each save holds the training loop (the
  cache written back, then either the whole DCP save or, with
  ``--async_checkpoint``, a copy of the state to CPU memory), against one
  training step, synchronous and asynchronous. Checkpoints every
  ``--save-every`` steps; every save of every repeat counts (slowest rank).
* **Time lost per failure** against the checkpoint interval: a rank is
  SIGKILLed after a random step (seeded); torchrun restarts the worker group,
  which resumes from the latest checkpoint and redoes the steps after it. The
  loss is the job's wall time minus that of the same job without the failure;
  what the redone steps do not explain is the restart (processes, process
  groups, model, loading the checkpoint, refilling the window).

Writes ``report.json`` into --out and prints both tables.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

from common import example_flags, machine, run_example


def launch(args: argparse.Namespace, work: Path, *flags: str) -> tuple[float, dict]:
    """One torchrun job of the example (checkpointing into a folder of its own); returns
    its wall seconds and its summary."""
    flags = [
        *example_flags(args.scale, args.batch_size, args.steps, args.data_cache),
        "--save_dir",
        str(Path(tempfile.mkdtemp(dir=work)) / "ckpt"),
        *flags,
    ]
    return run_example(work, args.world_size, flags, restarts=3)


def stall(args: argparse.Namespace, work: Path) -> dict:
    """Checkpoint stall per save, synchronous and asynchronous."""
    result = {}
    for mode, flags in (("sync", []), ("async", ["--async_checkpoint"])):
        stalls, steps, train = [], [], []
        for _ in range(args.repeats):
            _, summary = launch(args, work, "--checkpoint_every", str(args.save_every), *flags)
            run = summary["runs"][0]
            stalls += run["checkpoint_stall_s"]
            steps += run["step_s"]
            train.append(sum(run["step_s"]) + sum(run["checkpoint_stall_s"]))
        step_ms = 1000 * statistics.median(steps)
        stall_ms = 1000 * statistics.median(stalls)
        result[mode] = {
            "saves": len(stalls),
            "stall_ms": stall_ms,
            "stall_ms_max": 1000 * max(stalls),
            "step_ms": step_ms,
            "stall_per_step": stall_ms / step_ms,
            "train_s": statistics.median(train),
        }
    return result


def failures(args: argparse.Namespace, work: Path) -> list[dict]:
    """Time lost per failure (restart + redone steps) for each checkpoint interval."""
    rng = random.Random(args.seed)
    flags = ["--async_checkpoint"] if args.mode == "async" else []
    rows = []
    for interval in args.intervals:
        every = ["--checkpoint_every", str(interval), *flags]
        clean, lost, redone, restart = [], [], [], []
        for _ in range(args.repeats):
            seconds, summary = launch(args, work, *every)
            step_s = statistics.median(summary["runs"][0]["step_s"])
            clean.append(seconds)
            # After the first checkpoint step (an asynchronous one may not be published yet,
            # then the restart begins at step 0), with steps left for the resumed run.
            step, rank = rng.randint(interval + 1, args.steps - 1), rng.randrange(args.world_size)
            kill = ["--fail_at_step", str(step), "--fail_rank", str(rank)]
            failed_s, failed = launch(args, work, *every, *kill)
            steps = step - failed["runs"][0]["first_step"]
            lost.append(failed_s - seconds)
            redone.append(steps)
            restart.append(failed_s - seconds - steps * step_s)
        rows.append(
            {
                "interval": interval,
                "clean_s": statistics.median(clean),
                "lost_s": statistics.median(lost),
                "redone_steps": statistics.median(redone),
                "restart_s": statistics.median(restart),
                "lost_s_all": lost,
                "redone_all": redone,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/failures"))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=2048, help="per rank")
    parser.add_argument("--scale", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=5, help="steps, for the stall")
    parser.add_argument("--intervals", type=int, nargs="+", default=[10, 20, 40])
    parser.add_argument(
        "--mode", choices=["async", "sync"], default="async", help="checkpoints of the failure runs"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-cache", type=Path, default=Path(".cache/dlrm-data"))
    args = parser.parse_args()
    if max(args.intervals) + 2 > args.steps:
        parser.error(f"--steps ({args.steps}) must exceed every interval by at least 2")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        report = {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "machine": machine(),
            "stall": stall(args, Path(work)),
            "failures": failures(args, Path(work)),
        }
    (args.out / "report.json").write_text(json.dumps(report, indent=2))

    print(
        f"\nCheckpoint stall, world size {args.world_size}, batch {args.batch_size} per rank, "
        f"scale {args.scale}, a save every {args.save_every} steps "
        f"(medians over {args.repeats} runs)"
    )
    print(
        "{:>6} {:>6} {:>10} {:>10} {:>10} {:>12} {:>9}".format(
            "mode", "saves", "stall ms", "max ms", "step ms", "stall/step", "train s"
        )
    )
    for mode, r in report["stall"].items():
        print(
            "{:>6} {:>6} {:>10.1f} {:>10.1f} {:>10.1f} {:>12.1%} {:>9.2f}".format(
                mode,
                r["saves"],
                r["stall_ms"],
                r["stall_ms_max"],
                r["step_ms"],
                r["stall_per_step"],
                r["train_s"],
            )
        )
    print(
        f"\nTime lost per failure ({args.mode} checkpoints; a random rank killed after a "
        f"random step; medians over {args.repeats} runs)"
    )
    print(
        "{:>9} {:>12} {:>14} {:>13} {:>11}".format(
            "interval", "clean job s", "redone steps", "lost s", "restart s"
        )
    )
    for r in report["failures"]:
        cells = (r["interval"], r["clean_s"], r["redone_steps"], r["lost_s"], r["restart_s"])
        print("{:>9} {:>12.1f} {:>14.0f} {:>13.1f} {:>11.1f}".format(*cells))
    print(f"\nwrote {args.out / 'report.json'}")


if __name__ == "__main__":
    main()
