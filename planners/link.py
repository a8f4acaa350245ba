"""What a byte on the link and the replicas' work cost, measured where the job runs.

:func:`measure_link_cost` times a short all-to-all between the ranks (the
link's cost per byte a rank sends, or ``--link_gbps`` stated instead) and a
tiny all-reduce (a hop's latency), and times the replicas' work on this
machine on sample batches: splitting the hot ids off, pooling them, their
gradients, the update through FBGEMM. Every rank takes the largest of every
rank's measurements, so all choose the same hot rows
(:func:`~planners.hot.propose_hot_rows`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from planners.hot import LinkCost
from torchrec_lookahead.embedding.hot import HotLayout, RowRange, split_batch
from torchrec_lookahead.embedding.hot.replicas import ReplicaTables
from torchrec_lookahead.embedding.hot.sync import ordered_sum, union_of

__all__ = ["measure_link_cost", "probe_link", "replica_work"]

PROBE_BYTES = 4 << 20  # per rank: long enough that the rate, not the latency, sets the time


def probe_link(
    group: dist.ProcessGroup | None, device: torch.device, nbytes: int = PROBE_BYTES
) -> tuple[float, float]:
    """Seconds per byte a rank sends in an all-to-all, and a hop's latency (a one-float
    all-reduce), medians of three after a warm-up. A collective."""
    world = dist.get_world_size(group)
    send = torch.zeros(nbytes // 4 // world * world, device=device)
    receive = torch.empty_like(send)
    tiny = torch.zeros(1, device=device)
    times, hops = [], []
    for attempt in range(4):
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_to_all_single(receive, send, group=group)
        middle = time.perf_counter()
        dist.all_reduce(tiny, group=group)
        end = time.perf_counter()
        if attempt:  # the first connects and warms up
            times.append(middle - start)
            hops.append(end - middle)
    sent = send.numel() * 4 * (world - 1) / world
    return statistics.median(times) / max(sent, 1), statistics.median(hops)


def replica_work(
    batches: Mapping[str, Sequence[np.ndarray]],
    dim: int,
    optimizer: EmbOptimType,
    params: Mapping[str, object],
    device: torch.device,
) -> float:
    """Seconds of the replicas' work per hot lookup on this machine: the sample batches
    (``batches[table][step]``, every id taken as hot) split, pooled and updated as the
    hot-row tier does at one rank, timed after a warm-up step."""
    names = list(batches)
    steps = min(len(s) for s in batches.values())
    rows = {n: int(max((int(s.max()) for s in batches[n] if len(s)), default=0)) + 1 for n in names}
    hot = {n: np.unique(np.concatenate([np.asarray(s) for s in batches[n]])) for n in names}
    hot = {n: ids for n, ids in hot.items() if len(ids)}
    if not hot or steps < 2:
        return 0.0
    layout = HotLayout(
        hot,
        keys=names,
        key_tables=names,
        table_features={n: [n] for n in names},
        num_embeddings=rows,
        table_params={n: {"optimizer": optimizer, **params} for n in hot},
        shards={n: [RowRange(0, 0, rows[n])] for n in hot},
        dim=dim,
    )
    replicas = ReplicaTables(layout, device)
    seconds, lookups = 0.0, 0
    for step in range(steps):
        values = [np.asarray(batches[n][step], dtype=np.int64) for n in names]
        bag = max(len(v) for v in values)
        lengths = np.concatenate([np.ones(len(v), dtype=np.int64) for v in values])
        if bag == 0 or any(len(v) != bag for v in values):
            continue  # one id a bag, as many bags per table: what the sample's steps hold
        features = KeyedJaggedTensor(
            keys=names,
            values=torch.from_numpy(np.concatenate(values)),
            lengths=torch.from_numpy(lengths),
            stride=bag,
        )
        start = time.perf_counter()
        _, split = split_batch(layout, features, True, device)
        pooled = replicas.pooled(split)
        grad = torch.ones_like(pooled)
        per_id = grad.view(bag, len(names), dim).transpose(0, 1).reshape(-1, dim)
        per_id = per_id.index_select(0, split.bags)
        union = union_of(split, None, layout.num_rows)
        sums, rates = ordered_sum(
            [(union.positions, per_id)], len(union.host), dim, np.zeros(len(hot)), None, device
        )
        replicas.apply(union, sums, np.zeros(len(layout.tables)))
        if step:  # the first warms up
            seconds += time.perf_counter() - start
            lookups += len(split.rows)
    return seconds / lookups if lookups else 0.0


def measure_link_cost(
    batches: Mapping[str, Sequence[np.ndarray]],
    dim: int,
    optimizer: EmbOptimType,
    params: Mapping[str, object],
    group: dist.ProcessGroup | None,
    device: torch.device,
    link_gbps: float | None = None,
) -> LinkCost:
    """The :class:`LinkCost` of this job: the link probed (or ``link_gbps`` stated), the
    replicas' work timed; the largest of every rank's figures. A collective."""
    per_byte, hop = probe_link(group, device)
    if link_gbps is not None:
        per_byte = 8 / (link_gbps * 1e9)
    per_lookup = replica_work(batches, dim, optimizer, params, device)
    figures = torch.tensor([per_byte, hop, per_lookup], dtype=torch.float64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=group)
    per_byte, hop, per_lookup = figures.tolist()
    world = dist.get_world_size(group)
    return LinkCost(per_byte=per_byte, per_lookup=per_lookup, per_step=world * hop)
