"""Planning: the windowed-Belady oracle, its compiled passes, hash partitions (no torch),
and the same oracle made of device ops (``DeviceOracleCacher``: torch, imported on first
use)."""

from typing import TYPE_CHECKING

from torchrec_lookahead.oracle.cacher import OracleCacher, PreparedBatch, load_kernels
from torchrec_lookahead.oracle.partitioned import PartitionedOracle

if TYPE_CHECKING:
    from torchrec_lookahead.oracle.device import DeviceOracleCacher

__all__ = [
    "DeviceOracleCacher",
    "OracleCacher",
    "PartitionedOracle",
    "PreparedBatch",
    "load_kernels",
]


def __getattr__(name: str) -> object:
    if name == "DeviceOracleCacher":
        from torchrec_lookahead.oracle.device import DeviceOracleCacher

        return DeviceOracleCacher
    raise AttributeError(f"module 'torchrec_lookahead.oracle' has no attribute {name!r}")
