"""``ShardedLookaheadEmbeddingBagCollection``: TorchRec's sharded collection, pipeline-driven.

TorchRec's sharded collection is kept whole: its lookups create lookahead
kernels (:mod:`~torchrec_lookahead.embedding.kernel`), and the pipeline splits
its forward in time, ``input_dist`` when a batch enters the window and the rest
at the step. Every rank caches only the shards it owns, so each row has one
owner; hot rows (:mod:`~torchrec_lookahead.embedding.hot`) are replicated on
every rank.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.types import (
    ShardingEnv,
    ShardingType,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_lookahead._compat import (
    CompletedOutput,
    GatheredOutput,
    ShardedCollectionBase,
)
from torchrec_lookahead.cache.tables import CachedTables
from torchrec_lookahead.checks import check_feature_ids
from torchrec_lookahead.embedding.collection import LookaheadEmbeddingBagCollection
from torchrec_lookahead.embedding.hot import (
    HotInput,
    HotLayout,
    HotRowTier,
    ReplicaMetrics,
    RowRange,
)
from torchrec_lookahead.embedding.kernel import LookaheadFusedEmbeddingBag
from torchrec_lookahead.embedding.lookup import LookaheadPooledEmbeddingsLookup
from torchrec_lookahead.metrics import CacheMetrics
from torchrec_lookahead.store.files import StoreFiles
from torchrec_lookahead.traffic import label
from torchrec_lookahead.types import ModuleInput, StepContext, StepPlan, Window
from torchrec_lookahead.variable_batch import (
    VARIABLE_BATCH_OPTIMIZERS,
    gather_bags,
)

__all__ = ["ShardedLookaheadEmbeddingBagCollection", "refusals", "vote"]


class ShardedLookaheadEmbeddingBagCollection(ShardedCollectionBase):
    """``ShardedEmbeddingBagCollection`` with lookahead kernels, driven by the pipeline.

    The lookahead stage runs ``input_dist`` for a batch when it enters the
    window (``prepare``), so each rank's oracles see exactly the ids its shards
    will serve; the step's forward later consumes that distributed input.

    The stage runs on its own thread, beside the trainer's collectives, so its
    collectives use a process group of their own (made at ``attach``, by every
    rank): on the stage's thread this module's input dists are copies of
    TorchRec's bound to that group, while the trainer thread (eval forward)
    keeps TorchRec's own.
    """

    def __init__(self, module: LookaheadEmbeddingBagCollection, **kwargs: Any) -> None:
        # TorchRec's constructor calls back into this class before it returns: it builds
        # the lookups (``make_lookup`` reads the cache sizing and the disk store's files)
        # and may build the input dists (``input_dists_created`` reads the stage's
        # group). Those four attributes are therefore set first; all others after.
        self._sizing = module.sizing
        self._store_files = None  # a disk store's files (this rank's)
        if module.store_dir is not None:
            # One directory per rank and module: several modules may share a store_dir.
            where = f"rank{kwargs['env'].rank}/{kwargs.get('module_fqn') or 'module'}"
            self._store_files = StoreFiles.create_subdir(module.store_dir, where)
        self._stage_pg: dist.ProcessGroup | None = None
        self._stage_input_dists: list[torch.nn.Module] = []
        super().__init__(module=module, **kwargs)
        row_wise = {ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value}
        self._row_wise_on_gloo = bool(
            row_wise & set(self.sharding_type_to_sharding_infos)
            and dist.is_initialized()
            and dist.get_backend(self.env.process_group) == "gloo"
        )
        # Row-wise shards' outputs of a deduplicated batch need a reduce-scatter of uneven
        # parts, which gloo lacks: refused from two ranks up (at one rank there is one part).
        self._refuse_variable_batch = self._row_wise_on_gloo and self.env.world_size > 1
        # Collectives take tensors of the device the sharded module computes on (NCCL: CUDA).
        self._collective_device = torch.device(kwargs.get("device") or "cpu")
        self.input_dist_s = 0.0  # CPU time spent distributing batches entering the window
        self._context: StepContext | None = None  # the step being run, until its forward
        # The last batch every rank let through this module's vote since ``attach``: a
        # refused batch's stand-in in the collectives (see ``prepare``).
        self._stand_in: KeyedJaggedTensor | None = None
        self._feature_rows = {
            f: t.num_embeddings for t in self.embedding_bag_configs() for f in t.feature_names
        }
        self._table_features = {t.name: list(t.feature_names) for t in self.embedding_bag_configs()}
        self._hot = self._make_hot_tier(module.hot_rows) if module.hot_rows else None
        self._hot_pg: dist.ProcessGroup | None = None  # the hot rows' update, made at attach
        self.register_load_state_dict_post_hook(lambda m, _: m._reload_caches())

    def _make_hot_tier(self, hot: dict[str, np.ndarray]) -> HotRowTier:
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
        configs = self.embedding_bag_configs()
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
        tier = HotRowTier(layout, self._collective_device, owners=self)
        for kernel in self.kernels:
            kernel.fold_replicas_from(tier)
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

    def shard_readers(self) -> dict[tuple[str, int], Any]:
        """Per ``(table, first row)`` of a local shard, a reader of its rows (for the hot
        rows' replicas)."""
        return {
            (name, start): partial(kernel.read_rows, table)
            for kernel in self.kernels
            for table, (name, start) in enumerate(zip(kernel.table_names, kernel.row_starts))
        }

    def learning_rates(self) -> dict[str, float]:
        """The current learning rate of each table with a local shard: its kernel's, which
        the fused optimizer sets (schedules included)."""
        return {
            name: kernel.store_tbe.get_learning_rate()
            for kernel in self.kernels
            for name in kernel.table_names
        }

    @property
    def kernels(self) -> list[LookaheadFusedEmbeddingBag]:
        """This rank's lookahead kernels (one per group of its shards)."""
        return [kernel for lookup in self.lookups for kernel in lookup.kernels]

    @property
    def replica_metrics(self) -> ReplicaMetrics | None:
        """What the replicated hot rows served (``None`` without hot rows)."""
        return None if self._hot is None else self._hot.metrics

    def replica_rows(self) -> list[torch.Tensor]:
        """The replicas of the hot rows on this rank: per group, weights, then optimizer
        state."""
        return [] if self._hot is None else self._hot.replica_rows()

    @property
    def store_files(self) -> StoreFiles | None:
        """This rank's disk store files (``store_dir``), or ``None`` (tables in host memory)."""
        return self._store_files

    def make_lookup(
        self,
        index: int,
        configs: list[GroupedEmbeddingConfig],
        pg: dist.ProcessGroup | None,
        device: torch.device | None,
        sharding_type: ShardingType | None,
        env: ShardingEnv,
    ) -> LookaheadPooledEmbeddingsLookup:
        files = self._store_files
        return LookaheadPooledEmbeddingsLookup(
            grouped_configs=configs,
            pg=pg,
            device=device,
            sharding_type=sharding_type,
            env=env,
            sizing=self._sizing,
            store=None if files is None else (files, f"lookup{index}"),
        )

    # ----------------------------------------------- driven by the pipeline

    @property
    def cached_groups(self) -> list[CachedTables]:
        return [kernel.cached for kernel in self.kernels]

    def input_dists_created(self) -> None:
        self._bind_stage_input_dists()

    def _bind_stage_input_dists(self) -> None:
        """Input dists like TorchRec's, their collectives on the stage's process group; in
        place, so a first batch whose ``input_dist`` makes TorchRec's uses them at once."""
        if self._stage_pg is not None and self.input_dists_ready:
            self._stage_input_dists[:] = self.input_dists_on(self._stage_pg)

    def attach(self, window: Window) -> None:
        ranks = dist.get_process_group_ranks(self.env.process_group)
        # A fresh group at every attach (a collective: every rank attaches in the same
        # order): a pipeline closed mid-stream may leave one rank's stage thread inside a
        # batch's collectives that the other ranks' threads never joined; on a group of its
        # own it cannot meet the next pipeline's collectives.
        self._stage_pg = dist.new_group(ranks=ranks)
        self._bind_stage_input_dists()
        for group in self.cached_groups:
            group.attach(window)
        self._context = None
        self._stand_in = None
        if self._hot is not None:  # collectives: the hot rows' layout agreed, then loaded
            if self._hot_pg is None:
                self._hot_pg = dist.new_group(ranks=ranks)
            self._hot.attach(self._hot_pg)

    def prepare(
        self, features: KeyedJaggedTensor, step: int, refusal: ValueError | None = None
    ) -> ModuleInput:
        """Check the ids of the batch of ``step``, distribute it (a collective), and check
        every shard's cache.

        ``refusal`` is the stage's verdict on the batch as a whole (its
        structure, see :mod:`~torchrec_lookahead.checks`). It and bad ids are
        voted on with a window that does not fit a shard's cache, once per batch,
        after the collective. A batch refused on any rank is refused on every
        rank, so all ranks drop it together and their collectives stay in step:
        a rank that refuses its batch sends the last batch that passed the vote
        in its place, to be dropped with it. Until one has passed (the same on
        every rank), the first refusals are voted on before the collective too.
        """
        error = refusal or self._check_ids(features, step) or self._check_strides(features)
        if self._stand_in is None or self.env.world_size == 1:
            self._agree(error)
        elif error is not None:
            features = self._stand_in
        start = time.thread_time()
        bound = self._ids_bound(features)
        cold, hot = features, None
        if self._hot is not None:  # the union's exchange starts: a collective, on every rank
            cold, hot = self._hot.prepare(features, self._cold_variable_batch, self._stage_pg)
        ctx = self.create_context()
        self.use_input_dists(self._stage_input_dists)  # this thread's: the stage's
        try:
            distributed = self.input_dist(ctx, cold).wait().wait()
        finally:
            self.use_input_dists(None)
        self.input_dist_s += time.thread_time() - start
        prepared = []
        try:
            for lookup, kjt in zip(self.lookups, distributed):
                for kernel, part in zip(lookup.kernels, lookup.kernel_features(kjt)):
                    if error is None:
                        prepared.append(kernel.cached.prepare(part, step, bound))
        except ValueError as caught:
            error = caught
        self._agree(error)
        self._stand_in = features
        return ModuleInput(prepared, (ctx, distributed), hot)

    def _ids_bound(self, features: KeyedJaggedTensor) -> dict[str, int] | None:
        """Per table, the ids a shard of it can get from a batch like ``features`` (every
        rank's ids of its features, as many as this rank's: a bound where batches have one
        shape), for sizing caches at a window's first batch; ``None`` after that."""
        if all(group.sized for group in self.cached_groups):
            return None
        per_key = dict(zip(features.keys(), features.length_per_key()))
        bound: dict[str, int] = {}
        for table, feature_names in self._table_features.items():
            count = sum(per_key.get(f, 0) for f in feature_names)
            bound[table] = self.env.world_size * count
        return bound

    def _check_ids(self, features: KeyedJaggedTensor, step: int) -> ValueError | None:
        unchecked = np.iinfo(np.int64).max  # features of other modules
        try:
            check_feature_ids(
                features.values().cpu().numpy(),
                features.length_per_key(),
                features.keys(),
                [self._feature_rows.get(k, unchecked) for k in features.keys()],
                f"step {step}",
            )
        except ValueError as error:
            return error
        return None

    def _check_strides(self, features: KeyedJaggedTensor) -> ValueError | None:
        if self._hot is not None and features.variable_stride_per_key():
            return ValueError(
                "a deduplicated (variable-batch) batch cannot be split for "
                "replicated hot rows; send plain batches, or build the "
                "collection without hot_rows"
            )
        if self._refuse_variable_batch and features.variable_stride_per_key():
            return ValueError(
                "a deduplicated (variable-batch) batch cannot reach row-wise shards over gloo: "
                "their outputs need a reduce-scatter of uneven parts, which gloo lacks; shard "
                "these tables table- or column-wise, or send plain batches"
            )
        return None

    def _agree(self, error: ValueError | None) -> None:
        """Raise on every rank if any rank failed, so all drop the batch together."""
        if self.env.world_size > 1:
            vote(error, self._stage_pg, self._collective_device)
        elif error is not None:
            raise error

    def enter(self, prepared: ModuleInput) -> StepPlan | None:
        if self._hot is not None:
            assert isinstance(prepared.replicated, HotInput)
            self._hot.enter(prepared.replicated)
        planned = [g.enter(p) for g, p in zip(self.cached_groups, prepared.groups)]
        return _merge(planned)

    def finish(self) -> list[StepPlan]:
        if self._hot is not None:
            self._hot.resolve()
        per_group = [group.finish() for group in self.cached_groups]
        return [merged for step in zip(*per_group) if (merged := _merge(list(step)))]

    def begin_step(self, context: StepContext) -> None:
        """The next forward runs ``context``'s step: it takes from there the input the stage
        distributed when the batch entered the window, and its lookups the step's slots."""
        for group in self.cached_groups:
            group.begin_step(context)
        self._context = context

    def write_back(self) -> None:
        for kernel in self.kernels:
            kernel.write_back()

    def cache_metrics(self) -> dict[str, CacheMetrics]:
        """Counters per table, summed over this rank's shards of it."""
        out: dict[str, CacheMetrics] = {}
        for group in self.cached_groups:
            for name, metrics in zip(group.names, group.metrics):
                out[name] = out.get(name, CacheMetrics()) + metrics
        return out

    # -------------------------------------------------------------- module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        context, self._context = self._context, None
        if context is None:
            return super().forward(*args, **kwargs)  # eval: kernels read the store
        step_input = context.inputs[self]
        assert step_input.distributed is not None  # a sharded module's input is distributed
        (ctx, distributed), hot = step_input.distributed, step_input.replicated
        assert hot is None or isinstance(hot, HotInput)
        output = GatheredOutput.adopt(self.compute_and_output_dist(ctx, distributed), gather_bags)
        if hot is None:
            return output
        assert self._hot is not None
        pooled = self._hot.lookup(hot)  # while the cold outputs travel
        layout = self._hot.layout

        def with_hot_rows(cold: KeyedTensor) -> KeyedTensor:
            values = cold.values() + _in_order(pooled, layout.keys, cold.keys(), layout.dim)
            return KeyedTensor(cold.keys(), cold.length_per_key(), values)

        return CompletedOutput(output, with_hot_rows)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.write_back()
        return super().state_dict(*args, **kwargs)

    def _reload_caches(self) -> None:
        for group in self.cached_groups:
            group.cache.refresh()
        if self._hot is not None:  # reloaded from the owners before they are next read
            self._hot.invalidate()


def _in_order(pooled: torch.Tensor, keys: list[str], wanted: list[str], dim: int) -> torch.Tensor:
    """``pooled`` (features in ``keys``' order) with its features in ``wanted``'s order
    (TorchRec's sharded output orders them by sharding)."""
    if wanted == keys:
        return pooled
    index = torch.tensor([keys.index(k) for k in wanted], device=pooled.device)
    per_key = pooled.view(pooled.shape[0], len(keys), dim)
    return per_key.index_select(1, index).reshape(pooled.shape[0], -1)


def _merge(planned: list[StepPlan | None]) -> StepPlan | None:
    """One step's plans from every group (the groups plan in lockstep)."""
    steps = [p for p in planned if p is not None]
    if not steps:
        return None
    merged = StepPlan(steps[0].step)
    for step in steps:
        merged.merge(step)
    return merged


def vote(error: ValueError | None, group: dist.ProcessGroup | None, device: torch.device) -> None:
    """Raise ``error`` on this rank, and on every other rank of ``group`` a refusal naming
    it, if any rank has one (so all ranks drop a batch together)."""
    if refusals(error, group, device).item():
        raise error or ValueError("another rank refused this batch (see its error)")


def refusals(
    error: ValueError | None, group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    """How many ranks of ``group`` refuse: an all-reduce of a tensor on ``device``, the
    device the group's backend takes (NCCL: CUDA only)."""
    failed = torch.tensor([error is not None], dtype=torch.int64, device=device)
    with label("other"):
        dist.all_reduce(failed, group=group)
    return failed
