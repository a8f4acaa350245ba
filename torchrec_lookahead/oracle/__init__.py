"""Planning (no torch): the windowed-Belady oracle, its compiled passes, hash partitions."""

from torchrec_lookahead.oracle.cacher import OracleCacher, PreparedBatch, load_kernels
from torchrec_lookahead.oracle.partitioned import PartitionedOracle

__all__ = ["OracleCacher", "PartitionedOracle", "PreparedBatch", "load_kernels"]
