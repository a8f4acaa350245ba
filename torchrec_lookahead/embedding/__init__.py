"""The TorchRec integration: the cached embedding(-bag) collections and their sharders (DMP)."""

from torchrec_lookahead.embedding.collection import LookaheadEmbeddingBagCollection
from torchrec_lookahead.embedding.hot.collection import HotRowsEmbeddingBagCollection
from torchrec_lookahead.embedding.hot.sharded import ShardedHotRowsEmbeddingBagCollection
from torchrec_lookahead.embedding.sequence import LookaheadEmbeddingCollection
from torchrec_lookahead.embedding.sharder import (
    HotRowsEmbeddingBagCollectionSharder,
    LookaheadEmbeddingBagCollectionSharder,
    LookaheadEmbeddingCollectionSharder,
    ShardedLookaheadEmbeddingBagCollection,
    ShardedLookaheadEmbeddingCollection,
    lookahead_sharders,
)

__all__ = [
    "HotRowsEmbeddingBagCollection",
    "HotRowsEmbeddingBagCollectionSharder",
    "LookaheadEmbeddingBagCollection",
    "LookaheadEmbeddingBagCollectionSharder",
    "LookaheadEmbeddingCollection",
    "LookaheadEmbeddingCollectionSharder",
    "ShardedHotRowsEmbeddingBagCollection",
    "ShardedLookaheadEmbeddingBagCollection",
    "ShardedLookaheadEmbeddingCollection",
    "lookahead_sharders",
]
