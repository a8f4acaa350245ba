"""The benchmark scripts run end to end (at toy sizes), and the figures they report agree
with what they ran: counts with the batches (regenerated here), ratios and medians with
the figures they are made of, printed rows with the JSON. No timing is asserted."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.common import SequenceData
from planners import LookaheadCacheStatistics
from tests.launch import run_script
from tests.models import needs_store_buffers
from torchrec_lookahead.data import SyntheticCriteo
from torchrec_lookahead.metrics import EMBEDDING_KINDS
from torchrec_lookahead.oracle.misses import lfu_misses, lru_misses, min_misses, oracle_misses

ROOT = Path(__file__).resolve().parents[1]


def benchmark(name: str, out: Path, *flags: str) -> str:
    """Run ``benchmarks/<name>.py --out out *flags`` (as ``python`` would, in a process
    forked from the tests' warm server); its stdout (its stderr if it fails)."""
    done = run_script(ROOT / "benchmarks" / f"{name}.py", "--out", str(out), *flags)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def widest_window(stream: list[np.ndarray], d: int) -> int:
    """Most distinct ids in d + 1 consecutive steps: the smallest cache the benchmarks use."""
    return max(
        len(np.unique(np.concatenate(stream[max(0, s - d) : s + 1]))) for s in range(len(stream))
    )


def distinct_per_step(streams: list[list[np.ndarray]]) -> int:
    """Distinct ids per table and step, summed: what the cache counts as unique ids."""
    return sum(len(np.unique(ids)) for stream in streams for ids in stream)


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
    misses = report["misses"]
    data = SyntheticCriteo(scale=0.002, zipf_exponent=1.1, seed=0)
    streams = data.table_streams(256, 20)
    assert misses["ids"] == 256 * 20 * 26 == sum(len(b) for s in streams for b in s)
    assert misses["rows"] == sum(data.num_embeddings)
    distinct = sum(len(np.unique(b)) for s in streams for b in s)
    assert misses["distinct_ids_per_step_total"] == distinct
    assert misses["compulsory_misses"] == sum(len(np.unique(np.concatenate(s))) for s in streams)

    def capacities(fraction: float) -> list[int]:
        return [
            min(n, max(math.ceil(fraction * n), widest_window(s, 1)))
            for s, n in zip(streams, data.num_embeddings)
        ]

    results = misses["results"]
    assert {r["policy"] for r in results} == {"LRU", "LFU", "oracle L=2", "MIN"}
    for r in results + misses["variants"] + misses["pooled"]:
        assert r["cache_rows"] == sum(capacities(r["cache_fraction"]))
        assert r["miss_rate"] == pytest.approx(r["misses"] / distinct)
    for fraction in (0.01, 0.1):
        caps = capacities(fraction)
        by_policy = {r["policy"]: r["misses"] for r in results if r["cache_fraction"] == fraction}
        lru = sum(
            int(lru_misses(s, c, n).sum()) for s, c, n in zip(streams, caps, data.num_embeddings)
        )
        assert by_policy["LRU"] == lru
        oracle = sum(
            int(oracle_misses(s, c, 2, 1, n).sum())
            for s, c, n in zip(streams, caps, data.num_embeddings)
        )
        assert by_policy["oracle L=2"] == oracle
        assert misses["compulsory_misses"] <= by_policy["MIN"] <= min(by_policy.values())
    (checked,) = misses["device_check"]  # at 1%: the device oracle misses as the numba one
    assert checked["equal_every_step"] and checked["lookahead"] == 2
    oracle_at_1 = next(
        r["misses"] for r in results if r["policy"] == "oracle L=2" and r["cache_fraction"] == 0.01
    )
    assert checked["numba_misses"] == checked["device_misses"] == oracle_at_1
    ids = 4096 * 4
    for t in report["throughput"]:
        assert t["ratio_to_unique"] == pytest.approx(t["oracle_s"] / t["unique_s"])
        assert t["ids_per_s"] == pytest.approx(ids / t["oracle_s"])
        assert t["speedup_vs_bagpipe"] == pytest.approx(t["ids_per_s"] / (16384 * 26 / 0.075))
        row = (
            f"{t['partitions']:>2} {t['lookahead']:>4} {t['oracle_s']:>9.3f} {t['unique_s']:>9.3f}"
        )
        assert row in out
    assert (tmp_path / "misses.png").stat().st_size > 0


def test_oracle_report_on_sequence_batches(tmp_path: Path) -> None:
    """``--sequence``: every policy's misses are its misses on the regenerated histories,
    and each printed row has the rates and the L / LRU, LFU, MIN ratios of the JSON."""
    out = benchmark(
        "oracle",
        tmp_path,
        "--sequence",
        "--items",
        "20000",
        "--history-lengths",
        "10",
        "30",
        "--batch-size",
        "16",
        "--steps",
        "30",
        "--cache-fractions",
        "0.01",
        "0.1",
        "--lookaheads",
        "2",
    )
    report = json.loads((tmp_path / "report.json").read_text())
    assert "throughput" not in report and "Planning speed" not in out
    misses = report["misses"]
    stream = SequenceData(20000, 1.1, (10, 30), seed=0).stream(16, 30)
    lengths = [len(b) for b in stream]
    assert min(lengths) >= 16 * 10 and max(lengths) <= 16 * 30
    assert (misses["tables"], misses["rows"], misses["ids"]) == (1, 20000, sum(lengths))
    distinct = sum(len(np.unique(b)) for b in stream)
    assert misses["distinct_ids_per_step_total"] == distinct
    assert misses["compulsory_misses"] == len(np.unique(np.concatenate(stream)))
    assert misses["pooled"] == []  # one table: its pool is its cache
    simulated = {
        "LRU": lambda cap: lru_misses(stream, cap, 20000),
        "LFU": lambda cap: lfu_misses(stream, cap, 20000),
        "oracle L=2": lambda cap: oracle_misses(stream, cap, 2, 1, 20000),
        "MIN": lambda cap: min_misses(stream, cap, 20000),
        "L=2 recency": lambda cap: oracle_misses(stream, cap, 2, 1, 20000, "recency"),
    }
    rows = misses["results"] + misses["variants"]
    assert [r["policy"] for r in rows] == 2 * list(simulated)[:4] + 2 * ["L=2 recency"]
    for fraction in (0.01, 0.1):
        capacity = min(20000, max(math.ceil(fraction * 20000), widest_window(stream, 1)))
        at = {r["policy"]: r for r in rows if r["cache_fraction"] == fraction}
        for policy, simulate in simulated.items():
            assert at[policy]["cache_rows"] == capacity
            assert at[policy]["misses"] == int(simulate(capacity).sum()), (policy, fraction)
            assert at[policy]["miss_rate"] == pytest.approx(at[policy]["misses"] / distinct)
        cells = " ".join(f"{100 * at[p]['miss_rate']:>13.2f}%" for p in simulated)
        ratios = "".join(
            f" {at['oracle L=2']['misses'] / at[p]['misses']:>11.2f}x"
            for p in ("LRU", "LFU", "MIN")
        )
        assert f"{100 * fraction:>6.1f}% {capacity:>10,} {cells}{ratios}" in out
    (checked,) = misses["device_check"]
    assert checked["equal_every_step"]
    assert checked["numba_misses"] == checked["device_misses"]
    assert checked["numba_misses"] == next(
        r["misses"] for r in rows if r["policy"] == "oracle L=2" and r["cache_fraction"] == 0.01
    )
    assert (tmp_path / "misses.png").stat().st_size > 0


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
    data = SyntheticCriteo(scale=0.001, zipf_exponent=1.1, seed=0)
    check_step_time(report, out, data.table_streams(64, 12), sum(data.num_embeddings))
    assert (tmp_path / "step_time.png").stat().st_size > 0


def check_step_time(report: dict, out: str, streams: list[list[np.ndarray]], rows: int) -> None:
    """A step-time report of 12 steps (2 warm-up, one repeat) against its batches: per
    table, the ids of each step (rank 0's under DMP)."""
    look = report["lookahead"]
    assert report["measured_steps"] == 12 - 2 and report["rows"] == rows
    assert report["ratio"] == pytest.approx(look["step_ms"] / report["baseline"]["step_ms"])
    assert report["ratios"] == [report["ratio"]]
    parts = [
        v
        for k, v in look.items()
        if k.endswith("_ms") and k not in ("step_ms", "other_ms") and "background" not in k
    ]
    assert {"stage_ms", "wait_ms", "compute_ms"} <= set(look)
    assert look["other_ms"] == pytest.approx(look["step_ms"] - sum(parts))  # the parts add up
    # Every distinct id of a table's step is a hit or a fetched row.
    fetched = look["rows_fetched_per_step"] * 12
    assert fetched == pytest.approx(round(fetched))
    assert look["hit_rate"] == pytest.approx(1 - fetched / distinct_per_step(streams))
    assert f"ratio {report['ratio']:.2f}x" in out and f"hit rate {look['hit_rate']:.3f}" in out


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
    assert report["cache_rows"] == report["ranks"][0]["cache_rows"]
    data = SyntheticCriteo(scale=0.001, zipf_exponent=1.1, seed=0)
    check_step_time(report, out, data.table_streams(64, 12), sum(data.num_embeddings))
    assert report["lookahead"]["background_input_dist_ms"] > 0  # the stage distributed input


@pytest.mark.parametrize("world_size", [0, 1])
def test_step_time_of_the_bert4rec_like_model_on_sequence_batches(
    tmp_path: Path, world_size: int
) -> None:
    """``--model bert4rec``: the item table's sequence collection against the all-resident
    TBE (unsharded) or plain TorchRec's ``EmbeddingCollection`` (DMP); the same final
    weights, the hit rate of the regenerated histories, and the cache the module sizes
    (the planner's statistics give the same size)."""
    out = benchmark(
        "step_time",
        tmp_path,
        "--model",
        "bert4rec",
        "--world-size",
        str(world_size),
        "--items",
        "5000",
        "--history-lengths",
        "10",
        "30",
        "--batch-size",
        "16",
        "--dim",
        "8",
        "--steps",
        "12",
        "--warmup",
        "2",
        "--lookahead",
        "4",
        "--repeats",
        "1",
    )
    baseline = "plain TorchRec" if world_size else "all resident"
    assert "BERT4Rec-like" in out and baseline in out and "same final weights: True" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["same_weights"] is True
    stream = SequenceData(5000, 1.1, (10, 30), seed=0).stream(16, 12)
    check_step_time(report, out, [stream], 5000)
    # The first batch raises the 5% share to what two batches of as many ids can touch.
    assert report["cache_rows"] == max(250, 2 * len(stream[0]))
    assert report["cache_rows"] == LookaheadCacheStatistics(stream, 5000, 4).capacity(0.05)
    assert (tmp_path / "step_time.png").stat().st_size > 0


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
    rows = SyntheticCriteo(scale=0.001).num_embeddings
    sample = SyntheticCriteo(scale=0.001, seed=1).table_streams(256, 10)
    full = SyntheticCriteo(scale=0.001, seed=2).table_streams(256, 20)
    assert report["rows"] == sum(rows) and "predicted" in out
    assert [a["load_factor"] for a in report["accuracy"]] == [0.01, 0.05, 0.2]
    for a in report["accuracy"]:  # measured: the oracle's misses over the second half
        misses = distinct = 0
        for sampled, stream, n in zip(sample, full, rows):
            # At the cache the module holds (its statistics' floor), or what the window needs.
            module = LookaheadCacheStatistics(sampled, n, 4, 1).capacity(a["load_factor"])
            capacity = min(n, max(module, widest_window(stream, 1)))
            misses += int(oracle_misses(stream, capacity, 4, 1, n)[10:].sum())
            distinct += sum(len(np.unique(b)) for b in stream[10:])
        assert a["measured"] == pytest.approx(misses / distinct)
        assert 0 <= a["predicted"] <= 1
        assert f"{a['load_factor']:>7.0%} {a['predicted']:>10.3f} {a['measured']:>9.3f}" in out


@needs_store_buffers
def test_disk_store_report_compares_stores_and_cleans_up(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    store_dir.mkdir()
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
        str(store_dir),
    )
    assert "disk, no read-ahead" in out and "larger than RAM" in out and "DCP checkpoints" in out
    report = json.loads((tmp_path / "report.json").read_text())
    stores = ("memory", "disk", "disk, no read-ahead")
    fits = report["fits"]
    assert sorted((r["store"], r["lookahead"]) for r in fits) == sorted(
        (name, lookahead) for name in stores for lookahead in (16, 64)
    )
    for lookahead in (16, 64):
        runs = {r["store"]: r for r in fits if r["lookahead"] == lookahead}
        # The same batches, cache and plans, whichever store holds the rows.
        assert len({r["hit_rate"] for r in runs.values()}) == 1
        for name, r in runs.items():  # the printed row: its step time, its ratio to memory
            ratio = r["step_ms"] / runs["memory"]["step_ms"]
            assert f"{lookahead:>4}{name:>22}{r['step_ms']:>10.1f}{ratio:>10.3f}" in out
    row_bytes = 4 * (64 + 1)  # dim 64 and the row-wise Adagrad state

    def rows_of(gigabytes: float) -> int:
        scale = gigabytes * 1e9 / row_bytes / sum(SyntheticCriteo().num_embeddings)
        return sum(SyntheticCriteo(scale=scale, seed=1).num_embeddings)

    huge = report["huge"]
    assert huge["rows"] == rows_of(0.02)
    assert huge["store_gb"] == pytest.approx(huge["rows"] * row_bytes / 1e9)
    for key in ("samples_per_s", "hit_rate", "step_ms", "first_step_ms", "private_mb"):
        assert f"{key:>28}  {huge[key]:,.3f}" in out
    saved = {r["planner"]: r for r in report["checkpoint"]}
    assert set(saved) == {"streamed", "default"}
    for r in saved.values():
        assert r["store_gb"] == pytest.approx(rows_of(0.02) * row_bytes / 1e9)
        assert r["checkpoint_gb"] >= r["store_gb"]  # the rows and their optimizer state
    assert not any(store_dir.iterdir()), "the store files must be removed"


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
    plain, dedup = eight["plain_samples_per_s"], eight["dedup_samples_per_s"]
    assert plain == pytest.approx(statistics.median(eight["plain_all"]))
    assert dedup == pytest.approx(statistics.median(eight["dedup_all"]))
    assert eight["speedup"] == pytest.approx(dedup / plain)
    assert eight["plain_step_ms"] == pytest.approx(1000 * 128 / plain)  # one rank of 128
    # The ceiling: a plain step over the dense part alone, which dedup cannot shrink.
    floor, step = eight["dense_floor_ms"], eight["plain_step_ms"]
    assert eight["speedup_bound"] == pytest.approx(step / floor)
    kept = 1 - 13 / 26 * (1 - 1 / 8)  # sessions of 8 share 13 of 26 features' bags
    assert eight["speedup_bound_by_bags"] == pytest.approx(step / (floor + (step - floor) * kept))
    # One id per feature and sample: 26 ids a sample, 8 bytes each and a bag of 16 floats.
    assert eight["ids_per_step_plain"] == 128 * 26
    assert eight["sparse_mb_per_step_plain"] == pytest.approx(128 * 26 * (16 + 4 * 16) / 2**20)
    assert eight["ids_per_step_dedup"] < 0.6 * eight["ids_per_step_plain"]
    assert "dense floor" in out and "one gather" in out
    assert set(eight["expand_ms"]) == {"fbgemm", "gather"}
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
    for r in results:
        assert len(r["ms_runs"]) == 2 and r["ms"] == pytest.approx(statistics.median(r["ms_runs"]))
        assert r["ids"] == r["batch_size"] * 26  # one id per feature and sample
        assert f"{r['check']:>10}{r['batch_size']:>8}{r['ids']:>9}{r['ms']:>22.3f}" in out


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
    sample_bytes = 13 * 4 + 26 * 8 + 4  # dense float32, sparse int64, label int32
    for (name, _), r in results.items():
        gigabytes = {"small": 0.01, "large": 0.02}[name]
        assert r["gigabytes"] == gigabytes and r["runs"] == 1
        assert r["samples"] == int(gigabytes * 2**30 / sample_bytes / 3) * 3  # whole days
        assert r["data_wait_share"] == pytest.approx(r["data_wait_ms"] / r["step_ms"])
        assert r["rank_private_mb"][0] > 100  # the sampler found the rank's process
        row = f"{gigabytes:>11g} GB {1:>3} {1:>7} {r['samples_per_s']:>10,.0f} {r['step_ms']:>8.2f}"
        assert row in out
    large, small = results["large", 1], results["small", 1]
    goals = report["goals"]
    assert goals["private_memory_large_over_small"] == {
        "ws1_workers1": pytest.approx(max(large["rank_private_mb"]) / max(small["rank_private_mb"]))
    }
    assert goals["data_wait_share_with_workers"] == {
        f"{name}_ws1_workers1": pytest.approx(results[name, 1]["data_wait_share"])
        for name in ("small", "large")
    }
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
    for s in settings.values():
        assert len(s["step_ms_runs"]) == 1
        assert s["step_ms"] == pytest.approx(statistics.median(s["step_ms_runs"]))
        kinds = s["bytes_per_step"]
        assert s["embedding_bytes_per_step"] == sum(kinds[k] for k in EMBEDDING_KINDS)
    plain, hot = settings["torchrec_table_wise"], settings["lookahead_hot"]
    for kind in ("ids", "pooled", "gradients"):  # the same plan: the same all-to-alls
        assert settings["lookahead"]["bytes_per_step"][kind] == plain["bytes_per_step"][kind]
    # The stage's vote as it reads a batch: 8 bytes a batch, one batch a step.
    assert settings["lookahead"]["bytes_per_step"]["other"] == 8
    assert hot["bytes_per_step"]["hot_sync"] > 0 and plain["bytes_per_step"]["hot_sync"] == 0
    assert hot["embedding_bytes_per_step"] < plain["embedding_bytes_per_step"]
    assert result["bytes_ratio"] == pytest.approx(
        hot["embedding_bytes_per_step"] / settings["torchrec_plan"]["embedding_bytes_per_step"]
    )
    assert result["time_ratio"] == pytest.approx(
        hot["step_ms"] / settings["torchrec_plan"]["step_ms"]
    )
    assert f"bytes_ratio {result['bytes_ratio']:.3f}, time_ratio {result['time_ratio']:.3f}" in out
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
        assert r["lines_per_day"] == 3000 and r["days"] == 2 and r["bytes"] > 0
        assert r["lines_per_s"] == pytest.approx(3000 * 2 / r["seconds"])
        assert r["peak_rss_mb"] > 10 and r["peak_private_mb"] > 10
        passes = r["pass_seconds"]
        assert set(passes) == {"convert_and_count", "merge_columns", "map_ids"}
        assert sum(passes.values()) <= r["seconds"]  # the passes happen within the run
        assert r["distinct_ids"] == sum(s - 2 for s in results[0]["table_sizes"])
    # The threshold maps rare ids to one row: no column grows.
    assert all(a <= b for a, b in zip(results[2]["table_sizes"], results[0]["table_sizes"]))
    assert not work.exists(), "the generated days and outputs must be removed"


def test_planning_report_times_the_host_planner_and_counts_its_calls(tmp_path: Path) -> None:
    flags = ["--scale", "0.002", "--batch-sizes", "64", "256", "--fractions", "0.05"]
    out = benchmark("planning", tmp_path, *flags, "--batches", "12", "--warmup", "6")
    assert "wall ms" in out
    rows = json.loads((tmp_path / "report.json").read_text())["results"]
    assert [(r["batch_size"], r["ids_per_batch"]) for r in rows] == [(64, 64 * 26), (256, 256 * 26)]
    assert all(r["cpu_ms"] > 0 and r["wall_ms"] > 0 and len(r["cpu_ms_runs"]) == 3 for r in rows)
    assert all(isinstance(r["faults"], (int, float)) and r["faults"] >= 0 for r in rows)
    # A batch's interpreter work (its calls hold the GIL) does not grow with its ids.
    assert rows[0]["calls"] == rows[1]["calls"] > 0


def test_gil_report_times_the_trainers_launches_beside_each_planner(tmp_path: Path) -> None:
    flags = ["--steps", "30", "--warmup", "5", "--batch-size", "64", "--scale", "0.002"]
    out = benchmark("gil", tmp_path, *flags, "--repeats", "2")
    assert "launch ms" in out
    rows = {r["setting"]: r for r in json.loads((tmp_path / "report.json").read_text())["results"]}
    assert list(rows) == ["alone", "host", "device"]
    assert all(r["launch_ms"] > 0 and len(r["launch_ms_runs"]) == 2 for r in rows.values())
    # Net of a step's wait for a core, which no step's launch time is below.
    assert all(0 < r["net_ms"] <= r["launch_ms"] for r in rows.values())
    # The planners planned beside the trainer; alone, nothing did.
    assert rows["alone"]["plan_ms"] == 0
    assert rows["host"]["plan_ms"] > 0 and rows["device"]["plan_ms"] > 0


def test_gil_on_fake_cuda_plans_on_the_device_and_waits_for_it(tmp_path, monkeypatch) -> None:
    """``--device cuda``: the trainer's ops and the device oracle on (fake) CUDA, the
    planner's launches waited for before its rate is read."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gil
    import torch

    from torchrec_lookahead.testing.fake_cuda import FakeCuda

    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: synchronized.append(a))
    flags = ["--steps", "6", "--warmup", "1", "--repeats", "1", "--device-ms", "1"]
    flags += ["--device", "cuda", "--device-ids", "64"]
    with FakeCuda():
        report = gil.main(["--out", str(tmp_path), *flags])
    rows = {r["setting"]: r for r in report["results"]}
    # The planning thread waits for each batch it planned, beside either planner.
    assert report["config"]["device"] == "cuda" and len(synchronized) >= 2
    assert rows["device"]["plan_ms"] > 0 and rows["alone"]["plan_ms"] == 0


def test_gpu_report_takes_the_median_round_of_each_figure_and_prints_the_hosts_cpu() -> None:
    """``benchmarks/gpu.py`` measures only on a GPU; what it makes of its rounds and how it
    prints a setting's row (the host's CPU columns last) are checked here."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu

    def row(step_ms: float, trainer_ms: float, others_ms: float) -> dict:
        return {
            "setting": "lookahead",
            "cache_fraction": 0.05,
            "step_ms": step_ms,
            "samples_per_s": 0.0,
            "peak_hbm_mb": 10.0,
            "bytes_moved_per_step": 2.0**20,
            "steady_step_ms": [step_ms, step_ms],
            "stage_ms": 0.5,
            "stage_cpu_plan_ms": 1.5,
            "trainer_cpu_ms": trainer_ms,
            "other_threads_cpu_ms": others_ms,
        }

    rounds = [[row(9.0, 3.0, 5.0)], [row(8.0, 4.0, 1.0)], [row(10.0, 2.0, 2.0)]]
    (result,) = gpu.summarised(rounds, batch_size=8192)
    assert (result["step_ms"], result["trainer_cpu_ms"], result["other_threads_cpu_ms"]) == (
        9.0,
        3.0,
        2.0,
    )
    assert result["trainer_cpu_ms_rounds"] == [3.0, 4.0, 2.0]
    assert result["steady_step_ms_rounds"] == [[9.0, 9.0], [8.0, 8.0], [10.0, 10.0]]
    assert "steady_step_ms" not in result
    assert result["samples_per_s"] == pytest.approx(8192 * 1000 / 9.0)
    printed = gpu.line(result).split()
    assert len(printed) == 10  # a value under each of the header's ten columns
    assert printed[-4:] == ["0.50", "1.50", "3.00", "2.00"]  # stage wait, stage CPU, host CPU
