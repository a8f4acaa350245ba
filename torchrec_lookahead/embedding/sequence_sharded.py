"""``ShardedLookaheadEmbeddingCollection``: a sharded ``EmbeddingCollection``, pipeline-driven.

The sequence twin of
:class:`~torchrec_lookahead.embedding.sharded.ShardedLookaheadEmbeddingBagCollection`:
the same driving (:class:`~torchrec_lookahead.embedding.sharded.ShardedLookaheadModule`),
over TorchRec's sharded ``EmbeddingCollection``, whose lookups build sequence
kernels (one row per id) and whose output dist is TorchRec's own
(``SequenceEmbeddingsAllToAll``): a step's output is the ``Dict[str, JaggedTensor]``
TorchRec's sharded ``EmbeddingCollection`` returns.
"""

from __future__ import annotations

from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead._compat import ShardedSequenceCollectionBase
from torchrec_lookahead.embedding.lookup import LookaheadSequenceEmbeddingsLookup
from torchrec_lookahead.embedding.sharded import ShardedLookaheadModule

__all__ = ["ShardedLookaheadEmbeddingCollection"]


class ShardedLookaheadEmbeddingCollection(ShardedLookaheadModule, ShardedSequenceCollectionBase):
    """``ShardedEmbeddingCollection`` with lookahead kernels, driven by the pipeline.

    A deduplicated (variable-stride) batch is refused, as the unsharded
    :class:`~torchrec_lookahead.embedding.sequence.LookaheadEmbeddingCollection` refuses it.
    """

    lookup_type = LookaheadSequenceEmbeddingsLookup

    def batch_kind_refusal(self, features: KeyedJaggedTensor) -> ValueError | None:
        if (refusal := super().batch_kind_refusal(features)) is not None:
            return refusal
        if features.variable_stride_per_key():
            return ValueError(
                "a deduplicated (variable-stride) batch is not taken by "
                "LookaheadEmbeddingCollection: sequence features are looked up id by id, "
                "each sample's own sequence; give it batches with every sample's bags"
            )
        return None
