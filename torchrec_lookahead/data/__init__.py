"""Data for lookahead caching: Criteo-shaped synthetic id streams, and Criteo days of any
size read in bounded memory (:mod:`.criteo`, :mod:`.tsv`, :mod:`.npy`)."""

from torchrec_lookahead.data.synthetic import (
    CRITEO_KAGGLE_TABLE_SIZES,
    SparseBatch,
    SyntheticCriteo,
    ZipfSampler,
)

__all__ = ["CRITEO_KAGGLE_TABLE_SIZES", "SparseBatch", "SyntheticCriteo", "ZipfSampler"]
