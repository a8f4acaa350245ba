"""``LookaheadEmbeddingBagCollection``: an ``EmbeddingBagCollection`` whose rows are cached.

Its cache settings (see the class's arguments): ``cache_load_factor`` or
``cache_rows`` (the slots a table starts with), ``min_cache_rows`` (a floor)
and ``max_cache_rows`` (a cap). A cache whose window needs more slots grows,
up to the cap; only a window over the cap refuses a batch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torch import nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollection,
    get_embedding_names_by_table,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_lookahead.embedding.cached import CachedCollection, CacheSettings, check_table_kind
from torchrec_lookahead.variable_batch import expand_pooled, tbe_batch_sizes

__all__ = ["LookaheadEmbeddingBagCollection"]

_POOLING = {PoolingType.SUM: PoolingMode.SUM, PoolingType.MEAN: PoolingMode.MEAN}


class LookaheadEmbeddingBagCollection(CachedCollection, EmbeddingBagCollection):
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
            the first batch (see ``CacheGroup.prepare``), and a cache whose
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
        check_table_kind(tables, EmbeddingBagConfig, type(self).__name__)
        poolings = {t.pooling for t in tables}
        if len(poolings) > 1 or not poolings <= set(_POOLING):
            raise ValueError(f"tables must share one pooling, SUM or MEAN; got {poolings}")
        settings = CacheSettings.check(
            tables,
            device,
            cache_load_factor,
            cache_rows,
            min_cache_rows,
            store_dir,
            max_cache_rows,
        )
        super().__init__(tables=tables, is_weighted=is_weighted, device=settings.host)
        self._init_cache(settings, fused_params, _POOLING[poolings.pop()], init_each=False)
        in_lookup = [tables[i] for i in self._lookup]
        self._lookup_dims = [t.embedding_dim for t in in_lookup for _ in t.feature_names]
        # The output's keys and widths, as EmbeddingBagCollection lays them out.
        self._output_keys = [k for names in get_embedding_names_by_table(tables) for k in names]
        self._output_dims = [t.embedding_dim for t in tables for _ in t.feature_names]
        self._columns = _output_columns(tables, self._lookup)

    def table_configs(self) -> list[BaseEmbeddingConfig]:
        return list(self.embedding_bag_configs())

    def _tables(self) -> nn.ModuleDict:
        return self.embedding_bags

    # -------------------------------------------------------------- module

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if not self._training_step():
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
