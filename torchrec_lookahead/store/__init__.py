"""Backing stores: the full tables and their optimizer state in host memory or in files."""

from torchrec_lookahead.store.files import StoreFiles
from torchrec_lookahead.store.stores import HostStore, MmapStore

__all__ = ["HostStore", "MmapStore", "StoreFiles"]
