"""What a run measured, and the summary: a table, ``summary.json`` and a PNG, shaped as the
DLRM example's (``examples/dlrm/report.py``), with ranking metrics for its AUROC."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shared import agreement, diverged, write_outputs

from torchrec_lookahead.metrics import EMBEDDING_KINDS

__all__ = ["Run", "report"]


@dataclass
class Run:
    """What one training run measured."""

    name: str
    first_step: int = 0  # (no resume here; the shared plot numbers steps from it)
    steps_asked: int | None = None  # --limit_train_batches (None: every epoch's steps)
    step_s: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)  # per step, rank 0's batch
    hit_rate: list[float] = field(default_factory=list)
    samples: int = 0
    seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)  # recall@10, ndcg@10, ...
    cache: dict[str, float] = field(default_factory=dict)
    bytes_per_step: dict[str, float] = field(default_factory=dict)  # sent per rank, by kind

    @property
    def steady_samples_per_s(self) -> float:
        """Samples/s after the first step, which holds one-time costs (the lookahead
        window's fill, the process' warm-up)."""
        later = self.seconds - (self.step_s[0] if self.step_s else 0.0)
        per_step = self.samples / len(self.step_s) if self.step_s else 0
        return per_step * (len(self.step_s) - 1) / later if later > 0 else 0.0


def cells(run: Run) -> dict[str, str]:
    """One column of the summary table."""
    cache = run.cache  # over every rank (bert4rec_main.cache_summary)
    return {
        "samples/s": f"{run.samples / run.seconds:,.0f}" if run.seconds else "-",
        "samples/s after step 1": f"{run.steady_samples_per_s:,.0f}" if run.seconds else "-",
        "first step ms": f"{1000 * run.step_s[0]:,.0f}" if run.step_s else "-",
        "final loss": f"{run.loss[-1]:.4f}" if run.loss else "-",
        "test Recall@10": f"{run.metrics['recall@10']:.4f}",
        "test NDCG@10": f"{run.metrics['ndcg@10']:.4f}",
        "cache hit rate": f"{cache['hit_rate']:.3f}" if cache else "all resident",
        "rows fetched / step": f"{cache['rows_fetched_per_step']:,.0f}" if cache else "-",
        "rows written back / step": f"{cache['rows_written_back_per_step']:,.0f}" if cache else "-",
        "planning CPU ms / step": f"{cache['planning_ms_per_step']:.2f}" if cache else "-",
        "embedding KiB sent / step": (
            f"{sum(run.bytes_per_step[k] for k in EMBEDDING_KINDS) / 1024:,.1f}"
            if run.bytes_per_step
            else "-"
        ),
    }


def report(
    args: argparse.Namespace,
    runs: list[Run],
    same: bool | None,
    gap: float | None,
    digest: str,
    world_size: int,
    evaluated: int,
) -> None:
    """Print the runs side by side, write ``summary.json`` and ``training.png`` to --out."""
    table = [cells(r) for r in runs]
    rows = args.num_items + 1
    cache_rows = int(runs[0].cache["cache_rows"])  # over every rank
    ran = len(runs[0].step_s)
    asked = runs[0].steps_asked
    steps = f"{ran} steps" if asked in (None, ran) else f"{ran} of the {asked} steps asked"
    data = f"MovieLens {args.dataset_path}" if args.dataset_path else "synthetic histories"
    settings = (
        f"BERT4Rec on {data} ({args.num_users:,} users, {args.num_items:,} items), world "
        f"size {world_size}, batch {args.train_batch_size} per rank, {steps}, lookahead "
        f"{args.lookahead}, {'row-wise Adagrad' if args.adagrad else 'SGD'}; cache "
        f"{cache_rows:,} of {rows:,} rows ({cache_rows / rows:.1%})"
    )
    print(f"\n{settings}; test: each user's last item, {evaluated:,} users")
    print(f"{'':>26}" + "".join(f"{r.name:>16}" for r in runs))
    for label in table[0]:
        print(f"{label:>26}" + "".join(f"{column[label]:>16}" for column in table))
    if gap is not None:
        print(f"{'final weights':>26}{agreement(gap):>16}")
        print(f"{'largest difference':>26}{gap:>16.2g}")
    print(f"{'weights digest':>26}  {digest}")
    for warning in diverged(runs):
        print(warning)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "config": dict(vars(args)),
        "runs": [asdict(r) for r in runs],
        "weights_match": same,
        "weights_max_difference": gap,
        "weights_agreement": agreement(gap) if gap is not None else None,
        "weights_digest": digest,
        "world_size": world_size,
        "steps_run": ran,
        "steps_asked": asked,
        "cache_rows": cache_rows,
        "rows": rows,
        "users_evaluated": evaluated,
    }
    write_outputs(out, summary, runs, settings, gap)
