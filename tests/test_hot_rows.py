"""Replicated hot rows: what the collection refuses, what the planner picks, what is counted.

Training with them against plain TorchRec runs in ``test_distributed.py``
(``test_replicated_hot_rows_train_like_plain_torchrec``) and in the DLRM
example at two ranks (``test_dlrm_example.py``).
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

from planners import hot_rows_report, propose_hot_rows
from tests.launch import free_port, spawn
from torchrec_lookahead import (
    HotRowsEmbeddingBagCollection,
    HotRowsEmbeddingBagCollectionSharder,
)
from torchrec_lookahead.data import SyntheticCriteo

META = torch.device("meta")


def tables(dims=(8, 8), pooling=PoolingType.SUM, features=None):  # noqa: ANN001, ANN201
    return [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=d,
            num_embeddings=100,
            feature_names=(features or [[f"f{i}"] for _ in dims])[i],
            pooling=pooling,
        )
        for i, d in enumerate(dims)
    ]


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
        ({"hot_rows": {"t0": []}}, "names no row"),
    ],
)
def test_hot_rows_that_cannot_be_replicated_exactly_are_refused(kwargs, message) -> None:
    kwargs = {"tables": tables(), **kwargs}
    with pytest.raises(ValueError, match=message):
        HotRowsEmbeddingBagCollection(device=META, **kwargs)


def test_a_plan_splitting_a_hot_tables_columns_is_refused_before_sharding() -> None:
    module = HotRowsEmbeddingBagCollection(tables(), device=META, hot_rows={"t1": [5, 6]})
    sharder = HotRowsEmbeddingBagCollectionSharder()
    plan = EmbeddingShardingPlanner(
        topology=Topology(world_size=2, compute_device="cpu"),
        constraints={
            t.name: ParameterConstraints(sharding_types=["column_wise"], min_partition=4)
            for t in tables()
        },
    ).plan(module, [sharder])
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
    collectives = ("all_to_all_single", "all_reduce", "broadcast", "send", "recv")
    functions = {name: getattr(dist, name) for name in collectives}
    try:
        with CollectiveBytes() as sent:
            ids = torch.arange(8, dtype=torch.int64)
            received = torch.empty(11 if rank else 5, dtype=torch.int64)
            dist.all_to_all_single(
                received, ids, [5, 6] if rank else [3, 2], [2, 6] if rank else [3, 5]
            )
            rows = torch.ones(4, 16)
            dist.all_to_all_single(torch.empty(4, 16), rows)
            with torch.profiler.profile() as profile, label("hot_sync"):
                dist.all_reduce(torch.ones(10))
            with label("other"):  # a send counts what it sends; a receive nothing
                if rank == 0:
                    dist.send(torch.ones(3), dst=1)
                else:
                    dist.recv(torch.empty(3), src=0)
                dist.broadcast(torch.ones(5), src=1)  # from rank 1: 20 bytes to rank 0
            dist.broadcast(torch.ones(7), src=0)  # unlabelled: bookkeeping, not counted
            # Any thread's collectives count: an all-to-all of 2 ids to the other rank.
            other = threading.Thread(
                target=dist.all_to_all_single, args=(torch.empty(4).long(), torch.ones(4).long())
            )
            other.start()
            other.join()
        assert {name: getattr(dist, name) for name in collectives} == functions, "torch's own"
        sent_ids = 5 * 8 if rank == 0 else 2 * 8  # all but its own part
        assert sent.bytes["ids"] == sent_ids + 2 * 8, sent.bytes
        assert sent.bytes["pooled"] == 2 * 16 * 4, sent.bytes
        assert sent.bytes["hot_sync"] == 40, sent.bytes  # ring: 2 (W - 1) / W of 40 bytes
        assert sent.bytes["other"] == (12 if rank == 0 else 20), sent.bytes
        names = [event.name for event in profile.events()]
        assert "## lookahead:hot_sync ##" in names, names  # named in a profile, as TorchRec's
        counted = dict(sent.bytes)
        dist.all_to_all_single(torch.empty(4), torch.ones(4))  # the counter has closed
        assert sent.bytes == counted
        assert sent.embedding_total == sent_ids + 16 + 128 + 40 + counted["other"]
        with CollectiveBytes() as again:  # a second counter counts afresh
            dist.all_to_all_single(torch.empty(4), torch.ones(4))
            with pytest.raises(ValueError, match="unknown kind"):
                with label("hot sync"):
                    pass
        assert again.bytes["pooled"] == 8 and sent.bytes == counted, again.bytes
    finally:
        dist.destroy_process_group()


def test_collective_bytes_are_what_each_rank_sends_to_the_others() -> None:
    spawn(_count, (free_port(),), nprocs=2)


def _layout(hot, keys, key_tables, rows=10):  # noqa: ANN001, ANN202
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from torchrec_lookahead.embedding.hot import HotLayout, RowRange

    names = sorted(set(key_tables))
    features = {t: [k for k, kt in zip(keys, key_tables) if kt == t] for t in names}
    return HotLayout(
        hot,
        keys,
        key_tables,
        features,
        dict.fromkeys(names, rows),
        {t: {"optimizer": EmbOptimType.EXACT_SGD} for t in hot},
        {name: [RowRange(0, 0, rows)] for name in hot},
        4,
    )


def test_a_batch_splits_into_its_cold_bags_and_hot_ids_by_either_search() -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_lookahead.embedding.hot.split import direct_map, split_batch
    from torchrec_lookahead.embedding.hot.sync import union_of

    hot = {"t0": np.array([1, 5, 7]), "t1": np.array([0, 2])}
    keys, batch = ["f0", "f1", "f2"], 4  # f2: a table without hot rows
    lengths = np.array([[1, 2, 0, 1], [1, 1, 1, 2], [1, 0, 1, 1]])
    values = np.array([5, 3, 7, 1, 2, 2, 9, 0, 4, 5, 6, 7])
    features = KeyedJaggedTensor(
        keys=keys,
        values=torch.from_numpy(values),
        lengths=torch.from_numpy(lengths.reshape(-1)),
        stride=batch,
    )
    layout = _layout(hot, keys, ["t0", "t1", "t2"])
    cpu = torch.device("cpu")
    splits = [
        split_batch(layout, features, True, cpu, row_of) for row_of in (direct_map(layout), None)
    ]  # the map of small tables, the search of large ones
    for cold, step in splits:
        # Hot ids, feature-major, as replica rows: t0's 5, 7, 1 (rows 1, 2, 0); t1's 2, 2, 0
        # (rows 4, 4, 3); one group, so one lookup of every bag.
        assert step.rows.tolist() == [1, 2, 0, 4, 4, 3]
        assert step.bags.tolist() == [0, 1, 3, 4, 5, 7]
        rows, offsets = step.lookups[0]
        assert rows.tolist() == [1, 2, 0, 4, 4, 3]
        assert offsets.tolist() == [0, 1, 2, 2, 3, 4, 5, 5, 6, 6, 6, 6, 6]
        union = union_of(step, None, layout.num_rows)
        assert union.rows.tolist() == [0, 1, 2, 3, 4]
        assert union.positions.tolist() == [1, 2, 0, 4, 4, 3]
        # Cold: bags with cold ids, then one empty bag for the samples without any.
        assert cold.values().tolist() == [3, 9, 4, 5, 6, 7]
        assert cold.stride_per_key() == [2, 3, 4]
        assert cold.lengths().tolist() == [1, 0, 1, 1, 0, 1, 0, 1, 1]
        assert cold.inverse_indices()[1].tolist() == [[1, 0, 1, 1], [2, 2, 0, 1], [0, 1, 2, 3]]


def test_a_shared_tables_hot_ids_are_summed_feature_by_feature() -> None:
    """FBGEMM adds a table's gradients feature by feature: a table serving two features
    has its hot ids in two rounds, each in bag order."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_lookahead.embedding.hot.split import split_batch

    layout = _layout({"t0": np.array([1, 2])}, ["a", "b"], ["t0", "t0"])
    assert layout.num_rounds == 2 and layout.groups[0].shared
    features = KeyedJaggedTensor(
        keys=["b", "a"],
        values=torch.tensor([2, 1, 1, 2]),
        lengths=torch.tensor([1, 1, 1, 1]),
        stride=2,
    )
    _, step = split_batch(layout, features, False, torch.device("cpu"))
    # Key order a, b: a's ids 1, 2 (bags 0, 1) in round 0, then b's 2, 1 (bags 2, 3).
    assert step.rows.tolist() == [0, 1, 1, 0] and step.bags.tolist() == [0, 1, 2, 3]
    assert step.round_ends == (2, 4)


def test_the_union_reads_a_bit_or_a_byte_per_row() -> None:
    """Over gloo the ranks OR-reduce a bit per hot row; NCCL, which has no bitwise OR,
    MAX-reduces a byte per row: the union reads both."""
    from torchrec_lookahead.embedding.hot import HotSplit
    from torchrec_lookahead.embedding.hot.sync import union_of

    touched = np.zeros(11, dtype=bool)
    touched[[2, 3, 9]] = True
    rows = torch.tensor([9, 2, 9])
    for packed, bits in ((True, np.packbits(touched)), (False, touched.view(np.uint8))):
        step = HotSplit(
            batch=1,
            lookups=[],
            rows=rows,
            bags=torch.zeros(3, dtype=torch.int64),
            round_ends=(3,),
            touched=torch.from_numpy(bits),
            packed=packed,
            ids=3,
            host_rows=rows.numpy(),
        )
        union = union_of(step, None, 11)
        assert union.rows.tolist() == [2, 3, 9] and union.positions.tolist() == [2, 0, 2]


def _spawn_hot(cases) -> None:  # noqa: ANN001
    from tests.hot_cases import hot_worker

    spawn(hot_worker, (2, free_port(), cases), nprocs=2)


def test_hot_rows_train_bitwise_like_plain_torchrec() -> None:
    """Every optimizer FBGEMM runs on the CPU, table- and row-wise: the replicas' update
    is the owners' update, summed in the owners' order, so training is bitwise plain
    TorchRec's (before: 7.5e-9 apart at 30 steps, and row-wise Adagrad 0.86 apart after
    100 steps of the DLRM example, where a nearly cancelling sum rounded otherwise)."""
    from tests.hot_cases import HotCase

    _spawn_hot(
        [HotCase(optimizer=o) for o in ("sgd", "adagrad", "rowwise_adagrad")]
        + [HotCase(sharding_type="row_wise")]
    )


def test_hot_rows_follow_a_learning_rate_schedule_and_per_table_optimizers() -> None:
    """(a) The replicas' update uses the rate the owner uses at that step (before: the
    next step's, read when the update was applied). (d) Each table's own optimizer and
    rate (before: the first hot table's settings and kernels[0]'s rate for all)."""
    from tests.hot_cases import HotCase

    _spawn_hot([HotCase(schedule=True), HotCase(per_table=True, schedule=True)])


def test_hot_rows_survive_a_new_pipeline_and_a_checkpoint_loaded_mid_run() -> None:
    """(c) A pipeline closed and another attached keeps the replicas' updates (before:
    reloaded from the owners unfolded, 1.4e-3 lost). (e) A checkpoint loaded while the
    pipeline runs reaches the replicas before the next step reads them (before: the
    prepared steps trained on stale replicas, their updates dropped). (b) Ranks holding
    different hot rows are refused on every rank when the pipeline attaches."""
    from tests.hot_cases import HotCase

    _spawn_hot(
        [
            HotCase(reattach_at=7, steps=20),
            HotCase(reload_at=(4, 12), steps=24),
            HotCase(mismatched_hot_rows=True, steps=2),
        ]
    )


def test_hot_rows_train_like_plain_torchrec_after_an_eval_forward_before_the_first_step() -> None:
    """(g) An eval forward of the model itself before the first step: TorchRec makes its
    output dists from that plain batch, the steps send the cold part as a variable batch
    (before: "variable batch dist is not initialized!" at the first step)."""
    from tests.hot_cases import HotCase

    _spawn_hot([HotCase(eval_first=True, steps=12)])


def _refuse_2d(rank: int, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torchrec.distributed.types import ShardingEnv2D

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType

        module = HotRowsEmbeddingBagCollection(tables(), device=META, hot_rows={"t1": [5, 6]})
        sgd = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
        sharder = HotRowsEmbeddingBagCollectionSharder(fused_params=sgd)
        plan = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu")).plan(
            module, [sharder]
        )
        world = dist.GroupMember.WORLD
        env = ShardingEnv2D(world, world, world, init_device_mesh("cpu", (1, 1)))
        with pytest.raises(ValueError, match="not replicated under 2D parallelism"):
            sharder.shard(module, plan.plan[""], env)
    finally:
        dist.destroy_process_group()


def test_hot_rows_under_2d_parallelism_are_refused() -> None:
    """(f) DMPCollection shards over a sharding group and all-reduces over replica groups:
    the hot rows' gradient divisor and group would be wrong there (before: not refused).
    DMPCollection itself builds on CUDA only; its ShardingEnv2D reaches the sharder here."""
    spawn(_refuse_2d, (free_port(),), nprocs=1)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("features", [1, 2])
def test_the_replicas_apply_what_fbgemm_applies_to_the_owners_bags(optimizer, features) -> None:
    """The owner's FBGEMM adds a row's bag gradients one by one, in float32, in bag order
    (feature by feature for a shared table); a replica given that sum, a bag per row,
    ends bitwise where the owner's row ends, also where the gradients nearly cancel."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from torchrec_lookahead.embedding.hot import HotLayout, RowRange
    from torchrec_lookahead.embedding.hot.replicas import ReplicaTables
    from torchrec_lookahead.embedding.hot.sync import TouchedReplicas, ordered_sum
    from torchrec_lookahead.tbe import training_tbe

    kind = {
        "sgd": EmbOptimType.EXACT_SGD,
        "adagrad": EmbOptimType.EXACT_ADAGRAD,
        "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    }[optimizer]
    rows, dim, batch = 20, 8, 150
    params = {"learning_rate": 0.1, "eps": 1e-8}
    keys = [f"f{k}" for k in range(features)]
    owner = {"t": {"optimizer": kind, **params}}
    layout = HotLayout(
        {"t": np.arange(rows)},
        keys,
        ["t"] * features,
        {"t": keys},
        {"t": rows},
        owner,
        {"t": [RowRange(0, 0, rows)]},
        dim,
    )
    rng = np.random.default_rng(features)
    for trial in range(20):
        owner = training_tbe(
            [rows], dim, kind, params, torch.device("cpu"), features_per_table=features
        )
        replicas = ReplicaTables(layout, torch.device("cpu"))
        start = torch.randn(rows, dim)
        owner.split_embedding_weights()[0].data.copy_(start)
        replicas.tensors(0)[0].copy_(start)
        ids = rng.integers(0, rows, features * batch)  # a bag each, feature-major
        scale = 10.0 ** rng.uniform(-6, 0, (features * batch, 1))
        grads = torch.from_numpy(
            (rng.standard_normal((features * batch, dim)) * scale).astype(np.float32)
        )
        owner(torch.from_numpy(ids), torch.arange(features * batch + 1)).backward(
            grads.view(features, batch, dim).transpose(0, 1).reshape(batch, features * dim)
        )
        union = np.unique(ids)
        positions = torch.from_numpy(np.searchsorted(union, ids))
        rounds = [
            (positions[k * batch : (k + 1) * batch], grads[k * batch : (k + 1) * batch])
            for k in range(features)
        ]
        sums, rates = ordered_sum(
            rounds, len(union), dim, np.array([0.1]), None, torch.device("cpu")
        )
        replicas.apply(TouchedReplicas(union, torch.from_numpy(union), positions), sums, rates)
        mine, theirs = replicas.tensors(0), [owner.split_embedding_weights()[0]]
        theirs += list(owner.split_optimizer_states()[0]) if optimizer != "sgd" else []
        for a, b in zip(mine, theirs, strict=True):
            assert torch.equal(a, b.view_as(a)), f"trial {trial}: {(a - b.view_as(a)).abs().max()}"


def test_on_a_link_where_bytes_cost_little_no_row_pays() -> None:
    """With what bytes and the replicas' work cost, a row is hot only where its bytes take
    the link longer than its lookups take the replicas, and none unless together they pay
    the fixed cost per step too."""
    from planners import LinkCost

    data = SyntheticCriteo(table_sizes=(50_000, 20), zipf_exponent=1.1, seed=3)
    steps = [data.batch(s, 2048) for s in range(30)]
    batches = {"big": [b.values[0] for b in steps], "tiny": [b.values[1] for b in steps]}
    every = propose_hot_rows(batches, world_size=2, dim=16, state_floats=1)
    slow = LinkCost(per_byte=8 / 1e9, per_lookup=1e-7, per_step=1e-4)  # 1 Gbit/s
    fast = LinkCost(per_byte=8 / 100e9, per_lookup=1e-7, per_step=1e-4)  # 100 Gbit/s
    on_slow = propose_hot_rows(batches, 2, 16, 1, link=slow)
    assert 0 < on_slow.rows <= every.rows
    assert set(on_slow.hot["tiny"]) == set(range(20)), "a tiny table still pays whole"
    assert propose_hot_rows(batches, 2, 16, 1, link=fast).rows == 0
    costly_step = LinkCost(per_byte=8 / 1e9, per_lookup=1e-7, per_step=1.0)
    assert propose_hot_rows(batches, 2, 16, 1, link=costly_step).rows == 0
    with pytest.raises(ValueError, match="per_byte must be a finite number"):
        LinkCost(per_byte=float("nan"), per_lookup=0, per_step=0)
