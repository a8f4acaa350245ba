"""``HotRowsEmbeddingBagCollection``: a lookahead collection whose hot rows are replicated.

Unsharded it is the lookahead collection itself (every row is local already);
its sharder
(:class:`~torchrec_lookahead.embedding.sharder.HotRowsEmbeddingBagCollectionSharder`)
builds :class:`~torchrec_lookahead.embedding.hot.sharded.ShardedHotRowsEmbeddingBagCollection`,
which keeps a replica of the hot rows on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType

from torchrec_lookahead.embedding.cached import check_table_kind
from torchrec_lookahead.embedding.collection import LookaheadEmbeddingBagCollection
from torchrec_lookahead.embedding.hot.layout import check_hot_rows

__all__ = ["HotRowsEmbeddingBagCollection"]


class HotRowsEmbeddingBagCollection(LookaheadEmbeddingBagCollection):
    """``LookaheadEmbeddingBagCollection`` with ``hot_rows`` replicated on every rank under DMP.

    Args:
        tables: as for ``LookaheadEmbeddingBagCollection``.
        hot_rows: ids per table name to replicate (see
            :mod:`~torchrec_lookahead.embedding.hot`): looked up where their
            samples are, their gradients summed across ranks. Needs SUM
            pooling, unweighted features, one row width for every table and
            each feature in one table. Every rank must name the same rows.
        **kwargs: the other arguments of ``LookaheadEmbeddingBagCollection``.
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        hot_rows: Mapping[str, Sequence[int]],
        **kwargs: Any,
    ) -> None:
        check_table_kind(tables, EmbeddingBagConfig, type(self).__name__)
        checked = check_hot_rows(hot_rows, {t.name: t.num_embeddings for t in tables})
        if not checked:
            raise ValueError(
                "hot_rows names no row: build a LookaheadEmbeddingBagCollection instead"
            )
        _check_replicable(tables, bool(kwargs.get("is_weighted", False)))
        super().__init__(tables, **kwargs)
        self.hot_rows = checked


def _check_replicable(tables: list[EmbeddingBagConfig], is_weighted: bool) -> None:
    """Raise ``ValueError`` if hot rows of ``tables`` cannot be replicated exactly."""
    problems = []
    if is_weighted:
        problems.append("weighted features (a hot id's weight would have to travel too)")
    types = sorted({t.data_type.value for t in tables} - {DataType.FP32.value})
    if types:
        problems.append(f"{', '.join(types)} tables (the replicas hold FP32 rows)")
    if any(t.pooling != PoolingType.SUM for t in tables):
        problems.append("MEAN pooling (a bag's mean needs its cold and hot ids together)")
    if len({t.embedding_dim for t in tables}) > 1:
        problems.append(f"tables of several widths {sorted({t.embedding_dim for t in tables})}")
    features = [f for t in tables for f in t.feature_names]
    if len(set(features)) < len(features):
        problems.append("a feature looked up in two tables")
    if problems:
        raise ValueError("hot_rows cannot be replicated with " + "; ".join(problems))
