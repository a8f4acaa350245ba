"""The host check made by a ``DataLoader``'s worker processes (``BatchCheck.collate``): the
same refusals and the same training as the stage's own check, and no check left in the
training process; a loader that checked for another model stops the stage."""

from __future__ import annotations

import gc
from collections.abc import Iterable

import pytest
import torch
from torch.utils.data import DataLoader
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torchrec_lookahead.pipeline.batch_check as batch_check
from tests.malformed import malformed
from tests.models import (
    assert_same_training_state,
    batches,
    lookahead_model,
    reference_twin,
    train_dropping_refused,
    train_reference,
)
from torchrec_lookahead import BatchCheck, LookaheadTrainPipeline

DATA = batches(10)


def out_of_range(batch: Batch) -> Batch:
    """``batch`` with its first id out of range for every table."""
    features = batch.sparse_features
    values = features.values().clone()
    values[0] = 10**9
    return Batch(
        batch.dense_features,
        KeyedJaggedTensor.from_lengths_sync(
            keys=features.keys(),
            values=values,
            lengths=features.lengths(),
            weights=features.weights_or_none(),
        ),
        batch.labels,
    )


# Good batches with a malformed one and one with an id out of range among them.
STREAM = DATA[:3] + [malformed("short_values", DATA[3])] + DATA[3:6] + [out_of_range(DATA[6])]
STREAM += DATA[6:]


def loader(stream: list[Batch], check: BatchCheck, workers: int) -> Iterable[Batch]:
    """``stream``, read by ``workers`` forked worker processes (0: by the reading thread),
    each batch checked by ``check`` where it is collated."""
    gc.collect()  # nothing of an earlier test's for a forked worker to finalize
    return DataLoader(
        stream,
        batch_size=None,
        num_workers=workers,
        collate_fn=check.collate(),
        multiprocessing_context="fork" if workers else None,
    )


@pytest.fixture
def checks_here(monkeypatch) -> list[int]:
    """Counts the host checks made in this process (a forked worker counts in its own)."""
    made: list[int] = []
    check_batch = batch_check.check_batch

    def counted(*args, **kwargs):
        made.append(1)
        return check_batch(*args, **kwargs)

    monkeypatch.setattr(batch_check, "check_batch", counted)
    return made


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loader_s_check_refuses_and_trains_as_the_stage_s_own(checks_here, workers) -> None:
    """Each refusal names its step as the stage's own check names it; training is bitwise
    plain TorchRec's on the good batches. With worker processes no batch is checked in
    the training process; without, the loader's check is the only one (made once)."""
    expected_model = lookahead_model("rowwise_adagrad", cache_load_factor=0.05)
    _, expected_errors = train_dropping_refused(expected_model, STREAM)
    assert len(checks_here) == len(STREAM)  # the stage's own check, once a batch
    checks_here.clear()

    model = lookahead_model("rowwise_adagrad", cache_load_factor=0.05)
    twin = reference_twin(model, "rowwise_adagrad")
    outputs, errors = train_dropping_refused(model, loader(STREAM, BatchCheck.of(model), workers))
    assert errors == expected_errors and len(errors) == 2, errors
    assert "lengths add up to" in errors[0] and "out of range" in errors[1], errors
    expected = train_reference(twin, DATA)
    assert len(outputs) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected))
    assert_same_training_state(model, twin)
    assert len(checks_here) == (0 if workers else len(STREAM))


@pytest.mark.parametrize("threaded", [True, False])
def test_batches_checked_for_another_model_stop_the_stage(threaded) -> None:
    model = lookahead_model("sgd", cache_load_factor=0.1)
    check = BatchCheck.of(model)
    other = BatchCheck(check.features, {**check.rows, "f0": check.rows["f0"] + 1})
    dense = torch.optim.SGD(model.over.parameters(), lr=0.1)
    cpu = torch.device("cpu")
    with LookaheadTrainPipeline(model, dense, cpu, lookahead=2, stage_thread=threaded) as pipeline:
        with pytest.raises(RuntimeError, match="step 0") as raised:
            pipeline.progress(iter(loader(DATA, other, 0)))
    assert "checked its batches for another model" in str(raised.value.__cause__)


def test_the_check_of_a_model_is_the_pipeline_s() -> None:
    """``BatchCheck.of`` holds every feature of the model, weighted or not, and the rows of
    each cached feature's table."""
    model = lookahead_model("sgd", cache_load_factor=0.1)
    check = BatchCheck.of(model)
    assert check.features == {f"f{i}": False for i in range(4)} | {"g0": True, "g1": True}
    assert check.rows == {"f0": 4000, "f1": 4000, "f2": 1500, "f3": 10000, "g0": 3000, "g1": 2500}
