"""Tables' data types: FP16 tables train as FBGEMM's FP16 TBE does, at half the bytes;
mixed types cache in a group per type; types FBGEMM's TBE cannot train are refused.
(Under DMP, against plain TorchRec: ``test_distributed.py``.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_configs import DataType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from tests.models import (
    OPTIMIZERS,
    UNWEIGHTED,
    assert_same_training_state,
    batches,
    lookahead_model,
    reference_twin,
    session_batches,
    train_lookahead,
    train_reference,
)
from torchrec_lookahead import LookaheadEmbeddingBagCollection
from torchrec_lookahead.data.dedup import deduplicate
from torchrec_lookahead.testing.resident import FullyResidentEmbeddingBagCollection

FP16 = DataType.FP16


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_fp16_tables_train_like_fbgemms_fp16_tbe(optimizer: str) -> None:
    """Every step's output, every FP16 table, the (FP32) optimizer state and the dense
    layer bitwise those of the all-resident FP16 TBE; the cache and the store hold
    half-precision rows."""
    model = lookahead_model(optimizer, FP16, cache_load_factor=0.05)
    twin = reference_twin(model, optimizer)
    data = batches(40)
    expected = train_reference(twin, data)
    got, pipeline = train_lookahead(model, data, lookahead=4, prefetch_distance=1)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert_same_training_state(model, twin)
    assert pipeline.cache_metrics()["total"].rows_written_back > 0, "the cache never evicted"
    for module in (model.unweighted, model.weighted):
        (group,) = module.cached_groups
        assert {w.dtype for w in group.cache.tbe.split_embedding_weights()} == {torch.float16}
        assert {w.dtype for w in group.cache.store.weights} == {torch.float16}
        assert {s.dtype for table in module.optimizer_states() for s in table} <= {torch.float32}


def module_bytes(module: LookaheadEmbeddingBagCollection) -> dict[str, int]:
    """Bytes of the cache's rows and optimizer state and of the store's, from the tensors."""

    def size(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    (group,) = module.cached_groups
    tbe, store = group.cache.tbe, group.cache.store
    return {
        "cache_rows": size(tbe.split_embedding_weights()),
        "cache_state": size(s for table in tbe.split_optimizer_states() for s in table),
        "store_rows": size(store.weights),
        "store_state": size(s for table in store.states for s in table),
        "bytes_moved": sum(m.bytes_moved for m in module.cache_metrics().values()),
    }


def test_fp16_rows_take_half_the_bytes_of_fp32_rows_in_the_cache_and_the_store() -> None:
    """The same training in FP32 and FP16 (EXACT_ADAGRAD: a state value per weight):
    the same misses, rows at exactly half the bytes in the cache and the store, optimizer
    state at the same (FBGEMM keeps it in FP32 for FP16 tables)."""
    data = batches(20)
    measured = {}
    for data_type in (DataType.FP32, FP16):
        model = lookahead_model("adagrad", data_type, cache_load_factor=0.05)
        train_lookahead(model, data, lookahead=4, prefetch_distance=1)
        measured[data_type] = module_bytes(model.unweighted)
    fp32, fp16 = measured[DataType.FP32], measured[FP16]
    print(f"FP32: {fp32}\nFP16: {fp16}")
    rows = {t.name: t.num_embeddings * t.embedding_dim for t in UNWEIGHTED}
    assert fp32["store_rows"] == 4 * sum(rows.values())
    assert fp16["store_rows"] * 2 == fp32["store_rows"]
    assert fp16["cache_rows"] * 2 == fp32["cache_rows"] > 0
    assert fp16["store_state"] == fp32["store_state"] == fp32["store_rows"]
    assert fp16["cache_state"] == fp32["cache_state"] == fp32["cache_rows"]
    # Rows move with their state: 2 + 4 bytes per value instead of 4 + 4.
    assert fp16["bytes_moved"] * 8 == fp32["bytes_moved"] * 6 > 0


class ByType(nn.Module):
    """The all-resident reference of a collection mixing data types: one TBE per type, as
    TorchRec's fused kernels, their outputs in the collection's table order."""

    def __init__(self, like: LookaheadEmbeddingBagCollection, fused: dict) -> None:
        super().__init__()
        configs = like.embedding_bag_configs()
        self.keys = [f for t in configs for f in t.feature_names]
        self.parts = nn.ModuleList()
        for data_type in dict.fromkeys(t.data_type for t in configs):
            tables = [t for t in configs if t.data_type == data_type]
            plain = EmbeddingBagCollection(tables=tables)
            for t in tables:
                plain.embedding_bags[t.name].weight.data.copy_(like.embedding_bags[t.name].weight)
            self.parts.append(FullyResidentEmbeddingBagCollection(plain, fused))

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        pooled = {k: v for part in self.parts for k, v in part(features).to_dict().items()}
        widths = [pooled[k].shape[1] for k in self.keys]
        return KeyedTensor(self.keys, widths, torch.cat([pooled[k] for k in self.keys], dim=1))

    def tables(self) -> dict[str, tuple[torch.Tensor, list[torch.Tensor]]]:
        """Per table name, its weights and optimizer state."""
        out = {}
        for part in self.parts:
            states = part.tbe.split_optimizer_states() or [[] for _ in part.tbe.embedding_specs]
            for t, w, s in zip(
                part.embedding_bag_configs(), part.tbe.split_embedding_weights(), states
            ):
                out[t.name] = (w, list(s))
        return out


class OneModule(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        torch.manual_seed(0)
        self.over = nn.Linear(sum(len(t.feature_names) * t.embedding_dim for t in UNWEIGHTED), 1)

    def forward(self, batch):
        logits = self.over(self.ebc(batch.sparse_features).values()).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.float())
        return loss, logits.detach()


@pytest.mark.parametrize(("optimizer", "dedup"), [("sgd", False), ("rowwise_adagrad", True)])
def test_a_collection_mixing_fp32_and_fp16_tables_caches_each_type_in_its_own_group(
    optimizer: str, dedup: bool
) -> None:
    """FP32, FP16, FP32 tables (the output interleaves the groups' columns): bitwise a TBE
    per type, the output in table order; plain or deduplicated batches (each group's
    variable-batch output, flat, joins the others')."""
    tables = [
        dataclasses.replace(t, data_type=d)
        for t, d in zip(UNWEIGHTED, [DataType.FP32, FP16, DataType.FP32])
    ]
    ebc = LookaheadEmbeddingBagCollection(tables, cache_load_factor=0.05)
    apply_optimizer_in_backward(OPTIMIZERS[optimizer][0], ebc.parameters(), {"lr": 0.05})
    model = OneModule(ebc)
    twin = OneModule(ByType(ebc, {"optimizer": OPTIMIZERS[optimizer][1], "learning_rate": 0.05}))
    keys = [f for t in tables for f in t.feature_names]  # the batches' first four
    data = []
    for b in session_batches(30, session=4, dedup=False):
        features = b.sparse_features.permute([0, 1, 2, 3])
        assert features.keys() == keys
        if dedup:
            features = deduplicate(features, ["f0", "f2"])
        data.append(Batch(b.dense_features, features, b.labels))
    expected = train_reference(twin, data)
    got, pipeline = train_lookahead(model, data, lookahead=4, prefetch_distance=1)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    groups = ebc.cached_groups
    assert [g.names for g in groups] == [["t0", "t2"], ["t1"]]
    assert [g.cache.tbe.split_embedding_weights()[0].dtype for g in groups] == [
        torch.float32,
        torch.float16,
    ]
    assert pipeline.cache_metrics()["total"].rows_written_back > 0
    state, reference = ebc.state_dict(), twin.ebc.tables()
    for t, states in zip(tables, ebc.optimizer_states()):
        weights, expected_states = reference[t.name]
        assert torch.equal(state[f"embedding_bags.{t.name}.weight"], weights), t.name
        assert len(states) == len(expected_states)
        assert all(torch.equal(a, b) for a, b in zip(states, expected_states)), t.name
    assert torch.equal(model.over.weight, twin.over.weight)


UNTRAINED = [
    DataType.BF16,
    DataType.INT8,
    DataType.UINT8,
    DataType.INT4,
    DataType.INT2,
    DataType.NFP8,
]


@pytest.mark.parametrize("data_type", UNTRAINED, ids=lambda d: d.value)
def test_a_type_fbgemm_cannot_train_is_refused_when_the_collection_is_built(
    data_type: DataType, tmp_path
) -> None:
    """Named with its table, before anything is made (a disk store makes no file)."""
    tables = [
        dataclasses.replace(UNWEIGHTED[0]),
        dataclasses.replace(UNWEIGHTED[1], data_type=data_type),
    ]
    with pytest.raises(ValueError, match=f"table t1: data type {data_type.value} is not trained"):
        LookaheadEmbeddingBagCollection(tables, store_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_width_fbgemm_does_not_take_is_refused_when_the_collection_is_built(tmp_path) -> None:
    """FBGEMM's TBE takes multiples of 4 columns: a table of 3 failed its assertion when the
    pipeline built the caches, naming no table."""
    tables = [
        dataclasses.replace(UNWEIGHTED[0]),
        dataclasses.replace(UNWEIGHTED[1], embedding_dim=6),
    ]
    with pytest.raises(ValueError, match="table t1: embedding_dim 6 is not a multiple of 4"):
        LookaheadEmbeddingBagCollection(tables, store_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_type_fbgemm_cannot_train_is_refused_by_the_sharder_before_sharding() -> None:
    """A module whose table was given another type after it was built (as a quantizing
    flow does) is refused by the sharder, which builds nothing."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.types import ShardingEnv

    from torchrec_lookahead import LookaheadEmbeddingBagCollectionSharder

    tables = [dataclasses.replace(t) for t in UNWEIGHTED]  # changed below
    module = LookaheadEmbeddingBagCollection(tables, device=torch.device("meta"))
    sharder = LookaheadEmbeddingBagCollectionSharder()
    plan = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu")).plan(
        module, [sharder]
    )
    module.embedding_bag_configs()[2].data_type = DataType.INT8
    with pytest.raises(ValueError, match="table t2: data type INT8 is not trained"):
        sharder.shard(module, plan.plan[""], ShardingEnv(world_size=1, rank=0, pg=None))


def test_fp16_tables_in_a_disk_store_or_with_hot_rows_are_refused(tmp_path) -> None:
    """The disk store's files and the hot rows' replicas hold FP32 rows."""
    from torchrec_lookahead import HotRowsEmbeddingBagCollection

    tables = [dataclasses.replace(t, data_type=FP16) for t in UNWEIGHTED]
    with pytest.raises(ValueError, match="table t0: a disk store holds FP32 tables"):
        LookaheadEmbeddingBagCollection(tables, store_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    one_width = [dataclasses.replace(t, embedding_dim=8) for t in tables[1:]]
    with pytest.raises(ValueError, match="hot_rows cannot be replicated with FP16 tables"):
        HotRowsEmbeddingBagCollection(one_width, hot_rows={"t1": [0, 1]})


def test_cache_metrics_read_mid_run_count_the_planned_steps_alone() -> None:
    """The progress bars' hit rate read mid-run was inflated: the distinct ids of every
    batch in the window were counted, the misses of the steps planned only."""
    from torchrec_lookahead import LookaheadTrainPipeline

    model = lookahead_model("sgd", DataType.FP32, cache_load_factor=0.05)
    data = batches(30)
    pipeline = LookaheadTrainPipeline(
        model,
        torch.optim.SGD(model.over.parameters(), lr=0.1),
        torch.device("cpu"),
        lookahead=8,
        prefetch_distance=1,
        stage_thread=False,  # no planning between the steps and the reads below
    )
    it = iter(data)
    for _ in range(5):
        pipeline.progress(it)
    total = pipeline.cache_metrics()["total"]
    groups = [g for m in (model.unweighted, model.weighted) for g in m.cached_groups]
    entered = max(step for g in groups for step in g.step_counts) + 1
    assert total.steps < entered  # batches in the window, not planned yet
    planned = [
        (u.sum(), m.sum()) for g in groups for s, (u, m) in g.step_counts.items() if s < total.steps
    ]
    assert total.unique_ids == sum(u for u, _ in planned)
    assert total.misses == sum(m for _, m in planned)
    assert total.lookups == sum(len(b.sparse_features.values()) for b in data[: total.steps])
    pipeline.close()
