"""LookaheadEmbeddingBagCollection and LookaheadTrainPipeline: checkpoints, errors, metrics."""

from __future__ import annotations

import logging

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.models import (
    DATA_KEYS_UNKNOWN_TO_MODEL,
    UNWEIGHTED,
    assert_same_training_state,
    batches,
    lookahead_model,
    reference_twin,
    train_dropping_refused,
    train_lookahead,
    train_reference,
)
from torchrec_lookahead import LookaheadEmbeddingBagCollection, LookaheadTrainPipeline
from torchrec_lookahead.settings import PLANNERS, WindowSettings

DATA = batches(40)


def with_values(batch: Batch, values: torch.Tensor, keys: list[str] | None = None) -> Batch:
    kjt = batch.sparse_features
    return Batch(
        dense_features=batch.dense_features,
        sparse_features=KeyedJaggedTensor.from_lengths_sync(
            keys=keys or kjt.keys(), values=values, lengths=kjt.lengths(), weights=kjt.weights()
        ),
        labels=batch.labels,
    )


def test_state_dict_has_the_keys_and_shapes_of_embedding_bag_collection() -> None:
    plain = EmbeddingBagCollection(UNWEIGHTED)
    cached = LookaheadEmbeddingBagCollection(UNWEIGHTED, cache_load_factor=0.05)
    assert {k: v.shape for k, v in plain.state_dict().items()} == {
        k: v.shape for k, v in cached.state_dict().items()
    }


def test_load_state_dict_from_plain_torchrec_then_training_matches() -> None:
    plain = EmbeddingBagCollection(UNWEIGHTED)
    model = lookahead_model("rowwise_adagrad", cache_load_factor=0.1)
    train_lookahead(model, DATA[:10], 4, 1)  # rows are cached and trained, then overwritten
    model.unweighted.load_state_dict(plain.state_dict())
    loaded = model.unweighted.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in plain.state_dict().items())
    with torch.no_grad():
        model.eval()
        got = model.unweighted(DATA[0].sparse_features).values()
        want = plain(DATA[0].sparse_features).values()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda v: torch.where(torch.arange(len(v)) == 3, -7, v), "negative id -7"),
        (lambda v: torch.where(torch.arange(len(v)) == 0, 123_456, v), "id 123456 is out of range"),
    ],
)
def test_bad_ids_are_refused_and_training_goes_on(corrupt, message) -> None:
    model = lookahead_model("adagrad", cache_load_factor=0.1)
    twin = reference_twin(model, "adagrad")
    bad = with_values(DATA[5], corrupt(DATA[5].sparse_features.values()))
    outputs, errors = train_dropping_refused(model, DATA[:5] + [bad] + DATA[5:])
    assert len(errors) == 1 and message in errors[0]
    expected = train_reference(twin, DATA)
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected)) and len(outputs) == 40
    assert_same_training_state(model, twin)


def test_unknown_feature_key_is_refused() -> None:
    model = lookahead_model("sgd", cache_load_factor=0.1)
    odd = with_values(DATA[0], DATA[0].sparse_features.values(), DATA_KEYS_UNKNOWN_TO_MODEL)
    pipeline = LookaheadTrainPipeline(
        model, torch.optim.SGD(model.over.parameters(), lr=0.1), torch.device("cpu"), lookahead=2
    )
    with pytest.raises(ValueError, match=r"features \['zz'\] that no embedding module knows"):
        pipeline.progress(iter([odd]))


@pytest.mark.parametrize("planner", PLANNERS)
@pytest.mark.parametrize("kept", [1, -7], ids=["one_value", "seven_short"])
def test_a_batch_whose_lengths_miss_its_values_is_refused_by_the_module_itself(
    planner: str, kept: int
) -> None:
    """Called without the pipeline (whose batch check refuses it first), the module's
    own planning refuses it before its compiled pass reads past the values (the host
    planner), or before it spreads too few values over the features (the device
    planner's, which raised a shape error, or with one value left planned it for every
    id)."""
    module = lookahead_model("sgd", cache_load_factor=0.1).unweighted
    module.open_window(WindowSettings(lookahead=2, prefetch_distance=1, planner=planner))
    kjt = module.select(DATA[0].sparse_features)
    short = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values()[:kept], lengths=kjt.lengths())
    with pytest.raises(ValueError, match=r"step 0: the lengths add up to \d+ ids but the batch"):
        module.prepare(short, 0)


def test_a_share_smaller_than_the_window_is_raised_once_and_training_stays_exact(caplog) -> None:
    model = lookahead_model("adagrad", cache_rows={"t1": 8, "w0": 5})
    twin = reference_twin(model, "adagrad")
    with caplog.at_level(logging.INFO, logger="torchrec_lookahead"):
        outputs, _ = train_lookahead(model, DATA, 4, 1)
    raised = [r.getMessage() for r in caplog.records if "cache raised" in r.getMessage()]
    assert any(m.startswith("table t1: cache raised from 8 to ") for m in raised)
    assert any(m.startswith("table w0: cache raised from 5 to ") for m in raised)
    assert len(raised) == len(set(raised))  # once per table
    assert all(torch.equal(a, b) for a, b in zip(outputs, train_reference(twin, DATA)))
    assert_same_training_state(model, twin)


def test_training_forward_outside_the_pipeline_is_refused() -> None:
    model = lookahead_model("sgd", cache_load_factor=0.1)
    with pytest.raises(RuntimeError, match="LookaheadTrainPipeline"):
        model(DATA[0])


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="cache_load_factor"):
        LookaheadEmbeddingBagCollection(UNWEIGHTED, cache_load_factor=0)
    with pytest.raises(ValueError, match="unknown tables"):
        LookaheadEmbeddingBagCollection(UNWEIGHTED, cache_rows={"nope": 3})
    model = lookahead_model("sgd")
    with pytest.raises(ValueError, match="lookahead must be at least 1"):
        LookaheadTrainPipeline(
            model, torch.optim.SGD(model.parameters(), lr=0.1), torch.device("cpu"), lookahead=0
        )
    bare = LookaheadEmbeddingBagCollection(UNWEIGHTED)
    with pytest.raises(ValueError, match="no fused optimizer"):
        LookaheadTrainPipeline(bare, torch.optim.SGD([torch.zeros(1)], lr=0.1), torch.device("cpu"))


def test_an_optimizer_fbgemm_cannot_run_on_the_cpu_is_refused_naming_the_tables() -> None:
    """FBGEMM's CPU TBE failed an assertion naming no table or remedy."""
    module = LookaheadEmbeddingBagCollection(UNWEIGHTED, cache_load_factor=0.1)
    apply_optimizer_in_backward(torch.optim.Adam, module.parameters(), {"lr": 0.1})
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match=r"tables \['t0', 't1', 't2'\]: .* optimizer ADAM"):
        LookaheadTrainPipeline(module, torch.optim.SGD([torch.zeros(1)], lr=0.1), "cpu")
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())


def test_metrics_count_lookups_hits_and_moves() -> None:
    model = lookahead_model("rowwise_adagrad", cache_load_factor=0.1)
    _, pipeline = train_lookahead(model, DATA, 8, 1)
    metrics = pipeline.cache_metrics()
    assert set(metrics) == {
        "unweighted.t0",
        "unweighted.t1",
        "unweighted.t2",
        "weighted.w0",
        "weighted.w1",
        "total",
    }
    total = metrics["total"]
    assert total.lookups == sum(int(b.sparse_features.values().numel()) for b in DATA)
    assert total.hits + total.misses == total.unique_ids
    assert total.steps == 40 and 0 < total.hit_rate < 1
    row_bytes = 4 * (8 + 1)  # t0: dim 8 weights + one row-wise Adagrad state
    t0 = metrics["unweighted.t0"]
    assert t0.bytes_moved == (t0.rows_fetched + t0.rows_written_back) * row_bytes


def test_each_step_reaches_the_modules_through_their_forward_and_eval_through_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As TorchRec's pipelines do, the pipeline stands in for each lookahead module's forward:
    a step's forward is ``step_forward`` with that step's context; a forward between steps
    (eval) is the module's own; closing the pipeline gives the modules their forward back."""
    from torchrec_lookahead.pipeline.forward import StepForward

    model = lookahead_model("sgd", cache_load_factor=0.1)
    cls = type(model.unweighted)
    steps: list[int] = []
    step_forward = cls.step_forward

    def spy(self, context, *args, **kwargs):
        steps.append(context.step)
        return step_forward(self, context, *args, **kwargs)

    monkeypatch.setattr(cls, "step_forward", spy)
    dense = torch.optim.SGD(model.over.parameters(), lr=0.1)
    with LookaheadTrainPipeline(model, dense, torch.device("cpu"), lookahead=2) as pipeline:
        assert isinstance(vars(model.unweighted)["forward"], StepForward)
        it = iter(DATA)
        for _ in range(3):
            pipeline.progress(it)
        assert steps == [0, 0, 1, 1, 2, 2]  # both collections of the model, each step
        model.eval()
        with torch.no_grad():
            model(DATA[0])  # the full tables, not the cache
        assert steps == [0, 0, 1, 1, 2, 2]
    assert "forward" not in vars(model.unweighted) and "forward" not in vars(model.weighted)


def test_a_partial_load_mid_run_keeps_the_cached_rows_newest_values() -> None:
    """``load_state_dict(part, strict=False)`` (the dense layers only) reloads every cached
    row from the store, which held their values of the last write-back: the rows went
    back in time. The store is written back before a load now."""
    data = batches(10, batch_size=32)
    model = lookahead_model("rowwise_adagrad", cache_load_factor=0.05)
    twin = reference_twin(model, "rowwise_adagrad")
    twin_dense = torch.optim.SGD(twin.over.parameters(), lr=0.1)
    pipeline = LookaheadTrainPipeline(
        model, torch.optim.SGD(model.over.parameters(), lr=0.1), torch.device("cpu"), lookahead=4
    )
    it = iter(data)
    with pipeline:
        for step, batch in enumerate(data):
            if step == 3:
                dense = {"over." + k: v.clone() for k, v in model.over.state_dict().items()}
                model.load_state_dict(dense, strict=False)
                twin.load_state_dict(dense, strict=False)
            twin_dense.zero_grad()
            loss, expected = twin(batch)
            loss.backward()
            twin_dense.step()
            assert torch.equal(pipeline.progress(it), expected), step
    assert_same_training_state(model, twin)
