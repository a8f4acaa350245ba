"""Fast cache simulators against the plain-Python references."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from torchrec_lookahead.oracle.cacher import TIE_BREAKS
from torchrec_lookahead.oracle.misses import lfu_misses, lru_misses, min_misses, oracle_misses
from torchrec_lookahead.testing.simulate import (
    reference_lfu,
    reference_lru,
    reference_min,
    reference_windowed,
)

batches_and_capacity = st.integers(1, 30).flatmap(
    lambda rows: st.tuples(
        st.lists(st.lists(st.integers(0, rows - 1), max_size=10).map(np.array), max_size=30),
        st.integers(10, 30),
    )
)


@given(batches_and_capacity)
def test_fast_lru_matches_reference(case) -> None:
    batches, capacity = case
    assert lru_misses(batches, capacity).tolist() == reference_lru(batches, capacity)


@given(batches_and_capacity)
def test_fast_lfu_matches_reference(case) -> None:
    batches, capacity = case
    assert lfu_misses(batches, capacity).tolist() == reference_lfu(batches, capacity)


@given(batches_and_capacity, st.sampled_from(TIE_BREAKS))
def test_min_misses_no_more_than_lru_or_lfu(case, tie_break) -> None:
    batches, capacity = case
    best = reference_min(batches, capacity, tie_break)
    assert min_misses(batches, capacity, tie_break=tie_break).tolist() == best
    assert sum(best) <= sum(reference_lru(batches, capacity))
    assert sum(best) <= sum(reference_lfu(batches, capacity))


@given(batches_and_capacity)
def test_an_empty_window_orders_by_the_tie_break_alone(case) -> None:
    # What lru_misses and lfu_misses rely on, checked on the references themselves.
    batches, capacity = case
    for tie_break, reference in (("recency", reference_lru), ("frequency", reference_lfu)):
        outcomes = reference_windowed(batches, capacity, 0, 0, tie_break)
        assert [len(o.fetched) for o in outcomes] == reference(batches, capacity)


@given(batches_and_capacity, st.integers(0, 6), st.integers(0, 2))
def test_oracle_misses_follow_the_reference(case, lookahead, d) -> None:
    batches, capacity = case
    for tie_break in TIE_BREAKS:
        try:
            outcomes = reference_windowed(batches, capacity, lookahead, d, tie_break)
        except ValueError:
            continue
        got = oracle_misses(batches, capacity, lookahead, d, tie_break=tie_break)
        assert got.tolist() == [len(o.fetched) for o in outcomes]


def test_policies_refuse_a_batch_larger_than_the_cache() -> None:
    batches = [np.array([0, 1, 2])]
    for simulate in (lru_misses, lfu_misses, reference_lru, reference_lfu):
        with pytest.raises(ValueError):
            simulate(batches, 2)


def test_lfu_keeps_the_frequent_row_that_lru_drops() -> None:
    # Row 0 is used often early, then a scan of new rows passes through.
    batches = [np.array([0, 1])] + [np.array([0])] * 3 + [np.array([r]) for r in range(2, 6)]
    batches.append(np.array([0]))
    assert lfu_misses(batches, 2).tolist()[-1] == 0
    assert lru_misses(batches, 2).tolist()[-1] == 1
