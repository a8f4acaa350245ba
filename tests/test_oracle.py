"""OracleCacher: the oracle's contract (docs/design.md), against the reference simulator."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.contract import plan_growing, replay
from torchrec_lookahead import OracleCacher
from torchrec_lookahead.oracle import kernels
from torchrec_lookahead.oracle.cacher import TIE_BREAKS
from torchrec_lookahead.testing.simulate import reference_min, reference_windowed

tie_breaks = st.sampled_from(TIE_BREAKS)


@st.composite
def traces(draw: st.DrawFn) -> tuple[list[np.ndarray], int, int, int, int]:
    num_rows = draw(st.integers(1, 40))
    batches = draw(
        st.lists(
            st.lists(st.integers(0, num_rows - 1), max_size=12).map(
                lambda ids: np.array(ids, dtype=np.int64)
            ),
            max_size=25,
        )
    )
    capacity = draw(st.integers(1, 40))
    lookahead = draw(st.integers(0, 6))
    prefetch_distance = draw(st.integers(0, 3))
    return batches, num_rows, capacity, lookahead, prefetch_distance


def run_oracle(batches, capacity, lookahead, d, num_rows=None, tie_break="frequency"):
    oracle = OracleCacher(capacity, lookahead, d, num_rows, tie_break=tie_break)
    plans = list(oracle.plan(batches))
    return oracle, plans


def assert_matches_reference(batches, num_rows, capacity, lookahead, d, tie_break) -> None:
    """The oracle meets the contract and makes the reference's choices, step by step."""
    try:
        expected = reference_windowed(batches, capacity, lookahead, d, tie_break)
    except ValueError:
        with pytest.raises(ValueError, match="a capacity of at least"):
            run_oracle(batches, capacity, lookahead, d, num_rows, tie_break)
        return
    oracle, plans = run_oracle(batches, capacity, lookahead, d, num_rows, tie_break)
    replay(batches, plans, oracle.flush(), capacity, d)
    for plan, want in zip(plans, expected):
        assert set(plan.fetch_ids.tolist()) == want.fetched, plan.step
        assert set(plan.evict_ids.tolist()) == want.evicted, plan.step


@given(traces(), tie_breaks)
def test_plans_meet_the_contract_and_match_the_reference(trace, tie_break) -> None:
    assert_matches_reference(*trace, tie_break)


@pytest.mark.parametrize("tie_break", TIE_BREAKS)
@pytest.mark.parametrize("lookahead, d", [(0, 0), (1, 1), (4, 2), (16, 0), (60, 1)])
def test_matches_the_reference_on_larger_traces(lookahead, d, tie_break) -> None:
    # Larger than hypothesis draws: many groups of candidates, some evicted in part, and
    # (on the uniform trace, whose rows come back within the window) buckets taken in part.
    rng = np.random.default_rng(lookahead * 10 + d)
    skewed = [np.minimum(rng.zipf(1.3, size=50), 400) - 1 for _ in range(60)]
    uniform = [rng.integers(0, 250, size=40) for _ in range(60)]
    for batches, capacity in [(skewed, 130), (skewed, 200), (uniform, 90), (uniform, 150)]:
        assert_matches_reference(batches, 400, capacity, lookahead, d, tie_break)


@given(traces(), tie_breaks)
def test_full_lookahead_without_prefetch_distance_is_belady_min(trace, tie_break) -> None:
    batches, num_rows, capacity, _, _ = trace
    try:
        expected = reference_min(batches, capacity, tie_break)
    except ValueError:
        return
    _, plans = run_oracle(batches, capacity, len(batches), 0, num_rows, tie_break)
    assert [p.num_misses for p in plans] == expected


@pytest.mark.parametrize("tie_break, evicted", [("frequency", 2), ("recency", 1)])
def test_tie_break_among_rows_with_no_use_in_the_window(tie_break, evicted) -> None:
    # At step 2 neither row 1 nor row 2 is used in the window. Row 1 was used twice
    # (duplicates count) but longer ago: frequency keeps it, recency does not.
    batches = [np.array([1, 1]), np.array([2]), np.array([3]), np.array([4])]
    _, plans = run_oracle(batches, capacity=2, lookahead=1, d=0, tie_break=tie_break)
    assert plans[2].evict_ids.tolist() == [evicted]


def test_unknown_tie_break_is_refused() -> None:
    with pytest.raises(ValueError, match="tie_break"):
        OracleCacher(4, 1, tie_break="random")
    with pytest.raises(ValueError, match="tie_break"):
        reference_windowed([np.array([1])], 4, 1, 0, tie_break="lfu")


def test_kernels_release_the_gil_and_oracles_plan_on_threads() -> None:
    for kernel in (kernels.prepare_batch, kernels.enter_batch, kernels.emit_step):
        assert kernel.targetoptions["nogil"], kernel
    rng = np.random.default_rng(7)
    tables = [[rng.integers(0, 5000, size=3000) for _ in range(20)] for _ in range(2)]
    alone = [[p.fetch_ids.tolist() for p in run_oracle(t, 4500, 4, 1)[1]] for t in tables]
    together: list = [None, None]

    def plan(t: int) -> None:
        together[t] = [p.fetch_ids.tolist() for p in run_oracle(tables[t], 4500, 4, 1)[1]]

    threads = [threading.Thread(target=plan, args=(t,)) for t in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together == alone


def optimal_misses(batches: list[set[int]], capacity: int) -> int:
    """Fewest misses any demand-fetching cache can have: search over resident sets."""
    states = {frozenset(): 0}
    for rows in batches:
        following: dict[frozenset[int], int] = {}
        for resident, misses in states.items():
            missing = rows - resident
            keep = resident - rows
            room = capacity - len(rows)
            # keep any subset of the other resident rows that still fits
            options = [frozenset()]
            for r in keep:
                options += [o | {r} for o in options]
            for kept in options:
                if len(kept) <= room:
                    nxt = frozenset(kept | rows)
                    cost = misses + len(missing)
                    if cost < following.get(nxt, 1 << 30):
                        following[nxt] = cost
        states = following
    return min(states.values())


@given(
    st.integers(1, 4).flatmap(
        lambda cap: st.tuples(
            st.just(cap),
            st.lists(st.sets(st.integers(0, 5), max_size=cap), min_size=1, max_size=8),
        )
    )
)
def test_belady_min_reference_is_optimal(case) -> None:
    capacity, batches = case
    arrays = [np.array(sorted(b), dtype=np.int64) for b in batches]
    assert sum(reference_min(arrays, capacity)) == optimal_misses(batches, capacity)


def test_longer_lookahead_never_misses_more_on_a_skewed_trace() -> None:
    rng = np.random.default_rng(3)
    ranks = np.minimum(rng.zipf(1.2, size=(200, 64)), 5000) - 1
    batches = list(ranks)
    misses = [sum(p.num_misses for p in run_oracle(batches, 300, L, 1)[1]) for L in (1, 8, 64)]
    best = sum(reference_min(batches, 300))
    assert misses[0] >= misses[1] >= misses[2] >= best
    assert misses[0] > best  # the window matters on this trace


def test_accepts_torch_tensors_and_lists() -> None:
    batches = [[1, 2, 2], np.array([3, 1]), torch.tensor([4, 4, 2])]
    oracle, plans = run_oracle(batches, 4, 2, 1, num_rows=5)
    as_numpy = [np.asarray(b) for b in batches]
    replay(as_numpy, plans, oracle.flush(), 4, 1)


@pytest.mark.parametrize(
    "bad, message",
    [
        (np.array([1, -3, 2]), "step 1: negative id -3"),
        (np.array([1, 7]), "step 1: id 7 is out of range for a table of 5 rows"),
        (np.array([[1, 2]]), "1-D array"),
        (np.array([0.5, 1.0]), "integers"),
        (np.array([0, 1, 2, 3, 4]), "a capacity of at least 5 is needed"),
        (np.array([1, 2**63 + 5], np.uint64), f"step 1: id {2**63 + 5} is out of range"),
    ],
)
def test_bad_batch_is_refused_and_changes_nothing(bad, message) -> None:
    good = [np.array([0, 1]), np.array([2, 3]), np.array([1, 4]), np.array([0, 3])]
    oracle = OracleCacher(capacity=4, lookahead=2, prefetch_distance=0, num_rows=5)
    plans = [p for p in [oracle.push(good[0])] if p is not None]
    with pytest.raises(ValueError, match=message):
        oracle.push(bad)
    for batch in good[1:]:
        plans += [p for p in [oracle.push(batch)] if p is not None]
    plans += oracle.finish()
    replay(good, plans, oracle.flush(), 4, 0)
    clean = OracleCacher(capacity=4, lookahead=2, prefetch_distance=0, num_rows=5)
    for got, want in zip(plans, clean.plan(good)):
        assert np.array_equal(got.slots, want.slots)
        assert np.array_equal(got.fetch_ids, want.fetch_ids)
        assert np.array_equal(got.evict_ids, want.evict_ids)


def test_capacity_error_names_the_steps_and_the_capacity_needed() -> None:
    oracle = OracleCacher(capacity=5, lookahead=4, prefetch_distance=1)
    oracle.push(np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"steps 0\.\.1 use 6 distinct rows.*at least 6"):
        oracle.push(np.array([3, 4, 5, 3]))


BAD_ORACLE_SETTINGS = [
    ("capacity", 0),
    ("capacity", math.nan),
    ("capacity", 4.0),
    ("capacity", True),
    ("lookahead", -1),
    ("lookahead", math.nan),
    ("lookahead", math.inf),
    ("lookahead", 2.5),
    ("lookahead", 2.0),
    ("lookahead", True),
    ("lookahead", "2"),
    ("lookahead", None),
    ("prefetch_distance", -1),
    ("prefetch_distance", math.inf),
    ("prefetch_distance", 1.0),
    ("num_rows", 0),
    ("num_rows", math.nan),
    ("num_rows", 10.0),
    ("tie_break", None),
    ("tie_break", "lru"),
]


@pytest.mark.parametrize("name, value", BAD_ORACLE_SETTINGS)
def test_bad_settings_are_refused_naming_them(name: str, value: object) -> None:
    """As the pipeline checks its settings (``torchrec_lookahead.settings``): every bad
    one is a ``ValueError`` naming it, raised by the constructor."""
    settings: dict[str, object] = {
        "capacity": 4,
        "lookahead": 2,
        "prefetch_distance": 1,
        "num_rows": 10,
        name: value,
    }
    with pytest.raises(ValueError, match=name):
        OracleCacher(**settings)


def test_integer_settings_of_any_integer_type_are_taken_as_ints() -> None:
    oracle = OracleCacher(np.int64(4), np.int32(2), np.uint8(1), num_rows=np.int64(10))
    assert [
        type(v)
        for v in (oracle.capacity, oracle.lookahead, oracle.prefetch_distance, oracle.num_rows)
    ] == [int] * 4
    assert oracle.push(np.array([1, 2])) is None


def test_push_emits_each_plan_once_its_window_is_visible() -> None:
    oracle = OracleCacher(capacity=8, lookahead=2, prefetch_distance=1)
    emitted = [oracle.push(np.array([i])) for i in range(5)]
    assert [p.step if p else None for p in emitted] == [None, None, 0, 1, 2]
    assert [p.step for p in oracle.finish()] == [3, 4]
    assert oracle.finish() == []


def test_flush_keeps_rows_resident_and_the_stream_can_go_on() -> None:
    batches = [np.array([i % 7, (3 * i) % 11]) for i in range(30)]
    oracle = OracleCacher(capacity=6, lookahead=3, prefetch_distance=1, num_rows=11)
    plans = list(oracle.plan(batches[:15]))
    mid = oracle.flush()
    assert len(mid.evict_ids) == oracle.num_resident
    plans += list(oracle.plan(batches[15:]))
    replay(batches, plans, oracle.flush(), 6, 1)


def test_ids_beyond_the_first_batches_grow_the_tables_when_num_rows_is_unknown() -> None:
    batches = [np.array([1, 2]), np.array([10_000, 2]), np.array([123_456, 1])]
    oracle = OracleCacher(capacity=4, lookahead=1, prefetch_distance=1)
    plans = list(oracle.plan(batches))
    replay(batches, plans, oracle.flush(), 4, 1)


def test_prepare_checks_without_changing_anything() -> None:
    batches = [np.array([1, 2]), np.array([3, 3, 4]), np.array([2, 5])]
    oracle = OracleCacher(capacity=4, lookahead=1, prefetch_distance=1, num_rows=10)
    plans = [p for p in [oracle.push(batches[0])] if p]
    prepared = oracle.prepare(batches[1])
    with pytest.raises(ValueError, match="a capacity of at least 5"):
        oracle.prepare(np.array([5, 6, 7]))
    oracle.prepare(np.array([9]))  # checked, never pushed: no trace
    plans += [p for p in [oracle.push(prepared)] if p]
    with pytest.raises(ValueError, match="prepared for step 1 cannot enter at step 2"):
        oracle.push(prepared)
    with pytest.raises(ValueError, match="another oracle"):
        OracleCacher(4, 1, 1).push(oracle.prepare(batches[2]))
    plans += [p for p in [oracle.push(batches[2])] if p] + oracle.finish()
    clean = list(OracleCacher(4, 1, 1, 10).plan(batches))
    assert [p.fetch_ids.tolist() for p in plans] == [p.fetch_ids.tolist() for p in clean]
    assert [p.slots.tolist() for p in plans] == [p.slots.tolist() for p in clean]


def test_load_kernels_loads_every_planning_kernel_before_the_first_batch() -> None:
    """In a fresh process: nothing is loaded at import, all three passes after."""
    script = (
        "from torchrec_lookahead.oracle import kernels as k\n"
        "from torchrec_lookahead.oracle.cacher import load_kernels\n"
        "passes = (k.prepare_batch, k.enter_batch, k.emit_step)\n"
        "print([len(p.signatures) for p in passes])\n"
        "load_kernels()\n"
        "print([len(p.signatures) for p in passes])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[:2] == ["[0, 0, 0]", "[1, 1, 1]"]


@given(traces(), tie_breaks)
def test_an_oracle_grown_when_a_window_needs_more_slots_meets_the_contract(
    trace, tie_break
) -> None:
    """Grown mid-stream (new free slots, the resident rows kept in theirs), the oracle's
    plans keep every rule, each judged at the capacity the plan was made with."""
    batches, num_rows, capacity, lookahead, d = trace
    oracle = OracleCacher(1, lookahead, d, num_rows, tie_break=tie_break)
    plans, capacities = plan_growing(oracle, batches)
    replay(batches, plans, oracle.flush(), capacities, d)


def test_a_batch_prepared_sized_enters_only_once_the_oracle_has_grown() -> None:
    oracle = OracleCacher(capacity=5, lookahead=4, prefetch_distance=1)
    oracle.push(np.array([0, 1, 2]))
    prepared, needed = oracle.prepare_sized(np.array([3, 4, 5, 3]))
    assert needed == 6
    with pytest.raises(ValueError, match="at least 6"):
        oracle.push(prepared)
    with pytest.raises(ValueError, match="capacity must be at least 5"):
        oracle.grow(4)
    oracle.grow(6)
    oracle.push(prepared)
    assert [len(p.fetch_ids) for p in oracle.finish()] == [3, 3]


def test_the_passes_are_recompiled_when_a_helper_module_changes() -> None:
    """Numba's cache keys the passes by kernels.py alone: a helper edited without updating
    HELPERS_DIGEST would leave stale compiled passes in the cache."""
    folder = Path(kernels.__file__).parent
    digest = hashlib.sha256()
    for name in kernels.HELPERS:
        digest.update((folder / name).read_bytes())
    assert digest.hexdigest()[:16] == kernels.HELPERS_DIGEST, (
        f"an oracle helper module changed: set kernels.HELPERS_DIGEST = "
        f"{digest.hexdigest()[:16]!r} (editing kernels.py makes numba recompile the passes)"
    )
