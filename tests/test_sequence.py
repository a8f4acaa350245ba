"""LookaheadEmbeddingCollection: sequence features (unpooled lookups) through the cache, bitwise
as FBGEMM's all-resident TBE with pooling NONE and as plain TorchRec's EmbeddingCollection
(under DMP, world size 1, fused kernel, TrainPipelineSparseDist); what it refuses."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from tests.models import (
    DENSE,
    DENSE_LR,
    LR,
    OPTIMIZERS,
    WEIGHTED,
    batches,
    session_batches,
    train_dropping_refused,
    train_lookahead,
    train_reference,
)
from torchrec_lookahead import (
    HotRowsEmbeddingBagCollection,
    LookaheadEmbeddingBagCollection,
    LookaheadEmbeddingCollection,
)
from torchrec_lookahead.data.dedup import deduplicate
from torchrec_lookahead.testing.resident import (
    FullyResidentEmbeddingBagCollection,
    FullyResidentEmbeddingCollection,
)

# One width for every table (as EmbeddingCollection requires); s0 serves two features.
SEQUENCE = [
    EmbeddingConfig(name="s0", embedding_dim=8, num_embeddings=4000, feature_names=["f0", "f1"]),
    EmbeddingConfig(name="s1", embedding_dim=8, num_embeddings=1500, feature_names=["f2"]),
    EmbeddingConfig(name="s2", embedding_dim=8, num_embeddings=10000, feature_names=["f3"]),
]
SEQUENCE_KEYS = ["f0", "f1", "f2", "f3"]
MIXED_DATA = batches(40)  # the sequence features, then the weighted bags' g0, g1


def sequence_only(data: list[Batch]) -> list[Batch]:
    """The batches with the sequence features alone (a model refuses features it lacks)."""
    keep = list(range(len(SEQUENCE_KEYS)))
    return [Batch(b.dense_features, b.sparse_features.permute(keep), b.labels) for b in data]


DATA = sequence_only(MIXED_DATA)


def summarise(jagged: JaggedTensor, labels: torch.Tensor) -> torch.Tensor:
    """Each sample's sequence as one vector, its rows weighted by their position (so the
    rows' order matters, as it does to a sequence model). A leaf of TorchRec's pipeline's
    trace of the model (``torch.fx.wrap``)."""
    batch_size = len(labels)
    lengths = jagged.lengths()
    sample = torch.repeat_interleave(torch.arange(batch_size), lengths)
    first = torch.repeat_interleave(jagged.offsets()[:-1], lengths)
    position = torch.arange(len(sample)) - first
    rows = jagged.values() / (1.0 + position.unsqueeze(1))
    return torch.zeros(batch_size, rows.shape[1]).index_add_(0, sample, rows)


torch.fx.wrap("summarise")


class SequenceModel(nn.Module):
    """The sequences summarised per sample, a pooled collection's output (if any) and the
    dense features into a logistic layer."""

    def __init__(self, sequence: nn.Module, pooled: nn.Module | None = None) -> None:
        super().__init__()
        self.sequence = sequence
        self.pooled = pooled
        width = 8 * len(SEQUENCE_KEYS) + DENSE
        if pooled is not None:
            width += sum(len(t.feature_names) * t.embedding_dim for t in WEIGHTED)
        torch.manual_seed(0)
        self.over = nn.Linear(width, 1)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        looked_up = self.sequence(batch.sparse_features)
        parts = [summarise(looked_up[key], batch.labels) for key in SEQUENCE_KEYS]
        if self.pooled is not None:
            parts.append(self.pooled(batch.sparse_features).values())
        logits = self.over(torch.cat([*parts, batch.dense_features], dim=1)).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels.float())
        return loss, logits.detach()


def sequence_tables(data_type: DataType = DataType.FP32) -> list[EmbeddingConfig]:
    return [dataclasses.replace(t, data_type=data_type) for t in SEQUENCE]


def lookahead_model(
    optimizer: str, data_type: DataType = DataType.FP32, pooled: bool = False, **cache: object
) -> SequenceModel:
    torch.manual_seed(1)
    sequence = LookaheadEmbeddingCollection(sequence_tables(data_type), **cache)
    bags = None
    if pooled:
        bags = LookaheadEmbeddingBagCollection(WEIGHTED, is_weighted=True, cache_load_factor=0.05)
    model = SequenceModel(sequence, bags)
    for module in filter(None, (sequence, bags)):
        apply_optimizer_in_backward(OPTIMIZERS[optimizer][0], module.parameters(), {"lr": LR})
    return model


def resident_twin(model: SequenceModel, optimizer: str) -> SequenceModel:
    """The same model (same weights) with every table in FBGEMM's all-resident TBEs."""
    fused = {"optimizer": OPTIMIZERS[optimizer][1], "learning_rate": LR}
    pooled = model.pooled
    twin = SequenceModel(
        FullyResidentEmbeddingCollection(model.sequence, fused),
        None if pooled is None else FullyResidentEmbeddingBagCollection(pooled, fused),
    )
    twin.over.load_state_dict(copy.deepcopy(model.over.state_dict()))
    return twin


def assert_same_state(model: SequenceModel, twin: SequenceModel) -> None:
    """Every table, optimizer-state tensor and dense parameter bitwise equal."""
    parts = [(model.sequence, twin.sequence, "embeddings")]
    if model.pooled is not None:
        parts.append((model.pooled, twin.pooled, "embedding_bags"))
    for cached, resident, prefix in parts:
        state = cached.state_dict()
        configs = (
            resident.embedding_configs()
            if prefix == "embeddings"
            else resident.embedding_bag_configs()
        )
        for config, weight in zip(configs, resident.tbe.split_embedding_weights(), strict=True):
            assert torch.equal(state[f"{prefix}.{config.name}.weight"], weight), config.name
        expected = resident.tbe.split_optimizer_states()
        got = cached.optimizer_states()
        assert len(got) == len(configs)
        for config, have, want in zip(configs, got, expected or [[]] * len(configs)):
            assert len(have) == len(want), config.name
            assert all(torch.equal(a, b) for a, b in zip(have, want)), config.name
    for name, param in twin.over.named_parameters():
        assert torch.equal(dict(model.over.named_parameters())[name], param), name


def assert_evicted_and_fetched(pipeline) -> None:
    total = pipeline.cache_metrics()["total"]
    assert total.misses > 0 and total.rows_written_back > 0, total


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_sequence_tables_train_like_fbgemms_resident_tbe(optimizer: str) -> None:
    """Every step's output, the tables, the optimizer state and the dense layer bitwise
    those of FBGEMM's TBE with pooling NONE over the whole tables; a cache small enough
    that rows are evicted and fetched."""
    model = lookahead_model(optimizer, cache_load_factor=0.05)
    twin = resident_twin(model, optimizer)
    expected = train_reference(twin, DATA)
    got, pipeline = train_lookahead(model, DATA, lookahead=4, prefetch_distance=1)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert_same_state(model, twin)
    assert_evicted_and_fetched(pipeline)
    metrics = pipeline.cache_metrics()
    assert set(metrics) == {"sequence.s0", "sequence.s1", "sequence.s2", "total"}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_model_mixing_sequence_and_bag_collections_trains_exactly(optimizer: str) -> None:
    """A lookahead sequence collection beside a lookahead bag collection (weighted) in one
    model, one pipeline: both bitwise as their all-resident TBEs."""
    model = lookahead_model(optimizer, pooled=True, cache_load_factor=0.05)
    twin = resident_twin(model, optimizer)
    expected = train_reference(twin, MIXED_DATA)
    got, pipeline = train_lookahead(model, MIXED_DATA, lookahead=3, prefetch_distance=1)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert_same_state(model, twin)
    metrics = pipeline.cache_metrics()
    assert {"sequence.s0", "pooled.w0", "pooled.w1"} < set(metrics)
    assert_evicted_and_fetched(pipeline)
    assert metrics["pooled.w0"].misses > 0 and metrics["sequence.s2"].rows_written_back > 0


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_fp16_sequence_tables_train_like_fbgemms_fp16_tbe(optimizer: str) -> None:
    """FP16 tables: FP32 rows out (as EmbeddingCollection's), half-precision rows in the
    cache and the store, FP32 optimizer state; bitwise the all-resident FP16 TBE."""
    model = lookahead_model(optimizer, DataType.FP16, cache_load_factor=0.05)
    twin = resident_twin(model, optimizer)
    expected = train_reference(twin, DATA[:25])
    got, pipeline = train_lookahead(model, DATA[:25], lookahead=4, prefetch_distance=1)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert_same_state(model, twin)
    assert_evicted_and_fetched(pipeline)
    (group,) = model.sequence.cached_groups
    assert {w.dtype for w in group.cache.tbe.split_embedding_weights()} == {torch.float16}
    assert {w.dtype for w in group.cache.store.weights} == {torch.float16}


def test_state_dict_is_embedding_collections_and_a_plain_checkpoint_loads() -> None:
    """The keys, shapes and values of EmbeddingCollection's state (cache folded in); a plain
    EmbeddingCollection's checkpoint loaded over trained rows, then looked up in eval
    mode, gives what that EmbeddingCollection gives (indices too)."""
    torch.manual_seed(5)
    plain = EmbeddingCollection(SEQUENCE, need_indices=True)
    torch.manual_seed(5)
    cached = LookaheadEmbeddingCollection(SEQUENCE, need_indices=True, cache_load_factor=0.05)
    assert {k: v.shape for k, v in plain.state_dict().items()} == {
        k: v.shape for k, v in cached.state_dict().items()
    }
    assert all(torch.equal(v, cached.state_dict()[k]) for k, v in plain.state_dict().items())
    model = lookahead_model("rowwise_adagrad", cache_load_factor=0.05)
    train_lookahead(model, DATA[:10], lookahead=4, prefetch_distance=1)
    trained = model.sequence.state_dict()
    assert not torch.equal(
        trained["embeddings.s0.weight"], plain.state_dict()["embeddings.s0.weight"]
    )
    model.sequence.load_state_dict(plain.state_dict())
    loaded = model.sequence.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in plain.state_dict().items())
    model.eval()
    features = DATA[0].sparse_features
    with torch.no_grad():
        got = cached(features)
        want = plain(features)
    assert list(got) == list(want) == SEQUENCE_KEYS
    for key in SEQUENCE_KEYS:
        assert torch.equal(got[key].values(), want[key].values()), key
        assert torch.equal(got[key].lengths(), want[key].lengths()), key
        assert torch.equal(got[key].weights(), want[key].weights()), key


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "fp32-and-fp16"])
def test_the_training_output_is_what_embedding_collection_returns(mixed: bool) -> None:
    """A training step's output: per feature a JaggedTensor with EmbeddingCollection's
    rows, lengths and (need_indices) ids, for a feature shared by two tables too; with
    an FP16 table among FP32 ones (two cache groups, looked up type by type) in the
    table order all the same."""
    tables = [
        *SEQUENCE,
        EmbeddingConfig(name="s3", embedding_dim=8, num_embeddings=4000, feature_names=["f0"]),
    ]
    if mixed:
        tables[1] = dataclasses.replace(tables[1], data_type=DataType.FP16)
    torch.manual_seed(2)
    plain = EmbeddingCollection(tables, need_indices=True)
    torch.manual_seed(2)
    cached = LookaheadEmbeddingCollection(tables, need_indices=True, cache_load_factor=0.05)
    apply_optimizer_in_backward(OPTIMIZERS["sgd"][0], cached.parameters(), {"lr": 0.0})
    outputs = []

    class Keep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sequence = cached
            self.over = nn.Linear(1, 1)

        def forward(self, batch: Batch):
            looked_up = self.sequence(batch.sparse_features)
            outputs.append(looked_up)
            loss = sum(jagged.values().sum() for jagged in looked_up.values())
            return loss, torch.zeros(1)

    train_lookahead(Keep(), DATA[:6], lookahead=2, prefetch_distance=1)
    assert len(outputs) == 6 and len(cached.cached_groups) == (2 if mixed else 1)
    for batch, got in zip(DATA, outputs):
        with torch.no_grad():
            want = plain(batch.sparse_features)
        assert list(got) == list(want) == ["f0@s0", "f1", "f2", "f3", "f0@s3"]
        for key, jagged in want.items():
            assert torch.equal(got[key].values(), jagged.values()), key
            assert torch.equal(got[key].lengths(), jagged.lengths()), key
            assert torch.equal(got[key].weights(), jagged.weights()), key


def test_a_disk_store_holds_what_embedding_collection_initialises_and_trains_exactly(
    tmp_path: Path,
) -> None:
    torch.manual_seed(3)
    plain = EmbeddingCollection(SEQUENCE)
    after = torch.rand(4)
    model = lookahead_model("adagrad", cache_load_factor=0.05, store_dir=tmp_path)
    (tmp_path / "other").mkdir()
    torch.manual_seed(3)
    on_disk = LookaheadEmbeddingCollection(SEQUENCE, store_dir=tmp_path / "other")
    assert torch.equal(torch.rand(4), after), "the generator must end where it would"
    assert all(torch.equal(v, on_disk.state_dict()[k]) for k, v in plain.state_dict().items())
    twin = resident_twin(model, "adagrad")
    expected = train_reference(twin, DATA[:20])
    got, pipeline = train_lookahead(model, DATA[:20], lookahead=4, prefetch_distance=1)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert_same_state(model, twin)
    assert_evicted_and_fetched(pipeline)


def test_deduplicated_batches_are_refused_and_training_goes_on() -> None:
    """A deduplicated (variable-stride) batch is refused with a ValueError naming the step
    before it changes anything; the plain batches around it train exactly."""
    model = lookahead_model("adagrad", cache_load_factor=0.05)
    twin = resident_twin(model, "adagrad")
    (session,) = sequence_only(session_batches(1, session=4, dedup=False, seed=7))
    features = deduplicate(session.sparse_features, ["f0", "f2"])
    deduplicated = Batch(session.dense_features, features, session.labels)
    stream = [*DATA[:5], deduplicated, *DATA[5:15]]
    outputs, errors = train_dropping_refused(model, stream)
    assert len(errors) == 1 and "step 5: a deduplicated (variable-stride) batch" in errors[0]
    expected = train_reference(twin, DATA[:15])
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))
    assert_same_state(model, twin)


def test_bad_ids_are_refused_with_the_sequence_tables_rows() -> None:
    """The pipeline finds the sequence collection's features and rows: an id past its
    table is refused (ValueError) before the batch moves."""
    model = lookahead_model("sgd", cache_load_factor=0.05)
    features = DATA[1].sparse_features
    values = torch.where(torch.arange(features.values().numel()) == 0, 4000, features.values())
    bad = Batch(
        DATA[1].dense_features,
        KeyedJaggedTensor.from_lengths_sync(features.keys(), values, features.lengths()),
        DATA[1].labels,
    )
    _, errors = train_dropping_refused(model, [DATA[0], bad, DATA[2]])
    assert len(errors) == 1 and "id 4000 is out of range" in errors[0], errors


def test_hot_rows_and_the_wrong_kind_of_table_are_refused() -> None:
    """Hot rows are replicated for pooled tables only: a sequence table given to the hot
    rows' collection (or to the bag collection) is refused when the module is built, and
    a bag table given to the sequence collection too."""
    with pytest.raises(ValueError, match="table s0: HotRowsEmbeddingBagCollection takes"):
        HotRowsEmbeddingBagCollection(SEQUENCE, hot_rows={"s0": [1, 2]})
    with pytest.raises(ValueError, match="cache it in a LookaheadEmbeddingCollection"):
        LookaheadEmbeddingBagCollection(SEQUENCE)
    bags = [EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=10, feature_names=["f"])]
    with pytest.raises(ValueError, match="cache it in a LookaheadEmbeddingBagCollection"):
        LookaheadEmbeddingCollection(bags)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="cache_load_factor"):
        LookaheadEmbeddingCollection(SEQUENCE, cache_load_factor=0)
    with pytest.raises(ValueError, match="unknown tables"):
        LookaheadEmbeddingCollection(SEQUENCE, max_cache_rows={"nope": 3})
    with pytest.raises(ValueError, match="same embedding dimension"):
        LookaheadEmbeddingCollection(
            [SEQUENCE[0], dataclasses.replace(SEQUENCE[1], embedding_dim=4)]
        )
    model = lookahead_model("sgd")
    with pytest.raises(RuntimeError, match="LookaheadTrainPipeline"):
        model(DATA[0])


# ------------------------------------------------- against plain TorchRec under DMP


def _against_torchrec(rank: int, port: int, optimizer: str, out: str) -> None:
    """Plain TorchRec's EmbeddingCollection under DMP (world size 1, gloo, table-wise, fused
    kernel) trained by TrainPipelineSparseDist, and the lookahead model from the same
    weights trained by LookaheadTrainPipeline; every step's output and the final state
    of both saved to ``out``."""
    import os

    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    try:
        plain = SequenceModel(EmbeddingCollection(SEQUENCE, device=torch.device("meta")))
        apply_optimizer_in_backward(
            OPTIMIZERS[optimizer][0], plain.sequence.parameters(), {"lr": LR}
        )
        constraints = {
            t.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
            for t in SEQUENCE
        }
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints
        )
        plan = planner.collective_plan(plain, None, dist.GroupMember.WORLD)
        dmp = DistributedModelParallel(plain, device=torch.device("cpu"), plan=plan)
        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(dmp.named_parameters())),
            lambda params: torch.optim.SGD(params, lr=DENSE_LR),
        )
        start = {k: local_tensor(v).clone() for k, v in dmp.state_dict().items()}
        model = lookahead_model(optimizer, cache_load_factor=0.05)
        model.load_state_dict({k.removeprefix("module."): v for k, v in start.items()})
        pipeline = TrainPipelineSparseDist(
            dmp, CombinedOptimizer([dmp.fused_optimizer, dense]), torch.device("cpu")
        )
        expected, it = [], iter(DATA)
        while True:
            try:
                expected.append(pipeline.progress(it))
            except StopIteration:
                break
        got, cached = train_lookahead(model, DATA, lookahead=4, prefetch_distance=1)
        fused = dmp.fused_optimizer.state_dict()["state"]
        torch.save(
            {
                "expected": expected,
                "got": got,
                "plain": {k: local_tensor(v) for k, v in dmp.state_dict().items()},
                "cached": model.state_dict(),
                "plain_states": {
                    t.name: [
                        local_tensor(v)
                        for v in fused.get(f"sequence.embeddings.{t.name}.weight", {}).values()
                    ]
                    for t in SEQUENCE
                },
                "cached_states": model.sequence.optimizer_states(),
                "metrics": cached.cache_metrics()["total"],
            },
            out,
        )
    finally:
        dist.destroy_process_group()


def local_tensor(value) -> torch.Tensor:
    """A tensor of a state dict at world size 1: a sharded table's only shard, or itself."""
    if hasattr(value, "local_shards"):
        (shard,) = value.local_shards()
        return shard.tensor
    return value


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_trains_bitwise_as_torchrecs_embedding_collection_under_dmp(
    optimizer: str, tmp_path: Path
) -> None:
    from tests.launch import free_port, spawn

    out = tmp_path / "results.pt"
    spawn(_against_torchrec, (free_port(), optimizer, str(out)))
    results = torch.load(out, weights_only=False)
    assert len(results["got"]) == len(DATA)
    assert all(torch.equal(a, b) for a, b in zip(results["got"], results["expected"], strict=True))
    plain = {k.removeprefix("module."): v for k, v in results["plain"].items()}
    assert sorted(plain) == sorted(results["cached"])
    for key, value in plain.items():
        assert torch.equal(results["cached"][key], value), key
    for config, got in zip(SEQUENCE, results["cached_states"], strict=True):
        want = results["plain_states"][config.name]
        assert len(got) == len(want), config.name
        assert all(torch.equal(a.flatten(), b.flatten()) for a, b in zip(got, want)), config.name
    metrics = results["metrics"]
    assert metrics.misses > 0 and metrics.rows_written_back > 0


def _refused_under_dmp(rank: int, port: int, out: str) -> None:
    """The sequence collection inside DistributedModelParallel without its sharder (DMP
    keeps it as a dense module): the pipeline's refusal, saved to ``out``."""
    import os

    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from torchrec_lookahead import LookaheadTrainPipeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    try:
        model = lookahead_model("sgd")
        dmp = DistributedModelParallel(model, device=torch.device("cpu"))
        try:
            LookaheadTrainPipeline(dmp, torch.optim.SGD(dmp.parameters(), lr=0.1), dmp.device)
            said = "no error"
        except ValueError as error:
            said = str(error)
        Path(out).write_text(said)
    finally:
        dist.destroy_process_group()


def test_under_dmp_without_its_sharder_the_sequence_collection_is_refused(tmp_path: Path) -> None:
    """DMP given no lookahead sharder leaves it unsharded: the pipeline refuses it when it
    is built, and names the sharder to pass."""
    from tests.launch import free_port, spawn

    out = tmp_path / "said.txt"
    spawn(_refused_under_dmp, (free_port(), str(out)))
    said = out.read_text()
    assert said.startswith(
        "module 'sequence': this LookaheadEmbeddingCollection was not sharded"
    ), said
    assert "sharders=[LookaheadEmbeddingCollectionSharder()]" in said
