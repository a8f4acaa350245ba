"""What a GPU's host pays per training step, counted on the CPU under fake CUDA.

Plain TorchRec (``TrainPipelineSparseDist``, FBGEMM's fused kernels, every table on the
device) against lookahead (``LookaheadEmbeddingBagCollectionSharder`` and
``LookaheadTrainPipeline``), both under ``DistributedModelParallel`` on ``cuda:0``, at
``benchmarks/gpu.py``'s shape (DLRM, 26 tables of Criteo Kaggle's sizes times --scale,
Zipf ids, row-wise Adagrad, table-wise) with the tables' devices and streams as on a GPU.
The process group is ``cuda:fake`` (CUDA tensors only, as NCCL; no data moves): at world
size 2 this process stands in as rank 0 of 2, every other rank sending what it sends.

Per measured step (after --warmup), from outside the pipelines, so that it stays valid
while their internals change:

* ``trainer_cpu_ms``: the trainer thread's CPU time in ``progress`` (``thread_time``);
  ``emulation_ms`` of it went into fake CUDA's device ops (each runs fake and on CPU
  shadows, which do the GPU's work), so ``trainer_net_ms`` (the difference) is the host
  work outside device ops; on a GPU the host pays, besides, a launch per device op;
* ``host_waits``: where the host would wait for the device (counted by
  :class:`~torchrec_lookahead.testing.host_waits.HostCounter`: ``.item()``, ``tolist``,
  D2H copies, data-dependent shapes, stream / event / device synchronisations, blocking
  or pageable H2D copies), with their kinds and call sites in the JSON;
* ``device_ops``: operators on CUDA tensors the trainer thread issued (views included);
  ``stream_ops``: event records, stream waits, ``record_stream``;
* ``other_threads_cpu_ms``: every other thread of the process (stage, executor, torch's
  and numba's pools), from ``/proc/self/task/*/schedstat``; threads alive before the
  row's pipeline was built are another's (in a test process, earlier tests' pipelines)
  and are not counted; in the JSON also by thread, each with its CPU net of emulation
  and its device ops.

Figures are medians over the measured steps. With --repeats every setting runs once a
round, in turn; the host's CPU figures (:data:`MEDIANS`, among them ``trainer_net_gap_ms``,
the trainer's net CPU less plain TorchRec's in the same round) are then medians over the
rounds, each round's in ``<key>_rounds``, and the rest (counts, the same every round, and
the figures by thread) the first round's. Stood in for (a CPU build of torch has no
CUDA runtime; see ``STOOD_IN``, also written to the JSON): the backward (autograd cannot
record fake CUDA tensors, so steps run under ``no_grad`` with ``Tensor.backward`` a
no-op, the model in training mode otherwise), FBGEMM's TBE forward kernels (fake kernel
only), ``torch.cuda``'s streams and events (counting doubles), DMP's constructor-time
collective validation, TorchRec's ``TableBatchedEmbeddingSlice``, DDP (not built) and
TorchRec's planner (table ``i`` on rank ``i % world_size``). Batches are pinned, as a
loader with ``pin_memory`` hands them. Torch runs on one intra-op thread.
Prints one table, writes ``OUT/report.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from common import dlrm_train, machine, over_rounds
from thread_cpu import StepCpu
from torchrec.datasets.utils import Batch
from torchrec.distributed import collective_utils
from torchrec.distributed.composable.table_batched_embedding_slice import (
    TableBatchedEmbeddingSlice,
)
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from tqdm import tqdm

from torchrec_lookahead import (
    BatchCheck,
    DeviceOracleCacher,
    LookaheadEmbeddingBagCollection,
    LookaheadEmbeddingBagCollectionSharder,
    LookaheadTrainPipeline,
)
from torchrec_lookahead._compat import fake_store, is_fake
from torchrec_lookahead.data import CRITEO_KAGGLE_TABLE_SIZES, SyntheticCriteo
from torchrec_lookahead.data.torchrec_batches import criteo_batch, feature_names
from torchrec_lookahead.settings import PLANNERS
from torchrec_lookahead.testing.fake_cuda import FakeCuda
from torchrec_lookahead.testing.host_waits import HostCounter, Tally

DEVICE = torch.device("cuda", 0)
# A row's figures reported as their median over --repeats rounds (the host's CPU, which
# varies from run to run here; its counts do not).
MEDIANS = (
    "trainer_cpu_ms",
    "emulation_ms",
    "trainer_net_ms",
    "trainer_net_gap_ms",
    "other_threads_cpu_ms",
)
STOOD_IN = [
    "backward and optimizer update: autograd cannot record fake CUDA tensors on a CPU build "
    "(the process aborts), so steps run under torch.no_grad() with Tensor.backward a no-op; "
    "the model is in training mode (zero_grad and optimizer.step run, the fused update "
    "lives in the backward and does not)",
    "FBGEMM's TBE forward kernels (split_embedding_codegen_forward_*_pt2_wrapper): a fake "
    "kernel only (fake_cuda.STUBBED), their output's shadow zero; the host side of the "
    "call runs",
    "torch.cuda's Stream, Event, current_stream, stream, synchronize and device queries: "
    "counting doubles (testing.host_waits), no stream or event exists",
    "DMP's constructor-time collective validation (broadcast_object_list, whose pickled "
    "bytes become meta tensors under the fake tensor mode): marked done, validation off",
    "DDP of the dense part: not built (DMP's init_data_parallel=False). DMP's wrap moves the "
    "model with Module.to, which cannot swap fake parameters; under no_grad DDP's forward "
    "would only call the module (no reducer work, DLRM has no buffers)",
    "TorchRec's TableBatchedEmbeddingSlice (a tensor subclass torch cannot make of a "
    "fake tensor, built once when sharding): the table's view, as a plain parameter",
    "three calls fake CUDA does not rewrite into operators (Tensor.copy_ of a CUDA tensor, "
    "indexing with two index tensors in DLRM's interaction, set_ of a device storage in "
    "the store): rewritten into the operators a GPU build dispatches them to "
    "(testing.host_waits); FakeTensor.tolist: one read of the shadow, counted as one wait",
    "the sharding plan: table-wise by hand, table i on rank i % world_size, not TorchRec's "
    "planner: fake CUDA's collectives need every rank to send as much as it receives",
    "batches: pinned (as a loader with pin_memory hands them); torch on one intra-op "
    "thread (the pipelines' own threads run one too)",
    "the process group: cuda:fake (CUDA tensors only, as NCCL; no data moves); at world "
    "size 2 this process is rank 0 and every other rank sends what it sends",
    "fake CUDA runs every device op twice (fake, and on CPU shadows doing the GPU's work): "
    "trainer_cpu_ms includes it for both pipelines; emulation_ms is that part, "
    "trainer_net_ms the rest (no launch cost added for device ops)",
]


@dataclass(frozen=True)
class Settings:
    """The model and the data: ``benchmarks/gpu.py``'s by default."""

    scale: float = 0.1
    dim: int = 64
    cache_load_factor: float = 0.05
    lookahead: int = 16
    zipf: float = 1.1
    seed: int = 0
    table_sizes: Sequence[int] = field(default=CRITEO_KAGGLE_TABLE_SIZES)


def build(
    kind: str, world_size: int, batch_size: int, settings: Settings, planner: str = "host"
) -> Any:
    """A pipeline of ``kind`` ("plain" or "lookahead", its plans made where ``planner``
    says) on ``DEVICE``, under DMP."""
    data = SyntheticCriteo(
        settings.table_sizes, scale=settings.scale, zipf_exponent=settings.zipf, seed=settings.seed
    )
    tables = [
        EmbeddingBagConfig(
            name=f"t_{name}", embedding_dim=settings.dim, num_embeddings=rows, feature_names=[name]
        )
        for name, rows in zip(feature_names(data), data.num_embeddings)
    ]
    meta = torch.device("meta")
    if kind == "lookahead":
        load = settings.cache_load_factor
        ebc: Any = LookaheadEmbeddingBagCollection(tables, device=meta, cache_load_factor=load)
        sharders: list[Any] = [LookaheadEmbeddingBagCollectionSharder()]
    else:
        ebc = EmbeddingBagCollection(tables, device=meta)
        sharders = [EmbeddingBagCollectionSharder()]
    model = dlrm_train(ebc, settings.dim, settings.seed, DEVICE)
    with torch.enable_grad():  # it hooks the meta parameters' autograd nodes
        sparse = model.model.sparse_arch.parameters()
        apply_optimizer_in_backward(RowWiseAdagrad, sparse, {"lr": 0.05})
    # Table-wise, table i on rank i % world_size: each rank's output all-to-all then sends
    # as much as it receives, which fake CUDA's collectives (every rank alike) need.
    kernel = "fused" if kind == "plain" else "fused_uvm_caching"
    per_table = {
        t.name: table_wise(rank=i % world_size, compute_kernel=kernel) for i, t in enumerate(tables)
    }
    module_plan = construct_module_sharding_plan(
        ebc, per_table, sharders[0], world_size, world_size, device_type="cuda"
    )
    plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": module_plan})
    dmp = DistributedModelParallel(
        model, device=DEVICE, plan=plan, sharders=sharders, init_data_parallel=False
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.1),
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    if kind == "lookahead":
        pipeline = LookaheadTrainPipeline(
            dmp, optimizer, DEVICE, lookahead=settings.lookahead, planner=planner
        )
        return pipeline, data, dmp
    return TrainPipelineSparseDist(dmp, optimizer, DEVICE), data, dmp


def measure(
    kind: str,
    world_size: int,
    batch_size: int,
    steps: int,
    warmup: int,
    settings: Settings,
    progress: bool = True,
    planner: str = "host",
    loader_checks: bool = False,
) -> dict[str, Any]:
    """Run ``warmup + steps`` steps of a ``kind`` pipeline under fake CUDA (lookahead's
    plans made where ``planner`` says; with ``loader_checks``, its batches checked before
    the run, as a loader's worker processes check them); the row of per-step medians over
    the last ``steps`` (see the module)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cpu = StepCpu()  # threads alive now are another's (in a test process: other pipelines)
    dist.init_process_group("cuda:fake", store=fake_store(), rank=0, world_size=world_size)
    try:
        with (
            FakeCuda(DEVICE) as fake,
            HostCounter(fake) as counter,
            stood_in(),
            torch.no_grad(),
        ):
            pipeline, data, model = build(kind, world_size, batch_size, settings, planner)
            total = warmup + steps + settings.lookahead + 2  # the window stays full
            batches = [criteo_batch(data, s, batch_size).pin_memory() for s in range(total)]
            checked = loader_checks and kind == "lookahead"
            if checked:  # by BatchCheck.collate, where the loader collates (not timed)
                collate = BatchCheck.of(model).collate()
                batches = [collate(batch) for batch in batches]
            rows = _run(pipeline, iter(batches), counter, warmup + steps, progress, cpu)
            if kind == "lookahead":
                pipeline.close()
            del pipeline, batches
            gc.collect()
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    row = summary(kind, world_size, batch_size, rows[warmup:])
    return {**row, "planner": planner if kind == "lookahead" else None, "loader_checks": checked}


@dataclass
class Step:
    """One step: the trainer thread's CPU seconds and tally; every other thread's CPU
    seconds and tally, by thread name."""

    cpu_s: float
    trainer: Tally
    others_s: dict[str, float]
    others_by_name: dict[str, Tally]

    @property
    def others(self) -> Tally:
        """Every other thread's tally, summed."""
        return _sum(iter(self.others_by_name.values()))

    def cpu_of(self, name: str) -> float:
        return self.others_s.get(name, 0.0)

    def tally_of(self, name: str) -> Tally:
        return self.others_by_name.get(name, Tally())


def summary(kind: str, world_size: int, batch_size: int, steps: list[Step]) -> dict[str, Any]:
    """The row of per-step medians over ``steps`` (and, in the JSON, what they are made of)."""

    def median(values: Iterator[float]) -> float:
        return statistics.median(list(values))

    def by_name(value: Callable[[Step, str], float]) -> dict[str, float]:
        """Each other thread's mean of ``value`` per step."""
        return {name: statistics.fmean(value(step, name) for step in steps) for name in names}

    others_s = [sum(step.others_s.values()) for step in steps]
    names = sorted({name for step in steps for name in step.others_s})
    return {
        "pipeline": kind,
        "world_size": world_size,
        "batch_size": batch_size,
        "steps": len(steps),
        "trainer_cpu_ms": median(1e3 * step.cpu_s for step in steps),
        "emulation_ms": median(1e3 * step.trainer.emulation_s for step in steps),
        "trainer_net_ms": median(1e3 * (step.cpu_s - step.trainer.emulation_s) for step in steps),
        "host_waits": median(step.trainer.host_waits for step in steps),
        "device_ops": median(step.trainer.device_ops for step in steps),
        "stream_ops": median(step.trainer.stream_ops for step in steps),
        "other_threads_cpu_ms": median(1e3 * s for s in others_s),
        "other_threads_emulation_ms": median(1e3 * step.others.emulation_s for step in steps),
        "other_threads_cpu_ms_mean": 1e3 * statistics.fmean(others_s),
        "other_threads_cpu_ms_by_name": by_name(lambda step, name: 1e3 * step.cpu_of(name)),
        "other_threads_net_ms_by_name": by_name(
            lambda step, name: 1e3 * (step.cpu_of(name) - step.tally_of(name).emulation_s)
        ),
        "other_threads_device_ops_by_name": by_name(
            lambda step, name: step.tally_of(name).device_ops
        ),
        "other_threads_host_waits": median(step.others.host_waits for step in steps),
        "other_threads_device_ops": median(step.others.device_ops for step in steps),
        "host_waits_range": _range([step.trainer.host_waits for step in steps]),
        "device_ops_range": _range([step.trainer.device_ops for step in steps]),
        "host_wait_kinds": _per_step([step.trainer.waits for step in steps]),
        "host_wait_sites": _per_step([step.trainer.sites for step in steps]),
        "other_threads_host_wait_sites": _per_step([step.others.sites for step in steps]),
    }


def _run(
    pipeline: Any,
    batches: Iterator[Batch],
    counter: HostCounter,
    steps: int,
    progress: bool,
    cpu: StepCpu,
) -> list[Step]:
    """Run ``steps`` steps, each one's figures (its threads' CPU as ``cpu`` counts it)."""
    trainer = threading.get_ident()
    rows = []
    for _ in tqdm(range(steps), desc="steps", leave=False, disable=not progress):
        tallies_before = counter.by_thread()
        with cpu.step():
            pipeline.progress(batches)
        tallies_after, measured = counter.by_thread(), cpu.steps[-1]
        mine = counter.name(trainer)
        spent = {
            name: t.minus(tallies_before.get(name, Tally())) for name, t in tallies_after.items()
        }
        rest = {name: t for name, t in spent.items() if name != mine}
        rows.append(Step(measured.cpu_s, spent.get(mine, Tally()), measured.others_s, rest))
    return rows


def _sum(tallies: Iterator[Tally]) -> Tally:
    total = Tally()
    for tally in tallies:
        total.device_ops += tally.device_ops
        total.stream_ops += tally.stream_ops
        total.waits.update(tally.waits)
        total.sites.update(tally.sites)
        total.emulation_s += tally.emulation_s
    return total


def _range(values: list[int]) -> list[int]:
    return [min(values), max(values)]


def _per_step(counters: list[Counter[str]]) -> dict[str, float]:
    """The mean count per step of each key."""
    total: Counter[str] = Counter()
    for counter in counters:
        total.update(counter)
    return {key: count / len(counters) for key, count in total.most_common()}


@contextlib.contextmanager
def stood_in() -> Iterator[None]:
    """What the CPU cannot run, stood in for (see ``STOOD_IN``): the backward, DMP's
    collective validation, ``TableBatchedEmbeddingSlice`` of a fake tensor."""
    saved_backward = torch.Tensor.backward
    saved_slice = TableBatchedEmbeddingSlice.__new__
    saved_validation = collective_utils._INITIALIZED

    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        return None

    def new_slice(cls: type, data: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not is_fake(data):
            return saved_slice(cls, data, *args, **kwargs)
        start, end, rows, dim = (*args, *kwargs.values())
        return torch.nn.Parameter(data[start:end].view(rows, dim), requires_grad=False)

    torch.Tensor.backward = backward  # type: ignore[method-assign]
    TableBatchedEmbeddingSlice.__new__ = new_slice  # type: ignore[method-assign]
    collective_utils._INITIALIZED = True
    try:
        yield
    finally:
        torch.Tensor.backward = saved_backward  # type: ignore[method-assign]
        TableBatchedEmbeddingSlice.__new__ = saved_slice  # type: ignore[method-assign]
        collective_utils._INITIALIZED = saved_validation


COLUMNS = [
    ("pipeline", "pipeline", "{:>10}"),
    ("planner", "planner", "{:>8}"),
    ("ws", "world_size", "{:>4}"),
    ("batch", "batch_size", "{:>7}"),
    ("trainer CPU ms", "trainer_cpu_ms", "{:>15.1f}"),
    ("emulation ms", "emulation_ms", "{:>13.1f}"),
    ("net ms", "trainer_net_ms", "{:>8.1f}"),
    ("gap ms", "trainer_net_gap_ms", "{:>8.1f}"),
    ("host waits", "host_waits", "{:>11g}"),
    ("device ops", "device_ops", "{:>11g}"),
    ("stream ops", "stream_ops", "{:>11g}"),
    ("other threads ms", "other_threads_cpu_ms", "{:>17.1f}"),
]


def table(rows: list[dict[str, Any]]) -> str:
    widths = [len(f.format(0 if "g" in f or "f" in f else "")) for _, _, f in COLUMNS]
    lines = ["".join(f"{name:>{w}}" for (name, _, _), w in zip(COLUMNS, widths))]
    for row in rows:
        cells = [
            f"{'-':>{width}}" if row.get(key) is None else f.format(row[key])
            for (_, key, f), width in zip(COLUMNS, widths)
        ]
        lines.append("".join(cells))
    return "\n".join(lines)


def add_gaps(rows: list[dict[str, Any]]) -> None:
    """Each row's ``trainer_net_gap_ms``: its trainer's net CPU per step less plain
    TorchRec's at the same world size and batch size, in the same round (the issue's
    goal: at most 1 ms). Every round runs plain at each of them."""
    plain = {
        (r["world_size"], r["batch_size"]): r["trainer_net_ms"]
        for r in rows
        if r["pipeline"] == "plain"
    }
    for row in rows:
        row["trainer_net_gap_ms"] = (
            row["trainer_net_ms"] - plain[row["world_size"], row["batch_size"]]
        )


def planner_dispatch(steps: int = 200, warmup: int = 50) -> dict[str, float]:
    """What the device oracle's step costs a host where its ops cost nothing but their
    dispatch: one pool's ``prepare_device`` and ``push_device`` on CPU tensors of 32 ids (a
    64-slot cache, L = 16), the median thread CPU per step; and the device ops the same
    step issues on ``cuda:0`` (counted under fake CUDA), with its host waits. Unlike the
    numba oracle's, this cost does not grow with the batch: on a GPU host each op is one
    launch (views none), whatever its size."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    batches = [torch.from_numpy(rng.integers(0, 1000, 32)) for _ in range(warmup + steps)]
    oracle = DeviceOracleCacher(64, 16, 1, num_rows=1000, device="cpu")
    cpu_s = []
    for i, batch in enumerate(batches):
        start = time.thread_time()
        oracle.push_device(oracle.prepare_device(batch))
        if i >= warmup:
            cpu_s.append(time.thread_time() - start)
    torch.set_num_threads(threads)
    with FakeCuda(DEVICE) as fake, HostCounter(fake) as counter:
        oracle = DeviceOracleCacher(64, 16, 1, num_rows=1000, device=DEVICE)
        for batch in batches[:warmup]:
            oracle.push_device(oracle.prepare_device(batch.to(DEVICE)))
        ids = batches[warmup].to(DEVICE)
        before = counter.tally().copy()
        oracle.push_device(oracle.prepare_device(ids))
        step = counter.tally().minus(before)
    return {
        "cpu_ms_per_step": 1e3 * statistics.median(cpu_s),
        "device_ops_per_step": step.device_ops,
        "host_waits_per_step": step.host_waits,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--planners", nargs="+", choices=PLANNERS, default=list(PLANNERS), help="lookahead's"
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1, help="rounds over every setting")
    p.add_argument(
        "--loader-checks",
        action="store_true",
        help="lookahead's batches checked by the loader (BatchCheck.collate), not its stage",
    )
    base = Settings()
    p.add_argument("--scale", type=float, default=base.scale)
    p.add_argument("--cache-load-factor", type=float, default=base.cache_load_factor)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    settings = replace(base, scale=args.scale, cache_load_factor=args.cache_load_factor)
    kinds = [("plain", "host"), *[("lookahead", planner) for planner in args.planners]]
    runs = [
        (kind, ws, bs, planner)
        for bs in args.batch_sizes
        for ws in args.world_sizes
        for kind, planner in kinds
    ]
    rounds: list[list[dict[str, Any]]] = []
    with tqdm(total=args.repeats * len(runs), desc="settings") as progress:
        for _ in range(args.repeats):  # every setting once a round: drift spreads over all
            rounds.append([])
            for kind, ws, bs, planner in runs:
                row = measure(
                    kind,
                    ws,
                    bs,
                    args.steps,
                    args.warmup,
                    settings,
                    planner=planner,
                    loader_checks=args.loader_checks,
                )
                rounds[-1].append(row)
                tqdm.write(table([row]))
                progress.update()
            add_gaps(rounds[-1])
    rows = over_rounds(rounds, MEDIANS)
    print(f"medians over {args.repeats} round(s)\n{table(rows)}")
    dispatch = planner_dispatch()
    print(
        "the device oracle's step, dispatch only (one pool, CPU tensors of 32 ids): "
        f"{dispatch['cpu_ms_per_step']:.2f} ms of CPU, {dispatch['device_ops_per_step']} "
        f"device ops, {dispatch['host_waits_per_step']} host waits"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(["benchmarks/host_cost.py", *(argv or sys.argv[1:])]),
        "machine": machine(),
        "settings": {
            **asdict(settings),
            "steps": args.steps,
            "warmup": args.warmup,
            "intra_op_threads": 1,
            "loader_checks": args.loader_checks,
            "device": str(DEVICE),
        },
        "stood_in": STOOD_IN,
        "rows": rows,
        "planner_dispatch": dispatch,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
