"""Resident-set bookkeeping for one cached table: which row sits in which slot.

Shared by the lookahead oracle and the fast LRU / LFU simulators, which differ
only in the priority they evict by.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SlotTable", "largest_keys"]


def largest_keys(keys: np.ndarray, ids: np.ndarray, count: int) -> np.ndarray:
    """Positions of the ``count`` largest ``keys``; equal keys go to the smaller id.

    Linear time (``argpartition``), and deterministic, so that fast and
    reference implementations of a policy choose the same victims.
    """
    n = len(keys)
    if count >= n:
        return np.arange(n)
    if count <= 0:
        return np.empty(0, dtype=np.int64)
    threshold = keys[np.argpartition(keys, n - count)[n - count]]
    above = np.flatnonzero(keys > threshold)
    tied = np.flatnonzero(keys == threshold)
    need = count - len(above)
    if need < len(tied):
        tied = tied[np.argpartition(ids[tied], need - 1)[:need]]
    return np.concatenate([above, tied])


class SlotTable:
    """Maps row ids to the slots ``0..capacity-1`` of a cache.

    Slots fill in order and a slot is freed only to be refilled in the same
    plan, so the free slots are always the tail ``[num_resident, capacity)``.
    The id -> slot map grows on demand when the table size is not given.

    Memory: 4 bytes per table row plus 8 bytes per slot.
    """

    def __init__(self, capacity: int, num_rows: int | None = None) -> None:
        self.capacity = capacity
        self.num_resident = 0
        self.slot_of_id = np.full(num_rows or 0, -1, dtype=np.int32)
        self.id_of_slot = np.full(capacity, -1, dtype=np.int64)

    def grow(self, num_rows: int) -> None:
        """Make room for ids below ``num_rows`` (amortised doubling)."""
        size = len(self.slot_of_id)
        if num_rows > size:
            grown = np.full(max(num_rows, 2 * size), -1, dtype=np.int32)
            grown[:size] = self.slot_of_id
            self.slot_of_id = grown

    @property
    def free(self) -> int:
        return self.capacity - self.num_resident

    def occupied_ids(self) -> np.ndarray:
        """Row ids in slots ``0..num_resident-1`` (slot order)."""
        return self.id_of_slot[: self.num_resident]

    def admit(self, ids: np.ndarray, victim_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Evict ``victim_slots`` and place the absent ``ids`` into free slots.

        Fills the free tail first, then the victims' slots. Returns
        ``(evict_ids, fetch_slots)``.
        """
        from_tail = len(ids) - len(victim_slots)
        evict_ids = self.id_of_slot[victim_slots]
        fetch_slots = np.concatenate(
            [np.arange(self.num_resident, self.num_resident + from_tail), victim_slots]
        )
        self.slot_of_id[evict_ids] = -1
        self.slot_of_id[ids] = fetch_slots
        self.id_of_slot[fetch_slots] = ids
        self.num_resident += from_tail
        return evict_ids, fetch_slots
