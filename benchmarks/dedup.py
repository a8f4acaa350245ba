"""Deduplicated batches (RecD): samples/s with and without ``--dedup`` at several session sizes.

Runs the DLRM example (``examples/dlrm/dlrm_main.py``) on synthetic data whose
sessions of k samples share the user-side features (13 of 26 sparse, 6 of 13
dense), once plain and once with ``--dedup``, alternating in blocks (this
machine drifts), and reports the median samples/s of each after the first
step (the window's fill and warm-up; the whole run's speedup is in the JSON
too), the ids looked up and planned per step and rank before and after
deduplication, and the sparse bytes per step and rank the all-to-alls carry
(ids and lengths at 8 bytes, pooled rows at 4 bytes a float; computed from
the batches' shapes).

It also measures the ceiling: the same DLRM's dense part alone (dense arch,
interaction, over arch, loss, backward and SGD step over the whole batch, the
embeddings a fixed input), which deduplicating the sparse features cannot
shrink. A plain step (mean after the first) over that floor bounds the
speedup ``--dedup`` can give on this machine, whatever the sparse side costs.
And it times the expansion of a deduplicated output to the batch (forward and
backward): FBGEMM's per-feature op that TorchRec uses against the one gather
the lookahead collections use.

Writes ``report.json`` and ``dedup.png`` into --out and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import example_flags, machine, run_example
from tqdm import tqdm

from torchrec_lookahead.variable_batch import gather_bags


def sparse_bytes(ids: int, bags: int, dim: int) -> int:
    return ids * 8 + bags * (8 + 4 * dim)


def dense_floor_ms(args: argparse.Namespace, steps: int = 60, warmup: int = 10) -> float:
    """Median ms of a training step of the example's DLRM without its sparse side: the
    sparse arch's output is a fixed leaf (its gradient still computed), the rest runs
    over a whole batch of --batch-size with the example's threads per rank."""
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    dim, batch, features = args.embedding_dim, args.batch_size, 26
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=dim, num_embeddings=1, feature_names=[f"f{i}"]
        )
        for i in range(features)
    ]
    collection = EmbeddingBagCollection(tables, device=torch.device("meta"))
    model = DLRM(
        embedding_bag_collection=collection,
        dense_in_features=13,
        dense_arch_layer_sizes=[64, dim],
        over_arch_layer_sizes=[64, 32, 1],
    )
    model.sparse_arch = _Fixed(torch.randn(batch, features, dim))
    optimizer = torch.optim.SGD([*model.parameters()], lr=0.1)
    dense, labels = torch.randn(batch, 13), torch.randint(0, 2, (batch,)).float()
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        logits = model(dense, None).squeeze(-1)
        torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[warmup:])


class _Fixed(torch.nn.Module):
    """Stands in for DLRM's sparse arch: the same embeddings (a trained leaf) for any input."""

    def __init__(self, embedded: torch.Tensor) -> None:
        super().__init__()
        self.embedded = torch.nn.Parameter(embedded)

    def forward(self, _features: object) -> torch.Tensor:
        return self.embedded


SHARED_FEATURES, SPARSE_FEATURES = 13, 26  # the example's sessions share 13 of 26 features


def expansion_ms(args: argparse.Namespace, session_size: int, repeats: int = 30) -> dict:
    """Median ms of expanding a deduplicated batch's pooled output to the batch, forward
    and backward: FBGEMM's ``batch_index_select_dim0`` (TorchRec's sharded path) against
    :func:`~torchrec_lookahead.variable_batch.gather_bags` (what the lookahead collections
    use), at the example's shape: sessions of ``session_size`` share 13 of 26 features."""
    batch, dim = args.batch_size, args.embedding_dim
    shared, own = torch.arange(batch) // session_size, torch.arange(batch)
    others = SPARSE_FEATURES - SHARED_FEATURES
    bags = [int(shared[-1]) + 1] * SHARED_FEATURES + [batch] * others
    inverse = torch.stack([shared] * SHARED_FEATURES + [own] * others)
    expand = {
        "fbgemm": lambda x: torch.ops.fbgemm.batch_index_select_dim0(
            inputs=x,
            indices=inverse.reshape(-1),
            input_num_indices=[batch] * len(bags),
            input_rows=bags,
            input_columns=[dim] * len(bags),
            permute_output_dim_0_1=True,
        ),
        "gather": lambda x: gather_bags(x, inverse, bags, dim),
    }
    pooled = torch.randn(sum(bags) * dim, requires_grad=True)
    gradient = torch.randn(batch * len(bags) * dim)
    times = {}
    for name, fn in expand.items():
        runs = []
        for _ in range(repeats + 3):
            start = time.perf_counter()
            fn(pooled).reshape(-1).backward(gradient)
            runs.append(time.perf_counter() - start)
        times[name] = 1000 * statistics.median(runs[3:])
    return times


def bags_bound(plain_step_ms: float, floor_ms: float, session_size: int) -> float:
    """The most deduplication can speed a step up if the sparse side's cost (a plain step
    over the dense floor) scales with the bags looked up: sessions of ``session_size``
    keep ``1 / session_size`` of the shared features' bags and all of the others'.
    Per-feature costs that do not shrink with the bags make the real gain smaller."""
    kept = 1 - SHARED_FEATURES / SPARSE_FEATURES * (1 - 1 / session_size)
    return plain_step_ms / (floor_ms + (plain_step_ms - floor_ms) * kept)


def measure(args: argparse.Namespace, work: Path) -> list[dict]:
    base = [
        *example_flags(
            args.scale, args.batch_size, args.steps, args.data_cache, args.samples_per_day
        ),
        "--embedding_dim",
        str(args.embedding_dim),
        "--dense_arch_layer_sizes",
        f"64,{args.embedding_dim}",
    ]
    # samples/s per run: over every step, and after the first (the window's fill and the
    # process's warm-up, one-time costs that weigh heavily in a short run)
    whole = {(k, mode): [] for k in args.sessions for mode in ("plain", "dedup")}
    steady = {(k, mode): [] for k in args.sessions for mode in ("plain", "dedup")}
    counts = {}
    runs = [
        (r, k, mode)
        for r in range(args.repeats)
        for k in args.sessions
        for mode in ("plain", "dedup")
    ]
    for _, k, mode in tqdm(runs, desc="runs", unit="run"):
        flags = [*base, "--session_size", str(k)] + (["--dedup"] if mode == "dedup" else [])
        _, summary = run_example(work, args.world_size, flags)
        run = summary["runs"][0]
        per_step = run["samples"] / len(run["step_s"])
        whole[k, mode].append(run["samples"] / run["seconds"])
        steady[k, mode].append(per_step * (len(run["step_s"]) - 1) / sum(run["step_s"][1:]))
        if mode == "dedup":
            counts[k] = (run["dedup"], len(run["step_s"]))
    floor = dense_floor_ms(args)
    rows = []
    for k in args.sessions:
        dedup, steps = counts[k]
        before = sparse_bytes(dedup["ids_before"], dedup["bags_before"], args.embedding_dim)
        after = sparse_bytes(dedup["ids_after"], dedup["bags_after"], args.embedding_dim)
        plain, deduped = (statistics.median(steady[k, m]) for m in ("plain", "dedup"))
        plain_step_ms = 1000 * args.batch_size * args.world_size / plain
        rows.append(
            {
                "session_size": k,
                "plain_samples_per_s": plain,
                "dedup_samples_per_s": deduped,
                "speedup": deduped / plain,
                "plain_step_ms": plain_step_ms,
                "dense_floor_ms": floor,
                "speedup_bound": plain_step_ms / floor,
                "speedup_bound_by_bags": bags_bound(plain_step_ms, floor, k),
                "expand_ms": expansion_ms(args, k),
                "plain_all": steady[k, "plain"],
                "dedup_all": steady[k, "dedup"],
                "whole_run_speedup": statistics.median(whole[k, "dedup"])
                / statistics.median(whole[k, "plain"]),
                "ids_per_step_plain": dedup["ids_before"] / steps,
                "ids_per_step_dedup": dedup["ids_after"] / steps,
                "sparse_mb_per_step_plain": before / steps / 2**20,
                "sparse_mb_per_step_dedup": after / steps / 2**20,
            }
        )
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["plain_samples_per_s"] for r in rows], 0.4, label="plain")
    ax.bar([i + 0.2 for i in x], [r["dedup_samples_per_s"] for r in rows], 0.4, label="--dedup")
    ax.set_xticks(list(x), [f"k = {r['session_size']}" for r in rows])
    ax.set_ylabel("samples/s (median)")
    ax.set_title("DLRM with lookahead caching, sessions of k samples")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/dedup"))
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=2048, help="per rank")
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--scale", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--samples-per-day", type=int, default=524288)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-cache", type=Path, default=Path(".cache/dlrm-data"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        rows = measure(args, Path(work))
    report = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": machine(),
        "results": rows,
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    plot(rows, args.out / "dedup.png")
    print(
        f"\nDeduplicated batches, world size {args.world_size}, batch {args.batch_size} per "
        f"rank, embedding dim {args.embedding_dim}, {args.steps} steps (medians over "
        f"{args.repeats} runs, after the first step; ids and sparse MB per step and "
        "rank)"
    )
    print(
        "{:>4} {:>12} {:>12} {:>8} {:>10} {:>10} {:>10} {:>10} {:>8} {:>6} {:>6}".format(
            "k",
            "plain s/s",
            "dedup s/s",
            "speedup",
            "ids plain",
            "ids dedup",
            "MB plain",
            "MB dedup",
            "step ms",
            "bound",
            "bags",
        )
    )
    for r in rows:
        print(
            "{:>4} {:>12,.0f} {:>12,.0f} {:>8.2f} {:>10,.0f} {:>10,.0f} {:>10.2f} {:>10.2f} "
            "{:>8.2f} {:>6.2f} {:>6.2f}".format(
                r["session_size"],
                r["plain_samples_per_s"],
                r["dedup_samples_per_s"],
                r["speedup"],
                r["ids_per_step_plain"],
                r["ids_per_step_dedup"],
                r["sparse_mb_per_step_plain"],
                r["sparse_mb_per_step_dedup"],
                r["plain_step_ms"],
                r["speedup_bound"],
                r["speedup_bound_by_bags"],
            )
        )
    print(
        "expanding the pooled output (forward and backward), FBGEMM's "
        "batch_index_select_dim0 -> one gather: "
        + ", ".join(
            f"k={r['session_size']} {r['expand_ms']['fbgemm']:.2f} -> "
            f"{r['expand_ms']['gather']:.2f} ms"
            for r in rows
        )
    )
    print(
        f"dense floor (the step without its sparse side, whole batch): "
        f"{rows[0]['dense_floor_ms']:.2f} ms; bound = plain step ms / floor, the most any "
        "deduplication can speed a step up on this machine; bags = the same if the sparse "
        "side's cost scales with the bags looked up (the shared features' shrink k-fold, "
        "the others' not)"
    )
    print(f"\nwrote {args.out / 'report.json'} and {args.out / 'dedup.png'}")


if __name__ == "__main__":
    main()
