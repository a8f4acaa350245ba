"""``LookaheadEmbeddingBagCollection``: an ``EmbeddingBagCollection`` whose rows are cached.

Its cache settings (see the class's arguments): ``cache_load_factor`` or
``cache_rows`` (the slots a table starts with), ``min_cache_rows`` (a floor)
and ``max_cache_rows`` (a cap). A cache whose window needs more slots grows,
up to the cap; only a window over the cap refuses a batch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torch import nn
from torchrec.distributed.utils import merge_fused_params, optimizer_type_to_emb_opt_type
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    get_embedding_names_by_table,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_lookahead._compat import in_backward_optimizers
from torchrec_lookahead.cache.tables import CachedTables, enter_groups, finish_groups
from torchrec_lookahead.checks import no_fused_optimizer, not_sharded
from torchrec_lookahead.metrics import CacheMetrics
from torchrec_lookahead.store.files import StoreFiles
from torchrec_lookahead.store.stores import HostStore, MmapStore
from torchrec_lookahead.tbe import check_trained
from torchrec_lookahead.types import CacheSizing, ModuleInput, StepContext, StepPlan, Window
from torchrec_lookahead.variable_batch import (
    expand_pooled,
    keep_inverse_indices,
    tbe_batch_sizes,
)

__all__ = ["LookaheadEmbeddingBagCollection"]

_POOLING = {PoolingType.SUM: PoolingMode.SUM, PoolingType.MEAN: PoolingMode.MEAN}


class LookaheadEmbeddingBagCollection(EmbeddingBagCollection):
    """An ``EmbeddingBagCollection`` that trains through a small cache of its rows.

    Built like an ``EmbeddingBagCollection`` plus cache settings. The full
    tables stay in host memory as the module's parameters (the backing
    store); a FBGEMM TBE of cache slots on ``device`` does the lookups and the
    fused optimizer update, and rows move between the two (with their
    optimizer state) as the oracle plans. Tables of one data type are cached
    together (one cache TBE per type, as TorchRec groups its TBEs); among them
    tables of equal dimension share their slots: each brings its share to one
    pool, planned by one oracle. Training goes through
    :class:`~torchrec_lookahead.pipeline.LookaheadTrainPipeline`, which owns
    the lookahead window; in eval mode (or without grad) the module looks up
    the current weights directly.

    Deduplicated batches (a stride per key with ``inverse_indices``, as
    TorchRec carries RecD batches) are taken as ``EmbeddingBagCollection``
    takes them: the distinct bags are planned and looked up, the output is
    expanded to the batch (see :mod:`~torchrec_lookahead.variable_batch`).

    ``state_dict()`` writes the cache back first, so it holds the full,
    current tables under the keys and shapes of ``EmbeddingBagCollection``;
    ``load_state_dict()`` writes into the store and reloads the cached rows.

    Args:
        tables: as for ``EmbeddingBagCollection`` (FP32 or FP16, what FBGEMM's
            TBE trains; SUM or MEAN pooling, the same for every table).
        is_weighted: as for ``EmbeddingBagCollection``.
        device: where the cache and the lookups live; the full tables are on
            the host (or on ``meta`` when ``device`` is meta, for sharding).
        cache_load_factor: the slots a table brings to its pool, as a share of its rows.
        cache_rows: slots per table name, overriding ``cache_load_factor``. A
            share smaller than what the window touches is raised to that at
            the first batch (see ``CachedTables.prepare``), and a cache whose
            later window needs more slots than it has grows (to 1.5 times its
            slots, or what is needed if more; logged, and counted in
            ``cache_metrics()``: ``growths``, ``cache_rows``), keeping its rows.
        fused_params: FBGEMM TBE settings (``optimizer``, ``learning_rate``,
            ...), used where ``apply_optimizer_in_backward`` was not.
        min_cache_rows: no table (or shard) gets fewer slots, unless it has
            fewer rows. Not needed for a window to fit (the cache grows), only
            to start at a size that spares the growths: e.g. what a window can
            touch, ``(d + 1)`` batches' ids; under DMP a shard's window holds
            ids of every rank's batch, so the batch that counts is the global
            one (``world_size x`` the per-rank batch).
        max_cache_rows: the most slots a table may have (an ``int`` for every
            table, or per table name; under DMP a shard's cap is its share of
            it, as for ``cache_rows``); by default all its rows. The only
            reason a good batch is refused: one whose window needs more slots
            than a cache may hold raises ``ValueError`` naming the size needed,
            before anything changes (training can go on with the next batch).
        store_dir: keep the full tables and their optimizer state in files in
            this existing directory (:class:`~torchrec_lookahead.store.stores.MmapStore`)
            instead of host memory, for tables larger than RAM. The module's
            parameters are then mappings of those files, initialised with the
            values ``EmbeddingBagCollection`` gives on the CPU for the same
            seed. Under DMP each rank keeps its shards in a directory of its
            own below this one.

    Hot rows replicated on every rank under DMP:
    :class:`~torchrec_lookahead.embedding.hot.collection.HotRowsEmbeddingBagCollection`.
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: torch.device | None = None,
        cache_load_factor: float = 0.1,
        cache_rows: Mapping[str, int] | None = None,
        fused_params: Mapping[str, Any] | None = None,
        min_cache_rows: int = 1,
        store_dir: str | os.PathLike | None = None,
        max_cache_rows: int | Mapping[str, int] | None = None,
    ) -> None:
        check_trained(tables)
        names = [t.name for t in tables]
        if max_cache_rows is None or isinstance(max_cache_rows, Mapping):
            caps = dict(max_cache_rows or {})
        else:
            caps = dict.fromkeys(names, max_cache_rows)
        sizing = CacheSizing(cache_load_factor, dict(cache_rows or {}), min_cache_rows, caps)
        for setting, named in (("cache_rows", sizing.cache_rows), ("max_cache_rows", caps)):
            unknown = sorted(set(named) - set(names))
            if unknown:
                raise ValueError(f"{setting} names unknown tables {unknown}; tables are {names}")
        poolings = {t.pooling for t in tables}
        if len(poolings) > 1 or not poolings <= set(_POOLING):
            raise ValueError(f"tables must share one pooling, SUM or MEAN; got {poolings}")
        compute = torch.device(device) if device is not None else torch.device("cpu")
        if store_dir is not None and compute.type not in ("cpu", "meta"):
            raise ValueError(
                f"a disk store runs on the CPU for now, not {compute}: its files "
                "are mapped host memory, and pinning them for a GPU would copy "
                "every table into RAM"
            )
        if store_dir is not None:
            for table in tables:
                if table.data_type != DataType.FP32:
                    raise ValueError(
                        f"table {table.name}: a disk store holds FP32 tables for now, not "
                        f"{table.data_type.value}; keep it in host memory (no store_dir)"
                    )
        host = compute if compute.type == "meta" else torch.device("cpu")
        self.store_dir = None if store_dir is None else Path(store_dir)
        files = None
        if self.store_dir is not None and host.type != "meta":
            files = StoreFiles(self.store_dir)  # checks the directory before anything is built
            host = torch.device("meta")
        super().__init__(tables=tables, is_weighted=is_weighted, device=host)
        self._compute_device = compute
        self._store_files = files
        self.sizing = sizing
        self._fused_params = dict(fused_params or {})
        self._pooling = _POOLING[poolings.pop()]
        # Tables of one data type, in table order, per cache group; groups in order of
        # their first table. Lookups run group after group.
        by_type: dict[DataType, list[int]] = {}
        for i, table in enumerate(tables):
            by_type.setdefault(table.data_type, []).append(i)
        self._groups = list(by_type.values())
        lookup = [i for group in self._groups for i in group]
        self._flat_features = [f for i in lookup for f in tables[i].feature_names]
        self._group_features = [sum(len(tables[i].feature_names) for i in g) for g in self._groups]
        in_lookup = [tables[i] for i in lookup]
        self._lookup_dims = [t.embedding_dim for t in in_lookup for _ in t.feature_names]
        # The output's keys and widths, as EmbeddingBagCollection lays them out.
        self._output_keys = [k for names in get_embedding_names_by_table(tables) for k in names]
        self._output_dims = [t.embedding_dim for t in tables for _ in t.feature_names]
        self._columns = _output_columns(tables, lookup)
        self._cached: list[CachedTables] = []  # one per group, built at the first attach
        self.input_dist_s = 0.0  # an unsharded module distributes nothing
        if files is not None:
            try:
                self._map_weights(files)
            except BaseException:
                files.close()  # a refused store keeps nothing open
                raise
        self.register_load_state_dict_post_hook(lambda module, _: module._reload_cache())

    # ------------------------------------------------------------ settings

    @property
    def device(self) -> torch.device:
        """Where the cache and the lookups live (the full tables stay on the host, where
        ``EmbeddingBagCollection`` builds and initialises them: its ``device`` until then)."""
        return self.__dict__.get("_compute_device") or super().device

    def cache_rows(self) -> list[int]:
        """The slots each table brings to its pool (before any raise at the first batch)."""
        return [
            self.sizing.rows(t.name, t.num_embeddings, t.num_embeddings)
            for t in self.embedding_bag_configs()
        ]

    @property
    def store_files(self) -> StoreFiles | None:
        """The disk store's files (``store_dir``), or ``None`` (tables in host memory)."""
        return self._store_files

    @property
    def feature_names(self) -> list[str]:
        """Features in the order this module looks them up (its tables grouped by data type)."""
        return list(self._flat_features)

    @property
    def fused_params(self) -> dict[str, Any]:
        """The TBE settings given to the constructor (the sharder's take precedence)."""
        return dict(self._fused_params)

    def fused_config(self) -> dict[str, Any]:
        """The TBE settings: ``fused_params`` merged with the in-backward optimizer."""
        configured = [in_backward_optimizers(bag.weight) for bag in self.embedding_bags.values()]
        if len({(tuple(c), repr(k)) for c, k in configured}) > 1:
            raise ValueError("every table of one module must have the same fused optimizer")
        params = dict(self._fused_params)
        classes, kwargs_list = configured[0]
        if classes:
            if len(classes) != 1:
                raise ValueError(f"one optimizer per table is supported, got {classes}")
            kwargs = dict(kwargs_list[0])
            kwargs.setdefault("optimizer", optimizer_type_to_emb_opt_type(classes[0]))
            params = merge_fused_params(params, kwargs)
        if "optimizer" not in params:
            raise no_fused_optimizer("the collection's tables")
        return params

    # ----------------------------------------------- driven by the pipeline

    @property
    def metrics(self) -> list[CacheMetrics]:
        """Per-table counters (zero until training starts)."""
        metrics = [CacheMetrics() for _ in self.embedding_bag_configs()]
        for tables, group in zip(self._groups, self._cached):
            for table, counted in zip(tables, group.metrics):
                metrics[table] = counted
        return metrics

    @property
    def cached_groups(self) -> list[CachedTables]:
        """The groups of cached tables, one per data type (once training has started)."""
        return list(self._cached)

    def cache_metrics(self) -> dict[str, CacheMetrics]:
        """Counters per table name."""
        return {t.name: m for t, m in zip(self.embedding_bag_configs(), self.metrics)}

    def attach(self, window: Window) -> None:
        """Get ready to train with a window of ``lookahead`` batches (builds the cache once)."""
        if self._compute_device.type == "meta":
            raise not_sharded(type(self).__name__, "a module on the meta device")
        if not self._cached:
            self._cached = [self._build_cache(tables) for tables in self._groups]
        for group in self._cached:
            group.attach(window)

    def select(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """This module's features of ``features``, in lookup order (a deduplicated
        batch keeps its inverse indices)."""
        keys = features.keys()
        if keys == self._flat_features:
            return features
        index = {k: i for i, k in enumerate(keys)}
        missing = [f for f in self._flat_features if f not in index]
        if missing:
            raise ValueError(f"features {missing} are missing from the batch (it has {keys})")
        return keep_inverse_indices(
            features.permute([index[f] for f in self._flat_features]), features
        )

    def prepare(
        self, features: KeyedJaggedTensor, step: int, refusal: ValueError | None = None
    ) -> ModuleInput:
        """Check the batch of ``step`` for every table without changing anything (see
        ``CachedTables``).

        ``refusal`` is the stage's verdict on the batch as a whole (its structure,
        see :mod:`~torchrec_lookahead.checks`): raised as it is.
        """
        if refusal is not None:
            raise refusal
        parts = self._group_parts(self.select(features))
        return ModuleInput([g.prepare(part, step) for g, part in zip(self._attached, parts)])

    def enter(self, prepared: ModuleInput) -> StepPlan | None:
        """A prepared batch enters the window; returns the plan of a step now complete."""
        return enter_groups(self._attached, prepared.groups)

    def finish(self) -> list[StepPlan]:
        """End of the data: the steps still to plan, with shorter windows."""
        return finish_groups(self._attached)

    def begin_step(self, context: StepContext) -> None:
        """The next forward runs ``context``'s step (its lookups take the slots from there)."""
        for group in self._attached:
            group.begin_step(context)

    def write_back(self) -> None:
        """Write updated cache rows back to the store (the rows stay cached)."""
        for group in self._cached:
            group.write_back()

    @property
    def _attached(self) -> list[CachedTables]:
        if not self._cached:
            raise RuntimeError("the module trains through a LookaheadTrainPipeline (attach first)")
        return self._cached

    def _group_parts(self, features: KeyedJaggedTensor) -> list[KeyedJaggedTensor]:
        """``features`` (in lookup order) split into each cache group's features."""
        if len(self._groups) == 1:
            return [features]
        return features.split(self._group_features)

    # -------------------------------------------------------------- module

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if not self._cached or self._cached[0].context is None:
            if self.training and torch.is_grad_enabled():
                raise RuntimeError(
                    "LookaheadEmbeddingBagCollection trains through LookaheadTrainPipeline; "
                    "call it directly only in eval mode or under torch.no_grad()"
                )
            self.write_back()
            pooled = super().forward(self.select(features).to(torch.device("cpu")))
            return KeyedTensor(
                keys=pooled.keys(),
                length_per_key=pooled.length_per_key(),
                values=pooled.values().to(self._compute_device),
            )
        features = self.select(features)
        device = self._compute_device
        pooled = torch.cat(
            [
                group.lookup(
                    part.offsets().to(device),
                    part.values().numel(),
                    part.weights().to(device) if self.is_weighted() else None,
                    **tbe_batch_sizes(part),
                )
                for group, part in zip(self._cached, self._group_parts(features))
            ],
            dim=-1,  # groups' columns (or, flat variable-batch outputs, blocks) in lookup order
        )
        pooled = expand_pooled(pooled, features, self._lookup_dims)
        if self._columns is not None:  # the groups' columns back in table order
            pooled = pooled.index_select(1, self._columns.to(pooled.device))
        return KeyedTensor(keys=self._output_keys, length_per_key=self._output_dims, values=pooled)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.write_back()
        return super().state_dict(*args, **kwargs)

    def optimizer_states(self) -> list[list[torch.Tensor]]:
        """Per table, the full optimizer state tensors (cache written back first)."""
        self.write_back()
        states: dict[int, list[torch.Tensor]] = {}
        for tables, group in zip(self._groups, self._cached):
            states.update((t, list(s)) for t, s in zip(tables, group.cache.store.states))
        return [states[t] for t in sorted(states)]

    # ------------------------------------------------------------ internals

    def _build_cache(self, tables: list[int]) -> CachedTables:
        """The cache group of ``tables`` (indices; one data type), its store their rows."""
        params = self.fused_config()
        optimizer = params.pop("optimizer")
        configs = [self.embedding_bag_configs()[t] for t in tables]
        # On CUDA the tables stay pageable: rows move through pinned staging buffers (the
        # store's), so no table is copied into page-locked memory.
        on_cuda = self._compute_device.type == "cuda"
        weights = [self.embedding_bags[t.name].weight for t in configs]
        store: HostStore
        if self._store_files is not None:
            store = MmapStore(self._store_files, [t.name for t in configs], weights)
        else:
            store = HostStore(weights, pin=on_cuda)
        slots = self.cache_rows()
        cached = CachedTables(
            [t.name for t in configs],
            [t.num_embeddings for t in configs],
            [t.embedding_dim for t in configs],
            [k for k, t in enumerate(configs) for _ in t.feature_names],
            [slots[t] for t in tables],
            store,
            optimizer,
            self._compute_device,
            self._pooling,
            params,
            configs[0].data_type,
            [self.sizing.cap(t.name, t.num_embeddings, t.num_embeddings) for t in configs],
        )
        store.allocate_states(cached.cache.state_shapes())
        return cached

    def _map_weights(self, files: StoreFiles) -> None:
        """Tables as store files, holding what ``EmbeddingBagCollection`` on the CPU would.

        That module draws each ``nn.EmbeddingBag``'s ``normal_`` init as it is
        built, then runs each table's ``init_fn``. The draws are replayed in
        chunks into a small buffer and dropped (same generator state, no table
        in RAM); the ``init_fn`` then writes the mapped weights in place.
        """
        configs = self.embedding_bag_configs()
        files.check_space(
            sum(4 * c.num_embeddings * c.embedding_dim for c in configs), "the tables"
        )
        for config in configs:
            shape = (config.num_embeddings, config.embedding_dim)
            weight = files.tensor(f"{config.name}.weight", shape)
            self.embedding_bags[config.name].weight = nn.Parameter(weight)
            _draw_normal(weight.numel())
        for config in configs:
            config.init_fn(self.embedding_bags[config.name].weight)

    def _reload_cache(self) -> None:
        for group in self._cached:
            group.cache.refresh()


def _output_columns(tables: list[EmbeddingBagConfig], lookup: list[int]) -> torch.Tensor | None:
    """Where each output column of ``EmbeddingBagCollection``'s layout (tables in order)
    lies in the lookups' output (tables in ``lookup`` order); ``None`` if in place."""
    if lookup == sorted(lookup):
        return None
    start, first = 0, {}
    for i in lookup:
        first[i] = start
        start += len(tables[i].feature_names) * tables[i].embedding_dim
    widths = [len(t.feature_names) * t.embedding_dim for t in tables]
    return torch.cat([torch.arange(first[i], first[i] + w) for i, w in enumerate(widths)])


DRAW_CHUNK = 1 << 22  # elements per normal_ call when replaying a table's init draws


def _draw_normal(numel: int) -> None:
    """Advance the default generator as ``torch.empty(numel).normal_()`` would.

    CPU ``normal_`` on a float tensor of 16 or more elements draws one uniform
    per element, in order, plus 16 more when the size is not a multiple of 16.
    Chunks of ``DRAW_CHUNK`` (a multiple of 16) and a last one of at least
    that size (so with the same remainder) draw exactly the same sequence.
    """
    buffer = torch.empty(min(numel, 2 * DRAW_CHUNK))
    left = numel
    while left:
        size = left if left < 2 * DRAW_CHUNK else DRAW_CHUNK
        buffer[:size].normal_()
        left -= size
