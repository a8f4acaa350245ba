"""The planner extension: measured miss-rate curves, cache sizing under a budget, plans."""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

import numpy as np
import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, CacheAlgorithm
from fbgemm_gpu.tbe.cache.cache_config import MultiPassPrefetchConfig
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.types import CacheParams, KeyValueParams
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim import SGD, RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.types import DataType

from benchmarks.common import SequenceData, pinned_rows_needed
from planners import (
    LookaheadCacheProposer,
    LookaheadCacheStatistics,
    TableCacheCost,
    lookahead_planner,
    plan_report,
)
from tests.models import LR, batches, lookahead_model, train_lookahead
from torchrec_lookahead import (
    LookaheadEmbeddingBagCollection,
    LookaheadEmbeddingBagCollectionSharder,
    LookaheadEmbeddingCollection,
    LookaheadEmbeddingCollectionSharder,
)
from torchrec_lookahead import LookaheadEmbeddingBagCollectionSharder as Sharder
from torchrec_lookahead.data import SyntheticCriteo
from torchrec_lookahead.embedding.sharder import check_plan
from torchrec_lookahead.oracle.misses import oracle_misses
from torchrec_lookahead.settings import CacheSizing

FEATURES = {"t0": (["f0", "f1"], 4000, 0), "t2": (["f3"], 10000, 2)}


def table_ids(batch, features):
    return np.concatenate([batch.sparse_features[f].values().numpy() for f in features])


def test_miss_rate_curve_matches_a_training_run_at_two_cache_sizes() -> None:
    """Statistics from an independent sample of the same length as the run predict the
    run's miss rate (misses per distinct id, second half, step-aligned) within 0.03."""
    sample = batches(120, seed=7)
    stats = {
        name: LookaheadCacheStatistics([table_ids(b, feats) for b in sample], rows, 8, 1, name)
        for name, (feats, rows, _) in FEATURES.items()
    }
    data = batches(120, seed=0)
    for clf in (0.1, 0.3):
        rows = {"t0": int(clf * 4000), "t1": 1500, "t2": int(clf * 10000), "w0": 3000}
        model = lookahead_model("sgd", cache_rows=rows)
        train_lookahead(model, data, 8, 1)
        counts = model.unweighted.cached_groups[0].step_counts
        for name, (_, _, index) in FEATURES.items():
            distinct = sum(counts[s][0][index] for s in range(60, 120))
            misses = sum(counts[s][1][index] for s in range(60, 120))
            assert abs(misses / distinct - stats[name].expected_miss_rate(clf)) <= 0.03, (name, clf)


def zipf_stats(rows: int, batch: int, pooling: float, seed: int) -> LookaheadCacheStatistics:
    data = SyntheticCriteo(
        table_sizes=(rows,), zipf_exponent=1.1, pooling_factor=pooling, seed=seed
    )
    return LookaheadCacheStatistics(data.table_streams(batch, 60)[0], rows, 16, 1, f"t{seed}")


def test_curve_is_monotone_with_the_documented_ends() -> None:
    stats = zipf_stats(20000, 256, 1.0, 0)
    rates = [stats.expected_miss_rate(c) for c in np.geomspace(1e-4, 0.999, 40)]
    assert all(a >= b for a, b in zip(rates, rates[1:]))
    assert stats.expected_miss_rate(0) == 1.0 and stats.expected_miss_rate(1.0) == 0.0
    assert 0 < stats.cacheability < 1 and stats.expected_lookups > 0


@pytest.mark.parametrize(
    "batches_, message",
    [
        ([], "at least 2 sample batches"),
        ([np.array([], np.int64)] * 3, "hold no ids"),
        ([np.array([1, 2]), np.array([5000])], "t9, sample batch 1: id 5000 is out of range"),
    ],
)
def test_bad_samples_are_refused(batches_, message) -> None:
    with pytest.raises(ValueError, match=message):
        LookaheadCacheStatistics(batches_, 100, 4, 1, "t9")


def costs(**pooling: float) -> list[TableCacheCost]:
    return [
        TableCacheCost(name, 20000, 16, 1, zipf_stats(20000, 256, p, seed))
        for seed, (name, p) in enumerate(pooling.items())
    ]


def test_proposer_respects_the_budget_and_gives_the_hotter_table_more() -> None:
    tables = costs(hot=4.0, cold=1.0)  # same size; "hot" is looked up four times as often
    floor = sum(t.device_bytes(0) for t in tables)
    budget = floor + 300_000
    proposal = LookaheadCacheProposer(bandwidth=1e3, step_compute_ms=0.0, budget_bytes=budget)
    chosen = proposal.propose(tables)
    assert sum(chosen.device_bytes.values()) <= budget
    assert chosen.load_factors["hot"] > chosen.load_factors["cold"]
    assert chosen.stall_ms > 0  # the budget is too small to hide the traffic: reported, not hidden


def test_proposer_stops_growing_once_the_step_is_stall_free() -> None:
    tables = costs(a=1.0, b=1.0)
    fast = LookaheadCacheProposer(bandwidth=1e12, step_compute_ms=1.0).propose(tables)
    assert fast.stall_ms == 0 and all(
        clf == pytest.approx(t.stats.min_load_factor) or clf <= 0.001
        for t, clf in zip(tables, fast.load_factors.values())
    )  # traffic is free: the smallest workable caches suffice
    slow = LookaheadCacheProposer(bandwidth=200.0, step_compute_ms=1.0).propose(tables)
    assert slow.stall_ms == 0 and slow.transfer_ms <= 1.0
    assert all(slow.load_factors[n] >= fast.load_factors[n] for n in ("a", "b"))


def test_budget_below_the_smallest_workable_caches_is_a_clear_error() -> None:
    tables = costs(a=1.0)
    with pytest.raises(ValueError, match="cannot hold even the smallest workable caches"):
        LookaheadCacheProposer(1e3, 0.0, budget_bytes=1000).propose(tables)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_plans_for_cpu_and_cuda_topologies_carry_the_proposed_cache_sizes(device) -> None:
    sizes = (20000, 20000, 5000)
    data = SyntheticCriteo(table_sizes=sizes, zipf_exponent=1.1, seed=1)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=16, num_embeddings=n, feature_names=[f"c{i}"]
        )
        for i, n in enumerate(sizes)
    ]
    stats = {
        t.name: LookaheadCacheStatistics(s, t.num_embeddings, 16, 1, t.name)
        for t, s in zip(tables, data.table_streams(256, 40))
    }
    planner, proposal = lookahead_planner(
        Topology(world_size=2, compute_device=device),
        256,
        tables,
        stats,
        EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        step_compute_ms=0.001,
        cache_budget_bytes=400_000,
    )
    ebc = LookaheadEmbeddingBagCollection(tables, device=torch.device("meta"))
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=13,
        dense_arch_layer_sizes=[32, 16],
        over_arch_layer_sizes=[32, 1],
    )
    model = DLRMTrain(dlrm)
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": 0.05})
    plan = planner.plan(model, [LookaheadEmbeddingBagCollectionSharder()])
    shardings = next(iter(plan.plan.values()))
    kernel = "fused" if device == "cpu" else "fused_uvm_caching"
    for name, sharding in shardings.items():
        assert sharding.cache_params.load_factor == proposal.load_factors[name]
        assert sharding.compute_kernel == kernel and sharding.sharding_type != "data_parallel"
    assert sum(proposal.device_bytes.values()) <= 400_000
    report = plan_report(plan, proposal)
    assert all(f"t{i}" in report for i in range(3)) and "ms/step" in report


def test_missing_statistics_are_named() -> None:
    tables = [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=10, feature_names=["f"])
    ]
    with pytest.raises(ValueError, match=r"no cache statistics for tables \['t0'\]"):
        lookahead_planner(
            Topology(world_size=1, compute_device="cpu"), 8, tables, {}, EmbOptimType.EXACT_SGD, 1.0
        )


def test_a_gpu_store_keeps_row_wise_state_in_device_memory() -> None:
    """On CUDA the store is FBGEMM's UVM TBE, whose row-wise optimizer state is in device
    memory: the storage estimate counts it there, not in host memory."""
    from planners.cost import TableCacheCost, optimizer_state_floats

    stats = LookaheadCacheStatistics([np.arange(64)] * 4, 1000, 2, 1, "t")
    rowwise = TableCacheCost(
        "t",
        1000,
        16,
        optimizer_state_floats(EmbOptimType.EXACT_ROWWISE_ADAGRAD, 16),
        stats,
        rowwise_state=True,
    )
    assert rowwise.store_device_bytes() == 1000 * 4
    assert rowwise.store_device_bytes() < rowwise.host_bytes()
    plain = TableCacheCost("t", 1000, 16, optimizer_state_floats(EmbOptimType.EXACT_SGD, 16), stats)
    assert plain.store_device_bytes() == 0


def test_optimizer_state_is_known_for_fbgemms_optimizers_and_torchrecs_classes() -> None:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.optim import Adagrad, RowWiseAdagrad

    from planners import optimizer_state_floats

    assert optimizer_state_floats(EmbOptimType.EXACT_ROWWISE_ADAGRAD, 16) == 1
    assert optimizer_state_floats(RowWiseAdagrad, 16) == 1  # the class, as TorchRec maps it
    assert optimizer_state_floats(Adagrad, 16) == 16
    with pytest.raises(ValueError, match="is not known here"):
        optimizer_state_floats(EmbOptimType.LAMB, 16)


def non_default(cls: type, values: dict[str, Any]) -> None:
    """``values`` sets every field of the dataclass ``cls`` (one a newer TorchRec adds
    too) to something other than its default."""
    assert set(values) == {f.name for f in fields(cls)}, f"give every {cls.__name__} field a value"
    for f in fields(cls):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        assert values[f.name] != default, f"{cls.__name__}.{f.name} is at its default"


def test_every_user_constraint_survives_into_the_enumeration() -> None:
    """Every field of the user's ``ParameterConstraints`` and ``CacheParams`` reaches the
    sharding options TorchRec's enumerator makes and the constraints its estimators read;
    only the cache's load factor and statistics are the planner's."""
    table = EmbeddingBagConfig(
        name="t0", embedding_dim=16, num_embeddings=2000, feature_names=["c0"]
    )
    data = SyntheticCriteo(table_sizes=(2000,), zipf_exponent=1.1, seed=3)
    ours, theirs = (
        LookaheadCacheStatistics(data.table_streams(batch, 8)[0], 2000, 4, 1, "t0")
        for batch in (64, 16)
    )
    cache = {
        "algorithm": CacheAlgorithm.LFU,
        "load_factor": 0.75,
        "reserved_memory": 1.5,
        "precision": DataType.FP16,
        "prefetch_pipeline": True,
        "stats": theirs,
        "multipass_prefetch_config": MultiPassPrefetchConfig(num_passes=3),
    }
    user = {
        "sharding_types": ["column_wise"],
        "compute_kernels": ["fused"],
        "min_partition": 8,
        "pooling_factors": [3.0],
        "num_poolings": [2.0],
        "batch_sizes": [48],
        "is_weighted": True,
        "cache_params": CacheParams(**cache),
        "enforce_hbm": True,
        "stochastic_rounding": False,
        "bounds_check_mode": BoundsCheckMode.IGNORE,
        "feature_names": ["c0"],
        "output_dtype": DataType.FP16,
        "device_group": "cpu",
        "key_value_params": KeyValueParams(max_l1_cache_size=1, l2_cache_size=2),
        "use_virtual_table": True,
    }
    non_default(ParameterConstraints, user)
    non_default(CacheParams, cache)
    planner, proposal = lookahead_planner(
        Topology(world_size=2, compute_device="cpu"),
        48,
        [table],
        {"t0": ours},
        EmbOptimType.EXACT_SGD,
        step_compute_ms=1.0,
        constraints={"t0": (given := ParameterConstraints(**user))},
    )
    assert given.cache_params is user["cache_params"] and given.cache_params.load_factor == 0.75
    planned = {**cache, "load_factor": proposal.load_factors["t0"], "stats": ours}
    assert planned["load_factor"] != cache["load_factor"]

    def dropped(constraints: ParameterConstraints | None) -> list[str]:
        assert constraints is not None
        lost = [k for k, v in user.items() if k != "cache_params" and getattr(constraints, k) != v]
        params = constraints.cache_params
        return lost + [
            f"cache_params.{k}"
            for k, v in planned.items()
            if params is None or getattr(params, k) != v  # stats: the very object
        ]

    lost = dropped(planner.constraints.get("t0"))  # given to TorchRec's planner and enumerator
    assert not lost, f"the constraints TorchRec plans with lost {lost}"

    ebc = LookaheadEmbeddingBagCollection([table], device=torch.device("meta"))
    options = planner.enumerator.enumerate(ebc, [LookaheadEmbeddingBagCollectionSharder()])
    assert options
    for option in options:
        assert option.sharding_type == "column_wise" and option.compute_kernel == "fused"
        assert [shard.size[1] for shard in option.shards] == [8, 8]  # min_partition
        assert option.input_lengths == user["pooling_factors"]
        for name in (
            "enforce_hbm",
            "stochastic_rounding",
            "bounds_check_mode",
            "feature_names",
            "output_dtype",
            "key_value_params",
        ):  # what the enumerator copies onto its options; the rest, estimators read above
            assert getattr(option, name) == user[name], name
        params = option.cache_params  # a deep copy: the statistics are compared by value
        assert params is not None and params.stats is not None
        assert params.stats.expected_lookups == ours.expected_lookups != theirs.expected_lookups
        for k, v in planned.items():
            assert k == "stats" or getattr(params, k) == v, f"cache_params.{k}"


# A sequence table: each sample's history of 20-60 items of Zipf popularity, 8 samples a batch.
ITEMS = EmbeddingConfig(
    name="item", embedding_dim=8, num_embeddings=6000, feature_names=["history"]
)
HISTORIES = SequenceData(ITEMS.num_embeddings, lengths=(20, 60), seed=5)


def history_batches(steps: int) -> list[Batch]:
    """The first ``steps`` batches of ``HISTORIES`` (no dense features, labels unused)."""
    out = []
    for step in range(steps):
        lengths, ids = HISTORIES.batch(step, 8)
        features = KeyedJaggedTensor.from_lengths_sync(
            keys=["history"], values=torch.from_numpy(ids), lengths=torch.from_numpy(lengths)
        )
        out.append(Batch(torch.zeros(8, 0), features, torch.zeros(8, dtype=torch.int64)))
    return out


class HistoryModel(nn.Module):
    """A sequence collection's rows, one logit each: enough for the pipeline to train it."""

    def __init__(self, items: nn.Module) -> None:
        super().__init__()
        self.sequence = items
        torch.manual_seed(0)
        self.over = nn.Linear(ITEMS.embedding_dim, 1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.over(self.sequence(batch.sparse_features)["history"].values()).squeeze(1)
        return logits.square().mean(), logits.detach()


def test_a_sequence_tables_statistics_are_its_modules_misses_step_for_step() -> None:
    """At each measured load factor, a ``LookaheadEmbeddingCollection`` given it and
    trained on the sample's batches holds the cache the statistics measured at, misses at
    every step what the oracle misses there, and its second-half miss rate is the
    statistics' rate. Its floor is what two batches' ids (repeats counted, as the module
    counts them) can touch, well above the rows two batches use together."""
    data = history_batches(24)
    ids = [b.sparse_features["history"].values().numpy() for b in data]
    stats = LookaheadCacheStatistics(ids, ITEMS.num_embeddings, 4, 1, "item")
    assert stats.min_rows == 2 * len(ids[0]) > 1.5 * pinned_rows_needed(ids, 1)
    for clf in (0.001, 0.2, 0.5):  # below the floor, and two larger shares
        items = LookaheadEmbeddingCollection([ITEMS], cache_load_factor=clf)
        apply_optimizer_in_backward(SGD, items.parameters(), {"lr": LR})
        train_lookahead(HistoryModel(items), data, 4, 1)
        (group,) = items.cached_groups
        capacity = stats.capacity(clf)
        assert group.pool_slots == [capacity] == [max(stats.min_rows, round(clf * 6000))]
        distinct, misses = (
            np.array([group.step_counts[s][k][0] for s in range(24)]) for k in (0, 1)
        )
        assert np.array_equal(misses, oracle_misses(ids, capacity, 4, 1, 6000))
        assert stats.expected_miss_rate(clf) == misses[12:].sum() / distinct[12:].sum()
        assert np.array_equal(distinct, [len(np.unique(i)) for i in ids])


@pytest.mark.parametrize("lookahead", [False, True], ids=["plain", "lookahead"])
def test_plans_for_a_sequence_table_carry_the_proposed_cache_size(lookahead: bool) -> None:
    """The planner sizes a sequence table (``EmbeddingConfig``) from its statistics: the
    proposal starts at its floor and stays in the budget, and every sharding option
    TorchRec's enumerator makes for an ``EmbeddingCollection`` (or a
    ``LookaheadEmbeddingCollection``, with its sharder) holding it, and the plan, carry
    the proposed load factor and the statistics. The lookahead collection's shards are
    estimated with the lookahead layout: the cache and the whole table in host memory
    on a CPU topology."""
    ids = [b.sparse_features["history"].values().numpy() for b in history_batches(24)]
    stats = {"item": LookaheadCacheStatistics(ids, ITEMS.num_embeddings, 4, 1, "item")}
    cost = TableCacheCost("item", 6000, 8, 0, stats["item"])
    budget = cost.device_bytes(0.5)
    planner, proposal = lookahead_planner(
        Topology(world_size=2, compute_device="cpu"),
        8,
        [ITEMS],
        stats,
        EmbOptimType.EXACT_SGD,
        step_compute_ms=0.0,
        cache_budget_bytes=budget,
    )
    clf = proposal.load_factors["item"]
    assert stats["item"].min_load_factor <= clf <= 0.5
    assert proposal.device_bytes["item"] == cost.device_bytes(clf) <= budget
    meta = torch.device("meta")
    if lookahead:
        collection = LookaheadEmbeddingCollection([ITEMS], device=meta)
        sharder = LookaheadEmbeddingCollectionSharder()
    else:
        collection, sharder = (
            EmbeddingCollection([ITEMS], device=meta),
            EmbeddingCollectionSharder(),
        )
    options = planner.enumerator.enumerate(collection, [sharder])
    assert options
    for option in options:
        assert option.cache_params is not None and option.cache_params.load_factor == clf
        assert option.cache_params.stats.min_rows == stats["item"].min_rows
        if lookahead:  # each shard its share of the cache and of the table, rounded down
            whole = cost.device_bytes(clf) + cost.host_bytes()
            assert all(shard.storage.hbm == 0 for shard in option.shards)
            ddr = sum(shard.storage.ddr for shard in option.shards)
            assert whole - len(option.shards) < ddr <= whole, option.sharding_type
    plan = planner.plan(HistoryModel(collection), [sharder])
    (sharding,) = next(iter(plan.plan.values())).values()
    assert sharding.cache_params.load_factor == clf
    assert "item" in plan_report(plan, proposal)


def _bag_tables(sizes: tuple[int, ...], dim: int = 16, **config: Any) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=dim, num_embeddings=n, feature_names=[f"f{i}"], **config
        )
        for i, n in enumerate(sizes)
    ]


def _meta_collection(tables: list[EmbeddingBagConfig]) -> LookaheadEmbeddingBagCollection:
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    return LookaheadEmbeddingBagCollection(tables, device=torch.device("meta"), fused_params=fused)


def test_a_table_cached_whole_plans_on_a_cuda_topology() -> None:
    """TorchRec refuses a UVM cache's load factor of 1.0 ("strictly between 0 and 1"): a
    table the proposer caches whole gets the load factor just below 1, whose cache still
    holds every row."""
    tables = _bag_tables((10, 4000))
    stats = {
        "t0": LookaheadCacheStatistics([np.arange(10)] * 4, 10, 8, 1, "t0"),
        "t1": zipf_stats(4000, 256, 1.0, seed=1),
    }
    planner, proposal = lookahead_planner(
        Topology(world_size=1, compute_device="cuda"), 64, tables, stats, SGD, 1.0
    )
    assert proposal.load_factors["t0"] == 1.0
    shardings = next(iter(planner.plan(_meta_collection(tables), [Sharder()]).plan.values()))
    clf = shardings["t0"].cache_params.load_factor
    assert shardings["t0"].compute_kernel == "fused_uvm_caching" and 0.999 < clf < 1.0
    assert CacheSizing().rows("t0", 10, 10, clf) == 10  # every row, as at 1.0


def test_statistics_of_another_table_are_refused() -> None:
    tables = _bag_tables((50_000,))
    cpu = Topology(world_size=1, compute_device="cpu")
    other = zipf_stats(5000, 256, 1.0, seed=1)  # measured over a table of 5,000 rows
    with pytest.raises(ValueError, match="table t0: .* measured over 5,000 rows, .* 50,000"):
        lookahead_planner(cpu, 64, tables, {"t0": other}, SGD, 1.0)
    with pytest.raises(ValueError, match="table t0: its statistics are a NoneType"):
        lookahead_planner(cpu, 64, tables, {"t0": None}, SGD, 1.0)  # type: ignore[dict-item]


def test_fp16_tables_cost_half_the_weight_bytes() -> None:
    """FBGEMM keeps an FP16 table's weights in half precision, its optimizer state in FP32."""
    stats = {"t0": zipf_stats(4000, 256, 1.0, seed=1)}
    cpu = Topology(world_size=1, compute_device="cpu")
    host = {}
    for data_type in (DataType.FP32, DataType.FP16):
        tables = _bag_tables((4000,), dim=16, data_type=data_type)
        _, proposal = lookahead_planner(cpu, 64, tables, stats, RowWiseAdagrad, 1.0)
        host[data_type] = proposal.host_bytes["t0"]
    oracle = 12  # ORACLE_BYTES_PER_ROW
    assert host[DataType.FP32] == 4000 * (4 * 16 + 4 + oracle)
    assert host[DataType.FP16] == 4000 * (2 * 16 + 4 + oracle)


def test_an_optimizer_class_costs_as_its_fbgemm_type() -> None:
    """``RowWiseAdagrad`` (the class given to ``apply_optimizer_in_backward``) keeps its
    row-wise state in device memory on a CUDA topology, as ``EXACT_ROWWISE_ADAGRAD`` does."""
    tables = _bag_tables((4000,))
    stats = {"t0": zipf_stats(4000, 256, 1.0, seed=1)}
    cuda = Topology(world_size=1, compute_device="cuda")
    storage = []
    for optimizer in (RowWiseAdagrad, EmbOptimType.EXACT_ROWWISE_ADAGRAD):
        planner, _ = lookahead_planner(cuda, 64, tables, stats, optimizer, 1.0)
        options = planner.enumerator.enumerate(_meta_collection(tables), [Sharder()])
        storage.append([(o.sharding_type, [s.storage for s in o.shards]) for o in options])
    assert storage[0] == storage[1]


def test_a_lookahead_prefetch_is_estimated_once_on_a_cuda_topology() -> None:
    """TorchRec's perf estimator charges a UVM cache's prefetch from the same statistics:
    the lookahead estimate replaces it, not adds to it."""
    tables = _bag_tables((200_000,), dim=64)
    stats = {"t0": zipf_stats(200_000, 4096, 1.0, seed=1)}
    slow_link = Topology(world_size=1, compute_device="cuda", hbm_to_ddr_mem_bw=2e4)
    planner, proposal = lookahead_planner(slow_link, 4096, tables, stats, SGD, 0.0, 3_000_000)
    moved = proposal.bytes_per_step["t0"]  # at the proposed load factor, the whole table
    for option in planner.enumerator.enumerate(_meta_collection(tables), [Sharder()]):
        assert option.cache_params.load_factor == proposal.load_factors["t0"]
        for shard in option.shards:
            share = shard.size[0] / 200_000 * shard.size[1] / 64
            compute = shard.perf.fwd_compute + shard.perf.bwd_compute
            want = max(0.0, moved * share / slow_link.hbm_to_ddr_mem_bw - compute)
            assert shard.perf.prefetch_compute == pytest.approx(want)


def test_a_plan_never_gives_a_rank_no_rows_of_a_table() -> None:
    """Row-wise over more ranks than a table's rows leaves a rank none, which the sharder
    refuses: such options are never placed."""
    tables = _bag_tables((1, 4000))
    stats = {
        "t0": LookaheadCacheStatistics([np.array([0])] * 3, 1, 8, 1, "t0"),
        "t1": zipf_stats(4000, 256, 1.0, seed=1),
    }
    constraints = {"t0": ParameterConstraints(sharding_types=["row_wise", "table_wise"])}
    planner, _ = lookahead_planner(
        Topology(world_size=2, compute_device="cpu"),
        256,
        tables,
        stats,
        SGD,
        1.0,
        constraints=constraints,
    )
    module = _meta_collection(tables)
    plan = planner.plan(module, [Sharder(cpu_row_wise=True)])
    shardings = next(iter(plan.plan.values()))
    assert shardings["t0"].sharding_type == "table_wise"
    check_plan(module, shardings)  # what DMP runs first: no refusal


def test_identical_planners_hash_alike() -> None:
    """TorchRec's planner hashes ``str(cache_params)`` (to tell whether a stored plan still
    fits): the statistics print their measurements, not an object's address."""
    tables = _bag_tables((5000, 3000))
    cpu = Topology(world_size=2, compute_device="cpu")
    hashes = []
    for _ in range(2):
        stats = {t.name: zipf_stats(t.num_embeddings, 256, 1.0, seed=1) for t in tables}
        planner, _ = lookahead_planner(cpu, 256, tables, stats, SGD, 1.0, 200_000)
        planner.plan(_meta_collection(tables), [Sharder()])
        hashes.append(planner.hash_planner_context_inputs_str())
    assert hashes[0] == hashes[1]


def test_statistics_cost_memory_by_the_sample_not_the_table() -> None:
    """The oracle runs over the sample's ids renumbered in order: the same rates as over the
    table's own ids, and a table of a trillion rows needs no per-row state."""
    rng = np.random.default_rng(4)
    sample = [np.minimum(rng.zipf(1.1, 300), 4999) * 997 for _ in range(8)]  # sparse ids
    stats = LookaheadCacheStatistics(sample, 5000 * 997, 4, 1, "t", grid=(0.0002, 0.001))
    for clf, rate in zip(stats.grid, stats.rates):
        misses = oracle_misses(sample, stats.capacity(clf), 4, 1, 5000 * 997)
        distinct = [len(np.unique(s)) for s in sample[4:]]
        assert rate <= misses[4:].sum() / sum(distinct)  # the curve is made monotone
    direct = oracle_misses(sample, stats.capacity(0.0002), 4, 1, 5000 * 997)
    assert stats.rates[0] == direct[4:].sum() / sum(len(np.unique(s)) for s in sample[4:])
    huge = LookaheadCacheStatistics(sample, 10**12, 4, 1, "t")
    assert (huge.rates == stats.rates[-1]).all()  # every cache holds the sample: first touches


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefetch_distance": -1}, "prefetch_distance must be"),
        ({"grid": (0.1, float("nan"))}, r"grid load factors must lie in \(0, 1\]"),
        ({"grid": (0.0, 0.5)}, r"grid load factors must lie in \(0, 1\]"),
    ],
)
def test_bad_statistics_settings_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        LookaheadCacheStatistics([np.arange(4)] * 2, 10, 2, name="t", **kwargs)


@pytest.mark.parametrize(("batch_size", "message"), [(None, "integer"), (0, "at least 1")])
def test_a_batch_size_that_is_not_a_positive_integer_is_refused(batch_size, message) -> None:
    """TorchRec's estimators failed inside on ``None`` (its planner's default is 512
    samples; a cache is not sized for a batch the user did not say)."""
    stats = {"t0": zipf_stats(4000, 256, 1.0, seed=1)}
    cpu = Topology(world_size=1, compute_device="cpu")
    with pytest.raises(ValueError, match=f"batch_size must be .*{message}"):
        lookahead_planner(cpu, batch_size, _bag_tables((4000,)), stats, SGD, 1.0)


def test_a_step_time_that_is_not_a_number_is_refused() -> None:
    with pytest.raises(ValueError, match="step_compute_ms non-negative"):
        LookaheadCacheProposer(1e3, float("nan"))


def test_constraints_of_none_are_taken_as_none_given() -> None:
    """TorchRec's planner takes ``{name: None}``; so does this one."""
    tables = _bag_tables((4000,))
    stats = {"t0": zipf_stats(4000, 256, 1.0, seed=1)}
    cpu = Topology(world_size=1, compute_device="cpu")
    planner, _ = lookahead_planner(cpu, 64, tables, stats, SGD, 1.0, constraints={"t0": None})
    assert planner.constraints["t0"].cache_params.stats is stats["t0"]
