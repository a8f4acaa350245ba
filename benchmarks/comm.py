"""Bytes per distributed step and step time: replicated hot rows against plain TorchRec.

Runs the DLRM example (``examples/dlrm/dlrm_main.py``) under ``torchrun`` on
synthetic Criteo-shaped data, two kinds of job alternating (this machine
drifts), each training two models on the same batches:

* ``hot``: the lookahead model with replicated hot rows (``--hot_rows``: every
  row that saves bytes) and plain TorchRec with the same table-wise plan;
* ``plain``: the lookahead model without hot rows (``--no_hot_rows``) and
  plain TorchRec with the plan TorchRec's planner picks for the topology
  (``--torchrec_plan``: it may make small tables data-parallel).

Bytes are what each rank sends per step (mean over ranks), counted where the
collectives send them (``torchrec_lookahead.traffic``): ids and lengths,
pooled forward, pooled gradients, the hot rows' sync, data-parallel tables'
all-reduce; the dense layers' all-reduce (the same everywhere) is shown
apart and left out of the ratios. Step time is the median step after the
first, then the median over the runs.

``bytes_ratio`` and ``time_ratio``: lookahead with hot rows over plain
TorchRec with its planner's plan. Writes ``report.json`` and ``comm.png``
into --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from common import example_flags, machine, run_example
from tqdm import tqdm

from torchrec_lookahead.metrics import EMBEDDING_KINDS

SETTINGS = ("torchrec_plan", "torchrec_table_wise", "lookahead", "lookahead_hot")
JOBS = {  # job -> flags, and the settings its two runs measure (lookahead first)
    "hot": (["--hot_rows"], ("lookahead_hot", "torchrec_table_wise")),
    "plain": (["--no_hot_rows", "--torchrec_plan"], ("lookahead", "torchrec_plan")),
}


def measure(args: argparse.Namespace, work: Path, world_size: int, scale: float) -> dict:
    flags = [
        *example_flags(scale, args.batch_size, args.steps, args.data_cache, args.samples_per_day),
        "--baseline",
        "--plan_sample_batches",
        str(args.sample_batches),
    ]
    step_ms = {s: [] for s in SETTINGS}
    sent: dict[str, dict[str, float]] = {}
    hot_share = []
    jobs = [job for _ in range(args.runs) for job in JOBS]
    for job in tqdm(jobs, desc=f"world size {world_size}, scale {scale}", unit="job"):
        job_flags, settings = JOBS[job]
        _, summary = run_example(work, world_size, [*flags, *job_flags])
        for setting, run in zip(settings, summary["runs"], strict=True):
            step_ms[setting].append(1000 * statistics.median(run["step_s"][1:]))
            sent[setting] = run["bytes_per_step"]  # counts: the same every run
        if job == "hot":
            hot_share.append(summary["runs"][0]["hot_share"])
    result = {"world_size": world_size, "scale": scale, "settings": {}}
    for setting in SETTINGS:
        by_kind = sent[setting]
        result["settings"][setting] = {
            "step_ms": statistics.median(step_ms[setting]),
            "step_ms_runs": step_ms[setting],
            "bytes_per_step": by_kind,
            "embedding_bytes_per_step": sum(by_kind[k] for k in EMBEDDING_KINDS),
        }
    hot, plan = result["settings"]["lookahead_hot"], result["settings"]["torchrec_plan"]
    result["bytes_ratio"] = hot["embedding_bytes_per_step"] / plan["embedding_bytes_per_step"]
    result["time_ratio"] = hot["step_ms"] / plan["step_ms"]
    result["hot_share"] = statistics.median(hot_share)
    return result


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in EMBEDDING_KINDS if k != "other"]
    fig, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results), 3.6), sharey=False)
    axes = axes if len(results) > 1 else [axes]
    for ax, result in zip(axes, results):
        bottom = [0.0] * len(SETTINGS)
        for kind in kinds:
            heights = [result["settings"][s]["bytes_per_step"][kind] / 1024 for s in SETTINGS]
            ax.bar(range(len(SETTINGS)), heights, bottom=bottom, label=kind)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_xticks(
            range(len(SETTINGS)),
            ["TorchRec\nplan", "TorchRec\ntable-wise", "lookahead", "lookahead\nhot"],
            fontsize=7,
        )
        ax.set_title(f"world size {result['world_size']}, scale {result['scale']}", fontsize=8)
        ax.set_ylabel("KiB sent per step and rank")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/comm"))
    parser.add_argument("--world-size", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--scales", type=float, nargs="+", default=[0.01, 0.1])
    parser.add_argument("--batch-size", type=int, default=1024, help="per rank")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--runs", type=int, default=3, help="jobs of each kind, alternating")
    parser.add_argument("--samples-per-day", type=int, default=262144)
    parser.add_argument(
        "--sample-batches", type=int, default=50, help="global batches the hot rows are chosen from"
    )
    parser.add_argument("--data-cache", type=Path, default=Path(".cache/dlrm-data"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        results = [measure(args, Path(work), w, s) for w in args.world_size for s in args.scales]
    report = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine(),
        "results": results,
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    plot(results, args.out / "comm.png")
    print(
        f"\nEmbedding bytes sent per step and rank (KiB; mean over ranks, counted at the "
        f"collectives) and step time (ms; median over {args.runs} runs of the median step "
        f"after the first), batch {args.batch_size} per rank, {args.steps} steps"
    )
    head = "{:>5} {:>6} {:<20} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>8}"
    print(
        head.format(
            "ranks",
            "scale",
            "setting",
            "ids",
            "pooled",
            "grads",
            "hot sync",
            "DP",
            "total",
            "dense",
            "step ms",
        )
    )
    for r in results:
        for setting in SETTINGS:
            s = r["settings"][setting]
            b = {k: v / 1024 for k, v in s["bytes_per_step"].items()}
            print(
                head.format(
                    r["world_size"],
                    r["scale"],
                    setting,
                    f"{b['ids']:.1f}",
                    f"{b['pooled']:.1f}",
                    f"{b['gradients']:.1f}",
                    f"{b['hot_sync']:.1f}",
                    f"{b['data_parallel']:.1f}",
                    f"{s['embedding_bytes_per_step'] / 1024:.1f}",
                    f"{b['dense']:.1f}",
                    f"{s['step_ms']:.1f}",
                )
            )
        print(
            f"{'':>13}bytes_ratio {r['bytes_ratio']:.3f}, time_ratio {r['time_ratio']:.3f} "
            f"(lookahead hot / TorchRec plan), hot lookups {r['hot_share']:.1%}"
        )
    print(f"\nwrote {args.out / 'report.json'} and {args.out / 'comm.png'}")


if __name__ == "__main__":
    main()
