"""Malformed batches and bad settings are refused before any state changes.

Every refusal is raised from ``progress`` as a ``ValueError`` (a
``BatchTypeError``, also a ``TypeError``, for a tensor of the wrong type)
naming the step; the batch is dropped and training goes on, bitwise equal to
training on the good batches alone. The same under DMP at world size 2 is in
``distributed_cases.check_malformed_batches``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.malformed import MALFORMED, malformed
from tests.models import (
    assert_same_training_state,
    batches,
    lookahead_model,
    reference_twin,
    session_batches,
    train_dropping_refused,
    train_reference,
)
from torchrec_lookahead import LookaheadEmbeddingBagCollection, LookaheadTrainPipeline
from torchrec_lookahead.checks import BatchTypeError

DATA = batches(12)


def assert_trains_as_good_batches_alone(stream: list[Batch], good: list[Batch], **cache) -> list:
    model = lookahead_model("rowwise_adagrad", **(cache or {"cache_load_factor": 0.05}))
    twin = reference_twin(model, "rowwise_adagrad")
    outputs, errors = train_dropping_refused(model, stream)
    expected = train_reference(twin, good)
    assert len(outputs) == len(expected), errors
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected))
    assert_same_training_state(model, twin)
    return errors


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_a_malformed_batch_is_refused_naming_its_step_and_training_goes_on(kind: str) -> None:
    make, phrase, error_type = MALFORMED[kind]
    stream = DATA[:5] + [make(DATA[5])] + DATA[5:]
    errors = assert_trains_as_good_batches_alone(stream, DATA)
    assert len(errors) == 1 and errors[0].startswith("step 5: ") and phrase in errors[0], errors


@pytest.mark.parametrize("kind", ["float_ids", "integer_weights"])
def test_a_tensor_of_the_wrong_type_is_a_type_error_and_a_value_error(kind: str) -> None:
    model = lookahead_model("sgd", cache_load_factor=0.2)
    pipeline = LookaheadTrainPipeline(
        model, torch.optim.SGD(model.over.parameters(), lr=0.1), torch.device("cpu"), lookahead=2
    )
    with pipeline, pytest.raises(BatchTypeError) as raised:
        pipeline.progress(iter([malformed(kind, DATA[0])] + DATA[:4]))
    assert isinstance(raised.value, TypeError) and isinstance(raised.value, ValueError)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 8), st.sampled_from(sorted(MALFORMED)), st.integers(0, 7)),
        max_size=4,
    )
)
def test_random_streams_of_good_and_malformed_batches_train_as_the_good_alone(insertions) -> None:
    good = DATA[:8]
    stream = list(good)
    for position, kind, source in sorted(insertions, reverse=True):
        stream.insert(position, malformed(kind, good[source]))
    errors = assert_trains_as_good_batches_alone(stream, good)
    assert len(errors) == len(insertions)


def test_a_refused_first_batch_leaves_the_cache_sizing_as_it_was() -> None:
    """The first batch sizes the caches (what d + 1 such batches can touch). A small first
    batch refused by the second module must not size the first module's cache: the good
    batches after it need more room than it would give."""
    small = batches(1, batch_size=2, seed=7)[0]
    values = small.sparse_features.values().clone()
    values[-1] = 10**6  # an out-of-range id of g1, a feature of the second (weighted) module
    bad_first = Batch(
        small.dense_features,
        KeyedJaggedTensor.from_lengths_sync(
            keys=small.sparse_features.keys(),
            values=values,
            lengths=small.sparse_features.lengths(),
            weights=small.sparse_features.weights(),
        ),
        small.labels,
    )
    errors = assert_trains_as_good_batches_alone([bad_first] + DATA, DATA, cache_load_factor=0.001)
    assert len(errors) == 1 and "out of range" in errors[0], errors


def test_int32_ids_train_as_int64_ids() -> None:
    def as_int32(batch: Batch) -> Batch:
        kjt = batch.sparse_features
        return Batch(
            batch.dense_features,
            KeyedJaggedTensor(
                keys=kjt.keys(),
                values=kjt.values().int(),
                lengths=kjt.lengths().int(),
                weights=kjt.weights(),
            ),
            batch.labels,
        )

    errors = assert_trains_as_good_batches_alone([as_int32(b) for b in DATA], DATA)
    assert errors == []


def test_deduplicated_inverse_indices_of_the_wrong_width_are_refused() -> None:
    deduped = session_batches(8, session=4, dedup=True)
    kjt = deduped[3].sparse_features
    names, inverse = kjt.inverse_indices()
    narrow = KeyedJaggedTensor(
        keys=kjt.keys(),
        values=kjt.values(),
        weights=kjt.weights(),
        lengths=kjt.lengths(),
        stride_per_key_per_rank=kjt.stride_per_key_per_rank(),
        inverse_indices=(names, inverse[:, :-1]),
    )
    stream = deduped[:3] + [Batch(deduped[3].dense_features, narrow, deduped[3].labels)]
    errors = assert_trains_as_good_batches_alone(stream + deduped[3:], deduped)
    assert len(errors) == 1 and "step 3: dense_features has 32 samples" in errors[0], errors


BAD_PIPELINE_SETTINGS = [
    ({"lookahead": math.nan}, TypeError),
    ({"lookahead": math.inf}, TypeError),
    ({"lookahead": 2.0}, TypeError),
    ({"lookahead": True}, TypeError),
    ({"lookahead": 0}, ValueError),
    ({"prefetch_distance": math.nan}, TypeError),
    ({"prefetch_distance": -1}, ValueError),
    ({"planning_workers": math.inf}, TypeError),
    ({"planning_workers": 0}, ValueError),
]


@pytest.mark.parametrize("kwargs, error", BAD_PIPELINE_SETTINGS)
def test_bad_pipeline_settings_are_refused_where_they_are_given(kwargs, error) -> None:
    model = lookahead_model("sgd")
    with pytest.raises(error, match=next(iter(kwargs))):
        LookaheadTrainPipeline(
            model, torch.optim.SGD(model.over.parameters(), lr=0.1), torch.device("cpu"), **kwargs
        )


BAD_MODULE_SETTINGS = [
    ({"cache_load_factor": math.nan}, ValueError),
    ({"cache_load_factor": "0.1"}, TypeError),
    ({"min_cache_rows": math.nan}, TypeError),
    ({"min_cache_rows": 0}, ValueError),
    ({"cache_rows": {"t0": 1.5}}, TypeError),
    ({"cache_rows": {"t0": 0}}, ValueError),
    ({"cache_rows": 5}, TypeError),
]


@pytest.mark.parametrize("kwargs, error", BAD_MODULE_SETTINGS)
def test_bad_module_settings_are_refused_where_they_are_given(kwargs, error, tmp_path) -> None:
    from tests.models import UNWEIGHTED

    with pytest.raises(error, match=next(iter(kwargs))):
        LookaheadEmbeddingBagCollection(UNWEIGHTED, store_dir=tmp_path, **kwargs)
    assert list(tmp_path.iterdir()) == [], "a refused module wrote its store"


def test_a_module_without_tables_or_with_a_store_dir_not_a_path_is_refused_by_name() -> None:
    """Python's own errors of these (a ``KeyError`` from an empty set, pathlib's
    ``TypeError``) named neither setting."""
    from tests.models import UNWEIGHTED

    with pytest.raises(ValueError, match="tables: .* got none"):
        LookaheadEmbeddingBagCollection([])
    with pytest.raises(TypeError, match="store_dir must be a path, got 5"):
        LookaheadEmbeddingBagCollection(UNWEIGHTED, store_dir=5)
