"""The device cache: slot pools, the cache TBE, and a group of tables cached behind it."""

from torchrec_lookahead.cache.table import CacheTable
from torchrec_lookahead.cache.tables import CachedTables

__all__ = ["CacheTable", "CachedTables"]
