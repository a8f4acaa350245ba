"""Storage and perf estimators for lookahead-cached shards, plugged into TorchRec's enumerator.

Each wraps TorchRec's own estimator: every sharding option gets TorchRec's
estimate first (so plain tables in a mixed model are estimated as usual), then
options of the lookahead collections (``LookaheadEmbeddingBagCollection`` and its
hot-rows subclass, ``LookaheadEmbeddingCollection`` for sequence tables) get the
lookahead layout:

* storage: device memory for the shard's cache (rows x (weights + optimizer
  state) + slot index), host memory for the full shard, its optimizer state
  and the oracle's per-row state (on a CPU topology both are host memory); a
  shard of no rows (row-wise over more ranks than rows), which the sharder
  refuses, more than any device holds;
* perf: the shard's row traffic per step over the host-device bandwidth,
  counted (as ``prefetch_compute``) only beyond the shard's compute time.
"""

from __future__ import annotations

from collections.abc import Mapping

from torchrec.distributed.planner.shard_estimators import (
    EmbeddingPerfEstimator,
    EmbeddingStorageEstimator,
)
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    ShardEstimator,
    ShardingOption,
    Storage,
    Topology,
)

from planners.cost import TableCacheCost, row_move_bandwidth
from torchrec_lookahead.embedding.cached import CachedCollection

__all__ = ["LookaheadPerfEstimator", "LookaheadStorageEstimator"]

_UNPLACEABLE = 1 << 62  # bytes no device or host has


class _LookaheadShards(ShardEstimator):
    """What both estimators share: the tables' costs and a walk over lookahead shards."""

    def __init__(
        self,
        topology: Topology,
        costs: Mapping[str, TableCacheCost],
        constraints: dict[str, ParameterConstraints] | None = None,
    ) -> None:
        super().__init__(topology, constraints)
        self._costs = costs
        self._cpu = topology.compute_device == "cpu"
        self._bandwidth = row_move_bandwidth(topology)

    def _lookahead_shards(self, options: list[ShardingOption]):
        """``(shard, cost, load factor, share of the table)`` for every lookahead shard."""
        for option in options:
            module = option.module[1]
            if not isinstance(module, CachedCollection) or option.name not in self._costs:
                continue
            cost = self._costs[option.name]
            params = option.cache_params
            clf = (
                params.load_factor
                if params and params.load_factor is not None
                else (module.sizing.cache_load_factor)
            )
            for shard in option.shards:
                share = (shard.size[0] / cost.num_rows) * (shard.size[1] / cost.dim)
                yield shard, cost, clf, share


class LookaheadStorageEstimator(_LookaheadShards, EmbeddingStorageEstimator):
    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map=None) -> None:  # noqa: ANN001
        super().estimate(sharding_options, sharder_data_map)
        for shard, cost, clf, share in self._lookahead_shards(sharding_options):
            device = int(cost.device_bytes(clf) * share)
            host = int(cost.host_bytes() * share)
            if not shard.size[0]:  # the sharder refuses a rank without rows: never placed
                shard.storage = Storage(hbm=_UNPLACEABLE, ddr=_UNPLACEABLE)
            elif self._cpu:
                shard.storage = Storage(hbm=0, ddr=device + host)
            else:  # the store's row-wise state lives in device memory there
                state = int(cost.store_device_bytes() * share)
                shard.storage = Storage(hbm=device + state, ddr=host - state)


class LookaheadPerfEstimator(_LookaheadShards, EmbeddingPerfEstimator):
    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map=None) -> None:  # noqa: ANN001
        super().estimate(sharding_options, sharder_data_map)
        for shard, cost, clf, share in self._lookahead_shards(sharding_options):
            if shard.perf is None:
                continue
            moved_ms = cost.bytes_per_step(clf) * share / self._bandwidth
            compute_ms = shard.perf.fwd_compute + shard.perf.bwd_compute
            # Set, not added: TorchRec's estimate of a UVM cache's prefetch (from the same
            # statistics, on a CUDA topology) is this one's, counted once.
            shard.perf.prefetch_compute = max(0.0, moved_ms - compute_ms)
