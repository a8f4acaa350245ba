"""torchrec-lookahead: lookahead (oracle) embedding caching for TorchRec.

The oracle and the metrics import without torch; the TorchRec-facing classes
import torch, FBGEMM and TorchRec (seconds) on first use, and the device oracle
torch.
"""

from typing import TYPE_CHECKING

from torchrec_lookahead.metrics import CacheMetrics
from torchrec_lookahead.oracle import OracleCacher, PartitionedOracle
from torchrec_lookahead.oracle.contract import CachePlan

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers
    from torchrec_lookahead.checks import BatchTypeError
    from torchrec_lookahead.embedding import (
        HotRowsEmbeddingBagCollection,
        HotRowsEmbeddingBagCollectionSharder,
        LookaheadEmbeddingBagCollection,
        LookaheadEmbeddingBagCollectionSharder,
        LookaheadEmbeddingCollection,
        LookaheadEmbeddingCollectionSharder,
        lookahead_sharders,
    )
    from torchrec_lookahead.oracle.device import DeviceOracleCacher
    from torchrec_lookahead.pipeline import BatchCheck, LookaheadTrainPipeline

__all__ = [
    "BatchCheck",
    "BatchTypeError",
    "CacheMetrics",
    "CachePlan",
    "DeviceOracleCacher",
    "HotRowsEmbeddingBagCollection",
    "HotRowsEmbeddingBagCollectionSharder",
    "LookaheadEmbeddingBagCollection",
    "LookaheadEmbeddingBagCollectionSharder",
    "LookaheadEmbeddingCollection",
    "LookaheadEmbeddingCollectionSharder",
    "LookaheadTrainPipeline",
    "OracleCacher",
    "PartitionedOracle",
    "lookahead_sharders",
]

_LAZY = {
    "BatchCheck": "torchrec_lookahead.pipeline",
    "BatchTypeError": "torchrec_lookahead.checks",
    "DeviceOracleCacher": "torchrec_lookahead.oracle.device",
    "HotRowsEmbeddingBagCollection": "torchrec_lookahead.embedding",
    "HotRowsEmbeddingBagCollectionSharder": "torchrec_lookahead.embedding",
    "LookaheadEmbeddingBagCollection": "torchrec_lookahead.embedding",
    "LookaheadEmbeddingBagCollectionSharder": "torchrec_lookahead.embedding",
    "LookaheadEmbeddingCollection": "torchrec_lookahead.embedding",
    "LookaheadEmbeddingCollectionSharder": "torchrec_lookahead.embedding",
    "LookaheadTrainPipeline": "torchrec_lookahead.pipeline",
    "lookahead_sharders": "torchrec_lookahead.embedding",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'torchrec_lookahead' has no attribute {name!r}")
