"""``ShardedHotRowsEmbeddingBagCollection``: the sharded lookahead collection, hot rows replicated.

Composed as TorchRec composes managed collision with its sharded collection:
the sharded lookahead collection is kept whole, and this subclass adds the
hot-row tier (:class:`~torchrec_lookahead.embedding.hot.tier.HotRowTier`) through
its hooks, with the batch's hot part travelling in TorchRec's context
(:class:`HotRowsContext`):

1. ``open_window``: the tier agrees its layout with every rank and loads the replicas;
2. ``route``: the stage's batch is split, the cold part goes to the shards, the
   hot part and its union's exchange into the context;
3. ``enter`` / ``finish``: the tier counts a batch's lookups / resolves the last union;
4. ``complete``: the step's output is the shards' plus the replicas' lookup, whose
   backward is their synchronised update;
5. a loaded state: the replicas reload from their owners.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext
from torchrec.distributed.types import LazyAwaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_lookahead._compat import CompletedOutput
from torchrec_lookahead.embedding.hot.collection import HotRowsEmbeddingBagCollection
from torchrec_lookahead.embedding.hot.layout import HotLayout, RowRange
from torchrec_lookahead.embedding.hot.tier import HotInput, HotRowTier, ReplicaMetrics
from torchrec_lookahead.embedding.kernel import LookaheadKernel
from torchrec_lookahead.embedding.sharded import ShardedLookaheadEmbeddingBagCollection
from torchrec_lookahead.settings import WindowSettings
from torchrec_lookahead.steps import ModuleInput, StepPlan
from torchrec_lookahead.variable_batch import VARIABLE_BATCH_OPTIMIZERS

__all__ = ["HotRowsContext", "ShardedHotRowsEmbeddingBagCollection"]


@dataclass
class HotRowsContext(EmbeddingBagCollectionContext):
    """TorchRec's per-batch context of the sharded collection, with the batch's hot part
    (``None`` for a batch that did not come through the stage: an eval forward)."""

    hot: HotInput | None = None

    def record_stream(self, stream: torch.Stream) -> None:
        super().record_stream(stream)
        if self.hot is not None:
            self.hot.record_stream(stream)


class ShardedHotRowsEmbeddingBagCollection(ShardedLookaheadEmbeddingBagCollection):
    """The sharded lookahead collection whose hot rows are replicated on every rank."""

    def __init__(self, module: HotRowsEmbeddingBagCollection, **kwargs: Any) -> None:
        super().__init__(module=module, **kwargs)
        self.hot = self._make_tier(module.hot_rows)
        self._hot_pg: dist.ProcessGroup | None = None  # the update's group, made at open_window
        # The kernels' stores are current only with the replicas folded in (this module's
        # write_back), and a loaded optimizer state is newer than the replicas.
        for kernel in self.kernels:
            kernel.route_store_events(self.write_back, self.hot.invalidate)

    def _make_tier(self, hot: dict[str, np.ndarray]) -> HotRowTier:
        """The hot rows' replicas on this rank, laid out like the plan's shards of them."""
        infos = {
            info.embedding_config.name: info
            for per_type in self.sharding_type_to_sharding_infos.values()
            for info in per_type
        }
        shards = {
            name: [
                RowRange(
                    md.placement.rank(),
                    md.shard_offsets[0],
                    md.shard_offsets[0] + md.shard_sizes[0],
                )
                for md in infos[name].param_sharding.sharding_spec.shards
            ]
            for name in hot
        }
        params = {name: dict(infos[name].fused_params or {}) for name in hot}
        configs = self.table_configs()
        layout = HotLayout(
            hot,
            keys=[f for t in configs for f in t.feature_names],
            key_tables=[t.name for t in configs for _ in t.feature_names],
            table_features={t.name: list(t.feature_names) for t in configs},
            num_embeddings={t.name: t.num_embeddings for t in configs},
            table_params=params,
            shards=shards,
            dim=configs[0].embedding_dim,
        )
        tier = HotRowTier(layout, self._collective_device)
        # The cold ids travel as a variable batch (bags of hot ids only dropped) where
        # TorchRec's sharding and FBGEMM's kernel take one: not row-wise over gloo, on
        # CUDA only with some optimizers, on the CPU only where each sharding's tables
        # share their fused settings, so that no rank's lookup has several kernels
        # (TorchRec merges their variable-batch outputs into a preallocated output,
        # which FBGEMM's CPU kernel does not write). Every rank decides alike: the
        # input all-to-all differs for a variable batch.
        optimizers = {p["optimizer"] for p in params.values()}
        one_kernel = all(
            len({repr(sorted((info.fused_params or {}).items())) for info in per_type}) <= 1
            for per_type in self.sharding_type_to_sharding_infos.values()
        )
        on_cpu = self._collective_device.type == "cpu"
        self._cold_variable_batch = not self._row_wise_on_gloo and (
            one_kernel if on_cpu else optimizers <= set(VARIABLE_BATCH_OPTIMIZERS)
        )
        return tier

    # -------------------------------------------- the owners (the tier's Owners)

    def shard_readers(self) -> dict[tuple[str, int], Any]:
        """Per ``(table, first row)`` of a local shard of a hot table, a reader of its rows."""
        return {
            (name, shard.start): partial(_read_rows, kernel, table)
            for name, shard, kernel, table in self._hot_shards()
        }

    def learning_rates(self) -> dict[str, float]:
        """The current learning rate of each table with a local shard: its kernel's, which
        the fused optimizer sets (schedules included)."""
        return {
            name: kernel.store_tbe.get_learning_rate()
            for kernel in self.kernels
            for name in kernel.cached.names
        }

    def _hot_shards(self) -> list[tuple[str, RowRange, LookaheadKernel, int]]:
        """This rank's shards of hot tables: name, rows, and the kernel and its table
        index that hold them."""
        held = {name: (k, t) for k in self.kernels for t, name in enumerate(k.cached.names)}
        return [
            (name, shard, *held[name])
            for name, shards in self.hot.layout.shards.items()
            for shard in shards
            if shard.rank == self.env.rank
        ]

    def write_back(self) -> None:
        """Make the stores current: the caches' updated rows, then the replicas of this
        rank's shards' hot rows (which the owners' caches never see)."""
        super().write_back()
        for name, shard, kernel, table in self._hot_shards():
            folded = self.hot.fold(name, shard.start, shard.stop)
            if folded is not None:
                ids, weights, states = folded
                kernel.store.scatter(table, torch.from_numpy(ids), weights, states)

    @property
    def replica_metrics(self) -> ReplicaMetrics:
        """What the replicated hot rows served."""
        return self.hot.metrics

    def replica_rows(self) -> list[torch.Tensor]:
        """The replicas on this rank: per group, weights, then optimizer state."""
        return self.hot.replica_rows()

    # ----------------------------------------------- the sharded collection's hooks

    def open_window(self, window: WindowSettings) -> None:
        super().open_window(window)
        if self._hot_pg is None:  # collectives: the hot rows' layout agreed, then loaded
            self._hot_pg = dist.new_group(
                ranks=dist.get_process_group_ranks(self.env.process_group)
            )
        self.hot.open_window(self._hot_pg, self)

    def create_context(self) -> HotRowsContext:
        return HotRowsContext()

    def batch_kind_refusal(self, features: KeyedJaggedTensor) -> ValueError | None:
        if features.variable_stride_per_key():
            return ValueError(
                "a deduplicated (variable-batch) batch cannot be split for "
                "replicated hot rows; send plain batches, or build a "
                "LookaheadEmbeddingBagCollection without hot rows"
            )
        return super().batch_kind_refusal(features)

    def route(
        self, features: KeyedJaggedTensor, ctx: Any, group: dist.ProcessGroup | None
    ) -> KeyedJaggedTensor:
        """The cold part to the shards; the hot part into ``ctx``, its union's exchange
        started on ``group`` (a collective, on every rank)."""
        cold, ctx.hot = self.hot.prepare(features, self._cold_variable_batch, group)
        return cold

    def enter(self, prepared: ModuleInput) -> StepPlan | None:
        assert prepared.distributed is not None
        hot = _hot_of(prepared.distributed[0])
        self.hot.enter(hot)
        return super().enter(prepared)

    def finish(self) -> list[StepPlan]:
        self.hot.resolve()
        return super().finish()

    def complete(
        self, ctx: EmbeddingBagCollectionContext, output: LazyAwaitable[KeyedTensor]
    ) -> LazyAwaitable[KeyedTensor]:
        pooled = self.hot.lookup(_hot_of(ctx), self)  # while the cold outputs travel
        layout = self.hot.layout

        def with_hot_rows(cold: KeyedTensor) -> KeyedTensor:
            values = cold.values() + _in_order(pooled, layout.keys, cold.keys(), layout.dim)
            return KeyedTensor(cold.keys(), cold.length_per_key(), values)

        return CompletedOutput(output, with_hot_rows)

    def _reload_caches(self) -> None:
        super()._reload_caches()
        self.hot.invalidate()  # reloaded from the owners before they are next read


def _read_rows(kernel: LookaheadKernel, table: int, ids: np.ndarray) -> list[torch.Tensor]:
    """Local rows ``ids`` of ``kernel``'s table ``table`` from its store: weights, then
    optimizer state."""
    weights, states = kernel.store.gather(table, torch.from_numpy(ids))
    return [weights, *states]


def _hot_of(ctx: EmbeddingBagCollectionContext) -> HotInput:
    assert isinstance(ctx, HotRowsContext) and ctx.hot is not None, "a batch not routed"
    return ctx.hot


def _in_order(pooled: torch.Tensor, keys: list[str], wanted: list[str], dim: int) -> torch.Tensor:
    """``pooled`` (features in ``keys``' order) with its features in ``wanted``'s order
    (TorchRec's sharded output orders them by sharding)."""
    if wanted == keys:
        return pooled
    index = torch.tensor([keys.index(k) for k in wanted], device=pooled.device)
    per_key = pooled.view(pooled.shape[0], len(keys), dim)
    return per_key.index_select(1, index).reshape(pooled.shape[0], -1)
