"""The sharded lookups: TorchRec's lookups, building lookahead kernels for fused tables."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.types import (
    ShardingEnv,
    ShardingType,
)

from torchrec_lookahead._compat import LookupBase, SequenceLookupBase
from torchrec_lookahead.embedding.kernel import (
    LookaheadFusedEmbedding,
    LookaheadFusedEmbeddingBag,
    LookaheadKernel,
)
from torchrec_lookahead.settings import CacheSizing
from torchrec_lookahead.store.files import StoreFiles

__all__ = [
    "LookaheadLookup",
    "LookaheadPooledEmbeddingsLookup",
    "LookaheadSequenceEmbeddingsLookup",
]


class LookaheadLookup:
    """A TorchRec lookup (a base listed after this mixin) whose kernels are ``kernel_type``:
    each group of fused tables gets a lookahead kernel, sized by ``sizing``, its store in
    host memory or in a disk store's files."""

    kernel_type: ClassVar[type[LookaheadKernel]]

    def __init__(
        self, *args: Any, sizing: CacheSizing, store: tuple[StoreFiles, str] | None, **kwargs: Any
    ) -> None:
        self._sizing = sizing
        self._store = store  # (files, name prefix) of a disk store, or None
        self._kernels_made = 0
        super().__init__(*args, **kwargs)

    def make_kernel(
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | None,
        pg: dist.ProcessGroup | None,
        sharding_type: ShardingType | None,
        env: ShardingEnv | None,
    ) -> LookaheadKernel:
        kernels = {EmbeddingComputeKernel.FUSED, EmbeddingComputeKernel.FUSED_UVM_CACHING}
        if config.compute_kernel not in kernels:
            raise ValueError(
                f"lookahead caching runs on the fused kernels {sorted(k.value for k in kernels)}, "
                f"the plan asks for {config.compute_kernel.value}"
            )
        store = None
        if self._store is not None:
            files, prefix = self._store
            store = files, f"{prefix}.kernel{self._kernels_made}"
        self._kernels_made += 1
        return self.kernel_type(config, self._sizing, pg, device, sharding_type, env, store)


class LookaheadPooledEmbeddingsLookup(LookaheadLookup, LookupBase):
    """TorchRec's pooled lookup, building lookahead kernels for fused tables."""

    kernel_type = LookaheadFusedEmbeddingBag


class LookaheadSequenceEmbeddingsLookup(LookaheadLookup, SequenceLookupBase):
    """TorchRec's sequence lookup, building lookahead kernels for fused tables."""

    kernel_type = LookaheadFusedEmbedding
