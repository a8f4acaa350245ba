"""Replicated hot rows: what the collection refuses, what the planner picks, what is counted.

Training with them against plain TorchRec runs in ``test_distributed.py``
(``test_replicated_hot_rows_train_like_plain_torchrec``) and in the DLRM
example at two ranks (``test_dlrm_example.py``).
"""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from planners import hot_rows_report, propose_hot_rows
from torchrec_lookahead import (
    LookaheadEmbeddingBagCollection,
    LookaheadEmbeddingBagCollectionSharder,
)
from torchrec_lookahead.data import SyntheticCriteo

META = torch.device("meta")


def tables(dims=(8, 8), pooling=PoolingType.SUM, features=None):  # noqa: ANN001, ANN201
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=100,
                               feature_names=(features or [[f"f{i}"] for _ in dims])[i],
                               pooling=pooling)
            for i, d in enumerate(dims)]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hot_rows": {"t9": [1]}}, r"hot_rows names unknown tables \['t9'\]"),
        ({"hot_rows": {"t0": [3, 100]}}, r"hot_rows\['t0'\]: ids \[100\] are outside"),
        ({"hot_rows": {"t0": [-1]}}, r"ids \[-1\] are outside"),
        ({"hot_rows": {"t0": [4, 4]}}, "names some ids twice"),
        ({"hot_rows": {"t0": [1]}, "is_weighted": True}, "weighted features"),
        ({"hot_rows": {"t0": [1]}, "tables": tables(pooling=PoolingType.MEAN)}, "MEAN pooling"),
        ({"hot_rows": {"t0": [1]}, "tables": tables(dims=(8, 16))}, r"several widths \[8, 16\]"),
        ({"hot_rows": {"t0": [1]}, "tables": tables(features=[["f"], ["f"]])}, "in two tables"),
    ],
)
def test_hot_rows_that_cannot_be_replicated_exactly_are_refused(kwargs, message) -> None:
    kwargs = {"tables": tables(), **kwargs}
    with pytest.raises(ValueError, match=message):
        LookaheadEmbeddingBagCollection(device=META, **kwargs)


def test_a_plan_splitting_a_hot_tables_columns_is_refused_before_sharding() -> None:
    module = LookaheadEmbeddingBagCollection(tables(), device=META, hot_rows={"t1": [5, 6]})
    sharder = LookaheadEmbeddingBagCollectionSharder()
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=2, compute_device="cpu"),
        constraints={t.name: ParameterConstraints(sharding_types=["column_wise"], min_partition=4)
                     for t in tables()},
    ).plan(module, [sharder])  # fmt: skip
    with pytest.raises(ValueError, match=r"table t1: hot rows are replicated whole"):
        sharder.shard(module, plan.plan[""], ShardingEnv(world_size=2, rank=0, pg=None))


def test_the_planner_replicates_the_rows_that_save_bytes_within_its_budget() -> None:
    data = SyntheticCriteo(table_sizes=(50_000, 20), zipf_exponent=1.1, seed=3)
    steps = [data.batch(s, 2048) for s in range(30)]
    batches = {"big": [b.values[0] for b in steps], "tiny": [b.values[1] for b in steps]}
    proposal = propose_hot_rows(batches, world_size=2, dim=16, state_floats=1)
    assert set(proposal.hot["tiny"]) == set(range(20)), "a tiny table is hot whole"
    hottest = data.samplers[0].rank_to_id(np.arange(50))
    assert set(hottest) <= set(proposal.hot["big"])
    assert len(proposal.hot["big"]) < 5_000 and proposal.lookup_share["big"] > 0.5
    assert proposal.replica_bytes["big"] == len(proposal.hot["big"]) * 4 * 17
    assert "hot rows:" in hot_rows_report(proposal)
    small = propose_hot_rows(batches, 2, 16, 1, budget_bytes=100 * 68)
    assert small.rows == 100 and set(small.hot["tiny"]) == set(range(20))
    assert propose_hot_rows(batches, 1, 16, 1).rows == 0, "one rank has nothing to replicate"


def _count(rank: int, port: int) -> None:
    from torchrec_lookahead.traffic import CollectiveBytes, label

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        with CollectiveBytes() as sent:
            ids = torch.arange(8, dtype=torch.int64)
            received = torch.empty(11 if rank else 5, dtype=torch.int64)
            dist.all_to_all_single(received, ids, [5, 6] if rank else [3, 2],
                                   [2, 6] if rank else [3, 5])  # fmt: skip
            rows = torch.ones(4, 16)
            dist.all_to_all_single(torch.empty(4, 16), rows)
            with label("hot_sync"):
                dist.all_reduce(torch.ones(10))
            held = dist.all_reduce  # as a thread entering a collective while the counter closes
        sent_ids = 5 * 8 if rank == 0 else 2 * 8  # all but its own part
        assert sent.bytes["ids"] == sent_ids, sent.bytes
        assert sent.bytes["pooled"] == 2 * 16 * 4, sent.bytes
        assert sent.bytes["hot_sync"] == 40, sent.bytes  # ring: 2 (W - 1) / W of 40 bytes
        dist.all_reduce(torch.ones(3))  # not counted once the counter has closed
        held(torch.ones(3))  # still torch's all-reduce, not counted
        assert dist.all_reduce is not held
        assert sent.embedding_total == sent_ids + 128 + 40
    finally:
        dist.destroy_process_group()


def test_collective_bytes_are_what_each_rank_sends_to_the_others() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_count, args=(port,), nprocs=2, join=True)


def test_a_batch_splits_into_its_cold_bags_and_hot_ids_by_either_search() -> None:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_lookahead.embedding.replicated import ReplicatedRows, RowRange

    hot = {"t0": np.array([1, 5, 7]), "t1": np.array([0, 2])}
    keys, batch = ["f0", "f1", "f2"], 4  # f2: a table without hot rows
    lengths = np.array([[1, 2, 0, 1], [1, 1, 1, 2], [1, 0, 1, 1]])
    values = np.array([5, 3, 7, 1,  2, 2, 9, 0, 4,  5, 6, 7])  # fmt: skip
    features = KeyedJaggedTensor(keys=keys, values=torch.from_numpy(values),
                                 lengths=torch.from_numpy(lengths.reshape(-1)),
                                 stride=batch)  # fmt: skip
    searched = type("Searched", (ReplicatedRows,), {"DIRECT_ROWS": 0})  # large tables' search
    splits = []
    for kind in (ReplicatedRows, searched):
        rows = kind(
            hot, keys, ["t0", "t1", "t2"], {"t0": 10, "t1": 10, "t2": 10},
            {name: [RowRange(0, 0, 10)] for name in hot}, 4, EmbOptimType.EXACT_SGD, {},
            torch.device("cpu"), lambda: 0.1,
        )  # fmt: skip
        splits.append(rows.split(features, True, None, torch.device("cpu")))
    for cold, step in splits:
        # Hot ids, feature-major, as replica rows: t0's 5, 7, 1 (rows 1, 2, 0); t1's 2, 2, 0
        # (rows 4, 4, 3)
        assert step.indices.tolist() == [1, 2, 0, 4, 4, 3]
        assert step.offsets.tolist() == [0, 1, 2, 2, 3, 4, 5, 5, 6, 6, 6, 6, 6]
        union, positions = step.union(rows.num_rows)
        assert union.tolist() == [0, 1, 2, 3, 4] and positions.tolist() == [1, 2, 0, 4, 4, 3]
        # Cold: bags with cold ids, then one empty bag for the samples without any.
        assert cold.values().tolist() == [3, 9, 4, 5, 6, 7]
        assert cold.stride_per_key() == [2, 3, 4]
        assert cold.lengths().tolist() == [1, 0, 1, 1, 0, 1, 0, 1, 1]
        assert cold.inverse_indices()[1].tolist() == [[1, 0, 1, 1], [2, 2, 0, 1], [0, 1, 2, 3]]
    assert splits[0][1].indices.tolist() == splits[1][1].indices.tolist()


def test_the_union_reads_a_bit_or_a_byte_per_row() -> None:
    """Over gloo the ranks OR-reduce a bit per hot row; NCCL, which has no bitwise OR,
    MAX-reduces a byte per row: the union reads both."""
    from torchrec_lookahead.embedding.replicated import HotStep

    touched = np.zeros(11, dtype=bool)
    touched[[2, 3, 9]] = True
    rows = torch.tensor([9, 2, 9])
    for packed, bits in ((True, np.packbits(touched)), (False, touched.view(np.uint8))):
        step = HotStep(indices=rows, offsets=torch.tensor([0, 3]), bags=torch.zeros(3),
                       touched=torch.from_numpy(bits), exchange=None, batch=1,
                       packed=packed)  # fmt: skip
        union, positions = step.union(11)
        assert union.tolist() == [2, 3, 9] and positions.tolist() == [2, 0, 2]
