"""Criteo-shaped synthetic id streams with realistic skew.

Real click logs are heavily skewed: on Criteo about 1% of rows take over 90%
of accesses. A bounded Zipf law with exponent about 1.1 reproduces that, and
it is what decides how well any embedding cache does, so synthetic data for
cache experiments must have it (uniform ids, as TorchRec's
``RandomRecDataset`` draws, are the worst case for every cache).

Each step's batch is drawn from its own seeded generator, so any batch can be
regenerated on its own (by a data-loader worker, or ahead of time).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

__all__ = ["CRITEO_KAGGLE_TABLE_SIZES", "SparseBatch", "SyntheticCriteo", "ZipfSampler"]

# Rows per categorical feature of the Criteo Kaggle (Display Advertising) data set.
CRITEO_KAGGLE_TABLE_SIZES: tuple[int, ...] = (
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
)


class ZipfSampler:
    """Ids in ``[0, num_rows)`` whose popularity follows a bounded Zipf law.

    The row of popularity rank ``r`` (0 = hottest) is drawn with probability
    proportional to ``(r + 1) ** -exponent``. Ranks map to ids by a fixed
    affine permutation, so hot rows are spread over the table as hashed ids are.
    Memory: one float64 per row (the cumulative distribution), up to
    ``EXACT_ROWS`` rows. Larger tables (those of disk stores, which must not
    cost memory per row) keep it for the hottest ``EXACT_ROWS`` ranks only and
    draw the tail by inverting the continuous law ``x ** -exponent`` on
    ``[EXACT_ROWS + 0.5, num_rows + 0.5)`` (the midpoint rule: within a
    fraction of a percent of the exact law there, and fixed memory).
    """

    EXACT_ROWS = 1 << 22

    def __init__(self, num_rows: int, exponent: float, salt: int = 0) -> None:
        if num_rows < 1:
            raise ValueError(f"num_rows must be at least 1, got {num_rows}")
        if exponent < 0:
            raise ValueError(f"exponent must be >= 0, got {exponent}")
        self.num_rows = num_rows
        self.exponent = exponent
        head = min(num_rows, self.EXACT_ROWS)
        cdf = np.cumsum(np.arange(1, head + 1, dtype=np.float64) ** -exponent)
        tail = _power_integral(head + 0.5, num_rows + 0.5, exponent) if head < num_rows else 0.0
        self.cdf = cdf / (cdf[-1] + tail)  # the head's cumulative share; the tail has the rest
        multiplier = int(num_rows * 0.6180339887) | 1
        while math.gcd(multiplier, num_rows) != 1:
            multiplier += 2
        self._multiplier = multiplier % num_rows or 1
        self._offset = (salt * 0x9E3779B1) % num_rows

    def rank_to_id(self, ranks: np.ndarray) -> np.ndarray:
        return (ranks * self._multiplier + self._offset) % self.num_rows

    def sample_ranks(self, rng: np.random.Generator, size: int) -> np.ndarray:
        u = rng.random(size)
        ranks = np.searchsorted(self.cdf, u, side="right")
        in_tail = ranks >= len(self.cdf)
        if in_tail.any():  # u beyond the head's share: invert the tail's integral
            head = self.cdf[-1]
            share = (u[in_tail] - head) / (1.0 - head)
            x = _power_inverse(len(self.cdf) + 0.5, self.num_rows + 0.5, self.exponent, share)
            ranks[in_tail] = np.floor(x - 0.5).astype(np.int64)  # x in [r+0.5, r+1.5): rank r
        return np.minimum(ranks, self.num_rows - 1)

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        return self.rank_to_id(self.sample_ranks(rng, size))


def _power_integral(a: float, b: float, s: float) -> float:
    """The integral of ``x ** -s`` over ``[a, b]``."""
    if s == 1.0:
        return math.log(b / a)
    return (b ** (1 - s) - a ** (1 - s)) / (1 - s)


def _power_inverse(a: float, b: float, s: float, share: np.ndarray) -> np.ndarray:
    """``x`` in ``[a, b]`` with ``share`` of the integral of ``x ** -s`` on ``[a, b]`` below it."""
    if s == 1.0:
        return a * (b / a) ** share
    lo, hi = a ** (1 - s), b ** (1 - s)
    return (lo + share * (hi - lo)) ** (1 / (1 - s))


@dataclass(frozen=True)
class SparseBatch:
    """One batch of categorical features in jagged form, one entry per table.

    ``lengths[t, i]`` ids of table ``t`` belong to sample ``i``; ``values[t]``
    holds them, concatenated in sample order.
    """

    lengths: np.ndarray  # int64 [num_tables, batch_size]
    values: tuple[np.ndarray, ...]


@dataclass(frozen=True)
class SyntheticCriteo:
    """A Criteo-shaped source of categorical ids.

    Args:
        table_sizes: rows per table before scaling (Criteo Kaggle's by default).
        scale: multiplies every table size (at least one row is kept).
        zipf_exponent: skew of every table's id popularity.
        pooling_factor: mean ids per sample and table. ``1.0`` gives exactly
            one id (as in Criteo); other values draw Poisson lengths, so
            empty bags occur.
        seed: the stream's seed; batch ``step`` depends only on it and ``step``.
    """

    table_sizes: Sequence[int] = CRITEO_KAGGLE_TABLE_SIZES
    scale: float = 1.0
    zipf_exponent: float = 1.1
    pooling_factor: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.scale <= 0:
            raise ValueError(f"scale must be positive, got {self.scale}")
        if self.pooling_factor <= 0:
            raise ValueError(f"pooling_factor must be positive, got {self.pooling_factor}")

    @cached_property
    def num_embeddings(self) -> tuple[int, ...]:
        """Rows per table after scaling."""
        return tuple(max(1, round(n * self.scale)) for n in self.table_sizes)

    @property
    def num_tables(self) -> int:
        return len(self.table_sizes)

    @cached_property
    def samplers(self) -> tuple[ZipfSampler, ...]:
        return tuple(
            ZipfSampler(n, self.zipf_exponent, salt=self.seed * 1000 + t)
            for t, n in enumerate(self.num_embeddings)
        )

    def batch(self, step: int, batch_size: int) -> SparseBatch:
        """The sparse features of batch ``step`` (reproducible)."""
        rng = np.random.default_rng([self.seed, step])
        if self.pooling_factor == 1.0:
            lengths = np.ones((self.num_tables, batch_size), dtype=np.int64)
        else:
            lengths = rng.poisson(self.pooling_factor, (self.num_tables, batch_size))
        values = tuple(
            sampler.sample(rng, int(n)) for sampler, n in zip(self.samplers, lengths.sum(axis=1))
        )
        return SparseBatch(lengths.astype(np.int64), values)

    def batches(self, batch_size: int, num_batches: int, first: int = 0) -> Iterator[SparseBatch]:
        for step in range(first, first + num_batches):
            yield self.batch(step, batch_size)

    def table_streams(self, batch_size: int, num_batches: int) -> list[list[np.ndarray]]:
        """Per table, the ids of each batch: ``streams[t][step]``."""
        streams: list[list[np.ndarray]] = [[] for _ in range(self.num_tables)]
        for batch in self.batches(batch_size, num_batches):
            for t, ids in enumerate(batch.values):
                streams[t].append(ids)
        return streams
