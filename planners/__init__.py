"""Sharding-planner extension: cache sizes for lookahead-cached tables from measured miss rates."""

from planners.cost import TableCacheCost, optimizer_state_floats
from planners.planner import lookahead_planner, plan_report
from planners.proposer import CacheProposal, LookaheadCacheProposer
from planners.statistics import LOAD_FACTOR_GRID, LookaheadCacheStatistics

__all__ = [
    "LOAD_FACTOR_GRID",
    "CacheProposal",
    "LookaheadCacheProposer",
    "LookaheadCacheStatistics",
    "TableCacheCost",
    "lookahead_planner",
    "optimizer_state_floats",
    "plan_report",
]
