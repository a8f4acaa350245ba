"""The TorchRec integration: the cached embedding-bag collection and its sharder (DMP)."""

from torchrec_lookahead.embedding.collection import LookaheadEmbeddingBagCollection
from torchrec_lookahead.embedding.sharder import (
    LookaheadEmbeddingBagCollectionSharder,
    ShardedLookaheadEmbeddingBagCollection,
    lookahead_sharders,
)

__all__ = [
    "LookaheadEmbeddingBagCollection",
    "LookaheadEmbeddingBagCollectionSharder",
    "ShardedLookaheadEmbeddingBagCollection",
    "lookahead_sharders",
]
