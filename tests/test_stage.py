"""The lookahead stage, threaded and inline: where planning runs, errors with their step, no
threads left behind."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch
from torchrec.distributed.types import Awaitable

import torchrec_lookahead.pipeline.stage as stage_module
from tests.models import (
    assert_same_training_state,
    batches,
    lookahead_model,
    reference_twin,
    train_reference,
)
from torchrec_lookahead import LookaheadTrainPipeline
from torchrec_lookahead.cache.slot_cache import SlotCache
from torchrec_lookahead.idle import run_normally, run_when_idle

DATA = batches(30)
THREADS = ("lookahead-stage", "lookahead-executor", "lookahead-reader", "lookahead-planner")


def pipeline_for(model, lookahead: int = 4, threaded: bool = True) -> LookaheadTrainPipeline:
    dense = torch.optim.SGD(model.over.parameters(), lr=0.1)
    return LookaheadTrainPipeline(
        model, dense, torch.device("cpu"), lookahead=lookahead, stage_thread=threaded
    )


@pytest.fixture
def live_threads():
    """The stage and executor threads started during the test that are still alive
    (pipelines that earlier tests left mid-data are not this test's)."""
    before = set(threading.enumerate())
    return lambda: [t.name for t in threading.enumerate() if t.name in THREADS and t not in before]


@pytest.mark.parametrize("threaded", [True, False])
def test_each_phase_runs_on_its_thread(live_threads, threaded) -> None:
    """Threaded, the stage's thread reads, distributes and plans. Inline (as on CUDA), the
    trainer's thread only distributes (the stage's collectives); a thread reads, another
    plans."""
    model = lookahead_model("sgd", cache_load_factor=0.1)
    distributed_on, planned_on, read_on = set(), set(), set()
    distribute, prepare = model.unweighted.distribute, model.unweighted.prepare

    def distribute_spy(features):
        distributed_on.add(threading.current_thread().name)
        return distribute(features)

    def prepare_spy(features, step):
        planned_on.add(threading.current_thread().name)
        return prepare(features, step)

    model.unweighted.distribute, model.unweighted.prepare = distribute_spy, prepare_spy

    def loader():  # where the batches are read (and checked, and moved)
        for batch in DATA:
            read_on.add(threading.current_thread().name)
            yield batch

    pipeline, it = pipeline_for(model, threaded=threaded), loader()
    for _ in range(5):
        pipeline.progress(it)
    if threaded:
        assert read_on == distributed_on == planned_on == {"lookahead-stage"}
    else:
        assert distributed_on == {threading.main_thread().name}
        assert read_on == {"lookahead-reader"} and planned_on == {"lookahead-planner"}
    pipeline.close()
    assert live_threads() == []


@pytest.mark.parametrize("threaded", [True, False])
def test_each_input_dist_is_waited_for_after_the_next_one_starts_inline(threaded) -> None:
    """Inline (as on CUDA), the trainer's thread starts a batch's input dist and waits for
    it in its next call for a batch, after starting the next batch's (TorchRec's split of
    the input dist over two steps). Threaded, the stage's thread waits for each at once."""
    model = lookahead_model("sgd", cache_load_factor=0.1)
    events: list[tuple[str, int, str]] = []
    distribute = model.unweighted.distribute

    class Recorded(Awaitable):
        def __init__(self, started: Awaitable, batch: int) -> None:
            super().__init__()
            self.started, self.batch = started, batch

        def _wait_impl(self):
            events.append(("wait", self.batch, threading.current_thread().name))
            return self.started.wait()

    def distribute_spy(features):
        batch = sum(kind == "start" for kind, _, _ in events)
        events.append(("start", batch, threading.current_thread().name))
        return Recorded(distribute(features), batch)

    model.unweighted.distribute = distribute_spy
    with pipeline_for(model, threaded=threaded) as pipeline:
        it = iter(DATA)
        for _ in range(4):
            pipeline.progress(it)
    order = [(kind, batch) for kind, batch, _ in events]
    if threaded:
        assert order[:6] == [
            ("start", 0),
            ("wait", 0),
            ("start", 1),
            ("wait", 1),
            ("start", 2),
            ("wait", 2),
        ]
        assert {thread for _, _, thread in events} == {"lookahead-stage"}
    else:
        assert order[:7] == [
            ("start", 0),
            ("start", 1),
            ("wait", 0),
            ("start", 2),
            ("wait", 1),
            ("start", 3),
            ("wait", 2),
        ]
        assert {thread for _, _, thread in events} == {threading.main_thread().name}


@pytest.mark.parametrize("threaded", [True, False])
def test_end_of_data_leaves_no_thread_behind(live_threads, threaded) -> None:
    model = lookahead_model("adagrad", cache_load_factor=0.1)
    twin = reference_twin(model, "adagrad")
    pipeline, it, outputs = pipeline_for(model, threaded=threaded), iter(DATA), []
    while True:
        try:
            outputs.append(pipeline.progress(it))
        except StopIteration:
            break
    assert live_threads() == []
    assert all(torch.equal(a, b) for a, b in zip(outputs, train_reference(twin, DATA)))
    assert_same_training_state(model, twin)


@pytest.mark.parametrize("threaded", [True, False])
def test_a_loader_error_reaches_the_trainer_with_its_step(live_threads, threaded) -> None:
    def loader():
        yield from DATA[:12]
        raise OSError("disk gone")

    model = lookahead_model("sgd", cache_load_factor=0.1)
    pipeline, it, steps = pipeline_for(model, 4, threaded), loader(), 0
    with pytest.raises(RuntimeError, match=r"failed reading the batch of step 12: OSError") as info:
        while True:
            pipeline.progress(it)
            steps += 1
    assert isinstance(info.value.__cause__, OSError)
    assert steps == 12 - 4 - 1  # the window (L + d + 1 batches) was short when it failed
    assert live_threads() == []


@pytest.mark.parametrize("threaded", [True, False])
def test_a_planning_error_reaches_the_trainer_with_its_step(live_threads, threaded) -> None:
    model = lookahead_model("sgd", cache_load_factor=0.1)
    enter = model.weighted.enter

    def failing(prepared):
        if prepared.groups[0].step == 9:
            raise MemoryError("no room for the plan")
        return enter(prepared)

    model.weighted.enter = failing
    pipeline, it = pipeline_for(model, threaded=threaded), iter(DATA)
    with pytest.raises(RuntimeError, match=r"failed planning the batch of step 9: MemoryError"):
        while True:
            pipeline.progress(it)
    assert live_threads() == []


@pytest.mark.parametrize("threaded", [True, False])
def test_ctrl_c_during_a_step_stops_every_thread(live_threads, threaded) -> None:
    model = lookahead_model("sgd", cache_load_factor=0.1)
    forward, calls = model.forward, []

    def interrupted(batch):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return forward(batch)

    model.forward = interrupted
    pipeline, it = pipeline_for(model, threaded=threaded), iter(DATA)
    with pytest.raises(KeyboardInterrupt):
        while True:
            pipeline.progress(it)
    assert live_threads() == []


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_the_stage_thread_yields_the_cores_to_the_trainer(live_threads, monkeypatch) -> None:
    """By default the stage runs on its thread, at idle priority, with one intra-op
    thread, and the executor's moves on one intra-op thread; the trainer's own thread
    keeps its priority and intra-op threads."""
    model = lookahead_model("sgd", cache_load_factor=0.1)
    seen, moved = set(), set()
    prepare = model.unweighted.prepare
    apply = SlotCache.apply

    def spy_apply(self, pool, plan):
        moved.add((threading.current_thread().name, torch.get_num_threads()))
        return apply(self, pool, plan)

    monkeypatch.setattr(SlotCache, "apply", spy_apply)

    def spy(features, step):
        seen.add(
            (threading.current_thread().name, os.sched_getscheduler(0), torch.get_num_threads())
        )
        return prepare(features, step)

    model.unweighted.prepare = spy
    trainer = (os.sched_getscheduler(0), torch.get_num_threads())
    dense = torch.optim.SGD(model.over.parameters(), lr=0.1)
    with LookaheadTrainPipeline(model, dense, torch.device("cpu"), lookahead=4) as pipeline:
        it = iter(DATA)
        for _ in range(5):
            pipeline.progress(it)
        assert seen == {("lookahead-stage", os.SCHED_IDLE, 1)}
        assert moved == {("lookahead-executor", 1)}
        assert (os.sched_getscheduler(0), torch.get_num_threads()) == trainer
    assert live_threads() == []


def test_the_context_manager_closes_a_pipeline_left_mid_data(live_threads) -> None:
    model = lookahead_model("sgd", cache_load_factor=0.1)
    with pipeline_for(model) as pipeline:
        it = iter(DATA)
        for _ in range(3):
            pipeline.progress(it)
    assert live_threads() == []


def test_the_stage_runs_inline_on_cuda_unless_asked() -> None:
    """N6: on NCCL every collective of a rank is issued by one thread (the stage's vote,
    union and input all-to-all inline with the trainer's), in one order on every rank;
    gloo runs concurrent groups safely, so the CPU keeps the stage's thread."""
    from torchrec_lookahead.pipeline.train import stage_on_thread

    assert stage_on_thread(torch.device("cpu")) is True
    assert stage_on_thread(torch.device("cuda", 0)) is False
    assert stage_on_thread(torch.device("cuda", 0), asked=True) is True
    assert stage_on_thread(torch.device("cpu"), asked=False) is False


def test_a_window_checks_its_settings() -> None:
    from torchrec_lookahead.settings import SettingTypeError, WindowSettings

    assert WindowSettings(4, 0).planning_workers == 1
    with pytest.raises(ValueError, match="lookahead must be at least 1"):
        WindowSettings(0, 1)
    with pytest.raises(SettingTypeError, match="prefetch_distance must be an integer"):
        WindowSettings(4, 1.5)
    with pytest.raises(ValueError, match="planning_workers must be at least 1"):
        WindowSettings(4, 1, 0)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
@pytest.mark.parametrize("threaded", [True, False])
def test_a_pipeline_closed_mid_data_gives_its_idle_threads_cores_to_stop(
    live_threads, monkeypatch, threaded
) -> None:
    """Closing waits (10 s at most) for the stage's threads, which run at idle priority:
    on a busy host they could get no cycle in that time, and were still running torch's
    code as the interpreter exited. Each is given normal priority before the wait."""
    given: list[str] = []
    monkeypatch.setattr(stage_module, "run_normally", lambda thread: given.append(thread.name))
    model = lookahead_model("sgd", cache_load_factor=0.1)
    pipeline, it = pipeline_for(model, threaded=threaded), iter(DATA)
    for _ in range(3):
        pipeline.progress(it)
    pipeline.close()
    assert live_threads() == []
    idle = {"lookahead-stage"} if threaded else {"lookahead-reader", "lookahead-planner"}
    assert idle <= set(given)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_a_thread_at_idle_priority_runs_normally_once_asked() -> None:
    started, release, policies = threading.Event(), threading.Event(), []

    def work() -> None:
        run_when_idle()
        policies.append(os.sched_getscheduler(0))
        started.set()
        release.wait()
        policies.append(os.sched_getscheduler(0))

    thread = threading.Thread(target=work)
    thread.start()
    started.wait()
    run_normally(thread)
    release.set()
    thread.join()
    run_normally(thread)  # gone: nothing to do
    if policies[1] == os.SCHED_IDLE and os.geteuid() != 0:
        pytest.skip("this process may not raise a thread's priority here (RLIMIT_NICE)")
    assert policies == [os.SCHED_IDLE, os.SCHED_OTHER]


def test_a_second_pipeline_on_a_model_in_an_open_window_closes_the_first(
    live_threads, caplog
) -> None:
    """Building a pipeline opens its modules' windows (caches written back and emptied,
    oracles restarted): on a model whose pipeline was still open, it corrupted that one's
    steps or broke its window. The first is closed first (with a warning; often it cannot
    be reached, left open at a loop's early end): it refuses to go on, and the second
    trains on exactly."""
    model = lookahead_model("sgd", cache_load_factor=0.1)
    twin = reference_twin(model, "sgd")
    expected = train_reference(twin, DATA[:12])
    dense = torch.optim.SGD(model.over.parameters(), lr=0.1)
    first, it, outputs = pipeline_for(model), iter(DATA[:4] + DATA[20:]), []
    for _ in range(4):
        outputs.append(first.progress(it))
    with caplog.at_level(logging.WARNING, logger="torchrec_lookahead"):
        second = LookaheadTrainPipeline(model, dense, "cpu", lookahead=4)
    assert "closing a LookaheadTrainPipeline still open" in caplog.text
    with pytest.raises(RuntimeError, match="this LookaheadTrainPipeline is closed"):
        first.progress(it)
    it = iter(DATA[4:12])
    with pytest.raises(StopIteration):
        while True:
            outputs.append(second.progress(it))
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))
    assert_same_training_state(model, twin)
    assert live_threads() == []


@pytest.mark.parametrize("steps", [0, 3])
def test_progress_after_close_says_the_pipeline_is_closed(live_threads, steps) -> None:
    """It waited a second, then said the stage "stopped without a word"."""
    pipeline, it = pipeline_for(lookahead_model("sgd", cache_load_factor=0.1)), iter(DATA)
    for _ in range(steps):
        pipeline.progress(it)
    pipeline.close()
    with pytest.raises(RuntimeError, match="this LookaheadTrainPipeline is closed"):
        pipeline.progress(it)
    assert live_threads() == []


def test_a_pipeline_whose_data_ended_refuses_a_new_iterator(live_threads) -> None:
    """TorchRec's DLRM example hands one pipeline a new iterator each epoch; this pipeline
    closes at the end of its data and trained nothing on the next, silently. The same
    iterator ends again; a new one is refused, naming what to do."""
    pipeline, it = pipeline_for(lookahead_model("sgd", cache_load_factor=0.1)), iter(DATA[:6])
    steps = 0
    with pytest.raises(StopIteration):
        while True:
            pipeline.progress(it)
            steps += 1
    assert steps == 6
    with pytest.raises(StopIteration):
        pipeline.progress(it)
    with pytest.raises(RuntimeError, match="build a new one for each epoch"):
        pipeline.progress(iter(DATA[:6]))
    assert live_threads() == []
