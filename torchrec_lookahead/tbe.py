"""FBGEMM's training TBE, built one way for the cache, the replicas and the baselines.

Every TBE of the project holds FP32 tables on the compute device (``HOST`` on
the CPU, ``DEVICE`` on CUDA) and runs a fused optimizer in its backward; only
the tables, the feature map, the optimizer and its settings differ.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)

__all__ = ["set_learning_rate", "training_tbe"]

_ACCEPTED = set(inspect.signature(SplitTableBatchedEmbeddingBagsCodegen).parameters)


def training_tbe(
    rows: Sequence[int],
    dims: int | Sequence[int],
    optimizer: EmbOptimType,
    params: Mapping[str, Any],
    device: torch.device,
    pooling: PoolingMode = PoolingMode.SUM,
    feature_table_map: Sequence[int] | None = None,
    features_per_table: int = 1,
) -> SplitTableBatchedEmbeddingBagsCodegen:
    """A TBE of tables of ``rows[t]`` rows and ``dims`` (one width, or one per table) columns.

    ``params`` are the fused optimizer's settings as TorchRec passes them to FBGEMM
    (those FBGEMM's constructor does not take are left out). Features map to tables by
    ``feature_table_map``, else ``features_per_table`` features per table, in order.
    """
    widths = [dims] * len(rows) if isinstance(dims, int) else list(dims)
    on_cuda = device.type == "cuda"
    location = EmbeddingLocation.DEVICE if on_cuda else EmbeddingLocation.HOST
    compute = ComputeDevice.CUDA if on_cuda else ComputeDevice.CPU
    if feature_table_map is None:
        feature_table_map = [t for t in range(len(rows)) for _ in range(features_per_table)]
    return SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(n, d, location, compute) for n, d in zip(rows, widths)],
        feature_table_map=list(feature_table_map),
        optimizer=optimizer,
        pooling_mode=pooling,
        device=device,
        **{k: v for k, v in params.items() if k in _ACCEPTED},
    )


def set_learning_rate(tbe: SplitTableBatchedEmbeddingBagsCodegen, rate: float) -> None:
    """Give ``tbe``'s fused optimizer ``rate`` (a no-op when it has it: FBGEMM may copy the
    rate to the device on every set)."""
    if tbe.get_learning_rate() != rate:
        tbe.set_learning_rate(rate)
