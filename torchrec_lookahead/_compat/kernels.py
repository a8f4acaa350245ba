"""TorchRec's fused kernels, their fused optimizer and the lookups that build them, with hooks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.distributed.batched_embedding_kernel import (
    BatchedFusedEmbedding,
    BatchedFusedEmbeddingBag,
    EmbeddingFusedOptimizer,
)
from torchrec.distributed.embedding_lookup import (
    GroupedEmbeddingsLookup,
    GroupedPooledEmbeddingsLookup,
)
from torchrec.distributed.embedding_types import GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingEnv, ShardingType

__all__ = [
    "FusedKernelBase",
    "FusedOptimizerBase",
    "FusedSequenceKernelBase",
    "LookupBase",
    "SequenceLookupBase",
]


if TYPE_CHECKING:
    # The mixins below read TorchRec's private attributes of the class they are mixed into
    # (Any to mypy, as TorchRec's classes are here).
    TorchRecPart = Any
else:
    TorchRecPart = object


class _FusedKernelParts(TorchRecPart):
    """TorchRec's fused kernels (pooled and sequence), read through properties: they keep
    their TBE and their shard's layout in private attributes only (``_emb_module``,
    ``_local_rows``, ``_local_cols``, ``_feature_table_map``)."""

    @property
    def store_tbe(self) -> SplitTableBatchedEmbeddingBagsCodegen:
        return self._emb_module

    @property
    def local_rows(self) -> list[int]:
        return list(self._local_rows)

    @property
    def local_cols(self) -> list[int]:
        return list(self._local_cols)

    @property
    def feature_table_map(self) -> list[int]:
        return list(self._feature_table_map)

    def use_fused_optimizer(self, optimizer: EmbeddingFusedOptimizer) -> None:
        """Make ``optimizer`` this kernel's ``fused_optimizer`` (TorchRec returns its
        private ``_optim`` there and has no setter)."""
        self._optim = optimizer


class FusedKernelBase(_FusedKernelParts, BatchedFusedEmbeddingBag):
    """TorchRec's fused kernel of pooled tables (``EmbeddingBagCollection``'s)."""

    @property
    def pooling(self) -> Any:
        return self._pooling


class FusedSequenceKernelBase(_FusedKernelParts, BatchedFusedEmbedding):
    """TorchRec's fused kernel of sequence tables (``EmbeddingCollection``'s: one row per
    id, FBGEMM's pooling ``NONE``), built with the pooled kernel's arguments (it takes no
    sharding type or environment)."""

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        pg: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        sharding_type: ShardingType | None = None,
        env: ShardingEnv | None = None,
    ) -> None:
        super().__init__(config, pg, device)

    @property
    def pooling(self) -> Any:
        return PoolingMode.NONE


class FusedOptimizerBase(EmbeddingFusedOptimizer):
    """TorchRec's fused optimizer with a hook before its state is read (``state`` is a
    plain attribute there, ``_state`` behind it, which ``state_dict`` and
    ``CombinedOptimizer`` read)."""

    def before_state_read(self) -> None:
        """Called whenever the optimizer state is read."""

    @property
    def state(self) -> Any:
        self.before_state_read()
        return self._state

    @state.setter
    def state(self, value: Any) -> None:
        self._state = value


class _LookupParts(TorchRecPart):
    """TorchRec's lookups whose kernels are made by ``make_kernel``: they have no public
    hook, only the private ``_create_embedding_kernel`` they call per group."""

    def make_kernel(
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | None,
        pg: dist.ProcessGroup | None,
        sharding_type: ShardingType | None,
        env: ShardingEnv | None,
    ) -> Any:
        raise NotImplementedError

    @property
    def kernels(self) -> list[Any]:
        return list(self._emb_modules)

    def kernel_features(self, features: Any) -> list[Any]:
        """The features each kernel's forward will get (as ``forward`` splits them)."""
        if not self._emb_modules:
            return []
        return features.split(self._feature_splits)


class LookupBase(_LookupParts, GroupedPooledEmbeddingsLookup):
    """TorchRec's pooled lookup, its kernels made by ``make_kernel``."""

    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | None,
        pg: dist.ProcessGroup | None,
        sharding_type: ShardingType | None,
        env: ShardingEnv | None,
    ) -> torch.nn.Module:
        return self.make_kernel(config, device, pg, sharding_type, env)


class SequenceLookupBase(_LookupParts, GroupedEmbeddingsLookup):
    """TorchRec's sequence lookup, its kernels made by ``make_kernel`` (its constructor
    takes the pooled lookup's arguments; a sequence lookup has no sharding type)."""

    def __init__(
        self,
        grouped_configs: list[GroupedEmbeddingConfig],
        pg: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        sharding_type: ShardingType | None = None,
        env: ShardingEnv | None = None,
    ) -> None:
        super().__init__(grouped_configs=grouped_configs, pg=pg, device=device, env=env)

    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        pg: dist.ProcessGroup | None,
        device: torch.device | None,
        env: ShardingEnv | None = None,
    ) -> torch.nn.Module:
        return self.make_kernel(config, device, pg, None, env)
