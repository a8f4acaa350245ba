"""The hot-row tier of a sharded collection: split, lookup, exact update, owners.

The calls it receives, in order (every rank alike):

1. ``open_window(group, owners)`` when a pipeline attaches: checks that every rank holds the
   same hot rows, and (re)loads the replicas from their owners unless they
   are current.
2. ``prepare(features, ...)`` per batch, on the stage's thread, ``L`` steps
   ahead: the cold part for the owners, the hot part for the replicas, and the
   union's exchange started (a collective on the stage's group); the previous
   batch's exchange is resolved first. ``resolve()`` at the end of the data
   resolves the last.
3. ``lookup(hot, owners)`` in the step's forward: the hot part of the pooled output.
   Its backward sums the step's hot-row gradients over the ranks in the
   owners' order and applies them to every replica
   (:mod:`~torchrec_lookahead.embedding.hot.sync`), each table at its owner's rate.
4. ``fold(table, start, stop)`` whenever an owner's store is written back
   (``state_dict``, optimizer state, eval): the replicas of its rows.
5. ``invalidate()`` when the owners' tables were loaded: the replicas reload
   from them at the next ``open_window`` or ``lookup``.

The owners (this rank's shards: their readers and learning rates, :class:`Owners`)
are handed to the calls that read them; the tier keeps no reference to them.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.embedding.hot.layout import HotLayout
from torchrec_lookahead.embedding.hot.replicas import ReplicaTables, ShardReader
from torchrec_lookahead.embedding.hot.split import HotSplit, direct_map, split_batch
from torchrec_lookahead.embedding.hot.sync import (
    TouchedReplicas,
    ordered_sum,
    start_union,
    union_of,
)

__all__ = ["HotInput", "HotRowTier", "Owners", "ReplicaMetrics"]


class Owners(Protocol):
    """What the tier needs of this rank's owned shards, handed to the calls that read
    them (the tier keeps no reference to its owners)."""

    def shard_readers(self) -> Mapping[tuple[str, int], ShardReader]:
        """Per ``(table, first row)`` of a local shard, a reader of its rows."""

    def learning_rates(self) -> Mapping[str, float]:
        """The current learning rate of each table with a local shard."""


class HotInput:
    """What the stage made of a batch for the replicas: its hot part, and the union of
    the rows every rank's batch touches, exchanged in the background. The stage
    resolves the union (:meth:`union`) when it prepares the next batch, so the step's
    backward finds it on the device, with no wait for the host."""

    def __init__(self, split: HotSplit, exchange: Any, num_rows: int) -> None:
        self.split = split
        self._exchange = exchange
        self._num_rows = num_rows
        self._union: TouchedReplicas | None = None
        self._lock = threading.Lock()

    def union(self) -> TouchedReplicas:
        with self._lock:
            if self._union is None:
                self._union = union_of(self.split, self._exchange, self._num_rows)
                self._exchange = None
            return self._union

    def record_stream(self, stream: torch.Stream) -> None:
        """Mark its device tensors as used on ``stream`` (made on the stage's streams): the
        split's, and the union's once resolved. Marking never resolves it: the stage's
        planning marks the batch before the exchange is due, and a step resolves a union
        still open on its own stream."""
        with self._lock:
            union = self._union
        split = self.split
        pairs = [t for pair in split.lookups for t in pair]
        tensors = [split.rows, split.bags, split.touched, *pairs]
        if union is not None:
            tensors += [union.rows, union.positions]
        for tensor in tensors:
            tensor.record_stream(stream)


@dataclass
class ReplicaMetrics:
    """Lookups served by the replicas, of all lookups of the collection's features."""

    lookups: int = 0
    hot_lookups: int = 0
    rows_synced: int = 0  # union rows summed over the ranks, over all steps

    @property
    def hot_share(self) -> float:
        return self.hot_lookups / self.lookups if self.lookups else 0.0


class HotRowTier:
    """Replicated hot rows: looked up where their samples are, updated alike everywhere.

    Args:
        layout: the hot rows, their groups and their owners' shards.
        device: where the replicas live and the collectives' tensors go.
    """

    def __init__(self, layout: HotLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.replicas = ReplicaTables(layout, device)
        self.metrics = ReplicaMetrics()
        self._row_of = direct_map(layout)
        self._group: dist.ProcessGroup | None = None
        self._current = False  # the replicas hold the newest values of their rows
        self._placeholder = torch.zeros(1, requires_grad=True)  # gives the lookup a backward
        # The ordered reduction of each step runs on a thread of its own (on the CPU), so
        # the backward goes on while the ranks pass their sums along; it is applied before
        # the replicas are next read (``settle``). The hot rows' process group is used by
        # that thread alone, and by the trainer only once every reduction has settled.
        self._reducer = ThreadPoolExecutor(
            1, "hot-rows-sum", initializer=torch.set_num_threads, initargs=(1,)
        )
        self._pending: tuple[Future, TouchedReplicas] | None = None
        self._exchanging: HotInput | None = None  # the stage's last batch, union unresolved

    # ------------------------------------------------------------ lifecycle

    def open_window(self, group: dist.ProcessGroup | None, owners: Owners) -> None:
        """Check every rank holds this layout; load the replicas from ``owners`` unless
        current. A collective on ``group``, the ranks the update runs over."""
        self.settle()
        self._group = group
        if group is not None and dist.get_world_size(group) > 1:
            self._check_same_layout(group)
        if not self._current:
            self._load(owners)

    def invalidate(self) -> None:
        """The owners' rows were loaded: reload the replicas before they are next read."""
        self._current = False

    def _load(self, owners: Owners) -> None:
        self.settle()  # a pending update lands first (the load then overwrites it)
        self.replicas.load(owners.shard_readers(), self._group)
        self._current = True

    def _check_same_layout(self, group: dist.ProcessGroup) -> None:
        digest = np.frombuffer(self.layout.digest(), dtype=np.int64)
        mine = torch.from_numpy(digest.copy()).to(self.device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        differ = [r for r, other in enumerate(everyone) if not torch.equal(other, everyone[0])]
        if differ:
            raise ValueError(
                f"ranks {differ} hold other hot rows (or optimizer settings for them) than "
                "rank 0: every rank must build the collection with the same hot_rows"
            )

    # --------------------------------------------------------------- stage

    def prepare(
        self, features: KeyedJaggedTensor, variable_batch: bool, group: dist.ProcessGroup | None
    ) -> tuple[KeyedJaggedTensor, HotInput]:
        """Split a batch into its cold part and its hot part, and start the exchange of
        the hot rows it touches (a collective on ``group``, the stage's), once the
        previous batch's is resolved (so its step's backward finds its union ready)."""
        self.resolve()
        cold, split = split_batch(self.layout, features, variable_batch, self.device, self._row_of)
        hot = HotInput(split, start_union(split, group), self.layout.num_rows)
        self._exchanging = hot
        return cold, hot

    def enter(self, hot: HotInput) -> None:
        """A batch entered the window (every rank let it through): its lookups count."""
        self.metrics.lookups += hot.split.ids
        self.metrics.hot_lookups += len(hot.split.rows)

    def resolve(self) -> None:
        """Resolve the union of the stage's last batch, if still exchanging (the end of
        the data: no next batch will)."""
        if self._exchanging is not None:
            self._exchanging.union()
            self._exchanging = None

    # ------------------------------------------------------------- trainer

    def lookup(self, hot: HotInput, owners: Owners) -> torch.Tensor:
        """The hot part of the step's pooled features, ``[batch, keys * dim]`` in the
        collection's key order; its backward updates every replica at ``owners``' rates."""
        self.settle()
        if not self._current:  # the owners were loaded since: a collective, ranks alike
            self._load(owners)
        return _HotLookup.apply(self._placeholder, self, hot, owners)

    def update(self, hot: HotInput, grad: torch.Tensor, owners: Owners) -> None:
        """Start summing the step's hot-row gradients over the ranks in the owners' order;
        :meth:`settle` applies the sums to every replica, each table at its owner's rate
        (read now: the rate the owner's update of this step uses)."""
        split, layout = hot.split, self.layout
        union = hot.union()
        if not len(union.host):  # no rank's batch touched a hot row: nothing to send
            return
        world = dist.get_world_size(self._group) if self._group is not None else 1
        local = owners.learning_rates()
        rates = np.array([local.get(name, np.nan) for name in layout.tables])
        args = (split, union, grad, world, rates)
        if self.device.type == "cpu":
            future = self._reducer.submit(self._reduce, *args)
        else:  # NCCL: every collective on the trainer's thread, in one order on every rank
            future = Future()
            future.set_result(self._reduce(*args))
        self._pending = (future, union)

    def _reduce(
        self,
        split: HotSplit,
        union: TouchedReplicas,
        grad: torch.Tensor,
        world: int,
        rates: np.ndarray,
    ) -> tuple[torch.Tensor, np.ndarray]:
        """Each hot id's gradient (its bag's, divided by the world size as TorchRec's owners
        divide theirs), summed over the ranks in the owners' order."""
        keys, dim = len(self.layout.keys), self.layout.dim
        per_bag = grad.view(split.batch, keys, dim).transpose(0, 1).reshape(-1, dim)
        per_id = per_bag.index_select(0, split.bags)
        if world > 1 and get_gradient_division():
            per_id = per_id / world
        starts = (0, *split.round_ends[:-1])
        positions = union.positions
        rounds = [(positions[a:b], per_id[a:b]) for a, b in zip(starts, split.round_ends)]
        return ordered_sum(rounds, len(union.host), dim, rates, self._group, self.device)

    def settle(self) -> None:
        """Apply the last step's update once its sums are in: before the replicas are next
        read (the next lookup, a fold, a load) and before the group is used again."""
        if self._pending is None:
            return
        future, union = self._pending
        self._pending = None
        sums, rates = future.result()
        touched_tables = np.unique(self.layout.table_of_row[union.host])
        if np.isnan(rates[touched_tables]).any():
            raise RuntimeError(
                "no rank owns some hot tables' rows: the sharding plan and the hot rows disagree"
            )
        self.replicas.apply(union, sums, rates)
        self.metrics.rows_synced += len(union.host)

    # ------------------------------------------------------------ the owners

    def fold(
        self, name: str, start: int, stop: int
    ) -> tuple[np.ndarray, torch.Tensor, list[torch.Tensor]] | None:
        """The replicas of table ``name``'s rows ``[start, stop)`` for its owner's store
        (``None`` if it has none, or the owner's rows are newer)."""
        if not self._current:
            return None
        self.settle()
        return self.replicas.fold(name, start, stop)

    def replica_rows(self) -> list[torch.Tensor]:
        """Every replica group's weights, then optimizer state (for checks)."""
        self.settle()
        return [t for g in range(len(self.layout.groups)) for t in self.replicas.tensors(g)]


class _HotLookup(torch.autograd.Function):
    """The replicas' lookup, whose backward is their synchronised update."""

    @staticmethod
    def forward(
        ctx,
        placeholder: torch.Tensor,
        tier: HotRowTier,
        hot: HotInput,  # noqa: ANN001
        owners: Owners,
    ) -> torch.Tensor:
        ctx.tier, ctx.hot, ctx.owners = tier, hot, owners
        return tier.replicas.pooled(hot.split)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None, None]:  # noqa: ANN001
        ctx.tier.update(ctx.hot, grad.contiguous(), ctx.owners)
        return None, None, None, None
