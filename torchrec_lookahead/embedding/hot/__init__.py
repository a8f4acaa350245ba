"""Hot rows on every rank: looked up where their samples are, updated alike everywhere.

Under ``DistributedModelParallel`` every row has one owner, and each lookup
travels there and back. On recommendation data a few rows take most lookups,
so each rank keeps a replica of those (the *hot rows*, chosen per table) with
their optimizer state, as Bagpipe's replicated cache does. One module per job:

- :mod:`~.layout`: which rows, where their replicas sit, which optimizer group
  updates them, who owns them.
- :mod:`~.split`: the lookahead stage splits each batch ``L`` steps ahead; hot
  ids never enter the input all-to-all, and a bag left with no cold ids leaves
  the pooled all-to-all too (the cold batch is a variable batch where the
  sharding and the optimizer allow it).
- :mod:`~.replicas`: the replicas, a FBGEMM TBE per optimizer group: the
  lookup, the update, the load from and fold into the owners' shards.
- :mod:`~.sync`: the ranks agree on the rows a step touches (a bit per row,
  exchanged ``L`` steps ahead) and sum their gradients in the order the owner
  would, so every replica applies the owner's very update.
- :mod:`~.tier`: the tier, as the sharded collection drives it.
- :mod:`~.collection` and :mod:`~.sharded`: ``HotRowsEmbeddingBagCollection``
  and its sharded module, the sharded lookahead collection extended by the
  tier (its sharder is in :mod:`~torchrec_lookahead.embedding.sharder`).

The replicas stay bitwise equal on every rank, and bitwise equal to plain
TorchRec's rows on the CPU where every bag of a hot table holds only hot or
only cold ids (every bag of one id, as in Criteo). A bag mixing both is pooled
as its cold sum plus its hot sum: within rounding of TorchRec's sum. The
replicas are folded into the owners' shards whenever the store is written
back (``state_dict``, optimizer state, eval), so checkpoints are plain
TorchRec's.
"""

from torchrec_lookahead.embedding.hot.layout import (
    HotLayout,
    ReplicaGroup,
    RowRange,
    check_hot_rows,
)
from torchrec_lookahead.embedding.hot.split import HotSplit, split_batch
from torchrec_lookahead.embedding.hot.tier import HotInput, HotRowTier, Owners, ReplicaMetrics

__all__ = [
    "HotInput",
    "HotLayout",
    "HotRowTier",
    "HotSplit",
    "Owners",
    "ReplicaGroup",
    "ReplicaMetrics",
    "RowRange",
    "check_hot_rows",
    "split_batch",
]
