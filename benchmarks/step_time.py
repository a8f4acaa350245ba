"""Step time: DLRM with lookahead-cached tables against the same DLRM with every row resident.

Both models start from the same weights, train on the same Criteo-shaped
batches (26 tables of Criteo Kaggle's sizes times --scale, Zipf ids) with
fused row-wise Adagrad on this machine's CPU, and must end with the same
weights (checked). Two set-ups:

* ``--world-size 0`` (default): unsharded; the all-resident model keeps its
  tables in one fused TBE (``FullyResidentEmbeddingBagCollection``).
* ``--world-size 1`` or ``2``: ``DistributedModelParallel`` on spawned gloo
  ranks; the baseline is plain TorchRec (``EmbeddingBagCollection``, default
  sharder, ``TrainPipelineSparseDist``), the lookahead model the canonical
  use (``docs/design.md``). Each rank has its own batches.

Both give every table --cache-load-factor of its rows (raised at the first
batch where the window needs more). The lookahead step time splits into
waiting for the lookahead stage (planning on the trainer's critical path),
waiting for the executor, and forward / backward / optimizer; the stage's
own CPU time (input distribution under DMP, planning), spent beside the
steps on its thread, is reported per step too. Writes ``report.json`` and
``step_time.png`` into --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import dlrm_train, machine
from torchrec.models.dlrm import DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from tqdm import tqdm

from torchrec_lookahead import LookaheadEmbeddingBagCollection, LookaheadTrainPipeline
from torchrec_lookahead.data import SyntheticCriteo
from torchrec_lookahead.data.torchrec_batches import criteo_batch, feature_names
from torchrec_lookahead.testing.resident import FullyResidentEmbeddingBagCollection


def table_configs(args: argparse.Namespace, data: SyntheticCriteo) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t_{name}", embedding_dim=args.dim, num_embeddings=rows, feature_names=[name]
        )
        for name, rows in zip(feature_names(data), data.num_embeddings)
    ]


def rank_data(args: argparse.Namespace, rank: int) -> SyntheticCriteo:
    return SyntheticCriteo(scale=args.scale, zipf_exponent=args.zipf, seed=args.seed + rank)


def timed_training(pipeline_or_step, batches: list, desc: str, timings=None):
    """Runs every batch; returns per-step seconds and per-step timing deltas."""
    times, parts, it = [], [], iter(batches)
    for _ in tqdm(range(len(batches)), desc=desc, unit="step", disable=None):
        before = dict(timings) if timings is not None else None
        start = time.perf_counter()
        try:
            pipeline_or_step(it)
        except StopIteration:
            break
        times.append(time.perf_counter() - start)
        if timings is not None:
            parts.append({k: timings[k] - before[k] for k in before})
    return times, parts


def drain(pipeline, it) -> None:
    """Let a pipeline see the end of the data (flushes caches, stops workers)."""
    try:
        pipeline.progress(it)
    except StopIteration:
        return
    raise RuntimeError("the pipeline had batches left")


# ---------------------------------------------------------------- unsharded


def run_unsharded(args: argparse.Namespace) -> dict:
    data = rank_data(args, 0)
    batches = [criteo_batch(data, s, args.batch_size) for s in range(args.steps)]
    tables = table_configs(args, data)
    torch.manual_seed(args.seed)
    ebc = LookaheadEmbeddingBagCollection(tables, cache_load_factor=args.cache_load_factor)
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": args.embedding_lr})
    cached = dlrm_train(ebc, args.dim, args.seed)
    resident = dlrm_train(
        FullyResidentEmbeddingBagCollection(ebc, ebc.fused_config()), args.dim, args.seed
    )
    for part in ("dense_arch", "over_arch"):
        state = copy.deepcopy(getattr(cached.model, part).state_dict())
        getattr(resident.model, part).load_state_dict(state)

    def dense(model: DLRMTrain) -> torch.optim.Optimizer:
        params = [*model.model.dense_arch.parameters(), *model.model.over_arch.parameters()]
        return torch.optim.SGD(params, lr=args.dense_lr)

    optimizer = dense(resident)

    def resident_step(it) -> None:
        batch = next(it)
        optimizer.zero_grad()
        loss, _ = resident(batch)
        loss.backward()
        optimizer.step()

    base_times, _ = timed_training(resident_step, batches, "all resident")
    pipeline = LookaheadTrainPipeline(
        cached,
        dense(cached),
        torch.device("cpu"),
        lookahead=args.lookahead,
        prefetch_distance=args.prefetch_distance,
        stage_thread=STAGE_THREAD[args.stage],
    )
    it = iter(batches)
    times, parts = timed_training(
        lambda _: pipeline.progress(it), batches, "lookahead", pipeline.timings
    )
    drain(pipeline, it)
    state = ebc.state_dict()
    tbe = resident.model.sparse_arch.embedding_bag_collection.tbe
    same = all(
        torch.equal(state[f"embedding_bags.{c.name}.weight"], w)
        for c, w in zip(ebc.embedding_bag_configs(), tbe.split_embedding_weights())
    ) and all(
        torch.equal(a, b)
        for a, b in zip(cached.model.over_arch.parameters(), resident.model.over_arch.parameters())
    )
    return summarise(
        args,
        base_times,
        times,
        parts,
        pipeline,
        same,
        sum(ebc.cached_groups[0].cache_rows),
        sum(data.num_embeddings),
    )


# --------------------------------------------------------------------- DMP


def dmp_worker(rank: int, args: argparse.Namespace, port: int, out_dir: str) -> None:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from torchrec_lookahead import LookaheadEmbeddingBagCollectionSharder

    ws = args.world_size
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ws))
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    data = rank_data(args, rank)
    tables = table_configs(args, data)

    def build(ebc, sharders):
        model = dlrm_train(ebc, args.dim, args.seed)
        apply_optimizer_in_backward(
            RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": args.embedding_lr}
        )
        # Both models get the same plan: table-wise, fused. (Left alone, TorchRec's
        # planner makes small tables data-parallel, trained by the dense optimizer.)
        same_plan = {
            t.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
            for t in tables
        }
        planner = EmbeddingShardingPlanner(
            Topology(world_size=ws, compute_device="cpu"),
            batch_size=args.batch_size,
            constraints=same_plan,
        )
        plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
        dmp = DistributedModelParallel(
            model, device=torch.device("cpu"), plan=plan, sharders=sharders
        )
        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(dmp.named_parameters())),
            lambda ps: torch.optim.SGD(ps, lr=args.dense_lr),
        )
        return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])

    meta = torch.device("meta")
    base, base_opt = build(
        EmbeddingBagCollection(tables, device=meta), [EmbeddingBagCollectionSharder()]
    )
    clf = args.cache_load_factor
    look_ebc = LookaheadEmbeddingBagCollection(tables, device=meta, cache_load_factor=clf)
    look, look_opt = build(look_ebc, [LookaheadEmbeddingBagCollectionSharder()])
    look.load_state_dict(base.state_dict())
    batches = [criteo_batch(data, s, args.batch_size) for s in range(args.steps)]

    base_pipeline = TrainPipelineSparseDist(base, base_opt, torch.device("cpu"))
    it = iter(batches)
    base_times, _ = timed_training(
        lambda _: base_pipeline.progress(it), batches, f"rank {rank} plain TorchRec"
    )
    pipeline = LookaheadTrainPipeline(
        look,
        look_opt,
        torch.device("cpu"),
        lookahead=args.lookahead,
        prefetch_distance=args.prefetch_distance,
        stage_thread=STAGE_THREAD[args.stage],
    )
    it = iter(batches)
    times, parts = timed_training(
        lambda _: pipeline.progress(it), batches, f"rank {rank} lookahead", pipeline.timings
    )
    drain(pipeline, it)
    same = _same_local_state(base.state_dict(), look.state_dict())
    sharded = [m for m in look.modules() if hasattr(m, "cached_groups")][0]
    rank_cache_rows = sum(sum(g.cache_rows) for g in sharded.cached_groups)
    report = summarise(
        args, base_times, times, parts, pipeline, same, rank_cache_rows, sum(data.num_embeddings)
    )
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()  # no rank shuts down while another's collectives are in flight
    dist.destroy_process_group()


def _same_local_state(expected: dict, got: dict) -> bool:
    def local(value):
        if hasattr(value, "local_shards"):
            return [s.tensor for s in value.local_shards()]
        return [value] if isinstance(value, torch.Tensor) else []

    return list(expected) == list(got) and all(
        torch.equal(a, b) for k in expected for a, b in zip(local(expected[k]), local(got[k]))
    )


def run_dmp(args: argparse.Namespace) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(dmp_worker, args=(args, port, out_dir), nprocs=args.world_size, join=True)
        ranks = [
            json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(args.world_size)
        ]
    report = dict(ranks[0])  # rank 0 speaks for the run; every rank is kept below
    report["ranks"] = ranks
    report["same_weights"] = all(r["same_weights"] for r in ranks)
    report["cache_rows"] = sum(r["cache_rows"] for r in ranks)
    return report


# ----------------------------------------------------------------- report


def summarise(args, base_times, times, parts, pipeline, same, cache_rows_, rows) -> dict:
    w = args.warmup
    measured = len(times) - w

    def ms(values: list[float]) -> float:
        return 1000 * sum(values[w:]) / measured

    look = {k.replace("_s", "_ms"): ms([p[k] for p in parts]) for k in parts[0]}
    look["step_ms"] = ms(times)
    look["other_ms"] = look["step_ms"] - sum(v for k, v in look.items() if k != "step_ms")
    background = {
        f"background_{k.replace('_s', '_ms')}": 1000 * v / len(times)
        for k, v in pipeline.stage_timings.items()
    }
    metrics = pipeline.cache_metrics()["total"]
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine(),
        "rows": rows,
        "cache_rows": cache_rows_,
        "measured_steps": measured,
        "baseline": {"step_ms": ms(base_times)},
        "lookahead": look
        | background
        | {
            "hit_rate": metrics.hit_rate,
            "rows_fetched_per_step": metrics.rows_fetched / len(times),
            "rows_written_back_per_step": metrics.rows_written_back / len(times),
        },
        "ratio": look["step_ms"] / ms(base_times),
        "same_weights": bool(same),
    }


STAGE_THREAD = {"thread": True, "inline": False}  # --stage: stage_thread=
PARTS = (
    ("stage_ms", "stage wait"),
    ("wait_ms", "executor wait"),
    ("compute_ms", "fwd/bwd/opt"),
    ("other_ms", "other"),
)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    look, cfg = report["lookahead"], report["config"]
    baseline = "all resident" if cfg["world_size"] == 0 else "plain TorchRec"
    colors = ("tab:orange", "tab:red", "tab:blue", "tab:gray")
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ax.barh([baseline], [report["baseline"]["step_ms"]], color="tab:blue")
    left = 0.0
    for (key, label), color in zip(PARTS, colors):
        ax.barh(["lookahead"], [look[key]], left=left, color=color, label=label)
        left += look[key]
    ax.set_xlabel("ms per step")
    share = report["cache_rows"] / report["rows"]
    where = "unsharded" if cfg["world_size"] == 0 else f"DMP world size {cfg['world_size']}"
    ax.set_title(
        f"DLRM, {where}, cache {share:.1%} of {report['rows']:,} rows, "
        f"L={cfg['lookahead']}, batch {cfg['batch_size']}",
        fontsize=10,
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/step_time"))
    parser.add_argument("--world-size", type=int, default=0, help="0: unsharded; 1, 2: DMP")
    parser.add_argument("--scale", type=float, default=0.01)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--batch-size", type=int, default=2048, help="per rank")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--cache-load-factor", type=float, default=0.05)
    parser.add_argument("--lookahead", type=int, default=16)
    parser.add_argument("--prefetch-distance", type=int, default=1)
    parser.add_argument("--embedding-lr", type=float, default=0.05)
    parser.add_argument("--dense-lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="baseline/lookahead pairs")
    parser.add_argument(
        "--stage",
        choices=sorted(STAGE_THREAD),
        default="thread",
        help="the lookahead stage on its thread (the default) or inline",
    )
    args = parser.parse_args()
    if args.warmup >= args.steps:
        parser.error("--warmup must be smaller than --steps")

    # Each repeat runs the baseline, then lookahead: the two alternate in blocks, and the
    # report is the repeat with the median ratio (this machine drifts within a minute).
    repeats = [
        run_dmp(args) if args.world_size else run_unsharded(args) for _ in range(args.repeats)
    ]
    report = sorted(repeats, key=lambda r: r["ratio"])[len(repeats) // 2]
    report["ratios"] = [r["ratio"] for r in repeats]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "step_time.png")

    look = report["lookahead"]
    baseline = "all resident" if args.world_size == 0 else "plain TorchRec"
    where = "unsharded" if args.world_size == 0 else f"DMP world size {args.world_size}, rank 0"
    print(
        f"\nDLRM {where}: {report['rows']:,} rows, cache {report['cache_rows']:,} rows, batch "
        f"{args.batch_size}, L={args.lookahead}, d={args.prefetch_distance}, "
        f"{report['measured_steps']} steps after {args.warmup} warm-up"
    )
    header = ["run", "step ms"] + [label for _, label in PARTS]
    print("{:>15} {:>8} {:>10} {:>13} {:>11} {:>6}".format(*header))
    print("{:>15} {:>8.2f}".format(baseline, report["baseline"]["step_ms"]))
    cells = [look["step_ms"]] + [look[k] for k, _ in PARTS]
    print("{:>15} {:>8.2f} {:>10.3f} {:>13.2f} {:>11.2f} {:>6.2f}".format("lookahead", *cells))
    print(
        f"the stage's CPU time per step: input dist {look['background_input_dist_ms']:.2f} ms, "
        f"planning {look['background_plan_ms']:.2f} ms"
    )
    print(
        f"ratio {report['ratio']:.2f}x (median of {args.repeats}: "
        f"{', '.join(f'{r:.2f}' for r in report['ratios'])}), hit rate {look['hit_rate']:.3f}, "
        f"{look['rows_fetched_per_step']:.0f} rows fetched and "
        f"{look['rows_written_back_per_step']:.0f} written back per step, "
        f"same final weights: {report['same_weights']}"
    )
    print(
        f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores; "
        f"wrote {args.out / 'report.json'} and {args.out / 'step_time.png'}"
    )


if __name__ == "__main__":
    main()
