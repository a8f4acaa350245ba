"""Synthetic Criteo-shaped streams: shape, reproducibility and skew."""

from __future__ import annotations

import numpy as np
import pytest

from torchrec_lookahead.data import CRITEO_KAGGLE_TABLE_SIZES, SyntheticCriteo, ZipfSampler


def test_default_shape_is_criteo_kaggle() -> None:
    data = SyntheticCriteo(scale=0.001)
    assert data.num_tables == 26 == len(CRITEO_KAGGLE_TABLE_SIZES)
    assert data.num_embeddings[2] == round(10131227 * 0.001)
    assert min(data.num_embeddings) == 1  # tiny tables keep one row
    batch = data.batch(0, 32)
    assert batch.lengths.shape == (26, 32) and (batch.lengths == 1).all()
    for ids, rows in zip(batch.values, data.num_embeddings):
        assert len(ids) == 32 and ids.min() >= 0 and ids.max() < rows


def test_batches_are_reproducible_per_step_and_differ_across_steps_and_seeds() -> None:
    data = SyntheticCriteo(scale=0.01, pooling_factor=2.5, seed=7)
    again = SyntheticCriteo(scale=0.01, pooling_factor=2.5, seed=7)
    a, b = data.batch(5, 64), again.batch(5, 64)
    assert np.array_equal(a.lengths, b.lengths)
    assert all(np.array_equal(x, y) for x, y in zip(a.values, b.values))
    assert not np.array_equal(a.values[2], data.batch(6, 64).values[2])
    other_seed = SyntheticCriteo(scale=0.01, pooling_factor=2.5, seed=8).batch(5, 64)
    assert not np.array_equal(a.values[2], other_seed.values[2])
    streamed = list(data.batches(64, 3, first=4))[1]
    assert np.array_equal(streamed.values[0], a.values[0])


def test_pooling_factor_gives_poisson_lengths_with_empty_bags() -> None:
    batch = SyntheticCriteo(scale=0.01, pooling_factor=1.5).batch(0, 4096)
    assert (batch.lengths == 0).any()
    assert abs(batch.lengths.mean() - 1.5) < 0.05
    assert [len(v) for v in batch.values] == batch.lengths.sum(axis=1).tolist()


def test_zipf_frequencies_follow_the_law() -> None:
    sampler = ZipfSampler(100_000, 1.1, salt=3)
    rng = np.random.default_rng(0)
    ranks = sampler.sample_ranks(rng, 400_000)
    pmf = np.diff(np.concatenate([[0.0], sampler.cdf]))
    observed = np.bincount(ranks, minlength=100_000) / len(ranks)
    # The hottest ranks within 4 standard errors of their probability.
    se = np.sqrt(pmf[:20] * (1 - pmf[:20]) / len(ranks))
    assert np.all(np.abs(observed[:20] - pmf[:20]) < 4 * se)
    top_share = observed[:1000].sum()  # top 1% of rows
    assert abs(top_share - sampler.cdf[999]) < 0.01
    assert top_share > 0.6  # strongly skewed


def test_rank_to_id_is_a_permutation() -> None:
    for rows in (1, 3, 24, 1000, 4096):
        sampler = ZipfSampler(rows, 1.1, salt=11)
        assert sorted(sampler.rank_to_id(np.arange(rows)).tolist()) == list(range(rows))


@pytest.mark.parametrize("kwargs", [dict(scale=0), dict(pooling_factor=0)])
def test_bad_settings_are_refused(kwargs) -> None:
    with pytest.raises(ValueError):
        SyntheticCriteo(**kwargs)


def test_huge_tables_draw_the_same_law_without_per_row_memory(monkeypatch) -> None:
    exact = ZipfSampler(100_000, 1.1)
    monkeypatch.setattr(ZipfSampler, "EXACT_ROWS", 100)  # the tail beyond rank 100 is inverted
    split = ZipfSampler(100_000, 1.1)
    assert len(split.cdf) == 100
    a = exact.sample_ranks(np.random.default_rng(0), 400_000)
    b = split.sample_ranks(np.random.default_rng(1), 400_000)
    assert b.min() >= 0 and b.max() < 100_000
    for top in (1, 100, 1_000, 10_000, 50_000):  # share of draws among the hottest ranks
        assert abs((a < top).mean() - (b < top).mean()) < 0.005, top
