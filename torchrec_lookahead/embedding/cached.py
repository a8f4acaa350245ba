"""What the lookahead collections share: their cache settings, cache groups and store.

:class:`~torchrec_lookahead.embedding.collection.LookaheadEmbeddingBagCollection`
(pooled, an ``EmbeddingBagCollection``) and
:class:`~torchrec_lookahead.embedding.sequence.LookaheadEmbeddingCollection`
(unpooled, an ``EmbeddingCollection``) cache their rows the same way: the
module's own full-table parameters are the store, its tables are cached in a
:class:`~torchrec_lookahead.cache.group.CacheGroup` group per data type, and
the pipeline drives the groups through the ``LookaheadModule`` protocol. Only
the lookups' output differs (one row per bag or one row per id, FBGEMM's
pooling mode), so :class:`CachedCollection` holds everything else and each
collection adds its TorchRec base, its pooling and its ``forward``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torch import nn
from torchrec.distributed.types import NoWait
from torchrec.distributed.utils import merge_fused_params, optimizer_type_to_emb_opt_type
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, DataType, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead._compat import in_backward_optimizers
from torchrec_lookahead.cache.group import CacheGroup, enter_groups, finish_groups
from torchrec_lookahead.checks import no_fused_optimizer, not_sharded
from torchrec_lookahead.embedding.cache_group import GroupTable, build_cache_group, check_disk_store
from torchrec_lookahead.metrics import CacheMetrics
from torchrec_lookahead.settings import CacheSizing, SettingTypeError, WindowSettings
from torchrec_lookahead.steps import ModuleInput, StepContext, StepPlan
from torchrec_lookahead.store.files import StoreFiles
from torchrec_lookahead.tbe import check_trained
from torchrec_lookahead.variable_batch import keep_inverse_indices

__all__ = ["CacheSettings", "CachedCollection", "check_table_kind"]


def check_table_kind(
    tables: Sequence[BaseEmbeddingConfig], kind: type[BaseEmbeddingConfig], module: str
) -> None:
    """Raise ``ValueError`` if a table is not a ``kind`` (a bag table given to the sequence
    collection or the other way round), naming the collection that caches it."""
    for table in tables:
        if not isinstance(table, kind):
            other = (
                "LookaheadEmbeddingCollection (sequence tables, EmbeddingConfig)"
                if kind is EmbeddingBagConfig
                else "LookaheadEmbeddingBagCollection (pooled tables, EmbeddingBagConfig)"
            )
            raise ValueError(
                f"table {table.name}: {module} takes {kind.__name__} tables, not "
                f"{type(table).__name__}; cache it in a {other}"
            )


@dataclass(frozen=True)
class CacheSettings:
    """A lookahead collection's cache settings, checked before its TorchRec base is built.

    ``host`` is where the base builds the full tables: the CPU, or ``meta`` (for
    sharding, or when a disk store's ``files`` take their place).
    """

    sizing: CacheSizing
    compute: torch.device
    host: torch.device
    store_dir: Path | None
    files: StoreFiles | None

    @classmethod
    def check(
        cls,
        tables: Sequence[BaseEmbeddingConfig],
        device: torch.device | None,
        cache_load_factor: float,
        cache_rows: Mapping[str, int] | None,
        min_cache_rows: int,
        store_dir: str | os.PathLike | None,
        max_cache_rows: int | Mapping[str, int] | None,
    ) -> CacheSettings:
        """The settings as the collections take them (see their arguments), or ``ValueError``
        before anything is built (a refused disk store makes no file)."""
        if not tables:
            raise ValueError("tables: a lookahead collection caches one table or more, got none")
        if cache_rows is not None and not isinstance(cache_rows, Mapping):
            raise SettingTypeError(f"cache_rows must map table names to rows, got {cache_rows!r}")
        if store_dir is not None and not isinstance(store_dir, (str, os.PathLike)):
            raise SettingTypeError(f"store_dir must be a path, got {store_dir!r}")
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
        compute = torch.device(device) if device is not None else torch.device("cpu")
        if store_dir is not None:
            check_disk_store(compute, tables)
        host = compute if compute.type == "meta" else torch.device("cpu")
        files = None
        if store_dir is not None and host.type != "meta":
            files = StoreFiles(Path(store_dir))  # checks the directory before anything is built
            host = torch.device("meta")
        return cls(sizing, compute, host, None if store_dir is None else Path(store_dir), files)


if TYPE_CHECKING:
    # TorchRec's collections are untyped here (Any to mypy); a mixin typed as nn.Module would
    # type their attributes through nn.Module.__getattr__ instead (Tensor | Module).
    ModuleBase = Any
else:
    ModuleBase = nn.Module


class CachedCollection(ModuleBase):
    """A TorchRec collection whose rows train through a lookahead cache (a mixin, listed
    before the TorchRec base).

    The collection builds its TorchRec base on ``settings.host``, then calls
    :meth:`_init_cache`. It gives :meth:`table_configs` and :meth:`_tables` (its
    base's configs and ``nn.Embedding`` / ``nn.EmbeddingBag`` modules, by table
    name); its ``forward`` looks up through ``self._cached`` (one group per data
    type, features in :attr:`feature_names` order, split by :meth:`_group_parts`).
    """

    _compute_device: torch.device

    # -------------------------------------------- what the collection gives

    def table_configs(self) -> list[BaseEmbeddingConfig]:
        """The tables, as the TorchRec base lists them."""
        raise NotImplementedError

    def _tables(self) -> nn.ModuleDict:
        """The TorchRec base's modules holding each table's ``weight``, by table name."""
        raise NotImplementedError

    def _weight(self, name: str) -> torch.Tensor:
        """Table ``name``'s full weights (the store's)."""
        weight = self._tables()[name].weight
        assert isinstance(weight, torch.Tensor)
        return weight

    def _init_cache(
        self,
        settings: CacheSettings,
        fused_params: Mapping[str, Any] | None,
        pooling: PoolingMode,
        init_each: bool,
    ) -> None:
        """Set the cache up once the TorchRec base is built (the caches themselves are built
        at the first ``open_window``). ``init_each``: the base runs each table's ``init_fn`` right
        after drawing it (``EmbeddingCollection``), not after drawing every table
        (``EmbeddingBagCollection``): a disk store replays the same order."""
        tables = self.table_configs()
        self._compute_device = settings.compute
        self._store_files = settings.files
        self.store_dir = settings.store_dir
        self.sizing = settings.sizing
        self._fused_params = dict(fused_params or {})
        self._pooling = pooling
        # Tables of one data type, in table order, per cache group; groups in order of
        # their first table. Lookups run group after group.
        by_type: dict[DataType, list[int]] = {}
        for i, table in enumerate(tables):
            by_type.setdefault(table.data_type, []).append(i)
        self._groups = list(by_type.values())
        self._lookup = [i for group in self._groups for i in group]
        self._flat_features = [f for i in self._lookup for f in tables[i].feature_names]
        self._group_features = [sum(len(tables[i].feature_names) for i in g) for g in self._groups]
        self._cached: list[CacheGroup] = []  # one per group, built at the first open_window
        if settings.files is not None:
            try:
                self._map_weights(settings.files, init_each)
            except BaseException:
                settings.files.close()  # a refused store keeps nothing open
                raise
        # A load, whole or partial (strict=False), then reloads every cached row from the
        # store: the store must hold their newest values first.
        self.register_load_state_dict_pre_hook(lambda module, *_: module.write_back())
        self.register_load_state_dict_post_hook(lambda module, _: module._reload_cache())

    # ------------------------------------------------------------ settings

    @property
    def device(self) -> torch.device:
        """Where the cache and the lookups live (the full tables stay on the host, where
        the TorchRec base builds and initialises them: its ``device`` until then)."""
        return self.__dict__.get("_compute_device") or super().device

    def table_slots(self) -> list[int]:
        """The slots each table brings to its pool (before any raise at the first batch)."""
        return [
            self.sizing.rows(t.name, t.num_embeddings, t.num_embeddings)
            for t in self.table_configs()
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
        configured = [in_backward_optimizers(self._weight(t.name)) for t in self.table_configs()]
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
        metrics = [CacheMetrics() for _ in self.table_configs()]
        for tables, group in zip(self._groups, self._cached):
            for table, counted in zip(tables, group.metrics):
                metrics[table] = counted
        return metrics

    @property
    def cached_groups(self) -> list[CacheGroup]:
        """The groups of cached tables, one per data type (once training has started)."""
        return list(self._cached)

    def cache_metrics(self) -> dict[str, CacheMetrics]:
        """Counters per table name."""
        return {t.name: m for t, m in zip(self.table_configs(), self.metrics)}

    def open_window(self, window: WindowSettings) -> None:
        """Get ready to train with a window of ``lookahead`` batches (builds the cache once)."""
        if self._compute_device.type == "meta":
            raise not_sharded(type(self).__name__, "a module on the meta device")
        if not self._cached:
            self._cached = [self._build_cache(tables) for tables in self._groups]
        for group in self._cached:
            group.open_window(window)

    def close_window(self, window: WindowSettings) -> None:
        """Nothing to release: an unsharded collection makes no process group."""

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

    def batch_kind_refusal(self, features: KeyedJaggedTensor) -> ValueError | None:
        """Nothing to vote on: an unsharded collection runs on one rank, and refuses in
        ``prepare`` what it cannot take."""
        return None

    def distribute(self, features: KeyedJaggedTensor) -> NoWait[KeyedJaggedTensor]:
        """An unsharded collection runs on one rank: the batch's features as they are."""
        return NoWait(features)

    def prepare(self, features: KeyedJaggedTensor, step: int) -> ModuleInput:
        """Check the batch of ``step`` for every table without changing anything (see
        ``CacheGroup``)."""
        parts = self._group_parts(self.select(features))
        return ModuleInput([g.prepare(part, step) for g, part in zip(self._opened, parts)])

    def enter(self, prepared: ModuleInput) -> StepPlan | None:
        """A prepared batch enters the window; returns the plan of a step now complete."""
        return enter_groups(self._opened, prepared.groups)

    def finish(self) -> list[StepPlan]:
        """End of the data: the steps still to plan, with shorter windows."""
        return finish_groups(self._opened)

    def step_forward(self, context: StepContext, *args: Any, **kwargs: Any) -> Any:
        """The forward of ``context``'s step (the pipeline's stand-in for ``forward`` calls
        it): the lookups take the step's slots from ``context``."""
        for group in self._opened:
            group.begin_step(context)
        return type(self).forward(self, *args, **kwargs)

    def write_back(self) -> None:
        """Write updated cache rows back to the store (the rows stay cached)."""
        for group in self._cached:
            group.write_back()

    @property
    def _opened(self) -> list[CacheGroup]:
        if not self._cached:
            raise RuntimeError(
                "the module trains through a LookaheadTrainPipeline (open_window first)"
            )
        return self._cached

    def _group_parts(self, features: KeyedJaggedTensor) -> list[KeyedJaggedTensor]:
        """``features`` (in lookup order) split into each cache group's features."""
        if len(self._groups) == 1:
            return [features]
        return features.split(self._group_features)

    def _training_step(self) -> bool:
        """Whether a forward looks up through the cache (a step the pipeline began), rather
        than the full tables (eval, no grad); a training forward outside the pipeline is
        refused."""
        if self._cached and self._cached[0].context is not None:
            return True
        if self.training and torch.is_grad_enabled():
            raise RuntimeError(
                f"{type(self).__name__} trains through LookaheadTrainPipeline; "
                "call it directly only in eval mode or under torch.no_grad()"
            )
        self.write_back()
        return False

    # -------------------------------------------------------------- module

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

    def _build_cache(self, tables: list[int]) -> CacheGroup:
        """The cache group of ``tables`` (indices; one data type), its store their rows."""
        configs = [self.table_configs()[t] for t in tables]
        return build_cache_group(
            [
                GroupTable(
                    t.name,
                    t.num_embeddings,
                    t.num_embeddings,
                    t.embedding_dim,
                    len(t.feature_names),
                )
                for t in configs
            ],
            [self._weight(t.name) for t in configs],
            sizing=self.sizing,
            fused_params=self.fused_config(),
            device=self._compute_device,
            pooling=self._pooling,
            data_type=configs[0].data_type,
            files=self._store_files,
        )

    def _map_weights(self, files: StoreFiles, init_each: bool) -> None:
        """Tables as store files, holding what the TorchRec base on the CPU would.

        The base draws each table's ``normal_`` init as it builds its module, and
        runs each table's ``init_fn`` (after each draw, ``init_each``, or after them
        all). The draws are replayed in chunks into a small buffer and dropped (same
        generator state, no table in RAM); the ``init_fn`` then writes the mapped
        weights in place, in the same order.
        """
        configs = self.table_configs()
        files.check_space(
            sum(4 * c.num_embeddings * c.embedding_dim for c in configs), "the tables"
        )
        tables = self._tables()
        for config in configs:
            shape = (config.num_embeddings, config.embedding_dim)
            weight = files.tensor(f"{config.name}.weight", shape)
            tables[config.name].weight = nn.Parameter(weight)
            _draw_normal(weight.numel())
            if init_each:
                config.init_fn(tables[config.name].weight)
        if not init_each:
            for config in configs:
                config.init_fn(tables[config.name].weight)

    def _reload_cache(self) -> None:
        for group in self._cached:
            group.cache.refresh()


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
