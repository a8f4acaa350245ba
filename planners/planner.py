"""The entry point: an ``EmbeddingShardingPlanner`` that sizes lookahead caches, and its report."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.types import CacheParams, ShardingPlan
from torchrec.distributed.utils import optimizer_type_to_emb_opt_type
from torchrec.modules.embedding_configs import DATA_TYPE_NUM_BITS, BaseEmbeddingConfig

from planners.cost import (
    ROWWISE_OPTIMIZERS,
    TableCacheCost,
    optimizer_state_floats,
    row_move_bandwidth,
)
from planners.estimators import LookaheadPerfEstimator, LookaheadStorageEstimator
from planners.proposer import CacheProposal, LookaheadCacheProposer
from planners.statistics import LookaheadCacheStatistics
from torchrec_lookahead.settings import check_count

__all__ = ["LookaheadShardingPlanner", "lookahead_planner", "plan_report"]

# TorchRec takes a UVM cache's load factor strictly below 1. Just below it a table's cache
# still holds every row: ceil(clf * rows) is rows for any table of fewer than 2**52 rows.
_WHOLE_UVM_CACHE = math.nextafter(1.0, 0.0)


class LookaheadShardingPlanner(EmbeddingShardingPlanner):
    """TorchRec's ``EmbeddingShardingPlanner``, with what it plans with in view: its
    enumerator (and the lookahead estimators in it) and the constraints per table."""

    def __init__(
        self,
        topology: Topology,
        batch_size: int,
        enumerator: EmbeddingEnumerator,
        constraints: dict[str, ParameterConstraints],
    ) -> None:
        super().__init__(
            topology=topology, batch_size=batch_size, enumerator=enumerator, constraints=constraints
        )
        self.enumerator = enumerator
        self.constraints = constraints


def lookahead_planner(
    topology: Topology,
    batch_size: int,
    tables: Sequence[BaseEmbeddingConfig],
    statistics: Mapping[str, LookaheadCacheStatistics],
    optimizer: EmbOptimType | type,
    step_compute_ms: float,
    cache_budget_bytes: int | None = None,
    constraints: Mapping[str, ParameterConstraints] | None = None,
) -> tuple[LookaheadShardingPlanner, CacheProposal]:
    """A planner for models with lookahead collections, and its cache sizes.

    Every table with ``statistics`` gets the cache load factor the
    :class:`LookaheadCacheProposer` picks (through ``cache_params.load_factor``,
    which sets the module's cache size), and the enumerator estimates storage and
    perf with the lookahead estimators. Use the planner's ``plan()`` or
    ``collective_plan()`` as usual.

    Args:
        topology: CPU or CUDA topology.
        batch_size: per-rank batch size, as for ``EmbeddingShardingPlanner``.
        tables: the lookahead tables' configs: ``EmbeddingBagConfig`` (bag collections),
            ``EmbeddingConfig`` (sequence collections), or both.
        statistics: measured miss rates per table name (``LookaheadCacheStatistics``
            over each table's rows).
        optimizer: the fused optimizer (its state travels with the rows): an
            ``EmbOptimType``, or the class given to ``apply_optimizer_in_backward``.
        step_compute_ms: a step's compute time, which prefetches hide behind.
        cache_budget_bytes: device memory for all caches (None: grow until stall-free).
        constraints: the user's constraints per table: every field of them and of their
            ``cache_params`` is kept but ``cache_params.load_factor`` and ``.stats``,
            which the planner sets (in copies; ``planner.constraints`` holds them). On
            a CUDA topology a table cached whole gets the load factor just below 1, which
            TorchRec's UVM caching takes (the cache still holds every row).
    """
    # TorchRec's estimators need it (EmbeddingShardingPlanner defaults None to 512 samples;
    # a cache sized for a batch other than the user's is not a default to take silently).
    batch_size = check_count("batch_size", batch_size, 1)
    missing = sorted({t.name for t in tables} - set(statistics))
    if missing:
        raise ValueError(f"no cache statistics for tables {missing}")
    for t in tables:
        _check_statistics(t, statistics[t.name])
    if isinstance(optimizer, type):  # the class given to apply_optimizer_in_backward
        optimizer = optimizer_type_to_emb_opt_type(optimizer)
    costs = {
        t.name: TableCacheCost(
            t.name,
            t.num_embeddings,
            t.embedding_dim,
            optimizer_state_floats(optimizer, t.embedding_dim),
            statistics[t.name],
            optimizer in ROWWISE_OPTIMIZERS,
            weight_bytes=DATA_TYPE_NUM_BITS[t.data_type] // 8,
        )
        for t in tables
    }
    proposal = LookaheadCacheProposer(
        row_move_bandwidth(topology), step_compute_ms, cache_budget_bytes
    ).propose(list(costs.values()))
    merged = {name: c for name, c in (constraints or {}).items() if c is not None}
    for name, clf in proposal.load_factors.items():
        base = merged.get(name, ParameterConstraints())
        if topology.compute_device != "cpu":
            clf = min(clf, _WHOLE_UVM_CACHE)
        cache = replace(base.cache_params or CacheParams(), load_factor=clf, stats=statistics[name])
        merged[name] = replace(base, cache_params=cache)
    estimators = [
        LookaheadPerfEstimator(topology, costs, merged),
        LookaheadStorageEstimator(topology, costs, merged),
    ]
    enumerator = EmbeddingEnumerator(topology, batch_size, constraints=merged, estimator=estimators)
    planner = LookaheadShardingPlanner(topology, batch_size, enumerator, merged)
    return planner, proposal


def _check_statistics(table: BaseEmbeddingConfig, stats: object) -> None:
    """Statistics measured over another table would size its cache wrongly: refused."""
    if not isinstance(stats, LookaheadCacheStatistics):
        raise ValueError(
            f"table {table.name}: its statistics are a {type(stats).__name__}, not "
            "LookaheadCacheStatistics"
        )
    if stats.num_rows != table.num_embeddings:
        raise ValueError(
            f"table {table.name}: its statistics were measured over {stats.num_rows:,} rows, "
            f"but the table has {table.num_embeddings:,}; measure them over its own ids"
        )


def plan_report(plan: ShardingPlan, proposal: CacheProposal) -> str:
    """A line per lookahead table: sharding, ranks, cache size, predicted misses, traffic, RAM."""
    row = "{:<16} {:<18} {:<10} {:>10} {:>9} {:>9} {:>10} {:>9}"
    lines = [
        row.format(
            "table",
            "sharding",
            "ranks",
            "cache load",
            "miss rate",
            "KiB/step",
            "device MiB",
            "host MiB",
        )
    ]
    for module_plan in plan.plan.values():
        for name, sharding in module_plan.items():
            if name not in proposal.load_factors:
                continue
            ranks = ",".join(str(r) for r in sorted(set(sharding.ranks or [])))
            lines.append(
                row.format(
                    name,
                    sharding.sharding_type,
                    ranks,
                    f"{proposal.load_factors[name]:.3f}",
                    f"{proposal.miss_rates[name]:.3f}",
                    f"{proposal.bytes_per_step[name] / 1024:.1f}",
                    f"{proposal.device_bytes[name] / 2**20:.2f}",
                    f"{proposal.host_bytes[name] / 2**20:.2f}",
                )
            )
    lines.append(
        f"row traffic {proposal.transfer_ms:.3f} ms/step, "
        f"stall {proposal.stall_ms:.3f} ms/step beyond compute"
    )
    return "\n".join(lines)
