"""CPU time per step, thread by thread, of this process: what a host pays beside the device.

A pipeline's host work is spread over threads: the trainer's, which launches the step,
and the ones a pipeline starts (lookahead's reader, planner and executor). Linux counts
each thread's CPU in ``/proc/self/task/<tid>/schedstat``; :class:`StepCpu` reads it
around each step. ``host_cost.py`` (fake CUDA, on the CPU) and ``gpu.py`` (on a GPU)
measure with it, so their figures are made alike.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["StepCpu", "ThreadsStep", "thread_ids", "threads_cpu_s"]


def thread_ids() -> set[int]:
    """The native ids of this process's threads now."""
    return {int(task) for task in os.listdir("/proc/self/task")}


def threads_cpu_s(skip: set[int]) -> dict[str, float]:
    """CPU seconds so far of every thread of this process but those in ``skip`` (the
    calling thread is never skipped), by name (Python's thread names; ``tid <id>`` for
    threads Python did not start: torch's and numba's pools, CUDA's and NCCL's)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    found: dict[str, float] = {}
    for task in os.listdir("/proc/self/task"):
        if int(task) in skip and int(task) != threading.get_native_id():
            continue
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            with open(f"/proc/self/task/{task}/schedstat") as f:
                name = names.get(int(task), f"tid {task}")
                found[name] = found.get(name, 0.0) + int(f.read().split()[0]) / 1e9
    return found


@dataclass(frozen=True)
class ThreadsStep:
    """One step's CPU seconds: the calling thread's, and every other counted thread's by
    name."""

    cpu_s: float
    others_s: dict[str, float]


class StepCpu:
    """Records, per step run under :meth:`step`, the calling thread's CPU and every other
    thread's. Threads alive when it is made are left out, as another's (an earlier
    pipeline's, the process group's), so make it just before the pipeline it measures.
    A thread that ends within a step is not counted (its ``/proc`` entry is gone). A
    thread that waits for the device by spinning (CUDA's default where cores outnumber
    GPUs) is charged that wait."""

    def __init__(self) -> None:
        self._earlier = thread_ids()
        self.steps: list[ThreadsStep] = []

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Count the CPU spent while the block runs as one step."""
        me = threading.current_thread().name
        before = threads_cpu_s(self._earlier)
        start = time.thread_time()
        yield
        cpu_s = time.thread_time() - start
        after = threads_cpu_s(self._earlier)
        others = {name: after[name] - before.get(name, 0.0) for name in after if name != me}
        self.steps.append(ThreadsStep(cpu_s, others))

    def summary(self, first: int = 0) -> dict[str, object]:
        """Per step from step ``first`` on, in milliseconds: the medians of the calling
        thread's CPU and of every other thread's together, and each other thread's mean."""
        steps = self.steps[first:]
        if not steps:
            return {}
        names = sorted({name for step in steps for name in step.others_s})
        return {
            "trainer_cpu_ms": 1e3 * statistics.median(step.cpu_s for step in steps),
            "other_threads_cpu_ms": 1e3
            * statistics.median(sum(step.others_s.values()) for step in steps),
            "other_threads_cpu_ms_by_name": {
                name: 1e3 * statistics.fmean(step.others_s.get(name, 0.0) for step in steps)
                for name in names
            },
        }
