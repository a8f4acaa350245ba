"""How many cache slots each table of a group brings to its pool, and how a pool grows.

A table brings its share (the slots it was given). At a window's first
batch, a share smaller than the rows ``d + 1`` batches like that one can
touch is raised to that many, within the table's cap (``max_cache_rows``; by
default all its rows). A pool whose window later needs more slots than it
has grows (:data:`GROWTH`), within the sum of its tables' caps; a window
that needs more than that is refused before anything changes. The grown
sizes are the shares of the next window.
:class:`~torchrec_lookahead.cache.group.CacheGroup` decides when; this
module, how much.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from torchrec_lookahead.cache.pools import SlotPool

__all__ = ["GROWTH", "TableSlots"]

# How much a pool grows when a window needs more slots than it has (at least what is
# needed): each growth costs a rebuild, bounded to a few; the cache holds at most half
# again what the widest window needed (2x would double it, 1.25x grow twice as often).
GROWTH = 1.5


class TableSlots:
    """The slots each table of a group brings to its pool: now, as shares, and at most.

    Args:
        names: table names (for messages), in the group's table order.
        num_rows: rows of each table.
        pools: the group's slot pools.
        shares: the slots each table brings to its pool.
        caps: the most slots each table may bring (``max_cache_rows``); ``None`` (for
            all, or a table): its rows.
    """

    def __init__(
        self,
        names: Sequence[str],
        num_rows: Sequence[int],
        pools: Sequence[SlotPool],
        shares: Sequence[int],
        caps: Sequence[int | None] | None = None,
    ) -> None:
        self.names = list(names)
        self.num_rows = list(num_rows)
        self.pools = list(pools)
        self.slots = list(shares)  # each table's slots now
        self.shares = list(shares)  # before any raise to what the window needs
        caps = caps or [None] * len(self.num_rows)
        self.capped = [cap is not None for cap in caps]  # by the user, not by its rows
        self.caps = [rows if cap is None else cap for rows, cap in zip(self.num_rows, caps)]

    def per_pool(self, table_slots: Sequence[int]) -> list[int]:
        """Each pool's slots: the sum of its tables' ``table_slots``."""
        return [sum(table_slots[t] for t in pool.tables) for pool in self.pools]

    def sized_for(self, lookups: np.ndarray, d: int) -> list[int]:
        """Each table's slots: its share, or what ``d + 1`` batches like this one can touch.

        ``lookups`` are this batch's ids per table: ``d + 1`` batches of as many
        ids touch at most ``d + 1`` times that many rows (a bound for batches of
        a fixed shape; batches with more ids may still need more).
        """
        return [
            max(share, min(cap, (d + 1) * int(count)))
            for share, cap, count in zip(self.shares, self.caps, lookups)
        ]

    def growth(
        self,
        slots: list[int],
        needed: list[int],
        step: int,
        d: int,
        partitions: Sequence[int] | None = None,
    ) -> list[tuple[int, int]] | None:
        """Each pool's slots to grow to, and what its window needs, if a window needs
        more than ``slots``; ``ValueError`` before anything changes if over a pool's cap.

        A pool grows to ``GROWTH`` times its slots, or to what is needed if more,
        within its cap: geometric growth, so a stream whose windows keep widening
        rebuilds the cache a few times (each rebuild copies the cache and waits for
        the moves in flight), not once per new maximum. A pool whose planner splits
        its slots into ``partitions[p] = K`` equal shares (hash partitions) and none of
        whose tables the user capped may grow to ``K * ceil(rows / K)``, a few slots more
        than its rows: a partition owns up to ``ceil(rows / K)`` of them (one id of each
        run of ``K``), which its share must be able to hold.
        """
        if all(n <= have for n, have in zip(needed, slots)):
            return None
        growth = []
        for p, (have, n) in enumerate(zip(slots, needed)):
            tables = self.pools[p].tables
            cap, k = sum(self.caps[t] for t in tables), partitions[p] if partitions else 1
            if not any(self.capped[t] for t in tables):
                cap = k * -(-cap // k)
            if n > cap:
                raise self._over_cap(p, n, cap, step, d, k)
            growth.append((have if n <= have else min(cap, max(n, math.ceil(GROWTH * have))), n))
        return growth

    def add(self, pool: int, extra: int) -> list[int]:
        """``extra`` slots more for ``pool``, counted to its tables in proportion to what
        they bring (the remainder to the largest first); returns each table's part. The
        next window starts at the grown sizes."""
        tables = self.pools[pool].tables
        parts = _spread(extra, [self.slots[t] for t in tables])
        for t, more in zip(tables, parts):
            self.slots[t] += more
        self.shares = list(self.slots)
        return parts

    def _over_cap(
        self, pool: int, needed: int, cap: int, step: int, d: int, partitions: int
    ) -> ValueError:
        tables = [self.names[t] for t in self.pools[pool].tables]
        capped = any(self.capped[t] for t in self.pools[pool].tables)
        why = "max_cache_rows" if capped else "all its rows"
        if partitions > 1:  # a share may be short while the whole cache is not
            why += (
                f"; planned in {partitions} hash partitions, each needs its own share of "
                "them: plan with fewer workers"
            )
        return ValueError(
            f"step {step}: steps {max(step - d, 0)}..{step} use {needed} distinct rows of "
            f"tables {tables}, which must be resident together (prefetch_distance={d}), "
            f"but their cache may hold at most {cap} slots ({why}); a capacity of at "
            f"least {needed} is needed"
        )


def _spread(extra: int, shares: list[int]) -> list[int]:
    """``extra`` slots split over tables in proportion to their ``shares`` (the remainder to
    the largest first): what each table is counted as bringing to its grown pool."""
    total = sum(shares)
    split = [extra * share // total for share in shares]
    for t in sorted(range(len(shares)), key=lambda t: -shares[t])[: extra - sum(split)]:
        split[t] += 1
    return split
