"""The all-resident limit: every row in one fused FBGEMM TBE, as TorchRec's fused kernel."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch import nn
from torchrec.modules.embedding_configs import (
    BaseEmbeddingConfig,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from torchrec_lookahead.embedding.sequence import jagged_output, output_places
from torchrec_lookahead.tbe import training_tbe
from torchrec_lookahead.variable_batch import expand_pooled, keep_inverse_indices, tbe_batch_sizes

__all__ = ["FullyResidentEmbeddingBagCollection", "FullyResidentEmbeddingCollection"]


class FullyResidentEmbeddingBagCollection(nn.Module):
    """An embedding-bag collection with every row resident in one fused FBGEMM TBE.

    What lookahead caching is measured against: the same TBE kernels and
    fused optimizer over the full tables, with nothing to move. It starts
    from the weights of ``like`` (an ``EmbeddingBagCollection``, lookahead or
    not) so that both train from the same point, and it quacks like one for
    TorchRec models (``embedding_bag_configs()``, ``KeyedTensor`` output,
    deduplicated batches expanded as ``EmbeddingBagCollection`` expands them).
    Its tables share one data type (FP32 or FP16), the TBE's.

    Args:
        like: the collection whose tables, features and weights to copy.
        fused_params: TBE settings including ``optimizer`` (for a lookahead
            module, its ``fused_config()``).
        device: where the tables live (CPU: host memory; CUDA: device memory).
    """

    def __init__(
        self,
        like: EmbeddingBagCollection,
        fused_params: Mapping[str, Any],
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self._configs: list[EmbeddingBagConfig] = like.embedding_bag_configs()
        self._is_weighted = like.is_weighted()
        self._features = [f for t in self._configs for f in t.feature_names]
        self._dims = [t.embedding_dim for t in self._configs for _ in t.feature_names]
        pooling = {PoolingType.SUM: PoolingMode.SUM, PoolingType.MEAN: PoolingMode.MEAN}
        state = like.state_dict()
        self.tbe = resident_tbe(
            self._configs,
            [state[f"embedding_bags.{t.name}.weight"] for t in self._configs],
            fused_params,
            device,
            pooling[self._configs[0].pooling],
        )

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        keys = features.keys()
        if keys != self._features:
            order = [keys.index(f) for f in self._features]
            features = keep_inverse_indices(features.permute(order), features)
        weights = features.weights() if self._is_weighted else None
        pooled = self.tbe(
            features.values(),
            features.offsets(),
            per_sample_weights=weights,
            **tbe_batch_sizes(features),
        )
        pooled = expand_pooled(pooled, features, self._dims)
        return KeyedTensor(keys=self._features, length_per_key=self._dims, values=pooled)


class FullyResidentEmbeddingCollection(nn.Module):
    """An embedding collection (sequence features) with every row resident in one fused
    FBGEMM TBE of pooling ``NONE``, as TorchRec's fused kernel for ``EmbeddingCollection``.

    The sequence counterpart of :class:`FullyResidentEmbeddingBagCollection`: it starts
    from the weights of ``like`` (an ``EmbeddingCollection``, lookahead or not) and gives
    ``EmbeddingCollection``'s output (a ``JaggedTensor`` per embedding name).
    """

    def __init__(
        self,
        like: EmbeddingCollection,
        fused_params: Mapping[str, Any],
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self._configs: list[EmbeddingConfig] = like.embedding_configs()
        self._need_indices = like.need_indices()
        self._features = [f for t in self._configs for f in t.feature_names]
        self._places = output_places(self._configs, list(range(len(self._configs))))
        state = like.state_dict()
        self.tbe = resident_tbe(
            self._configs,
            [state[f"embeddings.{t.name}.weight"] for t in self._configs],
            fused_params,
            device,
            PoolingMode.NONE,
        )

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._configs

    def forward(self, features: KeyedJaggedTensor) -> dict[str, JaggedTensor]:
        keys = features.keys()
        if keys != self._features:
            features = features.permute([keys.index(f) for f in self._features])
        rows = self.tbe(features.values(), features.offsets())
        return jagged_output(rows, features, self._places, self._need_indices)


def resident_tbe(
    configs: Sequence[BaseEmbeddingConfig],
    weights: Sequence[torch.Tensor],
    fused_params: Mapping[str, Any],
    device: torch.device | None,
    pooling: PoolingMode,
) -> SplitTableBatchedEmbeddingBagsCodegen:
    """One training TBE holding ``configs``' tables (of one data type), a feature per
    table feature, initialised to ``weights``."""
    params = dict(fused_params)
    data_types = {t.data_type for t in configs}
    if len(data_types) > 1:  # TorchRec would give each type a TBE of its own
        raise ValueError(f"one TBE holds tables of one data type, not {data_types}")
    tbe = training_tbe(
        [t.num_embeddings for t in configs],
        [t.embedding_dim for t in configs],
        params.pop("optimizer"),
        params,
        device or torch.device("cpu"),
        pooling,
        feature_table_map=[i for i, t in enumerate(configs) for _ in t.feature_names],
        data_type=data_types.pop(),
    )
    for table, weight in zip(tbe.split_embedding_weights(), weights):
        table.copy_(weight)
    return tbe
