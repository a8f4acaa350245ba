"""Data for lookahead caching: Criteo-shaped synthetic id streams."""

from torchrec_lookahead.data.synthetic import (
    CRITEO_KAGGLE_TABLE_SIZES,
    SparseBatch,
    SyntheticCriteo,
    ZipfSampler,
)

__all__ = ["CRITEO_KAGGLE_TABLE_SIZES", "SparseBatch", "SyntheticCriteo", "ZipfSampler"]
