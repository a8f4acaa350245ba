"""Sharding-planner extension: cache sizes from measured miss rates, and the rows to replicate."""

from planners.cost import TableCacheCost, optimizer_state_floats
from planners.hot import HotRowsProposal, LinkCost, hot_rows_report, propose_hot_rows
from planners.planner import LookaheadShardingPlanner, lookahead_planner, plan_report
from planners.proposer import CacheProposal, LookaheadCacheProposer
from planners.statistics import LOAD_FACTOR_GRID, LookaheadCacheStatistics

__all__ = [
    "LOAD_FACTOR_GRID",
    "CacheProposal",
    "HotRowsProposal",
    "LookaheadCacheProposer",
    "LookaheadCacheStatistics",
    "LookaheadShardingPlanner",
    "TableCacheCost",
    "hot_rows_report",
    "lookahead_planner",
    "optimizer_state_floats",
    "plan_report",
    "propose_hot_rows",
    "LinkCost",
]
