"""The oracle's contract: a planner turns batches of ids into cache plans.

A :class:`CachePlanner` (the numba :class:`~torchrec_lookahead.oracle.cacher.OracleCacher`,
the :class:`~torchrec_lookahead.oracle.device.DeviceOracleCacher`, the
:class:`~torchrec_lookahead.oracle.partitioned.PartitionedOracle`) takes a window of
batches and yields a :class:`CachePlan` per step (docs/design.md, "The oracle's
contract"). Plain data and an interface, importable without torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

__all__ = ["CachePlan", "CachePlanner", "PreparedIds"]


class PreparedIds(Protocol):
    """What a planner's ``prepare`` makes of a batch, as its caller reads it."""

    @property
    def unique(self) -> np.ndarray:
        """The batch's distinct ids."""
        ...


PreparedT = TypeVar("PreparedT", bound=PreparedIds)  # a planner's prepared batch


@dataclass(frozen=True)
class CachePlan:
    """What to do to one cache before step ``step`` runs.

    Apply ``evict`` (write back cache -> store) first, then ``fetch``
    (store -> cache). ``slots[i]`` is the cache slot of the batch's ``i``-th id.
    """

    step: int
    slots: np.ndarray
    evict_ids: np.ndarray
    evict_slots: np.ndarray
    fetch_ids: np.ndarray
    fetch_slots: np.ndarray

    @property
    def num_misses(self) -> int:
        return len(self.fetch_ids)


class CachePlanner(ABC, Generic[PreparedT]):
    """Plans one cache from the batches it will serve, in step order.

    The calls, in order: ``prepare`` a batch (checks it and changes nothing,
    so a caller planning several caches can refuse a batch before any of them
    moves; or ``prepare_sized`` and ``grow`` when the window needs more slots),
    then ``push`` what ``prepare`` returned; ``push`` returns the plan
    of the step ``lookahead`` batches back once it is complete. At the end of
    the stream ``finish`` returns the plans still due, with shorter windows,
    and ``flush`` the write-back of every resident row.

    ``partitions``: the equal shares a planner splits its slots into, each share
    planning its own hash partition of the rows (1: it does not split them).
    """

    partitions: int = 1

    @abstractmethod
    def prepare(self, batch: Any) -> PreparedT:
        """Check the next batch (ids, capacity) without letting it in; ``ValueError`` if bad."""

    @abstractmethod
    def push(self, batch: Any) -> CachePlan | None:
        """Let a batch (or what ``prepare`` returned for it) into the window."""

    @abstractmethod
    def finish(self) -> list[CachePlan]:
        """End of the stream: the plans still due."""

    @abstractmethod
    def flush(self) -> CachePlan:
        """The write-back of every resident row (for checkpoints and the end of training)."""

    @abstractmethod
    def absent(self, prepared: PreparedT) -> np.ndarray:
        """The distinct ids of a prepared batch not resident now: what its step may fetch."""

    def prepare_sized(self, batch: Any) -> tuple[PreparedT, int]:
        """``prepare`` that does not refuse a window larger than the slots: the prepared
        batch and the slots its window needs, to ``grow`` to before ``push``. A planner
        that cannot grow refuses as ``prepare`` does (and then needs no more: 0)."""
        return self.prepare(batch), 0

    def grow(self, capacity: int) -> None:
        """Have ``capacity`` slots from now on, the resident rows kept in their slots."""
        raise ValueError(f"{type(self).__name__} cannot grow to {capacity} slots")

    def plan(self, batches: Iterable[Any]) -> Iterator[CachePlan]:
        """Plans for a stream of batches, in step order, with the end drained."""
        for batch in batches:
            ready = self.push(batch)
            if ready is not None:
                yield ready
        yield from self.finish()
