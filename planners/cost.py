"""What a lookahead cache of a given size costs one table: memory, traffic, stall."""

from __future__ import annotations

from dataclasses import dataclass

from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.planner.types import Topology
from torchrec.distributed.utils import optimizer_type_to_emb_opt_type

from planners.statistics import LookaheadCacheStatistics

__all__ = ["ROWWISE_OPTIMIZERS", "TableCacheCost", "optimizer_state_floats", "row_move_bandwidth"]

SLOT_INDEX_BYTES = 8  # the cache's slot -> row map, per slot
ORACLE_BYTES_PER_ROW = 12  # the oracle's slot map and latest occurrence, per table row


def row_move_bandwidth(topology: Topology) -> float:
    """Bytes per millisecond for moving rows between store and cache: host memory
    bandwidth on a CPU topology, the host-device link on a GPU one."""
    return topology.ddr_mem_bw if topology.compute_device == "cpu" else topology.hbm_to_ddr_mem_bw


ROWWISE_OPTIMIZERS = frozenset(
    {
        EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        EmbOptimType.ENSEMBLE_ROWWISE_ADAGRAD,
        EmbOptimType.EMAINPLACE_ROWWISE_ADAGRAD,
    }
)


def optimizer_state_floats(optimizer: EmbOptimType | type, dim: int) -> int:
    """Optimizer state per row, in floats, for FBGEMM's fused optimizers: an
    ``EmbOptimType``, or the optimizer class given to ``apply_optimizer_in_backward``
    (``torchrec.optim.RowWiseAdagrad``, ...), mapped as TorchRec's sharders map it.
    An optimizer whose state is not known here is refused, not guessed."""
    if isinstance(optimizer, type):
        optimizer = optimizer_type_to_emb_opt_type(optimizer)
    floats = {
        EmbOptimType.EXACT_SGD: 0,
        EmbOptimType.EXACT_ROWWISE_ADAGRAD: 1,
        EmbOptimType.EXACT_ADAGRAD: dim,
        EmbOptimType.ADAM: 2 * dim,
        EmbOptimType.PARTIAL_ROWWISE_ADAM: dim + 1,
    }
    if optimizer not in floats:
        known = ", ".join(sorted(str(o) for o in floats))
        raise ValueError(f"the state of optimizer {optimizer} is not known here; known: {known}")
    return floats[optimizer]


@dataclass(frozen=True)
class TableCacheCost:
    """Costs of caching ``load_factor`` of a table's rows (all of its shards together).

    Device memory: cache rows x (weights, of ``weight_bytes`` each, + optimizer state,
    FP32 as FBGEMM keeps it) + the slot index,
    and, on a GPU under a row-wise optimizer, the store's row-wise state (FBGEMM
    keeps a UVM table's row-wise optimizer state in device memory).
    Host memory: the full table with optimizer state + the oracle's per-row state.
    Traffic: each miss fetches a row and, in steady state, writes one back.
    """

    name: str
    num_rows: int
    dim: int
    state_floats: int
    stats: LookaheadCacheStatistics
    rowwise_state: bool = False  # one state float per row (row-wise Adagrad and the like)
    weight_bytes: int = 4  # per weight: 2 for an FP16 table

    @property
    def row_bytes(self) -> int:
        return self.weight_bytes * self.dim + 4 * self.state_floats

    def slots_at(self, load_factor: float) -> int:
        """The rows the module caches at ``load_factor`` (its statistics' sizing)."""
        return self.stats.capacity(load_factor)

    def device_bytes(self, load_factor: float) -> int:
        return self.slots_at(load_factor) * (self.row_bytes + SLOT_INDEX_BYTES)

    def host_bytes(self) -> int:
        return self.num_rows * (self.row_bytes + ORACLE_BYTES_PER_ROW)

    def store_device_bytes(self) -> int:
        """The part of ``host_bytes`` a GPU store keeps in device memory: row-wise state."""
        return self.num_rows * 4 * self.state_floats if self.rowwise_state else 0

    def misses_per_step(self, load_factor: float) -> float:
        effective = self.slots_at(load_factor) / self.num_rows
        return self.stats.expected_miss_rate(effective) * self.stats.expected_lookups

    def bytes_per_step(self, load_factor: float) -> float:
        return 2 * self.misses_per_step(load_factor) * self.row_bytes
