"""The benchmark scripts run end to end (at toy sizes) and write what they promise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models import needs_store_buffers

ROOT = Path(__file__).resolve().parents[1]


def benchmark(name: str, out: Path, *flags: str) -> str:
    """Run ``benchmarks/<name>.py --out out *flags``; its stdout (its stderr if it fails)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--out", str(out), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_oracle_report_writes_json_and_plot(tmp_path: Path) -> None:
    out = benchmark(
        "oracle",
        tmp_path,
        "--scale",
        "0.002",
        "--batch-size",
        "256",
        "--steps",
        "20",
        "--cache-fractions",
        "0.01",
        "0.1",
        "--lookaheads",
        "2",
        "--tp-rows",
        "20000",
        "--tp-batch",
        "4096",
        "--tp-batches",
        "4",
        "--repeats",
        "1",
    )
    assert "MIN" in out and "Planning speed" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert (tmp_path / "misses.png").stat().st_size > 0
    results = report["misses"]["results"]
    assert {r["policy"] for r in results} == {"LRU", "LFU", "oracle L=2", "MIN"}
    for fraction in (0.01, 0.1):
        by_policy = {r["policy"]: r["misses"] for r in results if r["cache_fraction"] == fraction}
        assert by_policy["MIN"] <= min(by_policy.values())
        assert by_policy["MIN"] >= report["misses"]["compulsory_misses"]
    assert report["throughput"][0]["ids_per_s"] > 0
    checked = report["misses"]["device_check"]  # the device oracle misses as the numba one
    assert checked and all(r["equal_every_step"] for r in checked)


def test_step_time_report_compares_lookahead_with_all_resident(tmp_path: Path) -> None:
    out = benchmark(
        "step_time",
        tmp_path,
        "--scale",
        "0.001",
        "--batch-size",
        "64",
        "--steps",
        "12",
        "--warmup",
        "2",
        "--lookahead",
        "4",
        "--repeats",
        "1",
    )
    assert "all resident" in out and "same final weights: True" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["same_weights"] is True
    assert report["lookahead"]["step_ms"] > 0 and report["baseline"]["step_ms"] > 0
    assert 0 < report["lookahead"]["hit_rate"] < 1
    assert (tmp_path / "step_time.png").stat().st_size > 0


def test_step_time_under_dmp_compares_lookahead_with_plain_torchrec(tmp_path: Path) -> None:
    out = benchmark(
        "step_time",
        tmp_path,
        "--world-size",
        "1",
        "--scale",
        "0.001",
        "--batch-size",
        "64",
        "--steps",
        "12",
        "--warmup",
        "2",
        "--lookahead",
        "4",
        "--repeats",
        "1",
    )
    assert "plain TorchRec" in out and "same final weights: True" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["same_weights"] is True and len(report["ranks"]) == 1
    assert report["lookahead"]["background_input_dist_ms"] > 0


def test_planner_report_times_statistics_and_checks_accuracy(tmp_path: Path) -> None:
    out = benchmark(
        "planner",
        tmp_path,
        "--scale",
        "0.001",
        "--batch-size",
        "256",
        "--sample-batches",
        "10",
        "--full-batches",
        "20",
        "--lookahead",
        "4",
    )
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["statistics_s"] > 0 and len(report["accuracy"]) == 3 and "predicted" in out
    assert all(0 <= a["predicted"] <= 1 and 0 <= a["measured"] <= 1 for a in report["accuracy"])


@needs_store_buffers
def test_disk_store_report_compares_stores_and_cleans_up(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir()
    out = benchmark(
        "disk_store",
        tmp_path,
        "--scale",
        "0.001",
        "--batch-size",
        "64",
        "--steps",
        "12",
        "--warmup",
        "2",
        "--repeats",
        "1",
        "--huge-gb",
        "0.02",
        "--huge-steps",
        "12",
        "--checkpoint-gb",
        "0.02",
        "--checkpoint-steps",
        "2",
        "--store-dir",
        str(store),
    )
    assert "disk, no read-ahead" in out and "larger than RAM" in out and "DCP checkpoints" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["fits"]) == 6 and all(r["step_ms"] > 0 for r in report["fits"])
    assert report["huge"]["rows"] > 0 and 0 < report["huge"]["hit_rate"] < 1
    assert report["huge"]["private_mb"] > 0
    saved = {r["planner"]: r for r in report["checkpoint"]}
    assert set(saved) == {"streamed", "default"}
    assert all(r["checkpoint_gb"] >= r["store_gb"] and r["load_s"] > 0 for r in saved.values())
    assert not any(store.iterdir()), "the store files must be removed"


def test_dedup_report_compares_plain_and_deduplicated_sessions(tmp_path: Path) -> None:
    out = benchmark(
        "dedup",
        tmp_path,
        "--scale",
        "0.001",
        "--batch-size",
        "128",
        "--steps",
        "8",
        "--samples-per-day",
        "4096",
        "--sessions",
        "8",
        "--repeats",
        "1",
        "--data-cache",
        str(tmp_path / "data"),
    )
    assert "Deduplicated batches" in out
    report = json.loads((tmp_path / "report.json").read_text())
    (eight,) = report["results"]  # one size: the script does the same for each
    assert eight["ids_per_step_dedup"] < 0.6 * eight["ids_per_step_plain"]
    assert eight["plain_samples_per_s"] > 0 and eight["dedup_samples_per_s"] > 0
    # The ceiling: a plain step over the dense part alone, which dedup cannot shrink.
    assert eight["dense_floor_ms"] > 0
    assert eight["speedup_bound"] == pytest.approx(eight["plain_step_ms"] / eight["dense_floor_ms"])
    assert "dense floor" in out and "one gather" in out
    assert eight["expand_ms"]["fbgemm"] > 0 and eight["expand_ms"]["gather"] > 0
    assert (tmp_path / "dedup.png").stat().st_size > 0


def test_batch_check_report_times_both_checks(tmp_path: Path) -> None:
    out = benchmark(
        "batch_check",
        tmp_path,
        "--scale",
        "0.001",
        "--batch-sizes",
        "64",
        "128",
        "--calls",
        "3",
        "--repeats",
        "2",
    )
    assert "structure" in out and "ids" in out
    results = json.loads((tmp_path / "report.json").read_text())["results"]
    assert {(r["check"], r["batch_size"]) for r in results} == {
        (c, b) for c in ("structure", "ids") for b in (64, 128)
    }
    assert all(len(r["ms_runs"]) == 2 and r["ms"] > 0 for r in results)
    assert {r["ids"] for r in results if r["batch_size"] == 64} == {64 * 26}


def test_data_report_measures_both_sizes_and_removes_the_data(tmp_path: Path) -> None:
    data = tmp_path / "data"
    out = benchmark(
        "data",
        tmp_path,
        "--data-dir",
        str(data),
        "--small-gb",
        "0.01",
        "--large-gb",
        "0.02",
        "--days",
        "3",
        "--scale",
        "0.001",
        "--batch-size",
        "128",
        "--steps",
        "12",
        "--world-sizes",
        "1",
        "--workers",
        "1",
        "--repeats",
        "1",
        "--shuffle-chunk",
        "1024",
    )
    assert "Data larger than memory" in out
    report = json.loads((tmp_path / "report.json").read_text())
    results = {(r["data"], r["num_workers"]): r for r in report["results"]}
    assert set(results) == {("small", 1), ("large", 1)}
    assert all(r["samples_per_s"] > 0 and r["rank_private_mb"][0] > 100 for r in results.values())
    assert all(r["data_wait_ms"] >= 0 for r in results.values())
    assert results["large", 1]["samples"] > results["small", 1]["samples"]
    memory = report["goals"]["private_memory_large_over_small"]
    assert set(memory) == {"ws1_workers1"}
    assert not any(data.iterdir()), "the data sets must be removed"


def test_comm_report_counts_bytes_and_times_every_setting(tmp_path: Path) -> None:
    out = benchmark(
        "comm",
        tmp_path,
        "--world-size",
        "2",
        "--scales",
        "0.001",
        "--batch-size",
        "128",
        "--steps",
        "4",
        "--runs",
        "1",
        "--samples-per-day",
        "4096",
        "--sample-batches",
        "6",
        "--data-cache",
        str(tmp_path / "data"),
    )
    assert "bytes_ratio" in out and "time_ratio" in out
    (result,) = json.loads((tmp_path / "report.json").read_text())["results"]
    settings = result["settings"]
    assert set(settings) == {"torchrec_plan", "torchrec_table_wise", "lookahead", "lookahead_hot"}
    assert all(s["step_ms"] > 0 and len(s["step_ms_runs"]) == 1 for s in settings.values())
    plain, hot = settings["torchrec_table_wise"], settings["lookahead_hot"]
    for kind in ("ids", "pooled", "gradients"):  # the same plan: the same all-to-alls
        assert settings["lookahead"]["bytes_per_step"][kind] == plain["bytes_per_step"][kind]
    # The stage's vote, 8 bytes a batch, and one more at the first batch (voted on before its
    # collectives too): (16 + 3 * 8) / 4 steps.
    assert settings["lookahead"]["bytes_per_step"]["other"] == 10
    assert hot["bytes_per_step"]["hot_sync"] > 0 and plain["bytes_per_step"]["hot_sync"] == 0
    assert hot["embedding_bytes_per_step"] < plain["embedding_bytes_per_step"]
    assert result["bytes_ratio"] == pytest.approx(
        hot["embedding_bytes_per_step"] / settings["torchrec_plan"]["embedding_bytes_per_step"]
    )
    assert 0.5 < result["hot_share"] < 1
    assert (tmp_path / "comm.png").stat().st_size > 0


def test_preprocess_report_measures_memory_and_speed_and_removes_the_data(
    tmp_path: Path,
) -> None:
    work = tmp_path / "work"
    out = benchmark(
        "preprocess",
        tmp_path,
        "--work-dir",
        str(work),
        "--lines",
        "3000",
        "--days",
        "2",
        "--scale",
        "0.001",
        "--thresholds",
        "0",
        "2",
        "--workers",
        "1",
    )
    assert "Preprocessing Criteo days" in out and "peak RSS MB" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["date"] and report["machine"]["cores"] >= 1
    results = {r["threshold"]: r for r in report["results"]}
    assert set(results) == {0, 2}
    for r in results.values():
        assert r["lines_per_day"] == 3000 and r["lines_per_s"] > 0 and r["bytes"] > 0
        assert r["peak_rss_mb"] > 10 and r["peak_private_mb"] > 10
        assert set(r["pass_seconds"]) == {"convert_and_count", "merge_columns", "map_ids"}
        assert r["distinct_ids"] == sum(s - 2 for s in results[0]["table_sizes"])
    # The threshold maps rare ids to one row: no column grows.
    assert all(a <= b for a, b in zip(results[2]["table_sizes"], results[0]["table_sizes"]))
    assert not work.exists(), "the generated days and outputs must be removed"
