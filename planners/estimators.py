"""Storage and perf estimators for lookahead-cached shards, plugged into TorchRec's enumerator.

Each wraps TorchRec's own estimator: every sharding option gets TorchRec's
estimate first (so plain tables in a mixed model are estimated as usual), then
options of ``LookaheadEmbeddingBagCollection`` get the lookahead layout:

* storage: device memory for the shard's cache (rows x (weights + optimizer
  state) + slot index), host memory for the full shard, its optimizer state
  and the oracle's per-row state (on a CPU topology both are host memory);
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
    ShardingOption,
    Storage,
    Topology,
)

from planners.cost import TableCacheCost
from torchrec_lookahead.modules import LookaheadEmbeddingBagCollection

__all__ = ["LookaheadPerfEstimator", "LookaheadStorageEstimator"]


def _lookahead_options(options: list[ShardingOption], costs: Mapping[str, TableCacheCost]):
    for option in options:
        if isinstance(option.module[1], LookaheadEmbeddingBagCollection) and option.name in costs:
            yield option, costs[option.name]


def _load_factor(option: ShardingOption) -> float:
    if option.cache_params is not None and option.cache_params.load_factor is not None:
        return option.cache_params.load_factor
    return option.module[1].sizing.cache_load_factor


def _share(option: ShardingOption, shard_size: list[int], cost: TableCacheCost) -> float:
    """The part of the table a shard holds (rows x columns)."""
    return (shard_size[0] / cost.num_rows) * (shard_size[1] / cost.dim)


class LookaheadStorageEstimator(EmbeddingStorageEstimator):
    def __init__(
        self,
        topology: Topology,
        costs: Mapping[str, TableCacheCost],
        constraints: dict[str, ParameterConstraints] | None = None,
    ) -> None:
        super().__init__(topology, constraints)
        self._costs = costs
        self._cpu = topology.compute_device == "cpu"

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map=None) -> None:  # noqa: ANN001
        super().estimate(sharding_options, sharder_data_map)
        for option, cost in _lookahead_options(sharding_options, self._costs):
            clf = _load_factor(option)
            for shard in option.shards:
                share = _share(option, shard.size, cost)
                device = int(cost.device_bytes(clf) * share)
                host = int(cost.host_bytes() * share)
                shard.storage = (
                    Storage(hbm=0, ddr=device + host)
                    if self._cpu
                    else Storage(hbm=device, ddr=host)
                )


class LookaheadPerfEstimator(EmbeddingPerfEstimator):
    def __init__(
        self,
        topology: Topology,
        costs: Mapping[str, TableCacheCost],
        constraints: dict[str, ParameterConstraints] | None = None,
    ) -> None:
        super().__init__(topology, constraints)
        self._costs = costs
        cpu = topology.compute_device == "cpu"
        self._bandwidth = topology.ddr_mem_bw if cpu else topology.hbm_to_ddr_mem_bw

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map=None) -> None:  # noqa: ANN001
        super().estimate(sharding_options, sharder_data_map)
        for option, cost in _lookahead_options(sharding_options, self._costs):
            clf = _load_factor(option)
            for shard in option.shards:
                if shard.perf is None:
                    continue
                moved_ms = (
                    cost.bytes_per_step(clf) * _share(option, shard.size, cost) / self._bandwidth
                )
                compute_ms = shard.perf.fwd_compute + shard.perf.bwd_compute
                shard.perf.prefetch_compute += max(0.0, moved_ms - compute_ms)
