"""Criteo-shaped synthetic data as TorchRec ``Batch`` objects: dense, sparse KJT and labels."""

from __future__ import annotations

import numpy as np
import torch
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.data.synthetic import SyntheticCriteo

__all__ = ["criteo_batch", "feature_names"]


def feature_names(data: SyntheticCriteo) -> list[str]:
    """TorchRec's Criteo names (``cat_0``...) when there are 26 tables, else ``cat_i``."""
    if data.num_tables == len(DEFAULT_CAT_NAMES):
        return list(DEFAULT_CAT_NAMES)
    return [f"cat_{i}" for i in range(data.num_tables)]


def criteo_batch(data: SyntheticCriteo, step: int, batch_size: int) -> Batch:
    """Batch ``step``: 13 standard-normal dense features, the sparse ids, and 0/1 labels.

    Labels follow a fixed logistic function of the dense features (about a
    quarter positive), so a model has something to learn; reproducible per step.
    """
    sparse = data.batch(step, batch_size)
    rng = np.random.default_rng([data.seed, step, 1])
    dense = rng.standard_normal((batch_size, len(DEFAULT_INT_NAMES))).astype(np.float32)
    weights = np.linspace(-1.0, 1.0, len(DEFAULT_INT_NAMES), dtype=np.float32)
    logits = dense @ weights - 1.2
    labels = (rng.random(batch_size) < 1 / (1 + np.exp(-logits))).astype(np.int64)
    return Batch(
        dense_features=torch.from_numpy(dense),
        sparse_features=KeyedJaggedTensor.from_lengths_sync(
            keys=feature_names(data),
            values=torch.from_numpy(np.concatenate(sparse.values)),
            lengths=torch.from_numpy(sparse.lengths.reshape(-1)),
        ),
        labels=torch.from_numpy(labels),
    )
