"""The host-link benchmark's simulators against the project's references, and its report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchrec_lookahead.data import SyntheticCriteo
from torchrec_lookahead.oracle import OracleCacher
from torchrec_lookahead.oracle.misses import lru_misses, oracle_misses
from torchrec_lookahead.testing.simulate import reference_lru

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import host_link  # noqa: E402

ROWS = 40
traces = st.tuples(
    st.lists(st.lists(st.integers(0, ROWS - 1), max_size=10).map(np.array), max_size=25),
    st.integers(20, 30),
)


def murmur_set(linear_id: int, sets: int) -> int:
    """FBGEMM's ``cache_slot`` in Python integers."""
    mask = (1 << 64) - 1
    h = linear_id
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & mask
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & mask
    h ^= h >> 33
    return h % sets


def counts_of(cache: host_link.FbgemmLruCache, batches: list[np.ndarray]) -> np.ndarray:
    return np.array([cache.step(b.astype(np.int64), s) for s, b in enumerate(batches)])


def oracle_counts(oracle: OracleCacher, batches: list[np.ndarray]) -> np.ndarray:
    return np.array([host_link.plan_counts(p) for p in oracle.plan(batches)])


def test_cache_set_is_fbgemms_hash() -> None:
    ids = [0, 1, 2, 31, 12345, 33_762_577, 2**40 + 7, 2**62 + 3]
    for sets in (1, 7, 10_563, 2**20 + 1):
        assert [host_link.cache_set(i, sets) for i in ids] == [murmur_set(i, sets) for i in ids]


@settings(max_examples=40, deadline=None)
@given(traces)
def test_one_set_without_the_lock_is_fully_associative_lru(case) -> None:
    """One set as wide as the cache, no lock: the reference LRU's misses, and the same
    fetches and write-backs as the project's fast LRU."""
    batches, capacity = case
    cache = host_link.FbgemmLruCache(1, ROWS, lock=False, ways=capacity)
    counts = counts_of(cache, batches).reshape(-1, len(host_link.COUNTS))
    assert counts[:, 0].tolist() == reference_lru(batches, capacity)
    lru = OracleCacher(capacity, 0, 0, ROWS, tie_break="recency")
    assert counts.tolist() == oracle_counts(lru, batches).reshape(counts.shape).tolist()


@settings(max_examples=40, deadline=None)
@given(traces)
def test_one_set_with_the_lock_pins_the_previous_step(case) -> None:
    """The prefetch pipeline's lock keeps the previous step's rows: LRU with steps s-1..s
    pinned, the oracle with an empty window and prefetch distance 1."""
    batches, capacity = case
    cache = host_link.FbgemmLruCache(1, ROWS, lock=True, ways=capacity)
    counts = counts_of(cache, batches).reshape(-1, len(host_link.COUNTS))
    pinned = OracleCacher(capacity, 0, 1, ROWS, tie_break="recency")
    assert counts.tolist() == oracle_counts(pinned, batches).reshape(counts.shape).tolist()


def test_a_full_set_leaves_misses_uncached_and_reads_them_per_occurrence() -> None:
    cache = host_link.FbgemmLruCache(1, 10, lock=True, ways=2)
    step0 = cache.step(np.array([5, 3, 3, 7, 9, 9, 9]), 0)
    # Misses in order of id: 3 and 5 take the two slots; 7 (once) and 9 (3 times) stay out.
    assert step0.tolist() == [4, 2, 0, 2, 4]
    assert sorted(cache.tags[0].tolist()) == [3, 5]
    # Step 1 may not evict step 0's rows (locked): its miss stays out; step 2 evicts.
    assert cache.step(np.array([1]), 1).tolist() == [1, 0, 0, 1, 1]
    assert cache.step(np.array([1, 5]), 2).tolist() == [1, 1, 1, 0, 0]
    assert sorted(cache.tags[0].tolist()) == [1, 5]
    counts = np.array([step0])
    assert host_link.step_bytes(counts, 512).tolist() == [(2 + 0 + 4 + 2 * 2) * 512]


def test_main_writes_what_it_simulated(tmp_path: Path) -> None:
    flags = ["--scale", "0.01", "--batch-size", "64", "--cache-fraction", "0.01"]
    flags += ["--dim", "16", "--lookahead", "3", "--steps", "40", "--warmup", "5"]
    report = host_link.main([*flags, "--out", str(tmp_path)])
    written = (tmp_path / "report.json").read_text()
    assert (tmp_path / "host_link.png").stat().st_size > 0
    assert written == json.dumps(report, indent=1)
    policies = {p["name"]: p for p in report["policies"]}
    assert set(policies) == set(host_link.POLICIES)
    skipped = report["steps_skipped"]
    assert skipped >= 5 and report["steps_measured"] == 40 - skipped
    for name, p in policies.items():
        assert {"misses_per_step", "bytes_per_step", "row_bytes"} <= set(p)
        steps = report["per_step"][name]
        assert p["misses_per_step"] == pytest.approx(np.mean(steps["misses"][skipped:]))
        assert p["bytes_per_step"] == pytest.approx(np.mean(steps["bytes"][skipped:]))
        assert p["full_after_step"] is not None and p["full_after_step"] < skipped
        moved = np.add(steps["rows_fetched"], steps["rows_written_back"])
        if name.startswith("fbgemm"):
            assert p["row_bytes"] == 4 * 16
            moved = moved + np.add(steps["uncached_reads"], 2 * np.array(steps["uncached_rows"]))
        else:
            assert p["row_bytes"] == 4 * 17
            assert steps["uncached_rows"] == [0] * 40
        assert steps["bytes"] == (moved * p["row_bytes"]).tolist()
    assert policies["fbgemm-lru"]["bytes_ratio_to_fbgemm_lru"] == 1.0
    # The same stream through the project's own simulators gives the same misses.
    data = SyntheticCriteo(scale=0.01, zipf_exponent=1.05, seed=0)
    offsets = np.cumsum([0, *data.num_embeddings[:-1]])
    stream = [
        np.concatenate([v + o for v, o in zip(data.batch(s, 64).values, offsets)])
        for s in range(43)
    ]
    capacity = report["cache_rows"]
    expected = oracle_misses(stream, capacity, 3, 1, report["rows"])[:40]
    assert report["per_step"]["lookahead"]["misses"] == expected.tolist()
    assert report["per_step"]["lru"]["misses"] == lru_misses(stream[:40], capacity).tolist()
