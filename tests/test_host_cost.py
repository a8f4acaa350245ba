"""``benchmarks/host_cost.py``: its counts agree with what a step does.

The measuring function runs both pipelines at a tiny size (four tables, 64 samples,
world size 1) under fake CUDA: identical steps count alike; a ``.item()`` added to
every step shows as one more host wait. The counter counts a known sequence of
operators exactly, and the report has its keys. Its per-thread CPU (``thread_cpu.py``,
which ``gpu.py`` measures with on a GPU) goes to the thread that spent it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from torchrec_lookahead.testing.fake_cuda import FakeCuda
from torchrec_lookahead.testing.host_waits import HostCounter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import host_cost  # noqa: E402
from thread_cpu import StepCpu  # noqa: E402

TINY = host_cost.Settings(scale=1.0, table_sizes=(1000, 2000, 500, 300), lookahead=4)
KEYS = {
    "pipeline",
    "world_size",
    "batch_size",
    "trainer_cpu_ms",
    "host_waits",
    "device_ops",
    "other_threads_cpu_ms",
}


def run(kind: str, steps: int = 3, planner: str = "host", **kwargs: Any) -> dict[str, Any]:
    return host_cost.measure(kind, 1, 64, steps, 2, TINY, progress=False, planner=planner, **kwargs)


def test_a_known_step_is_counted_exactly() -> None:
    """Five device ops and the five waits they make, one of each kind, on this thread."""
    with FakeCuda() as fake, HostCounter(fake) as counter:
        ids = torch.arange(10).pin_memory().to("cuda", non_blocking=True)  # no wait
        before = counter.tally().copy()
        total = ids.sum()  # a device op, no wait
        total.item()  # a wait: the value read back
        (ids > 4).nonzero().tolist()  # a data-dependent shape (a wait), a read back (a wait)
        ids.cpu()  # a copy to pageable memory (a wait)
        torch.cuda.current_stream().synchronize()  # a wait
        step = counter.tally().minus(before)
    kinds = ["item", "nonzero", "tolist", "D2H copy", "stream synchronize"]
    assert step.waits == dict.fromkeys(kinds, 1)
    assert step.device_ops == 5  # sum, item, gt, nonzero, the copy
    assert step.emulation_s > 0


def test_kernels_that_read_back_inside_count_as_waits() -> None:
    """``index_fill_`` and ``masked_fill_`` take a 0-d value tensor, and on CUDA their
    kernels read it back (``value.item()``): a wait, where a host scalar or a device
    ``index_copy_`` of the expanded value is none."""
    with FakeCuda() as fake, HostCounter(fake) as counter:
        slots = torch.zeros(8, dtype=torch.int64, device="cuda")
        at, step = torch.tensor([1, 3], device="cuda"), torch.tensor(5, device="cuda")
        before = counter.tally().copy()
        slots.index_fill_(0, at, step)  # a wait
        slots.masked_fill_(slots > 4, step)  # a wait
        slots.index_fill_(0, at, 5)  # none
        slots.index_copy_(0, at, step.expand(2))  # none
        waits = counter.tally().minus(before).waits
        assert slots.cpu().tolist() == [0, 5, 0, 5, 0, 0, 0, 0]
    assert waits == {"item": 2}


@pytest.fixture(scope="module")
def plain() -> dict[str, Any]:
    return run("plain")


def test_both_pipelines_give_every_figure_and_identical_steps_count_alike(
    plain: dict[str, Any],
) -> None:
    lookahead, on_device = run("lookahead"), run("lookahead", planner="device")
    for row in (plain, lookahead, on_device):
        assert KEYS <= set(row)
        assert row["device_ops"] > 0 and row["host_waits"] > 0
        low, high = row["device_ops_range"]
        assert low == high  # identical steps issue the same ops
        assert row["trainer_cpu_ms"] > row["emulation_ms"] > 0
    assert plain["other_threads_cpu_ms_by_name"].get("lookahead-executor") is None
    assert "lookahead-executor" in lookahead["other_threads_cpu_ms_by_name"]
    for name, cpu_ms in on_device["other_threads_cpu_ms_by_name"].items():
        assert on_device["other_threads_net_ms_by_name"][name] <= cpu_ms, name
    assert on_device["other_threads_device_ops_by_name"]["lookahead-planner"] > 0
    assert (plain["planner"], lookahead["planner"], on_device["planner"]) == (
        None,
        "host",
        "device",
    )
    # No id comes back on the trainer's thread with either planner, and nothing through
    # pageable memory: the host's planner copies each batch's ids into page-locked memory
    # on the stage's planning thread and waits for that copy (``streams.to_host``), once
    # a step; the device's copies no ids (it reads one small tensor there), and reads
    # each plan back on the executor's thread the same way, twice a step.
    for row in (lookahead, on_device):
        assert row["host_wait_kinds"].get("D2H copy", 0) == 0
        assert not [s for s in row["other_threads_host_wait_sites"] if s.startswith("D2H")]
    reads = [
        sum(n for site, n in row["other_threads_host_wait_sites"].items() if "(to_host)" in site)
        for row in (lookahead, on_device)
    ]
    assert reads == [1, 2]


def test_batches_the_loader_checked_leave_the_trainer_s_counts_as_they_were() -> None:
    """Checked where the loader collates (``BatchCheck.collate``), the batches reach the
    stage with their verdicts (else the stage would refuse them); the trainer's thread
    waits and launches as before, and the row says how its batches were checked."""
    own, by_loader = run("lookahead"), run("lookahead", loader_checks=True)
    assert (own["loader_checks"], by_loader["loader_checks"]) == (False, True)
    for key in ("host_waits", "host_wait_kinds", "device_ops"):
        assert own[key] == by_loader[key], key


def test_an_item_added_to_a_step_is_one_more_host_wait(
    plain: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    progress = host_cost.TrainPipelineSparseDist.progress

    def with_item(self: Any, dataloader_iter: Any) -> Any:
        output = progress(self, dataloader_iter)
        output[1].sum().item()  # the logits' sum, read back: a reduction and a wait
        return output

    monkeypatch.setattr(host_cost.TrainPipelineSparseDist, "progress", with_item)
    added = run("plain")
    assert added["host_waits"] == plain["host_waits"] + 1
    assert added["device_ops"] == plain["device_ops"] + 2  # sum, _local_scalar_dense
    assert added["host_wait_kinds"]["item"] == plain["host_wait_kinds"].get("item", 0) + 1


def test_the_report_has_its_keys(
    plain: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``main`` writes every run's row and what the rows were measured under."""
    monkeypatch.setattr(
        host_cost,
        "measure",
        lambda kind, *args, planner, loader_checks: {**plain, "pipeline": kind, "planner": planner},
    )
    flags = ["--out", str(tmp_path), "--batch-sizes", "64", "--world-sizes", "1"]
    assert host_cost.main(flags) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert {"rows", "settings", "machine", "stood_in", "command", "date"} <= set(report)
    assert report["planner_dispatch"]["host_waits_per_step"] == 0
    got = [(row["pipeline"], row["planner"]) for row in report["rows"]]
    assert got == [("plain", "host"), ("lookahead", "host"), ("lookahead", "device")]
    assert all(KEYS <= set(row) for row in report["rows"])


def test_rounds_give_medians_of_the_hosts_cpu_and_of_each_rounds_gap_to_plain(
    plain: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``--repeats`` the settings alternate round by round; the trainer's net CPU and
    its gap to plain TorchRec's (taken within a round) are medians over the rounds."""
    nets = {  # per setting, its net CPU in rounds 1, 2 and 3
        "host": [10.0, 14.0, 12.0],
        "lookahead-host": [11.0, 20.0, 12.5],
        "lookahead-device": [9.0, 15.0, 13.0],
    }
    calls: list[str] = []

    def measure(kind: str, *args: Any, planner: str, loader_checks: bool) -> dict[str, Any]:
        name = planner if kind == "plain" else f"{kind}-{planner}"
        net = nets[name][sum(call == name for call in calls)]
        calls.append(name)
        return {**plain, "pipeline": kind, "planner": planner, "trainer_net_ms": net}

    monkeypatch.setattr(host_cost, "measure", measure)
    flags = ["--out", str(tmp_path), "--batch-sizes", "64", "--world-sizes", "1"]
    assert host_cost.main([*flags, "--repeats", "3"]) == 0
    assert calls == ["host", "lookahead-host", "lookahead-device"] * 3  # alternated
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert [row["trainer_net_ms"] for row in rows] == [12.0, 12.5, 13.0]
    assert rows[1]["trainer_net_ms_rounds"] == nets["lookahead-host"]
    # Gaps per round: host 1, 6, 0.5; device -1, 1, 1 (not the medians' difference).
    assert [row["trainer_net_gap_ms"] for row in rows] == [0.0, 1.0, 1.0]
    assert rows[2]["trainer_net_gap_ms_rounds"] == [-1.0, 1.0, 1.0]
    assert all(row["host_waits"] == plain["host_waits"] for row in rows)  # counts as measured


def test_the_device_oracles_step_issues_a_fixed_number_of_ops_and_waits_for_nothing() -> None:
    first, second = host_cost.planner_dispatch(5, 20), host_cost.planner_dispatch(5, 30)
    assert first["host_waits_per_step"] == second["host_waits_per_step"] == 0
    assert first["device_ops_per_step"] == second["device_ops_per_step"] > 0
    assert first["cpu_ms_per_step"] > 0


def _burn(cpu_s: float) -> None:
    """Spend ``cpu_s`` seconds of this thread's CPU."""
    start = time.thread_time()
    while time.thread_time() - start < cpu_s:
        pass


def test_step_cpu_charges_each_thread_its_own_cpu_and_leaves_out_earlier_threads() -> None:
    stop, burnt = threading.Event(), threading.Event()

    def spin() -> None:
        while not stop.is_set():
            _burn(0.001)

    def burn_then_stay() -> None:  # alive past the step, as a pipeline's threads are
        _burn(0.05)
        burnt.set()
        stop.wait()

    earlier = threading.Thread(target=spin, name="earlier")
    earlier.start()  # before the recorder: another's thread, busy during the step
    later = threading.Thread(target=burn_then_stay, name="later")
    try:
        cpu = StepCpu()
        with cpu.step():
            later.start()
            _burn(0.03)
            burnt.wait()
        with cpu.step():  # nothing but the calling thread's own work
            _burn(0.01)
    finally:
        stop.set()
        earlier.join()
        later.join()
    first, second = cpu.steps
    assert 0.03 <= first.cpu_s < 1.0 and 0.01 <= second.cpu_s < 1.0
    assert list(first.others_s) == ["later"] and 0.05 <= first.others_s["later"] < 1.0
    assert "earlier" not in second.others_s and sum(second.others_s.values()) < 0.05
    summary = cpu.summary(first=1)  # the second step alone
    assert summary["trainer_cpu_ms"] == pytest.approx(1e3 * second.cpu_s)
    assert "earlier" not in summary["other_threads_cpu_ms_by_name"]
