"""The settings, checked where they are given: counts are integers, fractions finite and in range.

:class:`WindowSettings` (the pipeline's window) and :class:`CacheSizing` (a cached
collection's slots per table) are the settings that travel between layers.

A setting of the wrong type raises :class:`SettingTypeError`, both a ``TypeError``
(what it is) and a ``ValueError`` (what callers that check settings catch), so one
``except ValueError`` handles every bad setting, as with bad batches."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "PLANNERS",
    "CacheSizing",
    "SettingTypeError",
    "WindowSettings",
    "check_count",
    "check_fraction",
]


class SettingTypeError(TypeError, ValueError):
    """A setting of the wrong type (a float or bool for a count, a string for a fraction)."""


def check_count(name: str, value: Any, minimum: int) -> int:
    """``value`` if it is an integer (not a bool) of at least ``minimum``; else
    ``SettingTypeError`` / ``ValueError`` naming the setting."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SettingTypeError(f"{name} must be an integer, got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def check_fraction(name: str, value: Any) -> float:
    """``value`` if it is a real number in (0, 1]; else ``SettingTypeError`` / ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SettingTypeError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and 0 < float(value) <= 1):
        raise ValueError(f"{name} must be in (0, 1], got {value}")
    return float(value)


# Where a cache group's plans are made: "host" (the numba oracle, the batch's ids copied to
# the host; the default) or "device" (the device oracle, on the cache's device: no id
# leaves it). The device is not the default on CUDA until a GPU has measured it faster.
PLANNERS = ("host", "device")


@dataclass(frozen=True)
class WindowSettings:
    """The pipeline's window: ``lookahead`` (L), ``prefetch_distance`` (d), how many
    hash partitions (threads) plan each slot pool, and where plans are made (``PLANNERS``)."""

    lookahead: int
    prefetch_distance: int
    planning_workers: int = 1
    planner: str = "host"

    def __post_init__(self) -> None:  # the settings' names as the pipeline takes them
        check_count("lookahead", self.lookahead, 1)
        check_count("prefetch_distance", self.prefetch_distance, 0)
        check_count("planning_workers", self.planning_workers, 1)
        if self.planner not in PLANNERS:
            raise ValueError(f"planner must be one of {PLANNERS}, got {self.planner!r}")
        if self.planner == "device" and self.planning_workers > 1:
            raise ValueError(
                "planning_workers > 1 partitions the host planner; planner='device' plans "
                "each pool in one pass on the device: leave planning_workers at 1"
            )


@dataclass(frozen=True)
class CacheSizing:
    """How many cache slots a table (or a shard of it) brings to its pool.

    ``cache_rows[name]`` (slots for the whole table) wins over
    ``cache_load_factor`` (a share of the rows); a sharding plan's per-table
    load factor wins over both. A shard gets its share of the table's slots,
    and never fewer than ``min_rows`` (nor more than it has rows). When a
    window's first batch shows that a table's share is smaller than what the
    window touches, the table brings that instead; when a later window needs
    more slots than its pool has, the pool grows. ``max_rows[name]`` caps a
    table's slots (a shard's cap is its share of it, as for ``cache_rows``):
    the only reason a good batch is refused.
    """

    cache_load_factor: float = 0.1
    cache_rows: Mapping[str, int] = field(default_factory=dict)
    min_rows: int = 1
    max_rows: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:  # the settings' names as the module takes them
        check_fraction("cache_load_factor", self.cache_load_factor)
        for name, rows in self.cache_rows.items():
            check_count(f"cache_rows[{name!r}]", rows, 1)
        check_count("min_cache_rows", self.min_rows, 1)
        for name, most in self.max_rows.items():
            check_count(f"max_cache_rows[{name!r}]", most, self.min_rows)
            if self.cache_rows.get(name, 0) > most:
                raise ValueError(
                    f"cache_rows[{name!r}] = {self.cache_rows[name]} is over "
                    f"max_cache_rows[{name!r}] = {most}"
                )

    def rows(
        self, name: str, num_embeddings: int, local_rows: int, plan_load_factor: float | None = None
    ) -> int:
        if plan_load_factor is not None:
            wanted = math.ceil(plan_load_factor * local_rows)
        elif name in self.cache_rows:
            wanted = math.ceil(self.cache_rows[name] * local_rows / num_embeddings)
        else:
            wanted = math.ceil(self.cache_load_factor * local_rows)
        return min(self.cap(name, num_embeddings, local_rows), max(self.min_rows, wanted, 1))

    def cap(self, name: str, num_embeddings: int, local_rows: int) -> int:
        """The most slots a table (or a shard of ``local_rows`` of its rows) may bring."""
        if name not in self.max_rows:
            return local_rows
        return min(local_rows, math.ceil(self.max_rows[name] * local_rows / num_embeddings))
