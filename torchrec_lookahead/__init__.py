"""torchrec-lookahead: lookahead (oracle) embedding caching for TorchRec."""

from torchrec_lookahead.oracle import CachePlan, OracleCacher

__all__ = ["CachePlan", "OracleCacher"]
