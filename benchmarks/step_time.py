"""Step time: DLRM with lookahead-cached tables against the same DLRM with every row resident.

Both models start from the same weights, train on the same Criteo-shaped
batches (26 tables of Criteo Kaggle's sizes times --scale, Zipf ids) with
fused row-wise Adagrad, and run on this machine's CPU, unsharded. The
lookahead run's time splits into the oracle (planning batches entering the
window), waiting for the executor (rows not yet moved), and forward /
backward / optimizer. It checks that both end with the same weights.

Writes ``report.json`` and ``step_time.png`` into --out and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
from common import machine, pinned_rows_needed
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from tqdm import tqdm

from torchrec_lookahead import LookaheadEmbeddingBagCollection, LookaheadTrainPipeline
from torchrec_lookahead.data import SyntheticCriteo
from torchrec_lookahead.data.torchrec_batches import criteo_batch, feature_names
from torchrec_lookahead.resident import FullyResidentEmbeddingBagCollection


def build_models(args: argparse.Namespace, data: SyntheticCriteo) -> tuple[DLRMTrain, DLRMTrain]:
    tables = [
        EmbeddingBagConfig(name=f"t_{name}", embedding_dim=args.dim, num_embeddings=rows,
                           feature_names=[name])
        for name, rows in zip(feature_names(data), data.num_embeddings)
    ]  # fmt: skip
    # A table's cache holds --cache-load-factor of its rows, but at least what d+1
    # consecutive batches use together (small tables end up fully cached).
    streams = data.table_streams(args.batch_size, args.steps)
    cache_rows = {
        t.name: max(math.ceil(args.cache_load_factor * t.num_embeddings),
                    pinned_rows_needed(stream, args.prefetch_distance))
        for t, stream in zip(tables, streams)
    }  # fmt: skip
    torch.manual_seed(args.seed)
    ebc = LookaheadEmbeddingBagCollection(tables, cache_rows=cache_rows)
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": args.embedding_lr})

    def dlrm(collection: torch.nn.Module) -> DLRMTrain:
        torch.manual_seed(args.seed)
        return DLRMTrain(DLRM(embedding_bag_collection=collection, dense_in_features=13,
                              dense_arch_layer_sizes=[64, args.dim],
                              over_arch_layer_sizes=[64, 32, 1]))  # fmt: skip

    cached = dlrm(ebc)
    resident = dlrm(FullyResidentEmbeddingBagCollection(ebc, ebc.fused_config()))
    resident.model.dense_arch.load_state_dict(copy.deepcopy(cached.model.dense_arch.state_dict()))
    resident.model.over_arch.load_state_dict(copy.deepcopy(cached.model.over_arch.state_dict()))
    return cached, resident


def dense_optimizer(model: DLRMTrain, lr: float) -> torch.optim.Optimizer:
    params = [*model.model.dense_arch.parameters(), *model.model.over_arch.parameters()]
    return torch.optim.SGD(params, lr=lr)


def run_resident(model: DLRMTrain, batches: list, args: argparse.Namespace) -> list[float]:
    optimizer = dense_optimizer(model, args.dense_lr)
    times = []
    for batch in tqdm(batches, desc="all resident", unit="step"):
        start = time.perf_counter()
        optimizer.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times


def run_lookahead(model: DLRMTrain, batches: list, args: argparse.Namespace):
    pipeline = LookaheadTrainPipeline(
        model, dense_optimizer(model, args.dense_lr), torch.device("cpu"),
        lookahead=args.lookahead, prefetch_distance=args.prefetch_distance,
    )  # fmt: skip
    times, parts = [], []
    it = iter(batches)
    with tqdm(total=len(batches), desc="lookahead", unit="step") as bar:
        while True:
            before = dict(pipeline.timings)
            start = time.perf_counter()
            try:
                pipeline.progress(it)
            except StopIteration:
                break
            times.append(time.perf_counter() - start)
            parts.append({k: pipeline.timings[k] - before[k] for k in before})
            bar.update()
            bar.set_postfix(hit_rate=f"{pipeline.cache_metrics()['total'].hit_rate:.3f}")
    return times, parts, pipeline.cache_metrics()["total"]


def same_weights(cached: DLRMTrain, resident: DLRMTrain) -> bool:
    ebc = cached.model.sparse_arch.embedding_bag_collection
    state = ebc.state_dict()
    tbe = resident.model.sparse_arch.embedding_bag_collection.tbe
    tables = all(
        torch.equal(state[f"embedding_bags.{c.name}.weight"], w)
        for c, w in zip(ebc.embedding_bag_configs(), tbe.split_embedding_weights())
    )
    dense = all(
        torch.equal(a, b)
        for a, b in zip(cached.model.over_arch.parameters(), resident.model.over_arch.parameters())
    )
    return tables and dense


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    look = report["lookahead"]
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ax.barh(
        ["all resident"], [report["resident"]["step_ms"]], color="tab:blue", label="fwd/bwd/opt"
    )
    left = 0.0
    for key, label, color in (("compute_ms", "fwd/bwd/opt", "tab:blue"),
                              ("plan_ms", "oracle", "tab:orange"),
                              ("wait_ms", "executor wait", "tab:red"),
                              ("other_ms", "other", "tab:gray")):  # fmt: skip
        ax.barh(["lookahead"], [look[key]], left=left, color=color,
                label=None if key == "compute_ms" else label)  # fmt: skip
        left += look[key]
    ax.set_xlabel("ms per step")
    cfg = report["config"]
    share = report["cache_rows"] / report["rows"]
    ax.set_title(f"DLRM, cache {share:.1%} of {report['rows']:,} rows, L={cfg['lookahead']}, "
                 f"batch {cfg['batch_size']}, CPU")  # fmt: skip
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/step_time"))
    parser.add_argument("--scale", type=float, default=0.01)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--cache-load-factor", type=float, default=0.05)
    parser.add_argument("--lookahead", type=int, default=16)
    parser.add_argument("--prefetch-distance", type=int, default=1)
    parser.add_argument("--embedding-lr", type=float, default=0.05)
    parser.add_argument("--dense-lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    data = SyntheticCriteo(scale=args.scale, zipf_exponent=args.zipf, seed=args.seed)
    batches = [criteo_batch(data, s, args.batch_size) for s in range(args.steps)]
    cached, resident = build_models(args, data)
    resident_times = run_resident(resident, batches, args)
    times, parts, metrics = run_lookahead(cached, batches, args)

    w = args.warmup
    measured = len(times) - w

    def ms(values: list[float]) -> float:
        return 1000 * sum(values[w:]) / measured

    look = {k.replace("_s", "_ms"): ms([p[k] for p in parts]) for k in parts[0]}
    look["step_ms"] = ms(times)
    look["other_ms"] = look["step_ms"] - look["plan_ms"] - look["wait_ms"] - look["compute_ms"]
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine(),
        "rows": sum(data.num_embeddings),
        "cache_rows": sum(cached.model.sparse_arch.embedding_bag_collection.cache_rows()),
        "resident": {"step_ms": ms(resident_times)},
        "lookahead": look | {
            "hit_rate": metrics.hit_rate,
            "rows_fetched_per_step": metrics.rows_fetched / len(times),
            "rows_written_back_per_step": metrics.rows_written_back / len(times),
        },
        "ratio": look["step_ms"] / ms(resident_times),
        "same_weights": same_weights(cached, resident),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "step_time.png")

    print(f"\nDLRM, {report['rows']:,} rows, cache {report['cache_rows']:,} rows, batch "
          f"{args.batch_size}, L={args.lookahead}, d={args.prefetch_distance}, "
          f"{measured} steps after {w} warm-up")  # fmt: skip
    header = ("run", "step ms", "oracle", "wait", "fwd/bwd/opt", "other")
    print("{:>13} {:>8} {:>7} {:>6} {:>11} {:>6}".format(*header))
    print(f"{'all resident':>13} {report['resident']['step_ms']:>8.1f}")
    cells = [look[k] for k in ("step_ms", "plan_ms", "wait_ms", "compute_ms", "other_ms")]
    print("{:>13} {:>8.1f} {:>7.1f} {:>6.1f} {:>11.1f} {:>6.1f}".format("lookahead", *cells))
    print(f"ratio {report['ratio']:.2f}x, hit rate {metrics.hit_rate:.3f}, "
          f"{report['lookahead']['rows_fetched_per_step']:.0f} rows fetched and "
          f"{report['lookahead']['rows_written_back_per_step']:.0f} written back per step, "
          f"same final weights: {report['same_weights']}")  # fmt: skip
    print(f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores; "
          f"wrote {args.out / 'report.json'} and {args.out / 'step_time.png'}")  # fmt: skip


if __name__ == "__main__":
    main()
