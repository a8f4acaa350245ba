"""TorchRec's sharded collections, pipeline-driven.

TorchRec's sharded collection is kept whole: its lookups create lookahead
kernels (:mod:`~torchrec_lookahead.embedding.kernel`), and the pipeline splits
its forward in time, ``input_dist`` when a batch enters the window and the rest
at the step. Every rank caches only the shards it owns, so each row has one
owner. :class:`ShardedLookaheadModule` is that driving, over either of TorchRec's
sharded collections: :class:`ShardedLookaheadEmbeddingBagCollection` (pooled) here,
:class:`~torchrec_lookahead.embedding.sequence_sharded.ShardedLookaheadEmbeddingCollection`
(sequence) beside it. Replicated hot rows extend the pooled one
(:class:`~torchrec_lookahead.embedding.hot.sharded.ShardedHotRowsEmbeddingBagCollection`)
through three hooks: ``create_context``, ``route`` and ``complete``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext
from torchrec.distributed.types import Awaitable, LazyAwaitable, ShardingEnv, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_lookahead._compat import (
    GatheredOutput,
    ShardedCollectionBase,
    destroy_group,
)
from torchrec_lookahead.cache.group import CacheGroup, enter_groups, finish_groups
from torchrec_lookahead.embedding.cache_group import check_disk_store
from torchrec_lookahead.embedding.cached import CachedCollection
from torchrec_lookahead.embedding.kernel import LookaheadKernel
from torchrec_lookahead.embedding.lookup import LookaheadLookup, LookaheadPooledEmbeddingsLookup
from torchrec_lookahead.metrics import CacheMetrics
from torchrec_lookahead.settings import WindowSettings
from torchrec_lookahead.steps import ModuleInput, StepContext, StepPlan
from torchrec_lookahead.store.files import StoreFiles
from torchrec_lookahead.variable_batch import check_variable_batch_optimizer, gather_bags
from torchrec_lookahead.votes import VoteGroup

__all__ = ["DistributedBatch", "ShardedLookaheadEmbeddingBagCollection", "ShardedLookaheadModule"]

if TYPE_CHECKING:
    # TorchRec's sharded collections are untyped here (Any to mypy): the mixin reads their
    # attributes as they do.
    ShardedBase = Any
else:
    ShardedBase = object


@dataclass
class DistributedBatch:
    """A batch as this rank's shards get it (``distribute``): TorchRec's context and
    distributed input, and, until every cache is sized, per table the most ids a shard
    can get from a batch like it."""

    ctx: EmbeddingBagCollectionContext
    features: Any  # TorchRec's KJTList
    bound: dict[str, int] | None


class _InputDist(Awaitable[DistributedBatch]):
    """A batch's input dist, started (``distribute``): its wait waits for the splits'
    exchange, then for the ids'."""

    def __init__(self, ctx: EmbeddingBagCollectionContext, splits: Any, bound: Any) -> None:
        super().__init__()
        self._ctx, self._splits, self._bound = ctx, splits, bound

    def _wait_impl(self) -> DistributedBatch:
        return DistributedBatch(self._ctx, self._splits.wait().wait(), self._bound)


class ShardedLookaheadModule(ShardedBase):
    """A TorchRec sharded collection (a base listed after this mixin, with the hooks of
    ``_compat``'s sharded bases) with lookahead kernels, driven by the pipeline.

    The lookahead stage runs ``input_dist`` for a batch when it enters the
    window (``distribute``), so each rank's oracles see exactly the ids its shards
    will serve; the step's forward later consumes that distributed input.

    The stage may distribute on its own thread, beside the trainer's collectives, so
    its collectives use a process group of their own (made at ``open_window``, by
    every rank): in ``distribute`` this module's input dists are copies of TorchRec's
    bound to that group, while any other forward (eval) keeps TorchRec's own. The
    one collective of ``prepare`` (a capped cache's verdict) runs on a vote group of
    its own too, for the stage's planning thread.
    """

    lookup_type: ClassVar[type[LookaheadLookup]]

    def __init__(self, module: CachedCollection, **kwargs: Any) -> None:
        # TorchRec's constructor calls back into this class before it returns: it builds
        # the lookups (``make_lookup`` reads the cache sizing and the disk store's files)
        # and may build the input dists (``input_dists_created`` reads the stage's
        # group). Those four attributes are therefore set first; all others after.
        self._sizing = module.sizing
        self._store_files = None  # a disk store's files (this rank's)
        if module.store_dir is not None:
            check_disk_store(
                torch.device(kwargs.get("device") or "cpu"), module.table_configs(), True
            )
            # One directory per rank and module: several modules may share a store_dir.
            where = f"rank{kwargs['env'].rank}/{kwargs.get('module_fqn') or 'module'}"
            self._store_files = StoreFiles.create_subdir(module.store_dir, where)
        self._stage_pg: dist.ProcessGroup | None = None
        self._window: WindowSettings | None = None  # the window the groups were made for
        self._verdicts: VoteGroup | None = None  # a capped cache's, from two ranks up
        self._stage_input_dists: list[torch.nn.Module] = []
        super().__init__(module=module, **kwargs)
        row_wise = {ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value}
        self._row_wise_on_gloo = bool(
            row_wise & set(self.sharding_types)
            and dist.is_initialized()
            and dist.get_backend(self.env.process_group) == "gloo"
        )
        # Collectives take tensors of the device the sharded module computes on (NCCL: CUDA).
        self._collective_device = torch.device(kwargs.get("device") or "cpu")
        self._table_features = {t.name: list(t.feature_names) for t in self.table_configs()}
        self._features = [f for names in self._table_features.values() for f in names]
        self._window_keys: list[str] | None = None  # the order of the window's first batch
        # A load, whole or partial (strict=False), then reloads every cached row from the
        # store: the store must hold their newest values first (hot rows' too).
        self.register_load_state_dict_pre_hook(lambda m, *_: m.write_back())
        self.register_load_state_dict_post_hook(lambda m, _: m._reload_caches())

    @property
    def kernels(self) -> list[LookaheadKernel]:
        """This rank's lookahead kernels (one per group of its shards)."""
        return [kernel for lookup in self.lookups for kernel in lookup.kernels]

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
    ) -> LookaheadLookup:
        files = self._store_files
        return self.lookup_type(
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
    def cached_groups(self) -> list[CacheGroup]:
        return [kernel.cached for kernel in self.kernels]

    def input_dists_created(self) -> None:
        self._bind_stage_input_dists()

    def _bind_stage_input_dists(self) -> None:
        """Input dists like TorchRec's, their collectives on the stage's process group; in
        place, so a first batch whose ``input_dist`` makes TorchRec's uses them at once."""
        if self._stage_pg is not None and self.input_dists_ready:
            self._stage_input_dists[:] = self.input_dists_on(self._stage_pg)

    def open_window(self, window: WindowSettings) -> None:
        ranks = dist.get_process_group_ranks(self.env.process_group)
        # A fresh group at every open_window (a collective: every rank attaches in the same
        # order): a pipeline closed mid-stream may leave one rank's stage thread inside a
        # batch's collectives that the other ranks' threads never joined; on a group of its
        # own it cannot meet the next pipeline's collectives.
        self._stage_pg = dist.new_group(ranks=ranks)
        if self._sizing.max_rows and self.env.world_size > 1:
            self._verdicts = VoteGroup(ranks, self._collective_device)
        self._window = window
        self._window_keys = None
        self._bind_stage_input_dists()
        for group in self.cached_groups:
            group.open_window(window)

    def close_window(self, window: WindowSettings) -> None:
        """Destroy the process groups ``open_window`` made for ``window`` (unless a later
        window's replaced them): each holds threads, and under NCCL a communicator's
        device memory, which a pipeline per epoch would otherwise pile up."""
        if window is not self._window:
            return
        destroy_group(self._stage_pg)
        if self._verdicts is not None:
            self._verdicts.close()
        self._stage_pg, self._verdicts, self._window = None, None, None
        self._stage_input_dists.clear()  # bound to the group

    def distribute(self, features: KeyedJaggedTensor) -> Awaitable[DistributedBatch]:
        """Start the batch's way to this rank's shards: TorchRec's input dist, on the
        stage's process group (collectives; every rank took the batch, see
        :mod:`~torchrec_lookahead.votes`). Its ``wait()`` exchanges the splits, then the
        ids, and gives the batch as the shards get it."""
        bound = self._ids_bound(features)
        ctx = self.create_context()
        sent = self.route(features, ctx, self._stage_pg)
        self.use_input_dists(self._stage_input_dists)  # the stage's
        try:
            splits = self.input_dist(ctx, sent)
        finally:
            self.use_input_dists(None)
        return _InputDist(ctx, splits, bound)

    def prepare(self, distributed: DistributedBatch, step: int) -> ModuleInput:
        """Check the distributed batch of ``step`` for every shard's cache, changing
        nothing. A shard's cache that cannot take the batch's window (its cap,
        ``max_cache_rows``, reached) is found only now: where a cap is set, every rank
        votes on that, so that all drop the batch together."""
        prepared, error = [], None
        try:
            for lookup, kjt in zip(self.lookups, distributed.features):
                for kernel, part in zip(lookup.kernels, lookup.kernel_features(kjt)):
                    prepared.append(kernel.cached.prepare(part, step, distributed.bound))
        except ValueError as caught:
            error = caught
        if self._verdicts is not None:
            error = self._verdicts.agree(error)
        elif error is not None and self.env.world_size > 1:
            raise RuntimeError(  # the stage's checks let through a batch they should not
                f"step {step}: a batch every rank accepted failed a cache's check: {error}"
            ) from error
        if error is not None:
            raise error
        return ModuleInput(prepared, (distributed.ctx, distributed.features))

    def route(
        self,
        features: KeyedJaggedTensor,
        ctx: EmbeddingBagCollectionContext,
        group: dist.ProcessGroup | None,
    ) -> KeyedJaggedTensor:
        """The part of a batch (every rank's passed the vote, or is a stand-in) that goes
        to the shards; a subclass may keep the rest in ``ctx`` and start collectives on
        ``group`` (the stage's), on every rank alike. Here: all of it."""
        return features

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

    def batch_kind_refusal(self, features: KeyedJaggedTensor) -> ValueError | None:
        """Why this collection cannot take a batch of ``features``' kind (checked on the
        host batch, as the stage reads it), if it cannot. TorchRec's input dist routes
        every feature of the collection, in the order of the first batch it saw: a batch
        missing one failed inside it, and one in another order went to the wrong tables.
        On a GPU, a deduplicated batch into a fused optimizer FBGEMM's variable-batch
        kernels lack. Subclasses add their own after these."""
        keys = [key for key in features.keys() if key in self._features]
        missing = [f for f in self._features if f not in keys]
        if missing:
            return ValueError(
                f"features {missing} are missing from the batch: a sharded collection "
                "takes every one of its features in every batch"
            )
        if self._window_keys is None:
            self._window_keys = keys
        elif keys != self._window_keys:
            return ValueError(
                f"the batch has its features in the order {keys}, the "
                f"window's first batch in the order {self._window_keys}: TorchRec's input "
                "dist sends every batch's features where the first batch's went"
            )
        if self._collective_device.type == "cpu":  # the CPU pools variable batches padded
            return None
        for group in self.cached_groups:
            try:
                check_variable_batch_optimizer(features, group.optimizer, "this batch")
            except ValueError as refused:
                return refused
        return None

    def enter(self, prepared: ModuleInput) -> StepPlan | None:
        return enter_groups(self.cached_groups, prepared.groups)

    def finish(self) -> list[StepPlan]:
        return finish_groups(self.cached_groups)

    def step_forward(self, context: StepContext, *args: Any, **kwargs: Any) -> Any:
        """The forward of ``context``'s step (the pipeline's stand-in for ``forward`` calls
        it, with the batch, which the stage distributed when it entered the window): the
        output of the input distributed then, its lookups taking the step's slots. Any
        other forward (eval) is TorchRec's own, its kernels reading the store."""
        for group in self.cached_groups:
            group.begin_step(context)
        step_input = context.inputs[self]
        assert step_input.distributed is not None  # a sharded module's input is distributed
        ctx, distributed = step_input.distributed
        return self.step_output(ctx, distributed)

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

    def step_output(self, ctx: Any, distributed: Any) -> Any:
        """The step's output from the input the stage distributed (TorchRec's lookups and
        output dist; a subclass may add to it)."""
        return self.compute_and_output_dist(ctx, distributed)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.write_back()
        return super().state_dict(*args, **kwargs)

    def _reload_caches(self) -> None:
        """The tables were loaded: every cache refreshes from its store."""
        for group in self.cached_groups:
            group.cache.refresh()


class ShardedLookaheadEmbeddingBagCollection(ShardedLookaheadModule, ShardedCollectionBase):
    """``ShardedEmbeddingBagCollection`` with lookahead kernels, driven by the pipeline
    (see :class:`ShardedLookaheadModule`)."""

    lookup_type = LookaheadPooledEmbeddingsLookup

    def __init__(self, module: CachedCollection, **kwargs: Any) -> None:
        super().__init__(module=module, **kwargs)
        # Row-wise shards' outputs of a deduplicated batch need a reduce-scatter of uneven
        # parts, which gloo lacks: refused from two ranks up (at one rank there is one part).
        self._refuse_variable_batch = self._row_wise_on_gloo and self.env.world_size > 1

    def batch_kind_refusal(self, features: KeyedJaggedTensor) -> ValueError | None:
        """Why this collection cannot take a batch of ``features``' kind, if it cannot."""
        if (refusal := super().batch_kind_refusal(features)) is not None:
            return refusal
        if self._refuse_variable_batch and features.variable_stride_per_key():
            return ValueError(
                "a deduplicated (variable-batch) batch cannot reach row-wise shards over gloo: "
                "their outputs need a reduce-scatter of uneven parts, which gloo lacks; shard "
                "these tables table- or column-wise, or send plain batches"
            )
        return None

    def step_output(self, ctx: EmbeddingBagCollectionContext, distributed: Any) -> Any:
        output = GatheredOutput.adopt(self.compute_and_output_dist(ctx, distributed), gather_bags)
        return self.complete(ctx, output)

    def complete(
        self, ctx: EmbeddingBagCollectionContext, output: LazyAwaitable[KeyedTensor]
    ) -> LazyAwaitable[KeyedTensor]:
        """The step's output, from the shards' ``output`` of the batch ``route`` sent them
        (a subclass adds what it kept in ``ctx``). Here: ``output``."""
        return output
