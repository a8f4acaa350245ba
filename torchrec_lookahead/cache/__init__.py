"""The device cache: slot pools, the cache TBE, and a group of tables cached behind it."""

from torchrec_lookahead.cache.group import CacheGroup
from torchrec_lookahead.cache.slot_cache import SlotCache

__all__ = ["SlotCache", "CacheGroup"]
