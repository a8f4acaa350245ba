"""torchrec-lookahead: lookahead (oracle) embedding caching for TorchRec."""

from torchrec_lookahead.metrics import CacheMetrics
from torchrec_lookahead.oracle import CachePlan, OracleCacher

__all__ = [
    "CacheMetrics",
    "CachePlan",
    "LookaheadEmbeddingBagCollection",
    "LookaheadTrainPipeline",
    "OracleCacher",
]


def __getattr__(name: str) -> object:
    # The TorchRec-facing classes import torch, FBGEMM and torchrec (seconds);
    # the oracle and simulators do not need them.
    if name == "LookaheadEmbeddingBagCollection":
        from torchrec_lookahead.modules import LookaheadEmbeddingBagCollection

        return LookaheadEmbeddingBagCollection
    if name == "LookaheadTrainPipeline":
        from torchrec_lookahead.pipeline import LookaheadTrainPipeline

        return LookaheadTrainPipeline
    raise AttributeError(f"module 'torchrec_lookahead' has no attribute {name!r}")
