"""How a cache group's slot pools are planned: one role, made on the host or on the device.

A :class:`~torchrec_lookahead.cache.group.CacheGroup` sizes its pools, grows
them, counts and looks up; where each step's plan is made is a
:class:`Planning`'s: :class:`~torchrec_lookahead.cache.host_plans.HostPlanning`
(the numba oracle; the default) or
:class:`~torchrec_lookahead.cache.device_plans.DevicePlanning` (the device
oracle, ``planner="device"``). The group calls, per window:

1. ``new_oracle(slots, pool)`` for each pool, at the window's first batch;
2. per batch, ``prepare(features, oracles, positions, step)`` (changes nothing,
   says the slots each pool's window needs), then ``enter(step, lookups,
   oracles, batches)`` once the batch is let in (it counts the batch and
   returns each pool's plan now due, or ``None``);
3. ``finish(oracles)`` at the end of the data: each pool's plans still due;
4. ``plan(ready)`` for each step planned: the step's slots, on the cache's
   device, and its moves for the executor (which count the plan, too).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.cache.pools import SlotPool
from torchrec_lookahead.oracle.contract import CachePlanner
from torchrec_lookahead.settings import WindowSettings
from torchrec_lookahead.steps import StepMoves

if TYPE_CHECKING:
    from torchrec_lookahead.cache.counters import TableCounters
    from torchrec_lookahead.cache.slot_cache import SlotCache

__all__ = ["GroupLayout", "Planning", "check_lengths"]


def check_lengths(lengths: Sequence[int] | np.ndarray, values: int, step: int) -> None:
    """``ValueError`` unless the features' ``lengths`` add up to the batch's ``values``:
    a planner reads each feature's ids by its length (a batch not checked before, by the
    pipeline's ``check_batch``, can reach it)."""
    total = int(np.sum(lengths))
    if total != values:
        raise ValueError(
            f"step {step}: the lengths add up to {total} ids but the batch has {values} values"
        )


@dataclass(frozen=True)
class GroupLayout:
    """Where a group's ids go: its tables, their pools, and each feature's place."""

    names: list[str]  # the tables, in the group's order
    pools: list[SlotPool]
    feature_table: np.ndarray  # per feature in lookup order: its table
    feature_offset: np.ndarray  # its table's row 0 as a pool id
    feature_rows: np.ndarray  # its table's rows
    pool_features: list[np.ndarray]  # per pool: its features (indices in lookup order)
    table_order: np.ndarray  # table t's place when per-pool counts are concatenated

    def per_table(self, counts: Sequence[np.ndarray]) -> np.ndarray:
        """Per-pool counts (one array per pool, one entry per table of it) in table order."""
        return np.concatenate(counts)[self.table_order]


class Planning(ABC):
    """Plans a group's pools (see the module for the calls, in order). ``row_bytes`` (each
    table's row with its optimizer state, in bytes) is set by the group when the window's
    first batch sizes the cache."""

    def __init__(
        self, layout: GroupLayout, cache: SlotCache, counters: TableCounters, window: WindowSettings
    ) -> None:
        self.layout = layout
        self.cache = cache
        self.counters = counters
        self.window = window
        self.row_bytes = np.zeros(len(layout.names), dtype=np.int64)

    @abstractmethod
    def new_oracle(self, slots: int, pool: int) -> CachePlanner[Any]:
        """The planner of ``pool``, of ``slots`` slots."""

    @abstractmethod
    def prepare(
        self,
        features: KeyedJaggedTensor,
        oracles: Sequence[CachePlanner[Any]],
        positions: Sequence[slice | np.ndarray],
        step: int,
    ) -> list[tuple[Any, int]]:
        """Each pool's batch (``positions``: where its ids sit) prepared by its planner,
        and the slots its window needs; ``ValueError`` for ids outside their tables."""

    @abstractmethod
    def enter(
        self,
        step: int,
        lookups: np.ndarray,
        oracles: Sequence[CachePlanner[Any]],
        batches: Sequence[Any],
    ) -> list[Any]:
        """Count the batch of ``step`` (``lookups`` per table) and let each pool's prepared
        batch into its planner's window: the plans now due (``None`` where none is)."""

    @abstractmethod
    def finish(self, oracles: Sequence[CachePlanner[Any]]) -> list[list[Any]]:
        """End of the data: each pool's plans still due."""

    @abstractmethod
    def plan(self, ready: list[Any]) -> tuple[torch.Tensor, StepMoves]:
        """One step's plans (one per pool): its slots on the cache's device, pool after
        pool, and its moves."""
