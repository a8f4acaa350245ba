"""TorchRec's sharded collections (pooled and sequence), with the hooks they lack publicly."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.embeddingbag import (
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from torchrec_lookahead._compat.kernels import TorchRecPart

__all__ = [
    "ShardedCollectionBase",
    "ShardedSequenceCollectionBase",
]


class _ShardedParts(TorchRecPart):
    """TorchRec's sharded collections (pooled and sequence) with the hooks they lack
    publicly.

    * ``make_lookup(index, configs, pg, device, sharding_type, env)`` builds the
      lookup of each sharding (TorchRec builds them in ``_create_lookups``).
    * ``use_input_dists(dists)`` gives this thread (the lookahead stage) input
      dists of its own: TorchRec's ``input_dist`` reads ``self._input_dists``,
      so a property answers per thread.
    * ``input_dists_on(pg)``: copies of TorchRec's input dists whose
      collectives run on ``pg`` (its modules hold their group as ``_pg``).
    * ``table_configs()`` and ``sharding_types``: the tables and how they are sharded.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._thread_input_dists = _ThreadValue()
        super().__init__(*args, **kwargs)

    def make_lookup(
        self,
        index: int,
        configs: list[GroupedEmbeddingConfig],
        pg: dist.ProcessGroup | None,
        device: torch.device | None,
        sharding_type: ShardingType | None,
        env: ShardingEnv,
    ) -> Any:
        raise NotImplementedError

    def _shardings(self) -> list[Any]:
        raise NotImplementedError

    def table_configs(self) -> list[Any]:
        raise NotImplementedError

    @property
    def sharding_types(self) -> list[str]:
        raise NotImplementedError

    @property
    def env(self) -> ShardingEnv:
        return self._env

    @property
    def lookups(self) -> list[Any]:
        return list(self._lookups)

    def input_dists_on(self, pg: dist.ProcessGroup) -> list[torch.nn.Module]:
        dists = [sharding.create_input_dist() for sharding in self._shardings()]
        for module in (m for d in dists for m in d.modules()):
            if isinstance(getattr(module, "_pg", None), dist.ProcessGroup):
                module._pg = pg
            _called_as_torch_calls(module)
        return dists

    def use_input_dists(self, dists: list[torch.nn.Module] | None) -> None:
        """This thread's input dists from now on (``None`` or empty: TorchRec's own)."""
        self._thread_input_dists.set(dists)

    @property
    def input_dists_ready(self) -> bool:
        """Whether TorchRec has made its input dists (at the first forward or input_dist)."""
        return bool(self.__dict__.get("_trainer_input_dists"))

    @property
    def _input_dists(self) -> list[torch.nn.Module]:
        return self._thread_input_dists.get() or self.__dict__["_trainer_input_dists"]

    @_input_dists.setter
    def _input_dists(self, value: list[torch.nn.Module]) -> None:
        self.__dict__["_trainer_input_dists"] = value

    def _create_input_dist(self, *args: Any, **kwargs: Any) -> None:
        super()._create_input_dist(*args, **kwargs)
        self.input_dists_created()

    def input_dists_created(self) -> None:
        """Called once TorchRec has made its input dists."""


class ShardedCollectionBase(_ShardedParts, ShardedEmbeddingBagCollection):
    """TorchRec's sharded ``EmbeddingBagCollection`` with the hooks of :class:`_ShardedParts`,
    and output dists of their own for variable batches.

    TorchRec's output dists (``_output_dists``) are built for the kind of the first batch
    they pass, and TorchRec reads the variable batches' feature order
    (``_create_inverse_indices_permute_indices``) at its first input dist only: a
    module sent a plain batch first (an eval forward) and variable batches after (the
    hot rows' cold part) fails, or orders them wrongly. Variable batches therefore get
    output dists of their own, made (with that order) at the first of them; plain batches
    keep TorchRec's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._variable_output_dists: list[torch.nn.Module] = []
        super().__init__(*args, **kwargs)

    def compute_and_output_dist(self, ctx: Any, input: Any) -> Any:
        if not ctx.variable_batch_per_feature:
            return super().compute_and_output_dist(ctx, input)
        if not self._variable_output_dists:
            self._create_inverse_indices_permute_indices(ctx.inverse_indices)
            self._variable_output_dists = [
                sharding.create_output_dist(device=self._device)
                for sharding in self._embedding_shardings
            ]
        plain: list[torch.nn.Module] = self._output_dists  # type: ignore[has-type]
        self._output_dists = self._variable_output_dists
        try:
            return super().compute_and_output_dist(ctx, input)
        finally:
            self._output_dists = plain

    def _shardings(self) -> list[Any]:
        return list(self._embedding_shardings)

    def table_configs(self) -> list[EmbeddingBagConfig]:
        return list(self._embedding_bag_configs)

    @property
    def sharding_types(self) -> list[str]:
        return list(self.sharding_type_to_sharding_infos)

    def _create_lookups(self) -> None:
        for index, sharding in enumerate(self._embedding_shardings):
            if isinstance(sharding, TwRwPooledEmbeddingSharding):
                configs = sharding._grouped_embedding_configs_per_rank[sharding._rank]
                sharding_type: ShardingType | None = ShardingType.TABLE_ROW_WISE
            else:
                configs = sharding._grouped_embedding_configs
                is_rw = isinstance(sharding, RwPooledEmbeddingSharding)
                sharding_type = ShardingType.ROW_WISE if is_rw else None
            self._lookups.append(
                self.make_lookup(
                    index, configs, sharding._pg, sharding._device, sharding_type, sharding._env
                )
            )


class ShardedSequenceCollectionBase(_ShardedParts, ShardedEmbeddingCollection):
    """TorchRec's sharded ``EmbeddingCollection`` with the hooks of :class:`_ShardedParts`."""

    def _shardings(self) -> list[Any]:
        return list(self._sharding_type_to_sharding.values())

    def table_configs(self) -> list[Any]:
        return list(self._embedding_configs)

    @property
    def sharding_types(self) -> list[str]:
        return list(self._sharding_types)

    def _create_lookups(self) -> None:
        for index, (sharding_type, sharding) in enumerate(self._sharding_type_to_sharding.items()):
            self._lookups.append(
                self.make_lookup(
                    index,
                    sharding._grouped_embedding_configs,
                    sharding._pg,
                    sharding._device,
                    ShardingType(sharding_type),
                    sharding._env,
                )
            )


_AS_TORCH_CALLS: dict[type, type] = {}


def _called_as_torch_calls(module: torch.nn.Module) -> None:
    """Keep torch's own ``__call__`` for ``module``, whatever another thread traces.

    While torch.fx traces a model it swaps ``nn.Module.__call__`` for a recorder
    that refuses modules outside that model, in every thread. The stage calls its
    input dists on its own thread, perhaps while the trainer's thread traces
    (TorchRec's pipelines trace their model at its first batch); its modules
    take a subclass that calls them as torch does.
    """
    cls = type(module)
    if cls not in _AS_TORCH_CALLS:
        _AS_TORCH_CALLS[cls] = type(
            cls.__name__,
            (cls,),
            {"__call__": torch.nn.Module._wrapped_call_impl, "__module__": cls.__module__},
        )
    module.__class__ = _AS_TORCH_CALLS[cls]


class _ThreadValue:
    """A value per thread (``None`` where unset)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self) -> Any:
        return getattr(self._local, "value", None)

    def set(self, value: Any) -> None:
        self._local.value = value
