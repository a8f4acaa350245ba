"""``cache/`` on its own: slot pools, and a cache table moving rows to and from its store."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from torchrec_lookahead.cache.id_passes import pool_ids, table_counts
from torchrec_lookahead.cache.pools import slot_pools
from torchrec_lookahead.cache.slot_cache import SlotCache
from torchrec_lookahead.oracle.contract import CachePlan
from torchrec_lookahead.store import HostStore

NONE = np.empty(0, np.int64)


def test_tables_of_one_width_share_a_pool_where_the_optimizer_allows() -> None:
    rows, dims = [5, 7, 3], [4, 8, 4]
    shared = slot_pools(rows, dims, EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    assert [(p.tables, p.dim, p.offsets.tolist()) for p in shared] == [
        ((0, 2), 4, [0, 5, 8]),
        ((1,), 8, [0, 7]),
    ]
    apart = slot_pools(rows, dims, EmbOptimType.ADAM)  # not checked to share: one pool each
    assert [p.tables for p in apart] == [(0,), (1,), (2,)]


def test_a_pools_ids_split_back_into_their_tables_rows() -> None:
    (pool,) = slot_pools([5, 7, 3], [4, 4, 4], EmbOptimType.EXACT_SGD)
    ids = np.random.default_rng(0).integers(0, pool.num_rows, 200)
    seen = np.zeros(len(ids), bool)
    for table, rows, positions in pool.by_table(ids):
        assert np.array_equal(pool.offsets[pool.tables.index(table)] + rows, ids[positions])
        assert rows.min() >= 0 and rows.max() < [5, 7, 3][table]
        seen[positions] = True
    assert seen.all()
    counts = pool.table_counts(ids)
    bounds = zip(pool.offsets[:-1], pool.offsets[1:])
    assert counts.tolist() == [int(((lo <= ids) & (ids < hi)).sum()) for lo, hi in bounds]


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_a_batchs_ids_become_pool_ids_in_one_pass_and_the_first_bad_id_is_found(dtype) -> None:
    rng = np.random.default_rng(1)
    rows, offsets, lengths = np.array([5, 9, 3]), np.array([0, 5, 14]), np.array([4, 0, 6])
    values = np.concatenate([rng.integers(0, r, n) for r, n in zip(rows, lengths)]).astype(dtype)
    ids, bad = pool_ids(values, lengths, rows, offsets)
    assert bad == -1 and ids.dtype == np.int64
    assert ids.tolist() == (values + np.repeat(offsets, lengths)).tolist()
    for position, value in [(5, 3), (6, -1), (2, 5)]:  # 3 is past the third table's rows
        broken = values.copy()
        broken[position] = value
        broken[9] = -4  # a later bad id: the first one is reported
        assert pool_ids(broken, lengths, rows, offsets)[1] == position


def test_ids_are_counted_per_range_as_numpy_counts_them() -> None:
    offsets = np.array([0, 5, 5, 12, 20])  # the second range is empty
    rng = np.random.default_rng(2)
    runs = np.sort(rng.integers(0, 20, 300))  # runs of one range
    for ids in (runs, rng.permutation(runs), runs[:0]):
        expected = np.bincount(np.searchsorted(offsets, ids, side="right") - 1, minlength=4)
        assert table_counts(ids, offsets).tolist() == expected.tolist()
    for outside in (-1, 20):
        with pytest.raises(ValueError, match="outside every table"):
            table_counts(np.append(runs, outside), offsets)


@pytest.fixture
def tables() -> tuple[list[torch.Tensor], SlotCache]:
    """Two tables (5 and 7 rows of width 4) in one pool of 4 slots, SGD."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, 4, generator=generator) for n in (5, 7)]
    store = HostStore([w.clone() for w in weights])
    pools = slot_pools([5, 7], [4, 4], EmbOptimType.EXACT_SGD)
    cache = SlotCache(pools, [4], [0, 1], EmbOptimType.EXACT_SGD, store, torch.device("cpu"))
    return weights, cache


def plan(
    fetch: Sequence[int] = (),
    slots: Sequence[int] = (),
    evict: Sequence[int] = (),
    evicted: Sequence[int] = (),
) -> CachePlan:
    """Fetch pool ids ``fetch`` into ``slots``; write ``evict`` back from ``evicted``."""
    ids = [np.array(list(v), np.int64) for v in (evict, evicted, fetch, slots)]
    return CachePlan(0, NONE, *ids)


def test_fetched_rows_are_looked_up_by_slot_and_written_back_on_eviction(tables) -> None:
    weights, cache = tables
    cache.apply(0, plan(fetch=[1, 6, 11], slots=[0, 1, 2]))  # table 0 row 1, table 1 rows 1, 6
    assert cache.slot_ids[0].tolist() == [1, 6, 11, -1]
    # Feature 0 (table 0): one bag of slot 0; feature 1 (table 1): one bag of slots 1 and 2.
    pooled = cache.forward(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 3]))
    assert torch.equal(pooled[0, :4], weights[0][1])
    assert torch.equal(pooled[0, 4:], weights[1][1] + weights[1][6])

    for table in cache.store.weights:  # the store forgets; the cache still holds the rows
        table.zero_()
    cache.apply(0, plan(evict=[6], evicted=[1]))
    assert cache.slot_ids[0].tolist() == [1, -1, 11, -1]
    assert torch.equal(cache.store.weights[1][1], weights[1][1])
    assert not cache.store.weights[1][6].any()  # still cached: not written yet
    cache.write_back_all()
    assert torch.equal(cache.store.weights[0][1], weights[0][1])
    assert torch.equal(cache.store.weights[1][6], weights[1][6])
    assert cache.slot_ids[0].tolist() == [1, -1, 11, -1]  # written back, still cached
