"""torchrec-lookahead: lookahead (oracle) embedding caching for TorchRec."""

from torchrec_lookahead.metrics import CacheMetrics
from torchrec_lookahead.oracle import CachePlan, OracleCacher
from torchrec_lookahead.partitioned import PartitionedOracle

__all__ = [
    "CacheMetrics",
    "CachePlan",
    "LookaheadEmbeddingBagCollection",
    "LookaheadEmbeddingBagCollectionSharder",
    "LookaheadTrainPipeline",
    "OracleCacher",
    "PartitionedOracle",
    "lookahead_sharders",
]

_LAZY = {
    "LookaheadEmbeddingBagCollection": "torchrec_lookahead.modules",
    "LookaheadEmbeddingBagCollectionSharder": "torchrec_lookahead.sharder",
    "LookaheadTrainPipeline": "torchrec_lookahead.pipeline",
    "lookahead_sharders": "torchrec_lookahead.sharder",
}


def __getattr__(name: str) -> object:
    # The TorchRec-facing classes import torch, FBGEMM and torchrec (seconds);
    # the oracle and simulators do not need them.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'torchrec_lookahead' has no attribute {name!r}")
