"""Training through the lookahead cache equals training with every row resident, bitwise.

The reference keeps each module's tables in one full-size FBGEMM TBE with the
same fused optimizer (what TorchRec's ``fused`` kernel runs). Both use the
same TBE kernels on the same rows in the same order; the cache only renames
rows to slots, so weights, optimizer state, dense parameters and every
step's output agree exactly, with no tolerance.

Every test runs twice: with moves that land at once, under the stream checker
(every access to device memory -- the cache's rows, the step's slots and batch --
across the trainer's stream, the side stream and the stage's must be ordered by
an event, as CUDA's sanitizer demands; ``torchrec_lookahead.testing.stream_check``;
the matrix of optimizers, lookaheads and distances is checked at lookahead 8,
where its other lookaheads run the same ordering code), and with a deferred side
stream that holds the moves back until the trainer waits for them, as a GPU's
side stream would (``torchrec_lookahead.testing.streams``): a missing wait then
reads rows that have not landed and the results differ.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.models import (
    assert_same_training_state,
    batches,
    lookahead_model,
    reference_twin,
    train_lookahead,
    train_reference,
)
from torchrec_lookahead.streams import side_stream
from torchrec_lookahead.testing.stream_check import StreamChecker
from torchrec_lookahead.testing.streams import DeferredSideStream, use_deferred_side_streams

STEPS = 120
DATA = batches(STEPS)


CHECKED_LOOKAHEAD = 8  # the matrix's lookahead run under the stream checker (see above)


@pytest.fixture(autouse=True, params=["immediate", "deferred"])
def side_streams(request):
    """Row moves that land at once (under the stream checker: every cross-stream access
    checked), or on a side stream that defers them until waited for. A test marked
    ``checked_with`` runs under the checker only with the optimizer it names."""
    if request.param == "immediate":
        callspec = getattr(request.node, "callspec", None)
        params = callspec.params if callspec is not None else {}
        marker = request.node.get_closest_marker("checked_with")
        if params.get("lookahead", 8) != CHECKED_LOOKAHEAD or (
            marker is not None and params.get("optimizer") != marker.args[0]
        ):
            yield  # the CPU's own side stream
            return
        with StreamChecker("cpu") as checker:  # raises what it found when the test ends
            yield
            assert checker.operators > 0, "the checker saw no device memory: it checked nothing"
        return
    with use_deferred_side_streams():
        yield
        deferred = side_stream(torch.device("cpu"))
        assert isinstance(deferred, DeferredSideStream) and deferred.deferred > 0, (
            "no move was ever held back: the deferred stream tested nothing"
        )


def check_against_reference(
    optimizer: str,
    lookahead: int,
    d: int,
    planning_workers: int = 1,
    planner: str = "host",
    **cache: object,
):
    model = lookahead_model(optimizer, **cache)
    twin = reference_twin(model, optimizer)
    expected = train_reference(twin, DATA)
    outputs, pipeline = train_lookahead(
        model, DATA, lookahead, d, planning_workers, planner=planner
    )
    assert len(outputs) == STEPS
    for step, (got, want) in enumerate(zip(outputs, expected)):
        assert torch.equal(got, want), f"step {step} output differs"
    assert_same_training_state(model, twin)
    return pipeline.cache_metrics()["total"]


# Every pair of (optimizer, lookahead, prefetch distance) values once: 9 runs, not 18
# (the differential harness draws the rest of the space in CI).
ALL_PAIRS = [
    ("sgd", 1, 1),
    ("sgd", 8, 2),
    ("sgd", 64, 1),
    ("adagrad", 1, 2),
    ("adagrad", 8, 1),
    ("adagrad", 64, 2),
    ("rowwise_adagrad", 1, 1),
    ("rowwise_adagrad", 8, 2),
    ("rowwise_adagrad", 64, 2),
]


@pytest.mark.parametrize(("optimizer", "lookahead", "prefetch_distance"), ALL_PAIRS)
def test_small_cache_matches_all_resident_training(optimizer, lookahead, prefetch_distance):
    metrics = check_against_reference(
        optimizer, lookahead, prefetch_distance, cache_load_factor=0.1
    )
    assert metrics.rows_written_back > 0 and metrics.misses < metrics.unique_ids


# The device planner's own ordering (plans made on the planning stream, read back on the
# read-back stream, the slots left on the device) does not depend on the optimizer; the
# moves of each optimizer's state, shared with the host planner, are checked above. So
# the checker (25-31 s a test here, against 2-3 s without it) runs at one.
@pytest.mark.checked_with("rowwise_adagrad")
@pytest.mark.parametrize(("optimizer", "lookahead", "prefetch_distance"), ALL_PAIRS[1::3])
def test_plans_made_on_the_device_match_all_resident_training_and_the_host_plans(
    optimizer, lookahead, prefetch_distance
) -> None:
    """``planner="device"`` on CPU tensors (the device oracle, its plans trimmed by the
    executor): bitwise all-resident training, and every counter as the host's plans."""
    on_device = check_against_reference(
        optimizer, lookahead, prefetch_distance, planner="device", cache_load_factor=0.1
    )
    on_host = check_against_reference(
        optimizer, lookahead, prefetch_distance, planner="host", cache_load_factor=0.1
    )
    timings = {"wait_s": 0.0, "stage_s": 0.0, "plan_s": 0.0}
    assert on_device.rows_written_back > 0
    assert replace(on_device, **timings) == replace(on_host, **timings)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_two_planning_workers_match_all_resident_training(optimizer) -> None:
    metrics = check_against_reference(optimizer, 8, 1, planning_workers=2, cache_load_factor=0.1)
    assert metrics.rows_written_back > 0


def test_cache_holding_every_row_never_evicts() -> None:
    metrics = check_against_reference("rowwise_adagrad", 8, 1, cache_load_factor=1.0)
    assert metrics.rows_written_back == 0


def _smallest_workable_cache(d: int) -> dict[str, int]:
    """Per table, the most distinct rows any d+1 consecutive steps use."""
    keys = {"t0": ["f0", "f1"], "t1": ["f2"], "t2": ["f3"], "w0": ["g0"], "w1": ["g1"]}
    sizes = {}
    for table, features in keys.items():
        per_step = [
            np.concatenate([b.sparse_features[f].values().numpy() for f in features]) for b in DATA
        ]
        sizes[table] = max(
            len(np.unique(np.concatenate(per_step[max(0, s - d) : s + 1])))
            for s in range(len(per_step))
        )
    return sizes


@pytest.mark.parametrize("prefetch_distance", [1, 2])
def test_cache_barely_large_enough_evicts_every_step(prefetch_distance) -> None:
    rows = _smallest_workable_cache(prefetch_distance)
    metrics = check_against_reference("adagrad", 8, prefetch_distance, cache_rows=rows)
    assert metrics.rows_written_back >= 0.9 * metrics.rows_fetched - sum(rows.values())


def test_state_dict_mid_training_holds_current_weights_and_training_goes_on() -> None:
    model = lookahead_model("rowwise_adagrad", cache_load_factor=0.1)
    twin = reference_twin(model, "rowwise_adagrad")
    dense = torch.optim.SGD(model.over.parameters(), lr=0.1)
    from torchrec_lookahead import LookaheadTrainPipeline

    pipeline = LookaheadTrainPipeline(model, dense, torch.device("cpu"), lookahead=8)
    it = iter(DATA)
    for _ in range(50):
        pipeline.progress(it)
    train_reference(twin, DATA[:50])
    assert_same_training_state(model, twin)  # reads state_dict() mid-training
    while True:
        try:
            pipeline.progress(it)
        except StopIteration:
            break
    train_reference(twin, DATA[50:])  # dense SGD is stateless: a fresh one continues exactly
    assert_same_training_state(model, twin)


def test_eval_mode_reads_current_weights() -> None:
    model = lookahead_model("adagrad", cache_load_factor=0.1)
    twin = reference_twin(model, "adagrad")
    from torchrec_lookahead import LookaheadTrainPipeline

    pipeline = LookaheadTrainPipeline(
        model, torch.optim.SGD(model.over.parameters(), lr=0.1), torch.device("cpu"), lookahead=4
    )
    it = iter(DATA)
    for _ in range(30):
        pipeline.progress(it)
    train_reference(twin, DATA[:30])
    # Pooling in eval runs EmbeddingBagCollection's own kernel over the store, not the
    # TBE, so sums may differ in the last bit: compared with a float32-tight tolerance.
    model.eval()
    twin.eval()
    probe = DATA[100]
    with torch.no_grad():
        got = model.unweighted(probe.sparse_features).values()
        want = twin.unweighted(probe.sparse_features).values()
        got_w = model.weighted(probe.sparse_features).values()
        want_w = twin.weighted(probe.sparse_features).values()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-6)
