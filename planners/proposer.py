"""``LookaheadCacheProposer``: per-table cache sizes that keep the step stall-free in a budget.

Prefetches cost nothing while they fit inside a step's compute time. So the
proposer repeatedly buys the cache growth (any table, any larger size) that
removes the most row traffic per device byte: without a budget, until all of
a step's traffic fits in its compute time; with one, until the budget is spent
(past stall-free, less traffic still means less contention). If the budget
runs out first, the caches are the largest that fit, and the proposal says how
long the step will stall.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planners.cost import TableCacheCost
from planners.statistics import LOAD_FACTOR_GRID

__all__ = ["CacheProposal", "LookaheadCacheProposer"]


@dataclass(frozen=True)
class CacheProposal:
    """Chosen load factor per table, with what the costs model predicts for it."""

    load_factors: dict[str, float]
    miss_rates: dict[str, float]
    bytes_per_step: dict[str, float]
    device_bytes: dict[str, int]
    host_bytes: dict[str, int]
    transfer_ms: float  # all tables' row traffic per step
    stall_ms: float  # the part of it beyond the step's compute time


class LookaheadCacheProposer:
    """Sizes lookahead caches from measured miss rates.

    Args:
        bandwidth: host <-> device bytes per millisecond for row moves.
        step_compute_ms: the step's compute time, which prefetches can hide behind.
        budget_bytes: device memory for all caches together (None: no limit; then
            caches grow only until the step is stall-free).
        grid: the load factors considered.
    """

    def __init__(
        self,
        bandwidth: float,
        step_compute_ms: float,
        budget_bytes: int | None = None,
        grid: Sequence[float] = LOAD_FACTOR_GRID,
    ) -> None:
        if not (bandwidth > 0 and step_compute_ms >= 0):  # NaN too
            raise ValueError("bandwidth must be positive and step_compute_ms non-negative")
        self.bandwidth = bandwidth
        self.step_compute_ms = step_compute_ms
        self.budget_bytes = budget_bytes
        self.grid = sorted(grid)

    def propose(self, tables: Sequence[TableCacheCost]) -> CacheProposal:
        if not tables:
            raise ValueError("no tables to size")
        # Start every table at its smallest workable cache.
        chosen = {t.name: self._options(t)[0] for t in tables}
        used = sum(t.device_bytes(chosen[t.name]) for t in tables)
        if self.budget_bytes is not None and used > self.budget_bytes:
            raise ValueError(
                f"a device budget of {self.budget_bytes:,} bytes cannot hold even the smallest "
                f"workable caches (what a window's steps use together): {used:,} bytes are needed"
            )

        def transfer_ms() -> float:
            return sum(t.bytes_per_step(chosen[t.name]) for t in tables) / self.bandwidth

        stall_free_only = self.budget_bytes is None
        while True:
            if stall_free_only and transfer_ms() <= self.step_compute_ms:
                break
            # Any larger size of any table may be the best buy (a flat stretch of the
            # miss curve makes the next size useless but a later one worthwhile).
            best, best_gain = None, 0.0
            for t in tables:
                current = chosen[t.name]
                for step_up in (f for f in self._options(t) if f > current):
                    extra = t.device_bytes(step_up) - t.device_bytes(current)
                    if self.budget_bytes is not None and used + extra > self.budget_bytes:
                        continue
                    saved = t.bytes_per_step(current) - t.bytes_per_step(step_up)
                    gain = saved / max(extra, 1)
                    if gain > best_gain:
                        best, best_gain = (t, step_up, extra), gain
            if best is None:  # nothing left that fits (or that helps)
                break
            table, step_up, extra = best
            chosen[table.name] = step_up
            used += extra
        total_ms = transfer_ms()
        return CacheProposal(
            load_factors=chosen,
            miss_rates={t.name: t.stats.expected_miss_rate(chosen[t.name]) for t in tables},
            bytes_per_step={t.name: t.bytes_per_step(chosen[t.name]) for t in tables},
            device_bytes={t.name: t.device_bytes(chosen[t.name]) for t in tables},
            host_bytes={t.name: t.host_bytes() for t in tables},
            transfer_ms=total_ms,
            stall_ms=max(0.0, total_ms - self.step_compute_ms),
        )

    def _options(self, table: TableCacheCost) -> list[float]:
        """Grid load factors at or above the table's smallest workable cache."""
        floor = table.stats.min_load_factor
        return sorted({max(f, floor) for f in self.grid if f >= floor} | {min(1.0, floor)})
