"""What a run measured, and the summary: a table, ``summary.json`` and a PNG."""

from __future__ import annotations

import json
import math
import statistics
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torchrec_lookahead.data.dedup import DedupCounts
from torchrec_lookahead.metrics import EMBEDDING_KINDS

__all__ = ["Run", "agreement", "diverged", "progress_postfix", "report"]


@dataclass
class Run:
    """What one training run measured."""

    name: str
    first_step: int = 0  # where training began: a resumed run's checkpoint step
    steps_asked: int | None = None  # --limit_train_batches (None: the whole data)
    step_s: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)  # per step, rank 0's batch
    hit_rate: list[float] = field(default_factory=list)
    samples: int = 0
    seconds: float = 0.0
    auroc: dict[str, float] = field(default_factory=dict)
    cache: dict[str, float] = field(default_factory=dict)
    checkpoint_stall_s: list[float] = field(default_factory=list)  # per save, slowest rank
    private_mb: float = 0.0  # the most anonymous RSS seen (sampled every 20 steps), rank 0
    dedup: DedupCounts = field(default_factory=DedupCounts)  # --dedup: what it saved, rank 0
    data_wait_s: list[float] = field(default_factory=list)  # per step, rank 0's trainer
    bytes_per_step: dict[str, float] = field(default_factory=dict)  # sent per rank, by kind
    hot_share: float | None = None  # share of the lookups the replicated hot rows served

    @property
    def steady_samples_per_s(self) -> float:
        """Samples/s after the first step, which holds one-time costs: the lookahead
        window's fill (L + d batches read and planned, the cache built) and whatever the
        process warms up first (the data reader's load: the first run of the process
        pays it)."""
        later = self.seconds - (self.step_s[0] if self.step_s else 0.0)
        per_step = self.samples / len(self.step_s) if self.step_s else 0
        return per_step * (len(self.step_s) - 1) / later if later > 0 else 0.0

    @property
    def data_wait_ms_per_step(self) -> float:
        """Mean time the trainer waited for its next batch, after the first step (which
        starts the loader's workers and, with lookahead, fills the window)."""
        later = self.data_wait_s[1:]
        return 1000 * sum(later) / len(later) if later else 0.0


def cells(run: Run, embedding_dim: int) -> dict[str, str]:
    """One column of the summary table."""
    cache = run.cache
    return {
        "samples/s": f"{run.samples / run.seconds:,.0f}" if run.seconds else "-",
        "samples/s after step 1": f"{run.steady_samples_per_s:,.0f}" if run.seconds else "-",
        "first step ms": f"{1000 * run.step_s[0]:,.0f}" if run.step_s else "-",
        "val AUROC": f"{run.auroc['val']:.4f}",
        "test AUROC": f"{run.auroc['test']:.4f}",
        "cache hit rate": f"{cache['hit_rate']:.3f}" if cache else "all resident",
        "rows fetched / step": f"{cache['rows_fetched_per_step']:,.0f}" if cache else "-",
        "rows written back / step": f"{cache['rows_written_back_per_step']:,.0f}" if cache else "-",
        "executor wait ms / step": f"{cache['executor_wait_ms_per_step']:.2f}" if cache else "-",
        "planning CPU ms / step": f"{cache['planning_ms_per_step']:.2f}" if cache else "-",
        "private memory MB": f"{run.private_mb:,.0f}",
        "data wait ms / step": f"{run.data_wait_ms_per_step:.3f}",
        "embedding KiB sent / step": (
            f"{sum(run.bytes_per_step[k] for k in EMBEDDING_KINDS) / 1024:,.1f}"
            if run.bytes_per_step
            else "-"
        ),
        "hot-row lookups": f"{run.hot_share:.1%}" if run.hot_share is not None else "-",
        **dedup_cells(run, embedding_dim),
        "checkpoint stall ms / save": (
            f"{1000 * statistics.median(run.checkpoint_stall_s):.1f}"
            if run.checkpoint_stall_s
            else "-"
        ),
    }


def dedup_cells(run: Run, embedding_dim: int) -> dict[str, str]:
    """With --dedup: ids and sparse bytes per step and rank (the input all-to-all's ids and
    lengths at 8 bytes, the output all-to-all's pooled rows at 4 bytes a float), after
    deduplication, and the share saved."""
    counts, steps = run.dedup, max(len(run.step_s), 1)
    if not counts.ids_before:
        return {}

    def sparse_bytes(ids: int, bags: int) -> float:
        return ids * 8 + bags * (8 + 4 * embedding_dim)

    before = sparse_bytes(counts.ids_before, counts.bags_before)
    after = sparse_bytes(counts.ids_after, counts.bags_after)
    return {
        "ids / step (dedup)": f"{counts.ids_after / steps:,.0f}",
        "ids saved by dedup": f"{counts.ids_saved:.1%}",
        "sparse MB / step (dedup)": f"{after / steps / 2**20:.2f}",
        "sparse bytes saved": f"{1 - after / before:.1%}",
    }


def report(
    args,
    runs: list[Run],
    same: bool | None,
    gap: float | None,
    digest: str,
    world_size: int,
    cache_rows: int,
) -> None:
    table = [cells(r, args.embedding_dim) for r in runs]
    names = [r.name for r in runs]
    rows = sum(args.num_embeddings)
    sizing = (
        "sized by the lookahead planner"
        if args.plan_cache_sizes
        else f"{args.cache_load_factor:.0%} per table, raised to what the window touches"
    )
    ran, first = len(runs[0].step_s), runs[0].first_step
    asked = runs[0].steps_asked
    steps = trained_steps(first, ran, asked)
    settings = (
        f"DLRM ({args.interaction_type}), world size {world_size}, batch {args.batch_size} "
        f"per rank, {steps}, lookahead {args.lookahead}"
        f"{', planned on the device' if args.planner == 'device' else ''}, "
        f"{'row-wise Adagrad' if args.adagrad else 'SGD'}; cache "
        f"{cache_rows:,} of {rows:,} rows ({cache_rows / rows:.1%})"
    )
    print(f"\n{settings}: {sizing}; {args.num_workers} loader worker(s) per rank")
    print(f"{'':>26}" + "".join(f"{n:>16}" for n in names))
    for label in table[0]:
        print(f"{label:>26}" + "".join(f"{column[label]:>16}" for column in table))
    if gap is not None:
        print(f"{'final weights':>26}{agreement(gap):>16}")
        print(f"{'largest difference':>26}{gap:>16.2g}")
    elif same is not None:  # --torchrec_plan: other starting weights, nothing to compare
        print(f"{'final weights':>26}{'not compared':>16}")
    print(f"{'weights digest':>26}  {digest}")
    for warning in diverged(runs):
        print(warning)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "config": {k: v for k, v in vars(args).items()},
        "runs": [{**asdict(r), "data_wait_ms_per_step": r.data_wait_ms_per_step} for r in runs],
        "weights_match": same,
        "weights_max_difference": gap,
        "weights_agreement": agreement(gap) if gap is not None else None,
        "weights_digest": digest,
        "world_size": world_size,
        "steps_run": ran,
        "first_step": first,
        "steps_asked": asked,
        "cache_rows": cache_rows,
        "rows": rows,
    }
    write_outputs(out, summary, runs, settings, gap)


def trained_steps(first: int, ran: int, asked: int | None) -> str:
    """The steps a run trained, ``first`` (a resumed run's checkpoint step) on, and whether
    the data ended before the ``asked`` limit."""
    if first and not ran:
        return f"no steps (resumed at step {first})"
    steps = f"steps {first + 1}-{first + ran} (resumed at step {first})" if first else ""
    if asked is None or first + ran >= asked:
        return steps or f"{ran} steps"
    return f"{steps}, of the {asked} asked" if first else f"{ran} of the {asked} steps asked"


TOLERANCE = 1e-5  # where summation orders differ (hot rows' bags mixing hot and cold ids)


def progress_postfix(run: Any, pipeline: Any | None) -> dict[str, str]:
    """The progress bar's figures: samples/s so far and, for a lookahead run (its
    ``LookaheadTrainPipeline``), the hit rate of the steps planned on this rank's shards
    (none shown where it owns none). Read every few steps: it sums counters over tables."""
    postfix = {"samples/s": f"{run.samples / run.seconds:,.0f}"}
    if pipeline is not None:
        cache = pipeline.cache_metrics()["total"]
        if cache.unique_ids:
            postfix["hit rate"] = f"{cache.hit_rate:.3f}"
    return postfix


def diverged(runs: list[Any]) -> list[str]:
    """A warning per run whose loss stopped being a number (its metrics mean nothing)."""
    warnings = []
    for run in runs:
        bad = next((i for i, loss in enumerate(run.loss) if not math.isfinite(loss)), None)
        if bad is not None:
            warnings.append(
                f"warning: the {run.name} run diverged: its loss is {run.loss[bad]} at step "
                f"{run.first_step + bad + 1} (a smaller learning rate?)"
            )
    return warnings


def agreement(gap: float) -> str:
    """What the largest difference between the two runs' final state says."""
    if gap == 0:
        return "bitwise equal"
    return f"within {TOLERANCE:g}" if gap <= TOLERANCE else "DIFFERENT"


# The runs' colours and the hit rate's own (a property of the lookahead run, not a third run).
RUN_COLOURS = {"lookahead": "tab:blue", "baseline": "tab:orange"}


HIT_RATE_COLOUR = "tab:green"


def step_time_ceiling(runs: list[Run]) -> float | None:
    """The step-time axis' top in ms: the 99th percentile of every run's steps after the
    first, plus 25%. The first step holds the window fill and the process' warm-up (often
    10x a step) and would flatten the rest. None when no run has a step after the first."""
    later = sorted(1000 * s for r in runs for s in r.step_s[1:])
    if not later:
        return None
    return 1.25 * later[min(len(later) - 1, math.ceil(0.99 * len(later)) - 1)]


def plot(runs: list[Run], path: Path, settings: str, verdict: str | None) -> None:
    """The runs' loss, the lookahead run's hit rate and every run's step time, per step;
    titled with the settings and whether the final weights matched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (losses, top, bottom) = plt.subplots(3, 1, figsize=(7, 7.5), sharex=True)
    title = textwrap.fill(settings, 90)
    if verdict is not None:
        title += f"\nfinal weights against plain TorchRec: {verdict}"
    fig.suptitle(title, fontsize=9)
    look = runs[0]
    # Steps are numbered as trained: a resumed run's from its checkpoint step on. The hit
    # rate begins with the first step the cache planned.
    first = look.first_step + len(look.step_s) - len(look.hit_rate) + 1
    dot = {"marker": "o", "markersize": 3}  # a series of one step draws no line: a dot
    for r, style in zip(runs, ("-", "--")):  # the runs overlap where they agree: dash one
        losses.plot(
            range(r.first_step + 1, r.first_step + len(r.loss) + 1),
            r.loss,
            label=r.name,
            color=RUN_COLOURS.get(r.name),
            linestyle=style,
            linewidth=1,
            **dot if len(r.loss) == 1 else {},
        )
    losses.set_ylabel("training loss\n(rank 0's batch)")
    losses.grid(alpha=0.3)
    losses.legend()
    top.plot(
        range(first, first + len(look.hit_rate)),
        look.hit_rate,
        color=HIT_RATE_COLOUR,
        linewidth=1,
        **dot if len(look.hit_rate) == 1 else {},
    )
    top.set_ylabel("cache hit rate")
    top.set_ylim(0, 1)
    top.grid(alpha=0.3)
    for r in runs:
        bottom.plot(
            range(r.first_step + 1, r.first_step + len(r.step_s) + 1),
            [1000 * s for s in r.step_s],
            label=r.name,
            color=RUN_COLOURS.get(r.name),
            linewidth=1,
            **dot if len(r.step_s) == 1 else {},
        )
    ceiling = step_time_ceiling(runs)
    if ceiling is not None and any(1000 * s > ceiling for r in runs for s in r.step_s):
        bottom.set_ylim(0, ceiling)
        firsts = [
            f"{r.name} {1000 * r.step_s[0]:,.0f} ms" for r in runs if 1000 * r.step_s[0] > ceiling
        ]
        later = sum(1000 * s > ceiling for r in runs for s in r.step_s[1:])
        clipped = [f"the first step ({', '.join(firsts)}; window fill, warm-up)"] if firsts else []
        if later:
            clipped.append(f"{later} later step{'s' if later > 1 else ''}")
        bottom.set_title(
            f"clipped at {ceiling:.1f} ms: {', '.join(clipped)}", fontsize=8, loc="left"
        )
    else:
        bottom.set_ylim(bottom=0)
    bottom.set_ylabel("step time (ms)")
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    bottom.grid(alpha=0.3)
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(
    out: Path, summary: dict[str, Any], runs: list[Any], settings: str, gap: float | None
) -> None:
    """``summary.json`` and ``training.png`` in ``out``, the plot titled with the verdict on
    the final weights (the BERT4Rec example writes its own alike)."""
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    verdict = agreement(gap) if gap is not None else None
    if verdict is not None and gap:
        verdict += f" (largest difference {gap:.2g})"
    plot(runs, out / "training.png", settings, verdict)
    print(f"wrote {out / 'summary.json'} and {out / 'training.png'}")
