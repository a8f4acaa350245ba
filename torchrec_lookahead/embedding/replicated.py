"""Hot rows on every rank: looked up where their samples are, updated alike everywhere.

Under ``DistributedModelParallel`` every row has one owner, and each lookup
travels there and back. On recommendation data a few rows take most lookups,
so each rank keeps a replica of those (the *hot rows*, chosen per table) with
their optimizer state, as Bagpipe's replicated cache does. The lookahead
stage splits every batch before it is distributed:

1. **Split** (stage, ``L`` steps ahead): a hot id is looked up locally and
   never enters the input all-to-all; cold ids go to their owners as before.
   A sample whose bag of a feature holds only hot ids sends no bag of that
   feature at all: the cold batch is a variable batch (TorchRec's
   deduplicated form, one empty bag standing for all of them), where the
   sharding and the optimizer allow it (otherwise its bags stay, empty).
2. **Union** (stage, async): the ranks exchange which hot rows their batch
   touches (a bit per hot row, OR-reduced), so every rank knows the rows of
   the step's update by the time it runs.
3. **Lookup** (forward): the hot ids are pooled from the replica and added to
   the cold output (SUM pooling: the sum of a bag is the sum of its two parts).
4. **Update** (backward): each rank sums its hot rows' gradients (divided by
   the world size when TorchRec divides the owners' gradients so), the ranks
   all-reduce them over the union (async, beside the rest of the backward),
   and before the replicas are read again every rank applies the same update
   through a FBGEMM TBE of the replica (a bag per row, its gradient the
   summed one). A fused optimizer's update is not linear in the gradient, so
   the row's update needs every rank's share first, as the owner's would.

The replicas stay bitwise equal on every rank (the all-reduce gives each the
same sums). They are loaded from the owners' shards when a pipeline attaches,
and folded back into them whenever the store is written back (``state_dict``,
optimizer state, eval), so checkpoints are plain TorchRec's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.traffic import label

__all__ = ["HotStep", "ReplicaMetrics", "ReplicatedRows", "RowRange", "check_hot_rows"]


@dataclass(frozen=True)
class RowRange:
    """Rows ``[start, stop)`` of a table, held by ``rank`` (a shard)."""

    rank: int
    start: int
    stop: int


@dataclass(frozen=True)
class HotStep:
    """One batch's hot part, made by the stage: what the step's lookup and update read."""

    indices: torch.Tensor  # replica row of each hot id, bag by bag (feature-major)
    offsets: torch.Tensor  # [features * batch + 1]
    bags: torch.Tensor  # each hot id's bag, feature-major (``feature * batch + sample``)
    touched: torch.Tensor  # per replica row: touched by this rank's batch, then by any
    exchange: Any  # the OR-reduce of ``touched`` over the ranks, in flight (None: one rank)
    batch: int
    packed: bool = True  # ``touched`` holds 8 rows a byte (NCCL, with no bitwise OR: one)

    def union(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The replica rows any rank's batch touches (ascending), and each hot id's
        position among them; waits for the exchange, started when the batch was split."""
        if self.exchange is not None:
            self.exchange.wait()
        bits = self.touched.cpu().numpy()
        bits = (np.unpackbits(bits, count=num_rows) if self.packed else bits).astype(bool)
        positions = (np.cumsum(bits) - 1)[self.indices.cpu().numpy()]
        device = self.indices.device
        return (torch.from_numpy(np.flatnonzero(bits)).to(device),
                torch.from_numpy(positions).to(device))  # fmt: skip


@dataclass
class ReplicaMetrics:
    """Lookups served by the replicas, of all lookups of the module's features."""

    lookups: int = 0
    hot_lookups: int = 0
    rows_synced: int = 0  # union rows all-reduced, summed over steps

    @property
    def hot_share(self) -> float:
        return self.hot_lookups / self.lookups if self.lookups else 0.0


def check_hot_rows(hot_rows: Mapping[str, Sequence[int]], num_rows: Mapping[str, int]
                   ) -> dict[str, np.ndarray]:  # fmt: skip
    """``hot_rows`` as sorted id arrays, checked against the tables' sizes."""
    unknown = sorted(set(hot_rows) - set(num_rows))
    if unknown:
        raise ValueError(f"hot_rows names unknown tables {unknown}; tables are {list(num_rows)}")
    out = {}
    for name, ids in hot_rows.items():
        array = np.asarray(ids, dtype=np.int64).reshape(-1)
        bad = array[(array < 0) | (array >= num_rows[name])]
        if len(bad):
            raise ValueError(f"hot_rows[{name!r}]: ids {bad[:5].tolist()} are outside the "
                             f"table's {num_rows[name]} rows")  # fmt: skip
        unique = np.unique(array)
        if len(unique) < len(array):
            raise ValueError(f"hot_rows[{name!r}] names some ids twice")
        if len(unique):
            out[name] = unique
    return out


class ReplicatedRows:
    """The hot rows of a sharded collection's tables, replicated on this rank.

    Finding a batch's hot ids takes a binary search per id, or, when the hot
    tables hold at most ``DIRECT_ROWS`` rows together, one gather from a map
    of 4 bytes per row (16 MiB at most).

    Args:
        hot: sorted hot ids per table name (tables without hot rows left out).
        keys: the collection's features, in its output order; ``key_tables[i]``
            is the table of ``keys[i]``.
        num_embeddings: rows of each table.
        shards: per hot table, its row ranges and their ranks.
        dim: the row width (one for every table of the collection).
        optimizer, fbgemm_params: the fused optimizer of the tables, as their TBEs take it.
        device: where the replicas live (the collection's device).
        learning_rate: reads the fused optimizer's current learning rate (schedulers change it).
    """

    DIRECT_ROWS = 1 << 22

    def __init__(
        self,
        hot: Mapping[str, np.ndarray],
        keys: Sequence[str],
        key_tables: Sequence[str],
        num_embeddings: Mapping[str, int],
        shards: Mapping[str, Sequence[RowRange]],
        dim: int,
        optimizer: EmbOptimType,
        fbgemm_params: Mapping[str, object],
        device: torch.device,
        learning_rate: Callable[[], float],
    ) -> None:
        self.hot = dict(hot)
        self.keys = list(keys)
        self.dim = dim
        self._tables = dict(zip(self.keys, key_tables))
        self._shards = {name: list(shards[name]) for name in self.hot}
        counts = [len(ids) for ids in self.hot.values()]
        self._first = dict(zip(self.hot, np.cumsum([0, *counts[:-1]]).tolist()))
        self.num_rows = sum(counts)
        # Table t's id i as one code, sorted across the hot tables: shift[t] + i.
        sizes = [num_embeddings[name] for name in self.hot]
        self._shift = dict(zip(self.hot, np.cumsum([0, *sizes[:-1]]).tolist()))
        self._codes = np.concatenate([ids + self._shift[name] for name, ids in self.hot.items()])
        # Where the hot tables are small enough, a row per code (its replica row, or -1)
        # finds ids in one gather instead of a binary search each.
        self._row_of: np.ndarray | None = None
        if sum(sizes) <= self.DIRECT_ROWS:
            self._row_of = np.full(sum(sizes), -1, dtype=np.int32)
            self._row_of[self._codes] = np.arange(self.num_rows, dtype=np.int32)
        on_cuda = device.type == "cuda"
        accepted = inspect.signature(SplitTableBatchedEmbeddingBagsCodegen).parameters
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(self.num_rows, dim,
                              EmbeddingLocation.DEVICE if on_cuda else EmbeddingLocation.HOST,
                              ComputeDevice.CUDA if on_cuda else ComputeDevice.CPU)],
            feature_table_map=[0],
            optimizer=optimizer,
            pooling_mode=PoolingMode.SUM,
            device=device,
            **{k: v for k, v in fbgemm_params.items() if k in accepted},
        )  # fmt: skip
        self.weights = self.tbe.split_embedding_weights()[0].data
        states = self.tbe.split_optimizer_states() if optimizer != EmbOptimType.EXACT_SGD else []
        self.states = [s.data for s in states[0]] if states else []
        self.device = device
        self._learning_rate = learning_rate
        self._placeholder = torch.zeros(1, requires_grad=True)  # gives the lookup a backward
        self.group: dist.ProcessGroup | None = None  # the trainer's, set by the collection
        self.metrics = ReplicaMetrics()
        self.loaded = False  # the replicas hold the owners' rows (made true at attach)
        self._order: tuple[list[str], torch.Tensor] | None = None  # for in_order
        self._pending: tuple[Any, torch.Tensor, torch.Tensor] | None = None  # see settle

    # ----------------------------------------------------------------- stage

    def split(
        self, features: KeyedJaggedTensor, variable_batch: bool,
        group: dist.ProcessGroup | None, device: torch.device,
    ) -> tuple[KeyedJaggedTensor, HotStep]:  # fmt: skip
        """The cold part of ``features`` (for the owners) and the hot part (for the
        replicas), with the union of the hot rows every rank's batch touches (a
        collective on ``group``, tensors on ``device``)."""
        names = features.keys()
        batch = features.stride()
        lengths = features.lengths().cpu().numpy().reshape(len(names), batch)
        values = features.values().cpu().numpy()
        bag_of = np.repeat(np.arange(lengths.size), lengths.reshape(-1))
        # One search for every id: a table's ids, shifted past the tables before it, and
        # the hot ids so shifted lie in one sorted array, at their replica rows.
        shift = np.array([self._shift.get(self._tables.get(n, ""), -1) for n in names])
        per_key = lengths.sum(axis=1)
        in_hot_table = np.repeat(shift >= 0, per_key)
        codes = values + np.repeat(shift, per_key)
        if self._row_of is not None:
            found = self._row_of[np.where(in_hot_table, codes, 0)].astype(np.int64)
            hot = (found >= 0) & in_hot_table
        else:
            found = np.minimum(np.searchsorted(self._codes, codes), self.num_rows - 1)
            hot = (self._codes[found] == codes) & in_hot_table
        cold = ~hot
        cold_lengths = np.bincount(bag_of[cold], minlength=lengths.size).reshape(lengths.shape)
        cold_features = _cold_batch(names, values[cold], cold_lengths, variable_batch,
                                    shift >= 0)  # fmt: skip
        # The hot ids in the replicas' feature-major order (the collection's keys).
        order = [names.index(key) for key in self.keys]
        picked = np.flatnonzero(hot)
        if order != list(range(len(names))):
            ends = np.cumsum(per_key)
            picked = np.concatenate([np.zeros(0, dtype=np.int64)] + [
                np.flatnonzero(hot[ends[k] - per_key[k] : ends[k]]) + ends[k] - per_key[k]
                for k in order
            ])  # fmt: skip
        hot_rows = found[picked]
        per_bag = np.bincount(bag_of[hot], minlength=lengths.size).reshape(lengths.shape)
        per_bag = per_bag[order].reshape(-1)
        touched = np.zeros(self.num_rows, dtype=bool)
        touched[hot_rows] = True
        several = group is not None and dist.get_world_size(group) > 1
        # NCCL (the collectives of CUDA tensors) reduces no bitwise OR: a byte per row
        # there, whose MAX is the OR.
        packed = device.type != "cuda"
        bits = torch.from_numpy(np.packbits(touched) if packed else touched.view(np.uint8))
        bits = bits.to(device)
        exchange = None
        if several:  # waited for at the update
            with label("hot_sync"):
                op = dist.ReduceOp.BOR if packed else dist.ReduceOp.MAX
                exchange = dist.all_reduce(bits, op=op, group=group, async_op=True)
        self.metrics.lookups += len(values)
        self.metrics.hot_lookups += len(hot_rows)
        as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device)  # noqa: E731
        return cold_features, HotStep(
            indices=as_tensor(hot_rows),
            offsets=as_tensor(np.concatenate([[0], np.cumsum(per_bag)])),
            bags=as_tensor(np.repeat(np.arange(len(per_bag)), per_bag)),
            touched=bits, exchange=exchange, batch=batch, packed=packed,
        )

    # --------------------------------------------------------------- trainer

    def lookup(self, step: HotStep) -> torch.Tensor:
        """The hot part of each sample's pooled features: ``[batch, features * dim]``."""
        return _HotLookup.apply(self._placeholder, self, step)

    def in_order(self, pooled: torch.Tensor, keys: list[str]) -> torch.Tensor:
        """``pooled`` (the collection's key order) with its features in the order of
        ``keys`` (TorchRec's sharded output orders them by sharding)."""
        if keys == self.keys:
            return pooled
        if self._order is None or self._order[0] != keys:
            self._order = (keys, torch.tensor([self.keys.index(k) for k in keys],
                                              device=pooled.device))  # fmt: skip
        per_key = pooled.view(pooled.shape[0], len(self.keys), self.dim)
        return per_key.index_select(1, self._order[1]).reshape(pooled.shape[0], -1)

    def pooled(self, step: HotStep) -> torch.Tensor:
        self.settle()
        bags = torch.nn.functional.embedding_bag(
            step.indices, self.weights, step.offsets, mode="sum", include_last_offset=True
        )
        return bags.view(len(self.keys), step.batch, self.dim).transpose(0, 1).reshape(
            step.batch, -1
        )

    def update(self, step: HotStep, grad: torch.Tensor) -> None:
        """Sum the step's hot-row gradients over the ranks, then update every replica alike."""
        per_bag = grad.view(step.batch, len(self.keys), self.dim).transpose(0, 1)
        per_id = per_bag.reshape(-1, self.dim).index_select(0, step.bags)
        union, positions = step.union(self.num_rows)
        self.metrics.rows_synced += len(union)
        summed = torch.zeros(len(union), self.dim, dtype=grad.dtype, device=grad.device)
        world = dist.get_world_size(self.group) if self.group is not None else 1
        if world > 1 and get_gradient_division():  # as TorchRec's output all-to-all does
            per_id = per_id / world
        summed.index_add_(0, positions, per_id)
        work = None
        if world > 1:
            with label("hot_sync"):
                work = dist.all_reduce(summed, group=self.group, async_op=True)
        self._pending = (work, union, summed)

    def settle(self) -> None:
        """Apply the last step's update, once its sum has arrived: the all-reduce runs
        beside the rest of the backward, and this runs before the replicas are next read
        (the next lookup, a fold, ``replica_rows``)."""
        if self._pending is None:
            return
        work, union, summed = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        if not len(union):
            return
        lr = self._learning_rate()
        if self.tbe.get_learning_rate() != lr:
            self.tbe.set_learning_rate(lr)
        offsets = torch.arange(len(union) + 1, device=self.device)
        with torch.enable_grad():  # FBGEMM's fused backward applies the update
            self.tbe(union, offsets).backward(summed)

    # ------------------------------------------------------------ the owners

    def load(self, stores: Mapping[tuple[str, int], Callable[[np.ndarray], list[torch.Tensor]]],
             group: dist.ProcessGroup | None) -> None:  # fmt: skip
        """Fill the replicas from the owners' shards: each shard's hot rows broadcast by
        its rank. ``stores[(table, start)]`` reads this rank's shard starting at row
        ``start`` (weights and optimizer state of the given local rows)."""
        self.settle()  # a pending update's collective completes on every rank alike
        rank = dist.get_rank(group) if group is not None else 0
        for name, ids in self.hot.items():
            for shard in self._shards[name]:
                inside = np.flatnonzero((ids >= shard.start) & (ids < shard.stop))
                if not len(inside):
                    continue
                replica = torch.from_numpy(inside + self._first[name]).to(self.device)
                targets = [self.weights, *self.states]
                if shard.rank == rank:
                    parts = stores[(name, shard.start)](ids[inside] - shard.start)
                else:
                    parts = [torch.empty((len(inside), *t.shape[1:]), dtype=t.dtype,
                                         device=t.device) for t in targets]  # fmt: skip
                for target, part in zip(targets, parts, strict=True):
                    part = part.to(target.device)
                    if group is not None and dist.get_world_size(group) > 1:
                        dist.broadcast(part, dist.get_global_rank(group, shard.rank), group)
                    target.index_copy_(0, replica, part)
        self.loaded = True

    def fold(self, name: str, start: int, stop: int
             ) -> tuple[np.ndarray, torch.Tensor, list[torch.Tensor]] | None:  # fmt: skip
        """The replicas of table ``name``'s rows ``[start, stop)``: their local rows in
        that shard, weights and optimizer state (what the owner writes into its shard)."""
        ids = self.hot.get(name)
        if ids is None or not self.loaded:
            return None
        self.settle()
        inside = np.flatnonzero((ids >= start) & (ids < stop))
        if not len(inside):
            return None
        replica = torch.from_numpy(inside + self._first[name]).to(self.device)
        return (ids[inside] - start, self.weights.index_select(0, replica),
                [s.index_select(0, replica) for s in self.states])  # fmt: skip


class _HotLookup(torch.autograd.Function):
    """The replicas' lookup, whose backward is their synchronised update."""

    @staticmethod
    def forward(ctx, placeholder: torch.Tensor, rows: ReplicatedRows, step: HotStep  # noqa: ANN001
                ) -> torch.Tensor:  # fmt: skip
        ctx.rows, ctx.step = rows, step
        return rows.pooled(step)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None]:  # noqa: ANN001
        ctx.rows.update(ctx.step, grad.contiguous())
        return None, None, None


def _cold_batch(
    names: list[str], values: np.ndarray, cold_lengths: np.ndarray, variable_batch: bool,
    has_hot: np.ndarray,
) -> KeyedJaggedTensor:  # fmt: skip
    """The cold ids as a batch for the owners. As a variable batch, a hot table's feature
    keeps only the bags with cold ids, and one empty bag for every sample without any."""
    keys, batch = cold_lengths.shape
    if not variable_batch:
        return KeyedJaggedTensor(keys=names, values=torch.from_numpy(values),
                                 lengths=torch.from_numpy(cold_lengths.reshape(-1)),
                                 stride=batch)  # fmt: skip
    kept = (cold_lengths > 0) | ~has_hot[:, None]
    count = kept.sum(axis=1)
    empty = count < batch  # the features that need the empty bag
    inverse = np.where(kept, np.cumsum(kept, axis=1) - 1, count[:, None])
    with_empty = np.hstack([cold_lengths, np.zeros((keys, 1), dtype=cold_lengths.dtype)])
    lengths = with_empty[np.hstack([kept, empty[:, None]])]  # per key: kept bags, then empty
    return KeyedJaggedTensor(
        keys=names, values=torch.from_numpy(values), lengths=torch.from_numpy(lengths),
        stride_per_key_per_rank=[[int(n)] for n in count + empty],
        inverse_indices=(names, torch.from_numpy(inverse)),
    )  # fmt: skip
