"""FBGEMM's training TBE, built one way for the cache, the replicas and the baselines.

Every TBE of the project holds its tables on the compute device (``HOST`` on
the CPU, ``DEVICE`` on CUDA) and runs a fused optimizer in its backward; only
the tables, their data type, the feature map, the optimizer and its settings
differ. The data types are those FBGEMM's CPU TBE trains (:data:`TRAINED`):
FP32, and FP16 (weights in half precision, optimizer state in FP32, as FBGEMM
keeps it); its CPU kernels refuse the others (BF16, NFP8: no forward; INT8,
INT4, INT2: no backward).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig

__all__ = [
    "CPU_OPTIMIZERS",
    "TRAINED",
    "check_optimizer",
    "check_trained",
    "set_learning_rate",
    "training_tbe",
]

# The tables' data types FBGEMM's TBE trains on the CPU, and the TBE precision of each.
TRAINED = {DataType.FP32: SparseType.FP32, DataType.FP16: SparseType.FP16}

# The fused optimizers FBGEMM's CPU TBE runs (its constructor asserts the same list).
CPU_OPTIMIZERS = (
    EmbOptimType.EXACT_SGD,
    EmbOptimType.EXACT_ADAGRAD,
    EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD,
)

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
    data_type: DataType = DataType.FP32,
) -> SplitTableBatchedEmbeddingBagsCodegen:
    """A TBE of ``data_type`` tables of ``rows[t]`` rows and ``dims`` (one width, or one per
    table) columns.

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
        weights_precision=TRAINED[data_type],
        **{k: v for k, v in params.items() if k in _ACCEPTED},
    )


def check_trained(tables: Sequence[EmbeddingBagConfig]) -> None:
    """Raise ``ValueError`` naming the first of ``tables`` whose data type FBGEMM's TBE
    cannot train (see :data:`TRAINED`), or whose width it does not take (a multiple of
    4 columns), before anything is built for them."""
    for table in tables:
        if table.embedding_dim % 4:
            raise ValueError(
                f"table {table.name}: embedding_dim {table.embedding_dim} is not a multiple "
                "of 4, which FBGEMM's TBE (the cache's kernel, as plain TorchRec's fused "
                "one) requires"
            )
        if table.data_type not in TRAINED:
            trained = ", ".join(t.value for t in TRAINED)
            raise ValueError(
                f"table {table.name}: data type {table.data_type.value} is not trained with "
                f"lookahead caching, which trains {trained} (what FBGEMM's TBE trains on "
                "the CPU); give the table one of those"
            )


def check_optimizer(optimizer: EmbOptimType, device: torch.device, tables: Sequence[str]) -> None:
    """Raise ``ValueError`` naming ``tables`` if FBGEMM's TBE on ``device`` does not run
    ``optimizer`` (on the CPU, :data:`CPU_OPTIMIZERS`), before any TBE is built: FBGEMM
    itself fails an assertion naming neither the tables nor the remedy."""
    if device.type != "cuda" and optimizer not in CPU_OPTIMIZERS:
        runs = ", ".join(o.name for o in CPU_OPTIMIZERS)
        raise ValueError(
            f"tables {list(tables)}: FBGEMM's CPU TBE does not run the fused optimizer "
            f"{optimizer.name}; on the CPU it runs {runs} (torch.optim.SGD, "
            "torch.optim.Adagrad and torchrec.optim.RowWiseAdagrad in backward)"
        )


def set_learning_rate(tbe: SplitTableBatchedEmbeddingBagsCodegen, rate: float) -> None:
    """Give ``tbe``'s fused optimizer ``rate`` (a no-op when it has it: FBGEMM may copy the
    rate to the device on every set)."""
    if tbe.get_learning_rate() != rate:
        tbe.set_learning_rate(rate)
