"""``LookaheadEmbeddingCollection``: an ``EmbeddingCollection`` (sequence features) whose rows
are cached.

The unpooled twin of
:class:`~torchrec_lookahead.embedding.collection.LookaheadEmbeddingBagCollection`:
the same cache settings, cache groups, store and oracle
(:mod:`~torchrec_lookahead.embedding.cached`), with the cache TBE's pooling
``NONE`` (one row per id, as TorchRec's sharded ``EmbeddingCollection`` builds
its TBE), and ``EmbeddingCollection``'s output: a ``JaggedTensor`` per feature.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torch import nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection, get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from torchrec_lookahead.embedding.cached import CachedCollection, CacheSettings, check_table_kind
from torchrec_lookahead.steps import ModuleInput

__all__ = ["LookaheadEmbeddingCollection", "jagged_output", "output_places"]


class LookaheadEmbeddingCollection(CachedCollection, EmbeddingCollection):
    """An ``EmbeddingCollection`` that trains through a small cache of its rows.

    Built like an ``EmbeddingCollection`` plus the cache settings of
    :class:`~torchrec_lookahead.embedding.collection.LookaheadEmbeddingBagCollection`
    (``cache_load_factor``, ``cache_rows``, ``fused_params``, ``min_cache_rows``,
    ``store_dir``, ``max_cache_rows``; see there), and cached the same way: the
    full tables stay in host memory as the module's parameters, a FBGEMM TBE of
    cache slots (pooling ``NONE``) on ``device`` looks up one row per id and runs
    the fused optimizer, and rows move with their optimizer state as the oracle
    plans. Training goes through
    :class:`~torchrec_lookahead.pipeline.LookaheadTrainPipeline`; in eval mode
    (or without grad) the module looks up the current weights directly.

    ``forward`` returns what ``EmbeddingCollection`` returns: per embedding name
    (a feature, ``feature@table`` where two tables share it), a ``JaggedTensor``
    of the feature's rows (FP32, whatever the table's type) and its lengths, with
    the ids as weights when ``need_indices``. ``state_dict()`` writes the cache
    back first, so it holds the full, current tables under ``EmbeddingCollection``'s
    keys; ``load_state_dict()`` writes into the store and reloads the cached rows.

    Deduplicated (variable-stride) batches are refused: the sequence of a
    deduplicated bag would have to be repeated for each of its samples, and its
    rows' gradients summed before FBGEMM's update, which is not the plain
    ``EmbeddingCollection``'s arithmetic.

    Args:
        tables: as for ``EmbeddingCollection`` (one ``embedding_dim`` for all; FP32 or
            FP16, what FBGEMM's TBE trains).
        device: where the cache and the lookups live; the full tables are on the
            host (or on ``meta`` when ``device`` is meta).
        need_indices: as for ``EmbeddingCollection``.
        cache_load_factor: as for ``LookaheadEmbeddingBagCollection``, and so are
            ``cache_rows``, ``fused_params``, ``min_cache_rows``, ``store_dir`` and
            ``max_cache_rows``.
    """

    def __init__(
        self,
        tables: list[EmbeddingConfig],
        device: torch.device | None = None,
        need_indices: bool = False,
        cache_load_factor: float = 0.1,
        cache_rows: Mapping[str, int] | None = None,
        fused_params: Mapping[str, Any] | None = None,
        min_cache_rows: int = 1,
        store_dir: str | os.PathLike | None = None,
        max_cache_rows: int | Mapping[str, int] | None = None,
    ) -> None:
        check_table_kind(tables, EmbeddingConfig, type(self).__name__)
        settings = CacheSettings.check(
            tables,
            device,
            cache_load_factor,
            cache_rows,
            min_cache_rows,
            store_dir,
            max_cache_rows,
        )
        super().__init__(tables=tables, device=settings.host, need_indices=need_indices)
        self._init_cache(settings, fused_params, PoolingMode.NONE, init_each=True)
        self._places = output_places(tables, self._lookup)

    def table_configs(self) -> list[BaseEmbeddingConfig]:
        return list(self.embedding_configs())

    def _tables(self) -> nn.ModuleDict:
        return self.embeddings

    def prepare(self, features: KeyedJaggedTensor, step: int) -> ModuleInput:
        """As the bag collection's ``prepare``; a deduplicated batch is refused."""
        if features.variable_stride_per_key():
            raise ValueError(
                f"step {step}: a deduplicated (variable-stride) batch is not taken by "
                f"{type(self).__name__}: sequence features are looked up id by id, each "
                "sample's own sequence; give it batches with every sample's bags"
            )
        return super().prepare(features, step)

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        if not self._training_step():
            looked_up = super().forward(self.select(features).to(torch.device("cpu")))
            return {name: jagged.to(self._compute_device) for name, jagged in looked_up.items()}
        features = self.select(features)
        device = self._compute_device
        rows = torch.cat(
            [
                group.lookup(part.offsets().to(device), part.values().numel(), None)
                for group, part in zip(self._cached, self._group_parts(features))
            ]
        )
        return jagged_output(rows, features, self._places, self.need_indices())


def output_places(tables: list[EmbeddingConfig], lookup: list[int]) -> list[tuple[str, int]]:
    """Each of ``EmbeddingCollection``'s outputs (tables in order, a table's features in
    order): its embedding name and the place of its feature among the features looked up
    table by table in ``lookup`` order."""
    place, at = {}, 0
    for i in lookup:
        place[i] = at
        at += len(tables[i].feature_names)
    names = get_embedding_names_by_table(tables)
    return [(name, place[i] + j) for i, table in enumerate(names) for j, name in enumerate(table)]


def jagged_output(
    rows: torch.Tensor,
    features: KeyedJaggedTensor,
    places: list[tuple[str, int]],
    need_indices: bool,
) -> dict[str, JaggedTensor]:
    """``EmbeddingCollection``'s output from the ``rows`` of ``features``' ids (one per id,
    in the features' order): per name of ``places``, its feature's rows and lengths (and
    ids, ``need_indices``)."""
    counts = features.length_per_key()
    per_feature = rows.split(counts)
    lengths = features.lengths().view(len(counts), -1).to(rows.device)
    ids = features.values().to(rows.device).split(counts) if need_indices else None
    return {
        name: JaggedTensor(
            values=per_feature[k],
            lengths=lengths[k],
            weights=None if ids is None else ids[k],
        )
        for name, k in places
    }
