"""Partitioned planning: one table's rows split into K hash partitions, planned on K threads.

:class:`PartitionedOracle` has the interface of
:class:`~torchrec_lookahead.oracle.OracleCacher`. It spreads the id space
over ``K`` partitions with a fixed hash (``oracle.partitions.split_of``: hot rows
spread, and each partition's rows stay dense), gives each its own
:class:`OracleCacher` with a contiguous range of the slots (shares differ by
at most one), and runs the partitions concurrently, one thread each: their
compiled passes release the GIL. Each partition's pass picks its own ids out
of the whole batch and writes its slots straight into the batch's, so the
merged plan is in batch order with no gather; evictions and fetches are
concatenated partition by partition.

A partition owns its slots, so the oracle's contract (docs/design.md) holds per
partition: in particular a partition evicts for its own misses when its own
slots are full, even if another partition still has free slots (only while
the cache fills up). With ``K=1`` the class is a bare ``OracleCacher``.

Each step costs two hand-offs to the worker threads (prepare, then push);
that pays off when batches are large and cores are free.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from torchrec_lookahead.oracle.cacher import OracleCacher, PreparedBatch, as_int64
from torchrec_lookahead.oracle.contract import CachePlan, CachePlanner
from torchrec_lookahead.oracle.partitions import global_ids, place
from torchrec_lookahead.settings import check_count

__all__ = ["PartitionedBatch", "PartitionedOracle"]

_T = TypeVar("_T")
_EMPTY = np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class PartitionedBatch:
    """A batch checked by :meth:`PartitionedOracle.prepare`, ready to ``push``."""

    owner: PartitionedOracle
    step: int
    ids: np.ndarray  # the batch, int64
    parts: tuple[PreparedBatch, ...]  # each partition's share, in its local rows

    @property
    def unique(self) -> np.ndarray:
        """The batch's distinct ids (partition by partition)."""
        k = len(self.parts)
        return np.concatenate([global_ids(b.unique, p, k) for p, b in enumerate(self.parts)])


class PartitionedOracle(CachePlanner[PreparedBatch | PartitionedBatch]):
    """``partitions`` oracles, each planning a hash share of the rows and of the slots.

    Args: those of :class:`OracleCacher` (``row_table`` is called once per
    partition), and ``partitions`` (``K``), at most
    ``capacity``. Partition ``p`` owns slots ``offsets[p] .. offsets[p + 1] - 1``
    and the ids ``i`` with ``oracle.partitions.split_of(i, K) == p``; a grown
    cache's new slots are numbered after the old ones, so each partition owns
    a share of them too.
    """

    def __init__(
        self,
        capacity: int,
        lookahead: int,
        prefetch_distance: int = 1,
        num_rows: int | None = None,
        *,
        partitions: int = 1,
        tie_break: str = "frequency",
        row_table: Callable[[int], np.ndarray] | None = None,
    ) -> None:
        if not 1 <= partitions <= capacity:
            raise ValueError(f"partitions must be in 1..capacity ({capacity}), got {partitions}")
        self.capacity = capacity
        self.num_rows = num_rows
        self.partitions = partitions
        shares = _shares(capacity, partitions)
        self.offsets = np.concatenate([[0], np.cumsum(shares)])
        # Each partition's slot -> the cache's: offsets[p] + slot until the cache grows.
        self._global_slots = [np.arange(a, b) for a, b in zip(self.offsets[:-1], self.offsets[1:])]
        self._grown = False
        local_rows = None if num_rows is None else -(-num_rows // partitions)
        self._parts = [
            OracleCacher(
                share,
                lookahead,
                prefetch_distance,
                local_rows,
                tie_break=tie_break,
                row_table=row_table,
            )
            for share in shares
        ]
        self._pending: deque[PartitionedBatch] = deque()  # pushed, not yet planned
        self._pool = None
        if partitions > 1:
            self._pool = ThreadPoolExecutor(partitions - 1, thread_name_prefix="oracle")
            weakref.finalize(self, self._pool.shutdown, wait=False)

    @property
    def lookahead(self) -> int:
        return self._parts[0].lookahead

    @property
    def prefetch_distance(self) -> int:
        return self._parts[0].prefetch_distance

    @property
    def tie_break(self) -> str:
        return self._parts[0].tie_break

    def partition_slots(self, partition: int) -> np.ndarray:
        """The cache slots ``partition`` owns, in the order of its own slots."""
        return self._global_slots[partition]

    @property
    def num_resident(self) -> int:
        return sum(part.num_resident for part in self._parts)

    @property
    def steps_pushed(self) -> int:
        """Batches that have entered the window so far."""
        return self._parts[0].steps_pushed

    def prepare(self, batch: Any) -> PreparedBatch | PartitionedBatch:
        """Check the next batch in every partition without letting it in; ``push`` it next.

        Raises ``ValueError`` for bad ids, or when a partition's rows of steps
        ``step-d..step`` exceed its slots. Changes nothing in any partition.
        """
        if self.partitions == 1:
            return self._parts[0].prepare(batch)
        prepared, needed = self.prepare_sized(batch)
        assert isinstance(prepared, PartitionedBatch)  # with more than one partition
        self._check_capacity(prepared, needed)
        return prepared

    def _check_capacity(self, prepared: PartitionedBatch, needed: int) -> None:
        """Refuse ``prepared`` unless every partition owns the slots its window needs
        (``needed``: the capacity that gives each its share)."""
        if needed <= self.capacity:
            return
        parts, k, d, step = prepared.parts, self.partitions, self.prefetch_distance, prepared.step
        p = next(p for p, b in enumerate(parts) if b.pinned_rows > self._parts[p].capacity)
        raise ValueError(
            f"step {step}: steps {max(step - d, 0)}..{step} use {parts[p].pinned_rows} "
            f"distinct rows of partition {p} of {k}, which must be resident together "
            f"(prefetch_distance={d}), but it owns {self._parts[p].capacity} of the "
            f"{self.capacity} slots; a capacity of at least {needed} is needed"
        )

    def prepare_sized(self, batch: Any) -> tuple[PreparedBatch | PartitionedBatch, int]:
        """``prepare`` without the capacity check: the batch and the capacity that gives
        every partition the slots its window needs (``grow`` to it before ``push``)."""
        if self.partitions == 1:
            return self._parts[0].prepare_sized(batch)
        k, step = self.partitions, self.steps_pushed
        ids = as_int64(batch, f"step {step}")
        parts = self._run(
            lambda p: self._parts[p].prepare_unchecked(ids, parts=k, part=p, id_limit=self.num_rows)
        )
        return PartitionedBatch(self, step, ids, tuple(parts)), _needed(parts)

    def grow(self, capacity: int) -> None:
        """``capacity`` slots from now on: each partition grows to its share of them (a
        share never shrinks as the capacity grows), its new slots numbered after the old
        capacity, so that every resident row keeps its slot."""
        capacity = check_count("capacity", capacity, self.capacity)  # before any change
        shares = _shares(capacity, self.partitions)
        extra = [share - part.capacity for share, part in zip(shares, self._parts)]
        starts = self.capacity + np.concatenate([[0], np.cumsum(extra)])
        for p, part in enumerate(self._parts):
            new_slots = np.arange(starts[p], starts[p + 1], dtype=np.int64)
            self._global_slots[p] = np.concatenate([self._global_slots[p], new_slots])
            part.grow(shares[p])
        self.capacity = capacity
        self._grown = True

    def absent(self, prepared: PreparedBatch | PartitionedBatch) -> np.ndarray:
        if isinstance(prepared, PreparedBatch):  # one partition: the oracle's own batch
            return self._parts[0].absent(prepared)
        k = len(self._parts)
        parts = zip(self._parts, prepared.parts)
        return np.concatenate([global_ids(o.absent(b), p, k) for p, (o, b) in enumerate(parts)])

    def push(self, batch: Any) -> CachePlan | None:
        """Let the next batch into every partition; returns ``plan(step - L)`` once it is due."""
        if self.partitions == 1:
            return self._parts[0].push(batch)
        prepared = batch if isinstance(batch, PartitionedBatch) else self.prepare(batch)
        assert isinstance(prepared, PartitionedBatch)  # with more than one partition
        if prepared.owner is not self or prepared.step != self.steps_pushed:
            raise ValueError(
                f"a batch prepared for step {prepared.step} cannot enter at step "
                f"{self.steps_pushed} (or it was prepared by another oracle)"
            )
        self._check_capacity(prepared, _needed(prepared.parts))  # prepared by prepare_sized
        self._pending.append(prepared)
        due = [self._pending[0]] if len(self._pending) > self.lookahead else []
        plans = self._plan(due, lambda p: [self._parts[p].push(prepared.parts[p])])
        return plans[0] if plans else None

    def finish(self) -> list[CachePlan]:
        """End of stream: plans for the steps still waiting, with shorter windows."""
        if self.partitions == 1:
            return self._parts[0].finish()
        return self._plan(list(self._pending), lambda p: self._parts[p].finish())

    def flush(self) -> CachePlan:
        """Write-back of every resident row; the rows stay resident (see ``OracleCacher``)."""
        return self._merge([part.flush() for part in self._parts], _EMPTY)

    # ------------------------------------------------------------ internals

    def _run(self, work: Callable[[int], _T]) -> list[_T]:
        """``work(p)`` for every partition: 1.. on the pool, 0 here; waits for all."""
        if self._pool is None:
            return [work(0)]
        futures = [self._pool.submit(work, p) for p in range(1, self.partitions)]
        try:
            first = work(0)
        finally:
            wait(futures)
        return [first, *(f.result() for f in futures)]

    def _plan(
        self, due: list[PartitionedBatch], work: Callable[[int], Sequence[CachePlan | None]]
    ) -> list[CachePlan]:
        """Plans of the ``due`` batches: ``work(p)`` gives partition ``p``'s, on its thread,
        which also writes its slots into the batch's; then the plans are merged."""
        slots = [np.empty(len(batch.ids), dtype=np.int64) for batch in due]

        def placed(p: int) -> list[CachePlan]:
            plans = [plan for plan in work(p) if plan is not None]
            for plan, batch, out in zip(plans, due, slots):
                if self._grown:
                    place(out, batch.parts[p].taken, self._global_slots[p][plan.slots], 0)
                else:
                    place(out, batch.parts[p].taken, plan.slots, self.offsets[p])
            return plans

        per_part = self._run(placed)
        merged = [self._merge(list(plans), out) for plans, out in zip(zip(*per_part), slots)]
        for _ in merged:
            self._pending.popleft()
        return merged

    def _merge(self, plans: list[CachePlan], slots: np.ndarray) -> CachePlan:
        """One plan from the partitions' plans of a step, in table ids and global slots."""
        k, offsets = self.partitions, self.offsets

        def joined(field: str, as_ids: bool) -> np.ndarray:
            arrays = [getattr(plan, field) for plan in plans]
            if as_ids:
                return np.concatenate([global_ids(a, p, k) for p, a in enumerate(arrays)])
            if self._grown:
                return np.concatenate([self._global_slots[p][a] for p, a in enumerate(arrays)])
            return np.concatenate([a + offsets[p] for p, a in enumerate(arrays)])

        return CachePlan(
            step=plans[0].step,
            slots=slots,
            evict_ids=joined("evict_ids", True),
            evict_slots=joined("evict_slots", False),
            fetch_ids=joined("fetch_ids", True),
            fetch_slots=joined("fetch_slots", False),
        )


def _needed(parts: Sequence[PreparedBatch]) -> int:
    """The capacity whose shares give each partition the slots its window needs: partition
    p's share of a capacity C is at least n once C >= k * (n - 1) + p + 1."""
    k = len(parts)
    return max(k * (b.pinned_rows - 1) + p + 1 for p, b in enumerate(parts))


def _shares(capacity: int, partitions: int) -> list[int]:
    """Each partition's slots of ``capacity``: equal, the first ones one more if needed."""
    return [capacity // partitions + (p < capacity % partitions) for p in range(partitions)]
