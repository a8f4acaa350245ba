"""Where the hot rows live: their replica rows, their optimizer groups, their owners.

A :class:`HotLayout` is fixed when the sharded collection is built and is the
same on every rank (checked at ``open_window`` with :meth:`HotLayout.digest`). The
replica rows of a table are consecutive, the tables of a :class:`ReplicaGroup`
are consecutive, so a group is one range of replica rows and one FBGEMM TBE.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from fbgemm_gpu.split_embedding_configs import EmbOptimType

__all__ = ["HotLayout", "ReplicaGroup", "RowRange", "check_hot_rows"]


@dataclass(frozen=True)
class RowRange:
    """Rows ``[start, stop)`` of a table, held by ``rank`` (a shard)."""

    rank: int
    start: int
    stop: int


@dataclass(frozen=True)
class ReplicaGroup:
    """Hot tables whose replicas one FBGEMM TBE updates.

    Their owners' fused optimizers have the same settings (the learning rate
    aside: it is read from the owners every step, see
    :mod:`~torchrec_lookahead.embedding.hot.sync`), and FBGEMM updates them on
    the same code path: ``shared`` tables serve several features each, which
    FBGEMM's CPU backward treats apart from single-feature tables.
    """

    optimizer: EmbOptimType
    params: tuple[tuple[str, Any], ...]  # the TBE's other settings, sorted by name
    shared: bool
    tables: tuple[str, ...]
    start: int  # replica rows [start, stop)
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def check_hot_rows(
    hot_rows: Mapping[str, Sequence[int]], num_rows: Mapping[str, int]
) -> dict[str, np.ndarray]:
    """``hot_rows`` as sorted id arrays, checked against the tables' sizes."""
    unknown = sorted(set(hot_rows) - set(num_rows))
    if unknown:
        raise ValueError(f"hot_rows names unknown tables {unknown}; tables are {list(num_rows)}")
    out = {}
    for name, ids in hot_rows.items():
        array = np.asarray(ids, dtype=np.int64).reshape(-1)
        bad = array[(array < 0) | (array >= num_rows[name])]
        if len(bad):
            raise ValueError(
                f"hot_rows[{name!r}]: ids {bad[:5].tolist()} are outside the table's "
                f"{num_rows[name]} rows"
            )
        unique = np.unique(array)
        if len(unique) < len(array):
            raise ValueError(f"hot_rows[{name!r}] names some ids twice")
        if len(unique):
            out[name] = unique
    return out


class HotLayout:
    """The hot rows of a collection: replica rows, groups, features, shards.

    Args:
        hot: sorted hot ids per table name (tables without hot rows left out).
        keys: the collection's features, in its output order; ``key_tables[i]``
            is the table of ``keys[i]``, ``table_features[t]`` the features of
            table ``t`` in its order.
        num_embeddings: rows of each table.
        table_params: per hot table, the fused parameters its owner's TBE runs
            (``optimizer`` among them).
        shards: per hot table, its row ranges and their ranks.
        dim: the row width (one for every table of the collection).
    """

    def __init__(
        self,
        hot: Mapping[str, np.ndarray],
        keys: Sequence[str],
        key_tables: Sequence[str],
        table_features: Mapping[str, Sequence[str]],
        num_embeddings: Mapping[str, int],
        table_params: Mapping[str, Mapping[str, Any]],
        shards: Mapping[str, Sequence[RowRange]],
        dim: int,
    ) -> None:
        self.keys = list(keys)
        self.key_tables = list(key_tables)
        self.dim = dim
        self.shards = {name: list(shards[name]) for name in hot}
        # Groups in the order of their first table; tables in a group in the order given.
        by_key: dict[tuple[Any, ...], list[str]] = {}
        for name in hot:
            key = _group_key(table_params[name], len(table_features[name]))
            by_key.setdefault(key, []).append(name)
        self.groups: list[ReplicaGroup] = []
        self.first: dict[str, int] = {}  # replica row of each table's first hot id
        self.hot: dict[str, np.ndarray] = {}
        row = 0
        for (optimizer, _, shared), names in by_key.items():
            start = row
            for name in names:
                self.first[name] = row
                self.hot[name] = np.asarray(hot[name], dtype=np.int64)
                row += len(hot[name])
            params = tuple(
                sorted(
                    (k, v)
                    for k, v in table_params[names[0]].items()
                    if k not in ("optimizer", "learning_rate")
                )
            )
            self.groups.append(ReplicaGroup(optimizer, params, shared, tuple(names), start, row))
        self.num_rows = row
        self.tables = [name for group in self.groups for name in group.tables]
        # The hot table of each replica row (for per-table learning rates).
        self.table_of_row = np.repeat(
            np.arange(len(self.tables)), [len(self.hot[n]) for n in self.tables]
        )
        self.group_of_key = [self._group_index(t) for t in self.key_tables]
        # FBGEMM's backward adds a shared table's gradients feature by feature (see sync.py):
        # the round of a feature is its place among its table's features.
        self.key_rounds = [
            list(table_features[t]).index(k) if t in self.hot else 0
            for k, t in zip(self.keys, self.key_tables)
        ]
        self.num_rounds = 1 + max((len(table_features[t]) - 1 for t in self.hot), default=0)
        # Table t's id i as one code, t's codes after those of the tables before it
        # (in ``hot``'s order): one sorted array finds every table's hot ids.
        sizes = [num_embeddings[name] for name in hot]
        self.code_shift = dict(zip(hot, np.cumsum([0, *sizes[:-1]]).tolist()))
        self.code_space = int(sum(sizes))
        self.codes = np.concatenate([self.hot[n] + self.code_shift[n] for n in hot])
        self.code_rows = np.concatenate([np.arange(len(self.hot[n])) + self.first[n] for n in hot])

    def _group_index(self, table: str) -> int:
        for index, group in enumerate(self.groups):
            if table in group.tables:
                return index
        return -1

    def group_of(self, table: str) -> ReplicaGroup:
        return self.groups[self._group_index(table)]

    def digest(self) -> bytes:
        """A fingerprint of the layout: equal on ranks that hold the same hot rows
        with the same optimizer groups."""
        h = hashlib.sha256()
        for group in self.groups:
            h.update(
                repr(
                    (group.optimizer, sorted(map(repr, group.params)), group.shared, group.tables)
                ).encode()
            )
            for name in group.tables:
                h.update(self.hot[name].tobytes())
        return h.digest()


def _group_key(params: Mapping[str, Any], features: int) -> tuple[Any, ...]:
    """What a replica group shares: the optimizer, its settings but the learning rate, and
    whether FBGEMM takes the table as shared (several features)."""
    rest = tuple(
        sorted((k, repr(v)) for k, v in params.items() if k not in ("optimizer", "learning_rate"))
    )
    return params["optimizer"], rest, features > 1
