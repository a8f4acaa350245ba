"""The disk store against the in-memory store, and tables larger than this machine's RAM.

Unsharded DLRM over 26 Criteo-shaped tables (Zipf ids), fused row-wise
Adagrad, trained through ``LookaheadTrainPipeline`` on this machine's CPU.

* ``--part fits``: a table set that fits in RAM, with the full tables in host
  memory or in a disk store (``store_dir``) whose page cache is dropped after
  initialisation, so rows come from disk. Cache 5% per table, lookahead 16
  and 64; the runs alternate (memory, disk, disk without reading ahead) in
  blocks, --repeats times; median step time of each after --warmup steps,
  its ratio to memory, and the first step (the window fill: all cold misses).
* ``--part huge``: tables (rows + optimizer state) of --huge-gb on disk, more
  than RAM: samples/s, hit rate, the process's disk reads and writes
  (``/proc/self/io``), executor wait per step (read latency not hidden by
  the window shows up there) and the largest private memory (``RssAnon``)
  seen. The files are removed afterwards. ``--oracle-rows memory`` keeps the
  oracles' per-row tables in RAM instead of store files (for comparison).
* ``--part checkpoint``: the same DLRM with a disk store of --checkpoint-gb,
  sharded by DMP on one rank (gloo) and trained a few steps, saved and
  loaded through ``torch.distributed.checkpoint`` with the streaming save
  planner and with DCP's default one (each checkpoint loaded back by the
  streaming load planner), the page cache dropped before each save and load:
  seconds, GB/s, and the private memory each adds (sampled every millisecond).

Runs every part unless --part names some. Prints a table and writes ``report.json`` into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import machine
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch.distributed.checkpoint import DefaultSavePlanner
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from tqdm import tqdm

from torchrec_lookahead import LookaheadEmbeddingBagCollection, LookaheadTrainPipeline
from torchrec_lookahead.data import SyntheticCriteo
from torchrec_lookahead.data.torchrec_batches import criteo_batch, feature_names
from torchrec_lookahead.store.checkpoint import StreamingLoadPlanner, StreamingSavePlanner
from torchrec_lookahead.store.files import anonymous_rss_bytes
from torchrec_lookahead.store.stores import HostStore, MmapStore


def process_io() -> dict[str, int]:
    """Bytes this process read from and wrote to storage so far."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"read": int(fields["read_bytes"]), "written": int(fields["write_bytes"])}


def table_configs(data: SyntheticCriteo, dim: int) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t_{name}", embedding_dim=dim, num_embeddings=rows, feature_names=[name]
        )
        for name, rows in zip(feature_names(data), data.num_embeddings)
    ]


def build(data: SyntheticCriteo, dim: int, cache_load_factor: float, store_dir: Path | None):
    """The DLRM and its pipeline parts; returns (model, module, seconds to build)."""
    tables = table_configs(data, dim)
    start = time.perf_counter()
    torch.manual_seed(0)
    # The fused optimizer through fused_params: TorchRec's RowWiseAdagrad, given to
    # apply_optimizer_in_backward, builds a full-table temporary per table on the CPU.
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    ebc = LookaheadEmbeddingBagCollection(
        tables, cache_load_factor=cache_load_factor, store_dir=store_dir, fused_params=fused
    )
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=13,
        dense_arch_layer_sizes=[64, dim],
        over_arch_layer_sizes=[64, 1],
    )
    model = DLRMTrain(dlrm)
    return model, ebc, time.perf_counter() - start


def train(model, ebc, data, args, lookahead: int, steps: int, desc: str) -> dict:
    """Trains ``steps`` batches; what the run measured."""
    dense = [*model.model.dense_arch.parameters(), *model.model.over_arch.parameters()]
    pipeline = LookaheadTrainPipeline(
        model, torch.optim.SGD(dense, lr=0.1), torch.device("cpu"), lookahead=lookahead
    )
    batches = (criteo_batch(data, s, args.batch_size) for s in range(steps))
    io_before, times, waits, private = process_io(), [], [], anonymous_rss_bytes()
    for _ in tqdm(range(steps), desc=desc, unit="step", disable=None, leave=False):
        start, waited = time.perf_counter(), pipeline.timings["wait_s"]
        pipeline.progress(batches)
        times.append(time.perf_counter() - start)
        waits.append(pipeline.timings["wait_s"] - waited)
        private = max(private, anonymous_rss_bytes())
    io_after = process_io()
    pipeline.close()
    metrics = pipeline.cache_metrics()["total"]
    steady = times[args.warmup :]
    return {
        "step_ms": 1000 * statistics.median(steady),
        "samples_per_s": args.batch_size * len(steady) / sum(steady),
        "hit_rate": metrics.hit_rate,
        "first_step_ms": 1000 * times[0],  # fills the window: every row is a cold miss
        "first_step_wait_ms": 1000 * waits[0],
        "executor_wait_ms_per_step": 1000 * statistics.mean(waits[args.warmup :]),
        "disk_read_mb_per_s": (io_after["read"] - io_before["read"]) / 1e6 / sum(times),
        "disk_written_mb_per_s": (io_after["written"] - io_before["written"]) / 1e6 / sum(times),
        "private_mb": private / 2**20,
        "read_ahead_dropped": ebc.store_files.read_ahead_dropped if ebc.store_files else 0,
    }


STORES = ("memory", "disk", "disk, no read-ahead")
PARTS = ["fits", "huge", "checkpoint"]


def part_fits(args) -> list[dict]:
    data = SyntheticCriteo(scale=args.scale, seed=1)
    runs = []
    for repeat in range(args.repeats):
        for lookahead in (16, 64):
            for store in STORES:
                folder = Path(tempfile.mkdtemp(dir=args.store_dir)) if store != "memory" else None
                model, ebc, _ = build(data, args.dim, 0.05, folder)
                if folder is not None:
                    ebc.store_files.drop_page_cache()
                MmapStore.reads_ahead = store != "disk, no read-ahead"
                desc = f"fits {store} L={lookahead} #{repeat + 1}"
                run = train(model, ebc, data, args, lookahead, args.steps, desc)
                runs.append({"store": store, "lookahead": lookahead, "repeat": repeat, **run})
                del model, ebc
                if folder is not None:
                    shutil.rmtree(folder)
    return runs


def sized_data(args, gigabytes: float, copies: int = 1) -> tuple[SyntheticCriteo, float, Path]:
    """Criteo-shaped tables of ``gigabytes`` (rows and row-wise Adagrad state), their size
    in GB, and a new folder for their store; exits if ``copies`` of them do not fit there."""
    row_bytes = 4 * (args.dim + 1)  # weights and the row-wise Adagrad state
    scale = gigabytes * 1e9 / row_bytes / sum(SyntheticCriteo().num_embeddings)
    data = SyntheticCriteo(scale=scale, seed=1)
    folder = Path(tempfile.mkdtemp(dir=args.store_dir))
    free = shutil.disk_usage(folder).free
    need = sum(data.num_embeddings) * row_bytes
    if need * copies > free:
        shutil.rmtree(folder)
        where = args.store_dir or tempfile.gettempdir()
        raise SystemExit(
            f"{gigabytes} GB of tables: {copies} x {need / 1e9:.1f} GB needed in "
            f"{where}, {free / 1e9:.1f} GB free"
        )
    return data, need / 1e9, folder


def part_huge(args) -> dict:
    data, store_gb, folder = sized_data(args, args.huge_gb)
    try:
        if args.oracle_rows == "memory":  # the ablation: oracles keep their row tables in RAM
            MmapStore.row_table = HostStore.row_table
        model, ebc, built_s = build(data, args.dim, args.huge_cache, folder)
        ebc.store_files.drop_page_cache()
        run = train(model, ebc, data, args, 64, args.huge_steps, "huge")
        rows = sum(data.num_embeddings)
        return {
            "rows": rows,
            "store_gb": store_gb,
            "init_s": built_s,
            "ram_gb": _ram_bytes() / 1e9,
            **run,
        }
    finally:
        shutil.rmtree(folder)


class PeakPrivateMemory:
    """The largest ``RssAnon`` of this process while the ``with`` block runs, sampled
    every millisecond on a thread (the block's own allocations and copies)."""

    def __enter__(self) -> PeakPrivateMemory:
        self.before = self.peak = anonymous_rss_bytes()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, anonymous_rss_bytes())

    @property
    def added_mb(self) -> float:
        return (self.peak - self.before) / 2**20


def build_sharded(data: SyntheticCriteo, dim: int, store_dir: Path):
    """The DLRM with its tables in a disk store, sharded table-wise by DMP on this one rank;
    returns (model, optimizer)."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import (
        EmbeddingShardingPlanner,
        ParameterConstraints,
        Topology,
    )
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from torchrec_lookahead import lookahead_sharders

    tables = table_configs(data, dim)
    ebc = LookaheadEmbeddingBagCollection(
        tables, device=torch.device("meta"), cache_load_factor=0.01, store_dir=store_dir
    )
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=13,
        dense_arch_layer_sizes=[64, dim],
        over_arch_layer_sizes=[64, 1],
    )
    model = DLRMTrain(dlrm)
    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.05})
    table_wise = {t.name: ParameterConstraints(sharding_types=["table_wise"]) for t in tables}
    planner = EmbeddingShardingPlanner(
        Topology(world_size=1, compute_device="cpu"), constraints=table_wise
    )
    sharders = lookahead_sharders()
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.1),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def drop_page_cache(model: torch.nn.Module) -> None:
    """Cold store files for the next save or load: every sharded module's pages dropped."""
    for module in model.modules():
        if getattr(module, "store_files", None) is not None:
            module.store_files.drop_page_cache()


def part_checkpoint(args) -> list[dict]:
    """Saves and loads of a disk store's model (DMP, one rank) through DCP, streamed and, for
    comparison, with DCP's default save planner: seconds, GB/s and private memory added."""
    data, store_gb, folder = sized_data(args, args.checkpoint_gb, copies=2)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(free.getsockname()[1]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    planners = {"streamed": StreamingSavePlanner, "default": DefaultSavePlanner}
    runs = []
    try:
        start = time.perf_counter()
        dmp, optimizer = build_sharded(data, args.dim, folder)
        built_s = time.perf_counter() - start
        pipeline = LookaheadTrainPipeline(dmp, optimizer, torch.device("cpu"), lookahead=16)
        batches = (criteo_batch(data, s, args.batch_size) for s in range(args.checkpoint_steps))
        for _ in tqdm(range(args.checkpoint_steps), desc="train", disable=None, leave=False):
            pipeline.progress(batches)
        pipeline.close()
        for repeat in range(args.repeats):
            for name in args.checkpoint_planners.split(","):
                state = {"model": dmp.state_dict(), "optimizer": optimizer.state_dict()}
                path = Path(tempfile.mkdtemp(dir=args.store_dir))
                drop_page_cache(dmp)
                with PeakPrivateMemory() as saving:
                    start = time.perf_counter()
                    dcp.save(state, checkpoint_id=path, planner=planners[name]())
                    save_s = time.perf_counter() - start
                size = sum(f.stat().st_size for f in path.iterdir())
                drop_page_cache(dmp)
                with PeakPrivateMemory() as loading:
                    start = time.perf_counter()
                    dcp.load(state, checkpoint_id=path, planner=StreamingLoadPlanner())
                    load_s = time.perf_counter() - start
                shutil.rmtree(path)
                runs.append(
                    {
                        "planner": name,
                        "repeat": repeat,
                        "store_gb": store_gb,
                        "built_s": built_s,
                        "checkpoint_gb": size / 1e9,
                        "save_s": save_s,
                        "load_s": load_s,
                        "save_added_mb": saving.added_mb,
                        "load_added_mb": loading.added_mb,
                        "private_mb": max(saving.peak, loading.peak) / 2**20,
                    }
                )
                print(f"{name}: {runs[-1]}")
    finally:
        dist.destroy_process_group()
        shutil.rmtree(folder)
    return runs


def _ram_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return -1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--part",
        nargs="+",
        choices=PARTS,
        default=PARTS,
        help="which parts to run (all by default)",
    )
    p.add_argument("--scale", type=float, default=0.1, help="Criteo Kaggle sizes times this")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of step times")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--huge-gb", type=float, default=40.0, help="rows + state on disk")
    p.add_argument("--huge-cache", type=float, default=0.01, help="cache load factor")
    p.add_argument("--huge-steps", type=int, default=300)
    p.add_argument(
        "--oracle-rows",
        choices=["disk", "memory"],
        default="disk",
        help="where the oracles' per-row tables live in the huge part",
    )
    p.add_argument("--checkpoint-gb", type=float, default=4.0, help="rows + state on disk")
    p.add_argument("--checkpoint-steps", type=int, default=20, help="trained before saving")
    p.add_argument(
        "--checkpoint-planners",
        default="streamed,default",
        help="save planners to compare (default needs the largest table in RAM)",
    )
    p.add_argument("--store-dir", type=str, default=None, help="where the store files go")
    p.add_argument("--out", type=str, default="results/disk_store")
    args = p.parse_args()
    report = {"machine": machine(), "config": vars(args)}
    if "fits" in args.part:
        report["fits"] = part_fits(args)
        print(
            f"\nfits in RAM: scale {args.scale}, dim {args.dim}, batch {args.batch_size}, "
            f"cache 5%, median of {args.repeats} runs (page cache dropped first)"
        )
        print(
            f"{'L':>4}{'store':>22}{'step ms':>10}{'/ memory':>10}{'wait ms':>10}"
            f"{'1st step ms':>13}{'read MB/s':>11}"
        )
        for lookahead in (16, 64):
            of = {
                s: [r for r in report["fits"] if r["lookahead"] == lookahead and r["store"] == s]
                for s in STORES
            }
            for store, runs in of.items():
                ratio = statistics.median(
                    r["step_ms"] / m["step_ms"] for r, m in zip(runs, of["memory"])
                )
                keys = (
                    "step_ms",
                    "executor_wait_ms_per_step",
                    "first_step_ms",
                    "disk_read_mb_per_s",
                )
                cells = [statistics.median(r[k] for r in runs) for k in keys]
                print(
                    f"{lookahead:>4}{store:>22}{cells[0]:>10.1f}{ratio:>10.3f}{cells[1]:>10.2f}"
                    f"{cells[2]:>13.1f}{cells[3]:>11.1f}"
                )
    if "huge" in args.part:
        huge = report["huge"] = part_huge(args)
        print(
            f"\nlarger than RAM: {huge['rows']:,} rows, {huge['store_gb']:.1f} GB on disk, "
            f"{huge['ram_gb']:.1f} GB RAM, cache {args.huge_cache:.0%}, L=64, "
            f"built in {huge['init_s']:.0f} s"
        )
        for key in (
            "samples_per_s",
            "hit_rate",
            "step_ms",
            "executor_wait_ms_per_step",
            "first_step_ms",
            "disk_read_mb_per_s",
            "disk_written_mb_per_s",
            "private_mb",
        ):
            print(f"{key:>28}  {huge[key]:,.3f}")
    if "checkpoint" in args.part:
        runs = report["checkpoint"] = part_checkpoint(args)
        print(
            f"\nDCP checkpoints of a disk store under DMP (1 rank, table-wise): "
            f"{runs[0]['store_gb']:.1f} GB of tables, page cache dropped before each save "
            f"and load (loads by StreamingLoadPlanner), median of {args.repeats}"
        )
        print(
            f"{'planner':>10}{'GB':>7}{'save s':>8}{'GB/s':>7}{'+MB saving':>12}"
            f"{'load s':>8}{'GB/s':>7}{'+MB loading':>13}"
        )
        for name in args.checkpoint_planners.split(","):
            of = [r for r in runs if r["planner"] == name]
            keys = ("checkpoint_gb", "save_s", "load_s", "save_added_mb", "load_added_mb")
            med = {k: statistics.median(r[k] for r in of) for k in keys}
            gb = med["checkpoint_gb"]
            print(
                f"{name:>10}{gb:>7.2f}{med['save_s']:>8.1f}{gb / med['save_s']:>7.2f}"
                f"{med['save_added_mb']:>12,.0f}{med['load_s']:>8.1f}{gb / med['load_s']:>7.2f}"
                f"{med['load_added_mb']:>13,.0f}"
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'report.json'}")


if __name__ == "__main__":
    main()
