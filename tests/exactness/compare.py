"""One configuration trained twice, under this project and under plain TorchRec, compared.

Before training, the device oracle (``DeviceOracleCacher``) and the numba oracle
plan each table's id stream of the rank's batches, and must fetch the same rows
at every step.

Both models start from the same weights (plain TorchRec's, loaded into the
lookahead model as a checkpoint) and train on the same batches, each rank its
own. Plain TorchRec is ``EmbeddingBagCollection`` with TorchRec's sharder (its
CUDA-only gate on row-wise sharding lifted) for the bag tables and
``EmbeddingCollection`` with TorchRec's default sharder for the sequence tables,
trained by ``TrainPipelineSparseDist``; this project is
``LookaheadEmbeddingBagCollection`` (``HotRowsEmbeddingBagCollection`` with hot
rows) and ``LookaheadEmbeddingCollection``, ``lookahead_sharders()`` and
``LookaheadTrainPipeline``. Every step's output, then every table shard,
optimizer-state shard and dense parameter, must agree within the
configuration's tolerance (0: bitwise).
"""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import (
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim import SGD, Adagrad, RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from benchmarks.common import pinned_rows_needed
from planners import optimizer_state_floats, propose_hot_rows
from tests.exactness.configs import Config
from tests.test_sequence import summarise
from torchrec_lookahead import (
    DeviceOracleCacher,
    HotRowsEmbeddingBagCollection,
    LookaheadEmbeddingBagCollection,
    LookaheadEmbeddingCollection,
    LookaheadTrainPipeline,
    OracleCacher,
    lookahead_sharders,
)
from torchrec_lookahead.data.dedup import deduplicate

__all__ = ["Divergence", "compare", "oracle_divergence"]

FUSED = {"sgd": SGD, "adagrad": Adagrad, "rowwise_adagrad": RowWiseAdagrad}
DENSE_IN = 13
SESSION = 4  # samples sharing their deduplicated features

# A leaf of the pipelines' trace of Ranker, as of SequenceModel (fx wraps a name per module).
torch.fx.wrap("summarise")


@dataclass
class Divergence:
    """Where the two runs first part: the step (-1: the final state), what, by how much."""

    step: int
    what: str
    gap: float


class RowWiseOnCpuSharder(EmbeddingBagCollectionSharder):
    """TorchRec's sharder with its CUDA-only gate on row-wise sharding lifted."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = super().sharding_types(compute_device_type)
        extra = [ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value]
        return types + [t for t in extra if t not in types]


class Ranker(torch.nn.Module):
    """A ranking model over any tables: dense features through a layer, beside every
    pooled feature and every sequence feature summarised per sample (its rows weighted by
    their position, as in ``tests/test_sequence.py``), into a logit (DLRMTrain's outputs:
    loss, then (loss, logits, labels))."""

    def __init__(
        self,
        ebc: torch.nn.Module | None,
        ec: torch.nn.Module | None,
        sequence_features: list[str],
        width: int,
    ) -> None:
        super().__init__()
        self.ebc = ebc  # the bag tables' collection (None: none)
        self.ec = ec  # the sequence tables' collection (None: none)
        self.sequence_features = sequence_features
        self.dense = torch.nn.Linear(DENSE_IN, 8)
        self.over = torch.nn.Linear(8 + width, 1)

    def forward(self, batch: Batch):  # noqa: ANN201
        parts = [torch.relu(self.dense(batch.dense_features))]
        if self.ebc is not None:
            parts.append(self.ebc(batch.sparse_features).values())
        if self.ec is not None:
            rows = self.ec(batch.sparse_features)
            parts += [summarise(rows[f], batch.labels) for f in self.sequence_features]
        logits = self.over(torch.cat(parts, dim=1)).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.float())
        return loss, (loss.detach(), logits.detach(), batch.labels)


# ------------------------------------------------------------------ data


def rank_batches(config: Config, rank: int) -> list[Batch]:
    """Rank ``rank``'s batches: Zipf ids (a table's row order shuffled), one id a bag or
    0 to 5, weights in [0.5, 1.5] where weighted, sessions of ``SESSION`` samples
    sharing the first feature of each table where deduplicated; where the caches grow,
    the first third of them a quarter the size (at least ``SESSION`` samples)."""
    out = []
    for step in range(config.steps):
        rng = np.random.default_rng([config.seed, config.index, rank, step])
        size = config.batch
        if config.grow and step < config.steps // 3:
            size = max(SESSION, config.batch // 4)
        keys, lengths, values = [], [], []
        for table in config.tables:
            order = np.random.default_rng([config.seed, config.index, 7]).permutation(table.rows)
            for k, feature in enumerate(table.features):
                samples = size // SESSION if config.dedup and k == 0 else size
                n = rng.poisson(1.5, samples) if table.multi_hot else np.ones(samples, np.int64)
                ids = order[np.minimum(rng.zipf(1.3, int(n.sum())) - 1, table.rows - 1)]
                if samples < size:  # a session's samples share the bag
                    starts = np.concatenate([[0], np.cumsum(n)])
                    bags = [ids[starts[i] : starts[i + 1]] for i in range(samples)]
                    n = np.repeat(n, SESSION)
                    ids = np.concatenate([bags[i // SESSION] for i in range(size)])
                keys.append(feature)
                lengths.append(n)
                values.append(ids)
        values_all = torch.from_numpy(np.concatenate(values).astype(np.int64))
        weights = (
            torch.from_numpy(rng.uniform(0.5, 1.5, len(values_all)).astype(np.float32))
            if config.weighted
            else None
        )
        features = KeyedJaggedTensor(
            keys=keys,
            values=values_all,
            lengths=torch.from_numpy(np.concatenate(lengths).astype(np.int64)),
            weights=weights,
        )
        if config.dedup:
            features = deduplicate(features, [t.features[0] for t in config.tables])
        dense = torch.from_numpy(rng.standard_normal((size, DENSE_IN)).astype(np.float32))
        labels = torch.from_numpy((rng.random(size) < 0.3).astype(np.int64))
        out.append(Batch(dense_features=dense, sparse_features=features, labels=labels))
    return out


def bad_batch(batch: Batch, config: Config) -> Batch:
    """``batch`` with one id out of its table's range."""
    features = batch.sparse_features
    values = features.values().clone()
    if len(values):
        values[0] = config.tables[0].rows + 1
    else:
        values = torch.tensor([config.tables[0].rows + 1])
    lengths = features.lengths().clone()
    if not len(features.values()):
        lengths[0] = 1
    bad = KeyedJaggedTensor(
        keys=features.keys(),
        values=values,
        lengths=lengths,
        weights=features.weights_or_none(),
        stride_per_key_per_rank=features.stride_per_key_per_rank()
        if features.variable_stride_per_key()
        else None,
        inverse_indices=features.inverse_indices_or_none(),
    )
    return Batch(batch.dense_features, bad, batch.labels)


def hot_rows(config: Config) -> dict[str, list[int]] | None:
    """The bag tables' rows to replicate (sequence tables have none): ids seen at least
    twice in the first steps' global batches (``on``), or the planner's choice within half
    the memory it would use (``budget``)."""
    if config.hot == "off":
        return None
    everyone = [rank_batches(config, r)[: min(5, config.steps)] for r in range(config.world_size)]
    samples = {
        t.name: [
            np.concatenate(
                [b.sparse_features[f].values().numpy() for b in step for f in t.features]
            )
            for step in zip(*everyone)
        ]
        for t in config.bags
    }
    if config.hot == "on":
        chosen = {}
        for name, steps in samples.items():
            ids, counts = np.unique(np.concatenate(steps), return_counts=True)
            if len(ids[counts >= 2]):
                chosen[name] = ids[counts >= 2].tolist()
        return chosen
    state = max(optimizer_state_floats(_emb_opt(t.optimizer), t.dim) for t in config.bags)
    dim = config.bags[0].dim
    full = propose_hot_rows(samples, config.world_size, dim, state)
    budget = sum(full.replica_bytes.values()) // 2
    proposal = propose_hot_rows(samples, config.world_size, dim, state, budget)
    return {name: list(ids) for name, ids in proposal.hot.items() if len(ids)}


def _emb_opt(name: str):  # noqa: ANN202
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return {
        "sgd": EmbOptimType.EXACT_SGD,
        "adagrad": EmbOptimType.EXACT_ADAGRAD,
        "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    }[name]


# ------------------------------------------------------------------ models


def bag_configs(config: Config) -> list[EmbeddingBagConfig]:
    pooling = PoolingType.MEAN if config.pooling == "mean" else PoolingType.SUM
    return [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.dim,
            num_embeddings=t.rows,
            feature_names=list(t.features),
            pooling=pooling,
            data_type=DataType(t.data_type),
        )
        for t in config.bags
    ]


def sequence_configs(config: Config) -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(
            name=t.name,
            embedding_dim=t.dim,
            num_embeddings=t.rows,
            feature_names=list(t.features),
            data_type=DataType(t.data_type),
        )
        for t in config.sequences
    ]


def _store(store_dir: str | None, collection: str) -> str | None:
    """A collection's own folder of ``store_dir`` (a store's folder is its alone)."""
    if store_dir is None:
        return None
    folder = Path(store_dir, collection)
    folder.mkdir()
    return str(folder)


def build(
    config: Config,
    lookahead: bool,
    hot: dict | None = None,
    store_dir: str | None = None,
    min_cache_rows: int = 1,
):
    """A DMP model of ``config`` (lookahead or plain), its optimizer and its plan."""
    meta = torch.device("meta")
    bags, sequences = bag_configs(config), sequence_configs(config)
    ebc: torch.nn.Module | None = None
    ec: torch.nn.Module | None = None
    if lookahead:

        def cache(collection: str) -> dict:
            folder = _store(store_dir, collection)
            return dict(
                device=meta,
                cache_load_factor=config.cache_load_factor,
                min_cache_rows=min_cache_rows,
                store_dir=folder,
            )

        if hot:
            ebc = HotRowsEmbeddingBagCollection(
                bags, is_weighted=config.weighted, hot_rows=hot, **cache("bags")
            )
        elif bags:
            ebc = LookaheadEmbeddingBagCollection(
                bags, is_weighted=config.weighted, **cache("bags")
            )
        if sequences:
            ec = LookaheadEmbeddingCollection(sequences, **cache("sequence"))
        sharders = lookahead_sharders(cpu_row_wise=True)
    else:
        if bags:
            ebc = EmbeddingBagCollection(bags, is_weighted=config.weighted, device=meta)
        if sequences:
            ec = EmbeddingCollection(sequences, device=meta)
        sharders = [RowWiseOnCpuSharder(), EmbeddingCollectionSharder()]
    width = sum(t.dim * len(t.features) for t in config.tables)
    features = [f for t in config.sequences for f in t.features]
    model = Ranker(ebc, ec, features, width)
    for t in config.tables:
        where = "ec.embeddings" if t.sequence else "ebc.embedding_bags"
        weight = model.get_parameter(f"{where}.{t.name}.weight")
        apply_optimizer_in_backward(FUSED[t.optimizer], [weight], {"lr": t.lr})
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=[t.sharding], compute_kernels=["fused"], min_partition=max(4, t.dim // 2)
        )
        for t in config.tables
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=config.world_size, compute_device="cpu"),
        batch_size=config.batch,
        constraints=constraints,
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.SGD(params, lr=0.1),
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), str(plan)


# ------------------------------------------------------------------ comparing


def rate_factor(config: Config, step: int) -> float:
    if config.schedule == "warmup_decay":
        return min(1.0, (step + 1) / 4) * max(0.0, min(1.0, (config.steps - step) / 6))
    if config.schedule == "random":
        return float(np.random.default_rng([config.seed, config.index, 99, step]).uniform(0, 1.5))
    return 1.0


def _local(value) -> list[torch.Tensor]:  # noqa: ANN001
    """This rank's tensors of a state entry: a tensor, a sharded tensor's local shards, or
    (an optimizer's state of one parameter) each of a mapping's values, in key order."""
    if hasattr(value, "local_shards"):
        return [shard.tensor for shard in value.local_shards()]
    if isinstance(value, dict):
        return [t for key in sorted(value) for t in _local(value[key])]
    return [value] if isinstance(value, torch.Tensor) else []


def _everywhere(gap: float) -> float:
    """The largest of every rank's ``gap`` (so that all ranks stop at the same step)."""
    worst = torch.tensor([gap], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    if torch.equal(a, b):
        return 0.0
    return float((a.float() - b.float()).abs().max()) if a.numel() else float("inf")


def _state_gap(expected: dict, got: dict, what: str) -> tuple[float, str]:
    if list(expected) != list(got):
        return float("inf"), f"{what} keys"
    worst, where = 0.0, ""
    for key in expected:
        if isinstance(expected[key], dict) and sorted(expected[key]) != sorted(got[key]):
            return float("inf"), f"{what} {key} keys"
        for a, b in zip(_local(expected[key]), _local(got[key]), strict=True):
            gap = _gap(a, b)
            if gap > worst:
                worst, where = gap, f"{what} {key}"
    return worst, where


def _first_state_gap(base, run) -> str:  # noqa: ANN001
    """The tensors that differ most after a step whose outputs differ: what its update
    left apart, e.g. ``most apart after it: t0.weight by 0.025``."""
    found = []
    for what, expected, got in (
        ("table or dense parameter", base[0].state_dict(), run.model.state_dict()),
        ("optimizer state", base[1].state_dict()["state"], run.optimizer.state_dict()["state"]),
    ):
        gap, where = _state_gap(expected, got, what)
        if gap:
            found.append(f"{where} by {gap:.3g}")
    return "most apart after it: " + ("; ".join(found) or "nothing")


def window_floor(config: Config) -> int:
    """The cache rows a window may need where batches vary in size (bags of several ids,
    deduplicated sessions), which a window's first batch does not bound: ``d + 1`` times
    the most ids any table gets from all ranks' batches of one step. (Fixed-shape
    batches need none: the caches size themselves from the first.) None where the
    caches grow: they start at their load factor and grow as the windows widen."""
    if config.grow or (not any(t.multi_hot for t in config.tables) and not config.dedup):
        return 1
    everyone = [rank_batches(config, r) for r in range(config.world_size)]
    most = 0
    for step in zip(*everyone):
        for t in config.tables:
            most = max(
                most, sum(b.sparse_features[f].values().numel() for b in step for f in t.features)
            )
    return (config.prefetch_distance + 1) * max(most, 1)


class _Run:
    """This project's side of a comparison: its model, optimizer, pipeline and stream."""

    def __init__(
        self,
        config: Config,
        hot: dict | None,
        base,
        batches: list[Batch],  # noqa: ANN001
        stream: list[Batch],
        refusals: int,
    ) -> None:
        self.config, self.hot, self.batches = config, hot, batches
        self.refusals = refusals  # batches of ``stream`` meant to be refused
        self.trained = 0
        self._iter = iter(stream)
        self.min_cache_rows = window_floor(config)
        self.dirs: list[str] = []
        self.grown = 0  # growths of the caches of models replaced (resume)
        self.model, self.optimizer, self.plan = self._new_model()
        self.model.load_state_dict(base[0].state_dict())  # plain TorchRec's weights
        self.pipeline = self._pipeline()

    def _new_model(self):  # noqa: ANN202
        store = None
        if self.config.disk_store:
            store = tempfile.mkdtemp(prefix="exactness-store-")
            self.dirs.append(store)
        return build(self.config, True, self.hot, store, self.min_cache_rows)

    def _pipeline(self) -> LookaheadTrainPipeline:
        return LookaheadTrainPipeline(
            self.model,
            self.optimizer,
            torch.device("cpu"),
            lookahead=self.config.lookahead,
            prefetch_distance=self.config.prefetch_distance,
            stage_thread=self.config.stage_thread,
            planner=self.config.planner,
            planning_workers=self.config.planning_workers,
        )

    def step(self) -> torch.Tensor:
        """The next step's logits. A refusal of a batch meant to be refused (raised when
        it enters the window) is taken, any other raised."""
        while True:
            try:
                logits = self.pipeline.progress(self._iter)[1]
                self.trained += 1
                return logits
            except ValueError as error:
                expected = "out of range" in str(error) or "another rank refused" in str(error)
                if not expected or not self.refusals:
                    raise
                self.refusals -= 1  # dropped on every rank

    def reattach(self) -> None:
        self.pipeline.close()
        self.pipeline = self._pipeline()
        self._iter = iter(self.batches[self.trained :])
        self.refusals = 0  # a bad batch not yet read is left out with the rest

    def resume(self) -> None:
        """A checkpoint of this model loaded into a new one, which trains on."""
        state, optimizer_state = self.model.state_dict(), self.optimizer.state_dict()
        self.pipeline.close()
        self.grown = self.growths()
        self.model, self.optimizer, _ = self._new_model()
        self.model.load_state_dict(state)
        self.optimizer.load_state_dict(optimizer_state)
        self.pipeline = self._pipeline()
        self._iter = iter(self.batches[self.trained :])
        self.refusals = 0

    def growths(self) -> int:
        """Times this rank's caches grew, over every model of the run."""
        return self.grown + self.pipeline.cache_metrics()["total"].growths

    def close(self) -> None:
        self.pipeline.close()
        for folder in self.dirs:
            shutil.rmtree(folder, ignore_errors=True)


def oracle_divergence(config: Config, batches: list[Batch]) -> Divergence | None:
    """The first step where the device oracle fetches other rows than the numba oracle,
    on a table's ids of ``batches`` (its features' ids per step; bag and sequence tables
    alike), with the configuration's window and cache (no smaller than the window needs)
    and the pipeline's tie-break (the unit tests cover the other)."""
    for table in config.tables:
        stream = [
            np.concatenate([b.sparse_features[f].values().numpy() for f in table.features])
            for b in batches
        ]
        floor = pinned_rows_needed(stream, config.prefetch_distance)
        capacity = max(math.ceil(config.cache_load_factor * table.rows), floor)
        window = (capacity, config.lookahead, config.prefetch_distance, table.rows)
        want = OracleCacher(*window).plan(stream)
        got = DeviceOracleCacher(*window, "cpu").plan(map(torch.from_numpy, stream))
        for a, b in zip(want, got, strict=True):
            apart = set(a.fetch_ids.tolist()) ^ set(b.fetch_ids.tolist())
            if apart:  # rows fetched by one oracle only
                what = (
                    f"the device oracle's fetches ({table.name}: {b.num_misses} misses, "
                    f"the numba oracle's {a.num_misses})"
                )
                return Divergence(a.step, what, len(apart))
    return None


def compare(config: Config, rank: int) -> tuple[Divergence | None, float, int]:
    """Train ``config`` both ways on this rank; the first divergence (or None), the
    largest difference seen, and how many times this rank's caches grew."""
    torch.manual_seed(config.index)
    batches = rank_batches(config, rank)
    planned = oracle_divergence(config, batches) if rank == 0 else None  # one stream will do
    if _everywhere(0.0 if planned is None else 1.0):  # every rank stops, or none
        return planned or Divergence(-1, "the device oracle (on rank 0)", 0.0), 0.0, 0
    hot = hot_rows(config)
    base = build(config, False)
    events = dict(config.events)
    stream = list(batches)
    for step, event in sorted(events.items(), reverse=True):
        if event == "refuse":  # after step ``step``, one rank's batch has a bad id
            bad = bad_batch(batches[step + 1], config) if rank == step % config.world_size else None
            stream.insert(step + 1, bad or batches[step + 1])
    refusals = sum(e == "refuse" for e in events.values())
    run = _Run(config, hot, base, batches, stream, refusals)
    if run.plan != base[2]:
        run.close()
        return Divergence(-1, "the sharding plans differ", float("inf")), float("inf"), 0
    snapshot = build(config, False) if "reload" in events.values() else None
    reload_from = {s: s // 2 for s, e in events.items() if e == "reload"}
    rates = [[g["lr"] for g in o.param_groups] for o in (base[1], run.optimizer)]
    base_pipe = TrainPipelineSparseDist(base[0], base[1], torch.device("cpu"))
    base_iter = iter(batches)
    worst = 0.0
    try:
        for step in range(config.steps):
            for optimizer, base_rates in zip((base[1], run.optimizer), rates):
                for group, lr in zip(optimizer.param_groups, base_rates):
                    group["lr"] = lr * rate_factor(config, step)
            expected = base_pipe.progress(base_iter)[1][1]
            got = run.step()[1]
            gap = _everywhere(_gap(expected, got))
            worst = max(worst, gap)
            if gap > config.tolerance:
                what = f"output ({_first_state_gap(base, run)})"
                return Divergence(step, what, gap), worst, run.growths()
            if snapshot is not None and step in reload_from.values():
                snapshot[0].load_state_dict(base[0].state_dict())
                snapshot[1].load_state_dict(base[1].state_dict())
            event = events.get(step)
            if event == "eval":
                base_pipe.detach()  # TorchRec's pipeline rewrote the forward
                probe = batches[0]
                for model in (base[0], run.model):
                    model.eval()
                with torch.no_grad():
                    gap = _everywhere(_gap(base[0](probe)[1][1], run.model(probe)[1][1]))
                for model in (base[0], run.model):
                    model.train()
                worst = max(worst, gap)
                if gap > config.tolerance:
                    return Divergence(step, "eval output", gap), worst, run.growths()
                base_pipe = TrainPipelineSparseDist(base[0], base[1], torch.device("cpu"))
                base_iter = iter(batches[step + 1 :])
            elif event == "reattach":
                run.reattach()
            elif event == "resume":  # both: a fresh DDP buckets its gradients anew, and
                # at 4 ranks gloo's ring sums each bucket's elements in an order of their own
                run.resume()
                base_pipe.detach()
                fresh = build(config, False)
                fresh[0].load_state_dict(base[0].state_dict())
                fresh[1].load_state_dict(base[1].state_dict())
                base = fresh
                base_pipe = TrainPipelineSparseDist(base[0], base[1], torch.device("cpu"))
                base_iter = iter(batches[step + 1 :])
            elif event == "reload":
                assert snapshot is not None
                for model, optimizer in ((base[0], base[1]), (run.model, run.optimizer)):
                    model.load_state_dict(snapshot[0].state_dict())
                    optimizer.load_state_dict(snapshot[1].state_dict())
        base_pipe.detach()
        run.pipeline.close()
        for what, expected, got in (
            ("table or dense parameter", base[0].state_dict(), run.model.state_dict()),
            ("optimizer state", base[1].state_dict()["state"], run.optimizer.state_dict()["state"]),
        ):
            gap, where = _state_gap(expected, got, what)
            worst = max(worst, gap)
            if gap > config.tolerance:
                return Divergence(-1, where, gap), worst, run.growths()
        return None, worst, run.growths()
    finally:
        run.close()
