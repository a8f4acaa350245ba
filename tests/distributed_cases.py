"""The canonical use (docs/design.md) against plain TorchRec, run in spawned gloo ranks.

Each rank builds the baseline (``EmbeddingBagCollection``, default sharder,
``TrainPipelineSparseDist``) and the lookahead model (same code with
``LookaheadEmbeddingBagCollection``, ``LookaheadEmbeddingBagCollectionSharder``
and ``LookaheadTrainPipeline``), loads the baseline's checkpoint into the
lookahead model, trains both on the same per-rank batches, and asserts that
every step's output, every local shard of every table, every optimizer-state
shard and every dense parameter are equal, bitwise.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingType
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import SGD, Adagrad, RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead import (
    HotRowsEmbeddingBagCollection,
    HotRowsEmbeddingBagCollectionSharder,
    LookaheadEmbeddingBagCollection,
    LookaheadTrainPipeline,
)
from torchrec_lookahead._compat import live_groups
from torchrec_lookahead.data import SyntheticCriteo
from torchrec_lookahead.data.dedup import deduplicate
from torchrec_lookahead.data.torchrec_batches import criteo_batch, feature_names
from torchrec_lookahead.determinism import deterministic_cuda
from torchrec_lookahead.embedding import ShardedHotRowsEmbeddingBagCollection
from torchrec_lookahead.embedding.sharder import LookaheadEmbeddingBagCollectionSharder
from torchrec_lookahead.traffic import CollectiveBytes

OPTIMIZERS = {"sgd": SGD, "adagrad": Adagrad, "rowwise_adagrad": RowWiseAdagrad}
SIZES = (6000, 3000, 1500)
DIM = 32
BATCH = 32


@dataclass(frozen=True)
class Case:
    sharding_type: str
    optimizer: str
    lookahead: int
    steps: int = 60
    cache_load_factor: float = 0.1
    stage_thread: bool = True  # the lookahead stage on its own thread, or inline
    planner: str = "host"  # where plans are made (WindowSettings.planner)
    store_dir: bool = False  # the tables in a disk store (a temporary directory)
    session: int = 0  # > 0: sessions of this many samples share cat_0 and cat_1, deduplicated
    data_types: tuple[str, ...] = ("FP32",) * len(SIZES)  # each table's (DataType values)


def tables(data_types: tuple[str, ...] = ("FP32",) * len(SIZES)) -> list[EmbeddingBagConfig]:
    names = feature_names(SyntheticCriteo(table_sizes=SIZES))
    return [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=DIM,
            num_embeddings=n,
            feature_names=[names[i]],
            data_type=DataType(data_type),
        )
        for i, (n, data_type) in enumerate(zip(SIZES, data_types, strict=True))
    ]


class RowWiseOnCpuSharder(EmbeddingBagCollectionSharder):
    """TorchRec's sharder with its CUDA-only gate on row-wise sharding lifted: the plain
    TorchRec baseline for row-wise and table-row-wise tables on the CPU."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = super().sharding_types(compute_device_type)
        row_wise = [ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value]
        return types + [t for t in row_wise if t not in types]


def build(ebc, sharders, case: Case, world_size: int, planner=None, configure=None):
    """The DLRM model of ``ebc`` sharded by DMP, with its optimizers and plan; the fused
    optimizer is ``case.optimizer`` at rate 0.05, or what ``configure(model)`` sets."""
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=13,
        dense_arch_layer_sizes=[32, DIM],
        over_arch_layer_sizes=[32, 1],
    )
    model = DLRMTrain(dlrm)
    if configure is not None:
        configure(model)
    else:
        apply_optimizer_in_backward(
            OPTIMIZERS[case.optimizer], model.model.sparse_arch.parameters(), {"lr": 0.05}
        )
    constraints = {
        t.name: ParameterConstraints(sharding_types=[case.sharding_type], min_partition=DIM // 2)
        for t in tables()
    }
    planner = planner or EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        batch_size=BATCH,
        constraints=constraints,
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.1),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), plan


def train(pipeline, batches, refused: list[str] | None = None) -> list[torch.Tensor]:
    """Each step's logits; with ``refused``, batches the pipeline refuses are dropped and
    their messages collected there."""
    it, logits = iter(batches), []
    while True:
        try:
            logits.append(pipeline.progress(it)[1])
        except StopIteration:
            return logits
        except ValueError as error:
            if refused is None:
                raise
            refused.append(str(error))


def local(value):
    if hasattr(value, "local_shards"):
        return [shard.tensor for shard in value.local_shards()]
    return [value] if isinstance(value, torch.Tensor) else []


def assert_equal_states(expected: dict, got: dict, what: str) -> None:
    assert list(expected) == list(got), f"{what}: keys differ"
    for key in expected:
        for a, b in zip(local(expected[key]), local(got[key]), strict=True):
            assert torch.equal(a, b), f"{what}: {key} differs"


def rank_data_and_baseline(case: Case, rank: int, world_size: int):
    """This rank's batches, and the plain TorchRec model (with optimizer and plan) to match."""
    data = SyntheticCriteo(table_sizes=SIZES, zipf_exponent=1.05, seed=100 + rank)
    batches = [criteo_batch(data, s, BATCH) for s in range(case.steps)]
    if case.session:
        batches = [deduplicated_sessions(b, case.session) for b in batches]
    baseline = build(
        EmbeddingBagCollection(tables=tables(case.data_types), device=torch.device("meta")),
        [RowWiseOnCpuSharder()],
        case,
        world_size,
    )
    return batches, baseline


def deduplicated_sessions(batch: Batch, session: int) -> Batch:
    """``batch`` (one id per sample and feature) with sessions sharing the first two features,
    in TorchRec's deduplicated form."""
    features = batch.sparse_features
    keys = features.keys()
    ids = features.values().view(len(keys), BATCH).clone()
    ids[:2] = ids[:2, torch.arange(BATCH) // session * session]
    ones = torch.ones(ids.numel(), dtype=torch.int64)
    plain = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids.reshape(-1), lengths=ones)
    return Batch(batch.dense_features, deduplicate(plain, keys[:2]), batch.labels)


def bad_inverse_indices(batch: Batch) -> Batch:
    """``batch`` with the first sample's bag of the first feature out of range."""
    features = batch.sparse_features
    names, inverse = features.inverse_indices()
    inverse = inverse.clone()
    inverse[0, 0] = features.stride_per_key()[0]
    bad = KeyedJaggedTensor(
        keys=features.keys(),
        values=features.values(),
        lengths=features.lengths(),
        stride_per_key_per_rank=features.stride_per_key_per_rank(),
        inverse_indices=(names, inverse),
    )
    return Batch(batch.dense_features, bad, batch.labels)


def check(case: Case, rank: int, world_size: int) -> None:
    batches, (base, base_opt, base_plan) = rank_data_and_baseline(case, rank, world_size)
    sharders = [LookaheadEmbeddingBagCollectionSharder(cpu_row_wise=True)]
    store_dir = tempfile.mkdtemp(prefix="lookahead-store-") if case.store_dir else None
    ebc = LookaheadEmbeddingBagCollection(
        tables=tables(case.data_types),
        device=torch.device("meta"),
        cache_load_factor=case.cache_load_factor,
        store_dir=store_dir,
    )
    look, look_opt, look_plan = build(ebc, sharders, case, world_size)
    assert str(base_plan) == str(look_plan), "both models must get the same plan"
    look.load_state_dict(base.state_dict())  # a plain TorchRec checkpoint

    expected = train(TrainPipelineSparseDist(base, base_opt, torch.device("cpu")), batches)
    pipeline = LookaheadTrainPipeline(
        look,
        look_opt,
        torch.device("cpu"),
        lookahead=case.lookahead,
        stage_thread=case.stage_thread,
        planner=case.planner,
    )
    stream, refused = list(batches), []
    if case.session:  # a batch with a bad inverse index on rank 0 only: every rank drops it
        stream.insert(5, bad_inverse_indices(batches[5]) if rank == 0 else batches[5])
    got = train(pipeline, stream, refused)
    if case.session:
        assert len(refused) == 1, refused
        want = "another rank refused" if rank else "step 5: feature 'cat_0': inverse index"
        assert want in refused[0], refused
    assert len(got) == len(expected) == case.steps
    for step, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"{case}: rank {rank} step {step} output differs"
    assert_equal_states(base.state_dict(), look.state_dict(), f"{case} weights")
    assert_equal_states(
        base_opt.state_dict()["state"], look_opt.state_dict()["state"], f"{case} optimizer"
    )
    total = pipeline.cache_metrics()["total"]
    assert total.rows_written_back > 0, f"{case}: the cache never evicted; the test is too easy"
    check_row_types(look, case)
    if store_dir is not None:
        files = sorted(p.name for p in Path(store_dir, f"rank{rank}").rglob("*.f32"))
        assert files and all(name.startswith("lookup") for name in files), files
        assert list(Path(store_dir, f"rank{rank}").rglob("oracle.*.i64"))
        check_streamed_checkpoint(case, world_size, (look, look_opt), (base, base_opt))
        shutil.rmtree(store_dir)


def check_row_types(look: DistributedModelParallel, case: Case) -> None:
    """Every lookahead kernel's cache and store hold rows in its tables' type, optimizer
    state in FP32 (as FBGEMM's TBE keeps it)."""
    types = {t.name: DataType(d).value for t, d in zip(tables(), case.data_types)}
    sharded = next(m for m in look.modules() if hasattr(m, "kernels"))
    for kernel in sharded.kernels:
        (kind,) = {types[name] for name in kernel.cached.names}
        want = {"FP32": torch.float32, "FP16": torch.float16}[kind]
        cache = kernel.cached.cache
        assert {w.dtype for w in cache.tbe.split_embedding_weights()} == {want}
        assert {w.dtype for w in kernel.store.weights} == {want}
        states = [s for table in kernel.store.states for s in table]
        assert all(s.dtype == torch.float32 for s in states)


def check_streamed_checkpoint(case: Case, world_size: int, look, base) -> None:
    """A streamed DCP save of the trained lookahead model (tables and optimizer state in
    row chunks of at most 4 KiB) loads into a fresh plain TorchRec model, which then
    holds exactly the plain run's state."""
    import torch.distributed.checkpoint as dcp

    from torchrec_lookahead.store.checkpoint import StreamingLoadPlanner, StreamingSavePlanner

    path = [tempfile.mkdtemp(prefix="lookahead-ckpt-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    chunk_bytes = 4096
    dcp.save(
        {"model": look[0].state_dict(), "optim": look[1].state_dict()},
        checkpoint_id=path[0],
        planner=StreamingSavePlanner(chunk_bytes),
    )
    tables_md = [
        md
        for fqn, md in dcp.FileSystemReader(path[0]).read_metadata().state_dict_metadata.items()
        if "embedding_bags" in fqn
    ]
    assert tables_md
    for md in tables_md:
        assert len(md.chunks) > world_size, "a table larger than a chunk was saved whole"
        assert all(c.sizes.numel() * 4 <= chunk_bytes for c in md.chunks)
    fresh = build(
        EmbeddingBagCollection(tables=tables(case.data_types), device=torch.device("meta")),
        [RowWiseOnCpuSharder()],
        case,
        world_size,
    )
    state = {"model": fresh[0].state_dict(), "optim": fresh[1].state_dict()}
    dcp.load(state, checkpoint_id=path[0], planner=StreamingLoadPlanner())
    fresh[0].load_state_dict(state["model"])
    fresh[1].load_state_dict(state["optim"])
    assert_equal_states(base[0].state_dict(), fresh[0].state_dict(), f"{case} streamed weights")
    assert_equal_states(
        base[1].state_dict()["state"], fresh[1].state_dict()["state"], f"{case} streamed optimizer"
    )
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path[0])


def _in_process_group(rank: int, world_size: int, port: int, body) -> None:  # noqa: ANN001
    """Run ``body()`` as one gloo rank (one share of the cores each, no oversubscription)."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    deterministic_cuda()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        body()
        # Every rank's collectives finish before any rank shuts down: torch's gloo workers
        # take the GIL to release a finished collective's tensors, and one still doing so
        # when its interpreter exits aborts the rank ("terminate called without an active
        # exception"; seen in about 1 of 8 runs of the integration case without this).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def worker(rank: int, world_size: int, port: int, cases: list[Case]) -> None:
    def body() -> None:
        for case in cases:
            check(case, rank, world_size)

    _in_process_group(rank, world_size, port, body)


class MixedModel(torch.nn.Module):
    """A lookahead (or plain) collection and a plain one, over the same batch."""

    def __init__(self, cached: torch.nn.Module, plain: EmbeddingBagCollection) -> None:
        super().__init__()
        self.cached = cached
        self.plain = plain
        torch.manual_seed(0)
        self.over = torch.nn.Linear(3 * DIM + 13, 1)

    def forward(self, batch):
        pooled = torch.cat(
            [
                self.cached(batch.sparse_features).values(),
                self.plain(batch.sparse_features).values(),
                batch.dense_features,
            ],
            dim=1,
        )
        logits = self.over(pooled).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach())


def mixed(cached_type: type, sharders: list, world_size: int, cache: dict | None = None):
    """The mixed model sharded by DMP, and its optimizer; ``cache``: the lookahead
    collection's settings (a load factor of 0.2 by default)."""
    all_tables = tables()
    cache = {"cache_load_factor": 0.2} if cache is None else cache
    cached_kwargs = cache if cached_type is not EmbeddingBagCollection else {}
    # One cached table: under table-wise sharding at world size 2 one rank owns no cached shard.
    model = MixedModel(
        cached_type(tables=all_tables[:1], device=torch.device("meta"), **cached_kwargs),
        EmbeddingBagCollection(tables=all_tables[1:], device=torch.device("meta")),
    )
    for module in (model.cached, model.plain):
        apply_optimizer_in_backward(RowWiseAdagrad, module.parameters(), {"lr": 0.05})
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"), batch_size=BATCH
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.1),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def check_integration(rank: int, world_size: int, checkpoint_dir: str) -> None:
    """Mixed modules, a bad batch on one rank, eval, and a DCP round trip to plain TorchRec."""
    import torch.distributed.checkpoint as dcp
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_lookahead import lookahead_sharders

    data = SyntheticCriteo(table_sizes=SIZES, zipf_exponent=1.05, seed=200 + rank)
    batches = [criteo_batch(data, s, BATCH) for s in range(60)]
    extra = criteo_batch(data, 1000, BATCH)  # every rank drops it: rank 0's copy is bad
    if rank == 0:
        values = extra.sparse_features.values().clone()
        values[3] = 10**9
        extra.sparse_features = KeyedJaggedTensor.from_lengths_sync(
            keys=extra.sparse_features.keys(),
            values=values,
            lengths=extra.sparse_features.lengths(),
        )
    base, base_opt = mixed(EmbeddingBagCollection, get_default_sharders(), world_size)
    look, look_opt = mixed(LookaheadEmbeddingBagCollection, lookahead_sharders(), world_size)
    look.load_state_dict(base.state_dict())

    base_pipeline = TrainPipelineSparseDist(base, base_opt, torch.device("cpu"))
    expected = train(base_pipeline, batches)
    base_pipeline.detach()  # restore the forward TorchRec's pipeline rewrote
    pipeline = LookaheadTrainPipeline(
        look, look_opt, torch.device("cpu"), lookahead=8, stage_thread=True
    )
    it, got, errors = iter(batches[:5] + [extra] + batches[5:]), [], []
    probe = criteo_batch(data, 2000, BATCH)
    while True:
        try:
            got.append(pipeline.progress(it)[1])
        except StopIteration:
            break
        except ValueError as error:
            errors.append(str(error))
        if len(got) == 20:  # optimizer state read mid-training must be current
            first = [
                t.clone()
                for v in look_opt.state_dict()["state"].values()
                for s in v.values()
                for t in local(s)
            ]
            look.state_dict()  # writes every cache back
            again = [
                t
                for v in look_opt.state_dict()["state"].values()
                for s in v.values()
                for t in local(s)
            ]
            assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
        if len(got) == 30:  # eval mid-training, caches dirty: must see the current weights
            look.eval()
            with torch.no_grad():
                mid = look(probe)[1][1]
            look.train()
            current, _ = mixed(EmbeddingBagCollection, get_default_sharders(), world_size)
            current.load_state_dict(look.state_dict())
            current.eval()
            with torch.no_grad():
                assert torch.equal(mid, current(probe)[1][1]), "eval read stale rows"
    assert len(errors) == 1, errors
    assert ("out of range" if rank == 0 else "another rank refused") in errors[0], errors[0]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert_equal_states(base.state_dict(), look.state_dict(), "mixed weights")
    assert_equal_states(base_opt.state_dict()["state"], look_opt.state_dict()["state"], "optim")

    base.eval()
    look.eval()
    with torch.no_grad():
        assert torch.equal(base(probe)[1][1], look(probe)[1][1]), "eval differs from baseline"

    dcp.save(look.state_dict(), checkpoint_id=checkpoint_dir)
    fresh, _ = mixed(EmbeddingBagCollection, get_default_sharders(), world_size)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=checkpoint_dir)
    fresh.load_state_dict(state)
    assert_equal_states(look.state_dict(), fresh.state_dict(), "checkpoint round trip")


def multi_hot_batch(rank: int, step: int, size: int) -> Batch:
    """A batch of ``size`` samples whose bags hold 0 to 2 skewed ids of each table."""
    rng = np.random.default_rng([rank, step, 43])
    lengths = rng.integers(0, 3, size=(len(SIZES), size))
    values = [
        np.floor(rows * rng.random(int(n.sum())) ** 3).astype(np.int64)
        for rows, n in zip(SIZES, lengths, strict=True)
    ]
    return Batch(
        dense_features=torch.from_numpy(rng.standard_normal((size, 13)).astype(np.float32)),
        sparse_features=KeyedJaggedTensor.from_lengths_sync(
            keys=feature_names(SyntheticCriteo(table_sizes=SIZES)),
            values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.from_numpy(lengths.reshape(-1)),
        ),
        labels=torch.from_numpy(rng.integers(0, 2, size)),
    )


def check_mixed_growth(rank: int, world_size: int) -> None:
    """The mixed model (a lookahead and a plain collection) at default cache settings, bags
    of 0 to 2 ids, batches of 32 per rank and then of 512: the cache sized at the first
    batch grows when the larger ones come, and training goes to the end bitwise plain
    TorchRec's; each rank's growths are logged and counted alike."""
    import logging

    from torchrec.distributed.sharding_plan import get_default_sharders

    from torchrec_lookahead import lookahead_sharders

    batches = [multi_hot_batch(rank, s, 32 if s < 4 else 512) for s in range(14)]
    base, base_opt = mixed(EmbeddingBagCollection, get_default_sharders(), world_size)
    look, look_opt = mixed(LookaheadEmbeddingBagCollection, lookahead_sharders(), world_size, {})
    look.load_state_dict(base.state_dict())
    base_pipeline = TrainPipelineSparseDist(base, base_opt, torch.device("cpu"))
    expected = train(base_pipeline, batches)
    base_pipeline.detach()

    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("torchrec_lookahead")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with LookaheadTrainPipeline(look, look_opt, torch.device("cpu"), lookahead=4) as pipeline:
            got = train(pipeline, batches)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert len(got) == len(batches)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)), "outputs differ"
    assert_equal_states(base.state_dict(), look.state_dict(), "mixed weights")
    assert_equal_states(base_opt.state_dict()["state"], look_opt.state_dict()["state"], "optim")
    grown = [line for line in lines if "cache grown" in line]
    total = pipeline.cache_metrics()["total"]
    assert total.growths == len(grown), (total, grown)
    growths = torch.tensor([total.growths])
    dist.all_reduce(growths)
    assert growths.item() > 0, "no rank's cache grew"
    for line in grown:
        print(f"rank {rank}: {line} (cache_rows now {total.cache_rows})", flush=True)


def mixed_growth_worker(rank: int, world_size: int, port: int) -> None:
    _in_process_group(rank, world_size, port, lambda: check_mixed_growth(rank, world_size))


def check_malformed_batches(rank: int, world_size: int) -> None:
    """Every kind of malformed batch, each on one rank only (the first batch among them, for
    the cache sizing): refused on every rank together, training equal to plain TorchRec."""
    from tests.malformed import MALFORMED, MALFORMED_SHARDED, malformed

    case = Case("table_wise", "rowwise_adagrad", 8, steps=30, cache_load_factor=0.05)
    batches, (base, base_opt, _) = rank_data_and_baseline(case, rank, world_size)
    extra = SyntheticCriteo(table_sizes=SIZES, zipf_exponent=1.05, seed=400 + rank)
    stream = list(batches)
    kinds = sorted(MALFORMED) + sorted(MALFORMED_SHARDED)  # not the first batch: its order
    for i, kind in reversed(list(enumerate(kinds))):  # at steps 0, 2, 4, ... of the good ones
        spare = criteo_batch(extra, i, BATCH)
        stream.insert(2 * i, malformed(kind, spare) if i % world_size == rank else spare)
    ebc = LookaheadEmbeddingBagCollection(
        tables=tables(), device=torch.device("meta"), cache_load_factor=case.cache_load_factor
    )
    look, look_opt, _ = build(ebc, [LookaheadEmbeddingBagCollectionSharder()], case, world_size)
    look.load_state_dict(base.state_dict())
    expected = train(TrainPipelineSparseDist(base, base_opt, torch.device("cpu")), batches)
    refused: list[str] = []
    with CollectiveBytes() as sent:
        got = train(
            LookaheadTrainPipeline(look, look_opt, torch.device("cpu"), lookahead=8),
            stream,
            refused,
        )
    # One vote per batch, as it is read (no cache is capped: none after its collectives).
    assert sent.calls["other"] == len(stream), sent.calls
    assert len(refused) == len(kinds), refused
    for i, (kind, message) in enumerate(zip(kinds, refused)):
        phrase = (MALFORMED | MALFORMED_SHARDED)[kind][1]
        phrase = phrase if i % world_size == rank else "another rank refused"
        assert phrase in message, (kind, message)
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert_equal_states(base.state_dict(), look.state_dict(), "weights")
    assert_equal_states(base_opt.state_dict()["state"], look_opt.state_dict()["state"], "optim")


def check_row_wise_refuses_deduplicated_batches(rank: int, world_size: int) -> None:
    """Deduplicated batches cannot reach row-wise shards over gloo (their outputs need an
    uneven reduce-scatter): every one is refused clearly on every rank, none trains."""
    case = Case("row_wise", "sgd", 4)
    data = SyntheticCriteo(table_sizes=SIZES, zipf_exponent=1.05, seed=100 + rank)
    batches = [deduplicated_sessions(criteo_batch(data, s, BATCH), 4) for s in range(5)]
    ebc = LookaheadEmbeddingBagCollection(
        tables=tables(), device=torch.device("meta"), cache_load_factor=case.cache_load_factor
    )
    sharders = [LookaheadEmbeddingBagCollectionSharder(cpu_row_wise=True)]
    look, look_opt, _ = build(ebc, sharders, case, world_size)
    refused: list[str] = []
    got = train(
        LookaheadTrainPipeline(look, look_opt, torch.device("cpu"), lookahead=4), batches, refused
    )
    assert got == [] and len(refused) == len(batches), refused
    assert all("cannot reach row-wise shards over gloo" in m for m in refused), refused


def row_wise_deduplicated_worker(rank: int, world_size: int, port: int) -> None:
    _in_process_group(
        rank,
        world_size,
        port,
        lambda: check_row_wise_refuses_deduplicated_batches(rank, world_size),
    )


def wide_batch(batch: Batch, ids: int) -> Batch:
    """``batch`` with its first feature's bags holding ``ids`` distinct ids in all."""
    features = batch.sparse_features
    lengths = features.lengths().clone()
    stride = features.stride()
    lengths[:stride] = torch.tensor(np.diff(np.linspace(0, ids, stride + 1).astype(np.int64)))
    per_key = [int(n) for n in lengths.view(len(features.keys()), stride).sum(1)]
    parts = list(features.values().split(features.length_per_key()))
    parts[0] = torch.randperm(SIZES[0], generator=torch.Generator().manual_seed(5))[:ids]
    assert per_key[0] == ids
    wide = KeyedJaggedTensor(features.keys(), torch.cat(parts), lengths=lengths)
    return Batch(batch.dense_features, wide, batch.labels)


def check_capped_cache_refusal(rank: int, world_size: int, stage_thread: bool) -> None:
    """A cache capped by ``max_cache_rows`` is the one verdict known only after a batch is
    distributed: a batch whose window one rank's shard cannot hold (rank 1's batch, whose
    ids of the first table go to rank 0's shard) is refused on every rank, after the
    collective; training goes on equal to plain TorchRec without that batch. Inline
    (``stage_thread=False``), that vote is the planning thread's while the trainer's
    thread distributes the next batches."""
    case = Case("table_wise", "rowwise_adagrad", 4, steps=20, cache_load_factor=0.05)
    batches, (base, base_opt, _) = rank_data_and_baseline(case, rank, world_size)
    stream = list(batches)
    spare = criteo_batch(SyntheticCriteo(table_sizes=SIZES, seed=500 + rank), 0, BATCH)
    stream.insert(6, wide_batch(spare, 900) if rank == 1 else spare)
    ebc = LookaheadEmbeddingBagCollection(
        tables=tables(),
        device=torch.device("meta"),
        cache_load_factor=case.cache_load_factor,
        max_cache_rows=360,  # a pool of a rank's tables: at most 360 slots per table
    )
    look, look_opt, _ = build(ebc, [LookaheadEmbeddingBagCollectionSharder()], case, world_size)
    look.load_state_dict(base.state_dict())
    expected = train(TrainPipelineSparseDist(base, base_opt, torch.device("cpu")), batches)
    refused: list[str] = []
    groups = live_groups()
    with CollectiveBytes() as sent:
        pipeline = LookaheadTrainPipeline(
            look, look_opt, torch.device("cpu"), lookahead=4, stage_thread=stage_thread
        )
        got = train(pipeline, stream, refused)
    # Two votes per batch where a cache is capped: as it is read, and after its collective.
    assert sent.calls["other"] == 2 * len(stream), sent.calls
    # The pipeline's groups (the reading vote's, the stage's, the capped cache's vote's)
    # went with it; closing it again leaves a later pipeline's groups alone.
    assert live_groups() == groups
    later = LookaheadTrainPipeline(look, look_opt, torch.device("cpu"), lookahead=4)
    made = live_groups() - groups
    pipeline.close()
    assert len(made) == 3 and live_groups() == groups | made
    later.close()
    assert live_groups() == groups
    assert len(refused) == 1, refused
    want = "max_cache_rows" if rank == 0 else "another rank refused"
    assert want in refused[0], refused
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(expected, got)), "outputs differ"
    assert_equal_states(base.state_dict(), look.state_dict(), "weights")


def capped_cache_worker(rank: int, world_size: int, port: int, stage_thread: bool) -> None:
    _in_process_group(
        rank, world_size, port, lambda: check_capped_cache_refusal(rank, world_size, stage_thread)
    )


def malformed_worker(rank: int, world_size: int, port: int) -> None:
    _in_process_group(rank, world_size, port, lambda: check_malformed_batches(rank, world_size))


def integration_worker(rank: int, world_size: int, port: int, checkpoint_dir: str) -> None:
    _in_process_group(
        rank, world_size, port, lambda: check_integration(rank, world_size, checkpoint_dir)
    )


def check_tracing_beside_the_stage(rank: int, world_size: int, hold: int) -> None:
    """torch.fx traces a model on another thread (TorchRec's pipelines trace theirs at their
    first batch) while the stage distributes the batch of step ``hold``: while it traces,
    torch.fx swaps every module's call, in every thread. Training goes on, exact.

    The trainer makes no call while the trace runs: the swapped call would refuse its
    modules too (torch.fx's, and every thread's, limit). At ``hold`` 0 the stage makes
    TorchRec's input dists while the trace runs; later it uses its own.
    """
    case = Case("table_wise", "adagrad", lookahead=4, steps=16)
    batches, (base, base_opt, _) = rank_data_and_baseline(case, rank, world_size)
    ebc = LookaheadEmbeddingBagCollection(
        tables=tables(), device=torch.device("meta"), cache_load_factor=case.cache_load_factor
    )
    look, look_opt, _ = build(ebc, [LookaheadEmbeddingBagCollectionSharder()], case, world_size)
    look.load_state_dict(base.state_dict())
    expected = train(TrainPipelineSparseDist(base, base_opt, torch.device("cpu")), batches)

    asked, go, traced, distributed, done = (threading.Event() for _ in range(5))

    def loader():  # the stage waits at batch ``hold`` until the trace runs
        for step, batch in enumerate(batches):
            if step == hold:
                asked.set()
                assert traced.wait(60)
            yield batch

    sharded = look.module.model.sparse_arch.embedding_bag_collection
    distribute, steps = sharded.distribute, iter(range(len(batches)))

    def spy(features):  # the held batch is distributed inside the trace
        step = next(steps)  # every batch is taken: the n-th distributed is step n's
        try:
            return distribute(features)
        finally:
            if step == hold:
                distributed.set()
                assert done.wait(60)

    sharded.distribute = spy

    class TracedWhileTheStagePrepares(torch.nn.Module):
        def forward(self, x):
            traced.set()
            assert distributed.wait(60), "the stage never distributed the held batch"
            return x + 1

    def trace() -> None:
        assert go.wait(60)
        try:
            torch.fx.symbolic_trace(TracedWhileTheStagePrepares())
        finally:
            done.set()

    tracer = threading.Thread(target=trace)
    tracer.start()
    pipeline = LookaheadTrainPipeline(look, look_opt, torch.device("cpu"), lookahead=4)
    it, got = loader(), []
    if hold == 0:
        go.set()  # the trainer waits in its first step for the stage's first batch
    while not asked.is_set():
        got.append(pipeline.progress(it)[1])
    go.set()
    assert done.wait(60)
    tracer.join()
    got += train(pipeline, it)
    assert len(got) == len(expected) == case.steps
    assert all(torch.equal(a, b) for a, b in zip(expected, got)), "outputs differ"
    assert_equal_states(base.state_dict(), look.state_dict(), "weights")


def tracing_worker(rank: int, world_size: int, port: int, hold: int) -> None:
    _in_process_group(
        rank, world_size, port, lambda: check_tracing_beside_the_stage(rank, world_size, hold)
    )


def check_planned(rank: int, world_size: int) -> None:
    """The canonical use planned by ``lookahead_planner`` trains exactly like plain TorchRec."""
    import math

    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from planners import LookaheadCacheStatistics, lookahead_planner, plan_report

    case = Case("table_wise", "rowwise_adagrad", 8)
    sample = SyntheticCriteo(table_sizes=SIZES, zipf_exponent=1.05, seed=300)
    sample_batches = [criteo_batch(sample, s, BATCH * world_size) for s in range(40)]
    stats = {
        t.name: LookaheadCacheStatistics(
            [b.sparse_features[t.feature_names[0]].values() for b in sample_batches],
            t.num_embeddings,
            case.lookahead,
            1,
            t.name,
        )
        for t in tables()
    }
    budget = 150_000
    planner, proposal = lookahead_planner(
        Topology(world_size=world_size, compute_device="cpu"),
        BATCH,
        tables(),
        stats,
        EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        step_compute_ms=0.0,
        cache_budget_bytes=budget,
        constraints={t.name: ParameterConstraints(sharding_types=["table_wise"]) for t in tables()},
    )
    assert sum(proposal.device_bytes.values()) <= budget
    assert len(set(proposal.load_factors.values())) > 1, "tables should get different sizes"

    batches, (base, base_opt, _) = rank_data_and_baseline(case, rank, world_size)
    ebc = LookaheadEmbeddingBagCollection(tables=tables(), device=torch.device("meta"))
    look, look_opt, plan = build(
        ebc, [LookaheadEmbeddingBagCollectionSharder()], case, world_size, planner
    )
    if rank == 0:
        print(plan_report(plan, proposal))
    sharded = next(m for m in look.modules() if hasattr(m, "cached_groups"))
    for group in sharded.cached_groups:
        for name, rows, slots in zip(group.names, group.num_rows, group.table_slots):
            want = max(1, math.ceil(proposal.load_factors[name] * rows))
            assert slots == min(rows, want), (name, slots, want)
    look.load_state_dict(base.state_dict())
    expected = train(TrainPipelineSparseDist(base, base_opt, torch.device("cpu")), batches)
    got = train(
        LookaheadTrainPipeline(look, look_opt, torch.device("cpu"), lookahead=8, stage_thread=True),
        batches,
    )
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    assert_equal_states(base.state_dict(), look.state_dict(), "planned weights")
    assert_equal_states(base_opt.state_dict()["state"], look_opt.state_dict()["state"], "optim")


def planned_worker(rank: int, world_size: int, port: int) -> None:
    _in_process_group(rank, world_size, port, lambda: check_planned(rank, world_size))


def hot_ids(world_size: int, per_table: int) -> dict[str, list[int]]:
    """The ``per_table`` hottest ids of every rank's stream, per table (every rank alike)."""
    hot: dict[str, set[int]] = {t.name: set() for t in tables()}
    for rank in range(world_size):
        data = SyntheticCriteo(table_sizes=SIZES, zipf_exponent=1.05, seed=100 + rank)
        for t, sampler in zip(tables(), data.samplers):
            hot[t.name] |= set(sampler.rank_to_id(np.arange(per_table)).tolist())
    return {name: sorted(ids) for name, ids in hot.items()}


def max_difference(expected: dict, got: dict) -> float:
    """The largest absolute difference between two states' local tensors."""
    assert list(expected) == list(got)
    return max(
        (
            float((a - b).abs().max())
            for key in expected
            for a, b in zip(local(expected[key]), local(got[key]), strict=True)
            if a.numel()
        ),
        default=0.0,
    )


def check_hot_rows(case: Case, rank: int, world_size: int) -> None:
    """Replicated hot rows against plain TorchRec, with a batch only one rank refuses, bytes
    counted and an eval forward: every output, table, optimizer state and dense parameter
    bitwise equal, and the replicas bitwise equal on every rank (more cases in
    ``hot_cases.py``)."""

    torch.manual_seed(rank)  # fixed initial weights: the rounding differences depend on them
    batches, (base, base_opt, base_plan) = rank_data_and_baseline(case, rank, world_size)
    sharders = [HotRowsEmbeddingBagCollectionSharder(cpu_row_wise=True)]
    store_dir = tempfile.mkdtemp(prefix="lookahead-store-") if case.store_dir else None
    ebc = HotRowsEmbeddingBagCollection(
        tables=tables(),
        device=torch.device("meta"),
        cache_load_factor=case.cache_load_factor,
        hot_rows=hot_ids(world_size, 64),
        store_dir=store_dir,
    )
    look, look_opt, look_plan = build(ebc, sharders, case, world_size)
    assert str(base_plan) == str(look_plan)
    look.load_state_dict(base.state_dict())  # a plain TorchRec checkpoint, replicas from it
    base_pipeline = TrainPipelineSparseDist(base, base_opt, torch.device("cpu"))
    expected = train(base_pipeline, batches)
    base_pipeline.detach()  # restore the forward TorchRec's pipeline rewrote
    pipeline = LookaheadTrainPipeline(
        look,
        look_opt,
        torch.device("cpu"),
        lookahead=case.lookahead,
        stage_thread=case.stage_thread,
    )
    # A deduplicated batch on rank 0 only (hot rows take plain batches): every rank drops it.
    stream, refused = list(batches), []
    stream.insert(5, deduplicated_sessions(batches[5], 4) if rank == 0 else batches[5])
    with CollectiveBytes() as sent:
        got = train(pipeline, stream, refused)
    want = "cannot be split for replicated hot rows" if rank == 0 else "another rank refused"
    assert len(refused) == 1 and want in refused[0], refused
    assert len(got) == len(expected) == case.steps
    per_step = [float((a - b).abs().max()) for a, b in zip(expected, got)]
    worst = max(
        max(per_step),
        max_difference(base.state_dict(), look.state_dict()),
        max_difference(base_opt.state_dict()["state"], look_opt.state_dict()["state"]),
    )
    print(f"{case}: rank {rank}: largest difference {worst:.3g}")
    assert worst == 0, f"{case}: rank {rank} differs by {worst}"
    sharded = next(m for m in look.modules() if isinstance(m, ShardedHotRowsEmbeddingBagCollection))
    metrics = sharded.replica_metrics
    assert metrics.hot_share > 0.5 and metrics.rows_synced > 0, metrics
    assert sent.bytes["hot_sync"] > 0 and sent.bytes["pooled"] > 0, sent.bytes
    for mine in sharded.replica_rows():
        gathered = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(gathered, mine)
        assert all(torch.equal(mine, other) for other in gathered), "replicas differ"
    probe = criteo_batch(SyntheticCriteo(table_sizes=SIZES, seed=7), 0, BATCH)
    base.eval()
    look.eval()  # the owners' shards, with the replicas folded in
    with torch.no_grad():
        eval_gap = float((base(probe)[1][1] - look(probe)[1][1]).abs().max())
    assert eval_gap == 0, eval_gap
    if store_dir is not None:
        shutil.rmtree(store_dir)


def hot_rows_worker(rank: int, world_size: int, port: int, cases: list[Case]) -> None:
    def body() -> None:
        for case in cases:
            check_hot_rows(case, rank, world_size)

    _in_process_group(rank, world_size, port, body)
