"""PlanExecutor: moves run in order in the background, and failures reach the trainer."""

from __future__ import annotations

import threading

import pytest
import torch

from torchrec_lookahead.pipeline.executor import PlanExecutor


def test_moves_run_in_submit_order_off_the_trainer_thread() -> None:
    executor = PlanExecutor(torch.device("cpu"))
    seen: list[tuple[int, str]] = []
    for step in range(5):
        executor.submit(step, [lambda s=step: seen.append((s, threading.current_thread().name))])
    for step in range(5):
        executor.wait(step)
    executor.close()
    executor.close()  # idempotent
    assert [s for s, _ in seen] == list(range(5))
    assert {name for _, name in seen} == {"lookahead-executor"}


def test_a_failed_move_is_raised_by_wait() -> None:
    executor = PlanExecutor(torch.device("cpu"))
    executor.submit(0, [lambda: None])
    executor.submit(1, [lambda: 1 / 0])
    executor.wait(0)
    with pytest.raises(RuntimeError, match="cache executor failed") as caught:
        executor.wait(1)
    assert isinstance(caught.value.__cause__, ZeroDivisionError)


def test_wait_returns_only_after_the_steps_moves_have_landed() -> None:
    executor = PlanExecutor(torch.device("cpu"))
    release = threading.Event()
    events: list[str] = []

    def blocked_move() -> None:
        release.wait()
        events.append("step 1 landed")

    executor.submit(0, [])
    executor.submit(1, [blocked_move])
    # Step 1's move is held until step 0's wait returned (or a failsafe, if it blocked).
    failsafe = threading.Timer(5.0, release.set)
    failsafe.start()
    executor.wait(0)
    events.append("waited for step 0")
    failsafe.cancel()
    threading.Timer(0.05, lambda: (events.append("released"), release.set())).start()
    executor.wait(1)
    events.append("waited for step 1")
    executor.close()
    assert events == ["waited for step 0", "released", "step 1 landed", "waited for step 1"]
