"""The project's vocabulary: what crosses its layers, the planner ABC and the module protocol.

Everything here is plain data or an interface, importable without torch (the
oracle layer needs none): a :class:`CachePlanner` turns batches of ids into
:class:`CachePlan`\\ s; a :class:`LookaheadModule` is what the pipeline drives;
a :class:`StepContext` is one batch's state from the moment it enters the
window until its step has run, and travels with the batch (stage -> pipeline
-> module) instead of being kept in per-step tables by each of them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from torchrec_lookahead.settings import check_count, check_fraction

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_lookahead.metrics import CacheMetrics

__all__ = [
    "CachePlan",
    "CachePlanner",
    "CacheSizing",
    "LookaheadModule",
    "PlannedStep",
    "PreparedStep",
    "StepContext",
    "StepInput",
    "StepMoves",
    "Window",
]

StepMoves = list[Callable[[], None]]  # the row moves of one step, run by the executor in order


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


class CachePlanner(ABC):
    """Plans one cache from the batches it will serve, in step order.

    The calls, in order: ``prepare`` a batch (checks it and changes nothing,
    so a caller planning several caches can refuse a batch before any of them
    moves), then ``push`` what ``prepare`` returned; ``push`` returns the plan
    of the step ``lookahead`` batches back once it is complete. At the end of
    the stream ``finish`` returns the plans still due, with shorter windows,
    and ``flush`` the write-back of every resident row.
    """

    @abstractmethod
    def prepare(self, batch: Any) -> Any:
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
    def absent(self, prepared: Any) -> np.ndarray:
        """The distinct ids of a prepared batch not resident now: what its step may fetch."""

    def plan(self, batches: Iterable[Any]) -> Iterator[CachePlan]:
        """Plans for a stream of batches, in step order, with the end drained."""
        for batch in batches:
            ready = self.push(batch)
            if ready is not None:
                yield ready
        yield from self.finish()


@dataclass(frozen=True)
class Window:
    """The pipeline's window: ``lookahead`` (L), ``prefetch_distance`` (d), and how many
    hash partitions (threads) plan each slot pool."""

    lookahead: int
    prefetch_distance: int
    planning_workers: int = 1

    def __post_init__(self) -> None:  # the settings' names as the pipeline takes them
        check_count("lookahead", self.lookahead, 1)
        check_count("prefetch_distance", self.prefetch_distance, 0)
        check_count("planning_workers", self.planning_workers, 1)


@dataclass(frozen=True)
class CacheSizing:
    """How many cache slots a table (or a shard of it) brings to its pool.

    ``cache_rows[name]`` (slots for the whole table) wins over
    ``cache_load_factor`` (a share of the rows); a sharding plan's per-table
    load factor wins over both. A shard gets its share of the table's slots,
    and never fewer than ``min_rows`` (nor more than it has rows). When a
    window's first batch shows that a table's share is smaller than what the
    window touches, the table brings that instead.
    """

    cache_load_factor: float = 0.1
    cache_rows: Mapping[str, int] = field(default_factory=dict)
    min_rows: int = 1

    def __post_init__(self) -> None:  # the settings' names as the module takes them
        check_fraction("cache_load_factor", self.cache_load_factor)
        for name, rows in self.cache_rows.items():
            check_count(f"cache_rows[{name!r}]", rows, 1)
        check_count("min_cache_rows", self.min_rows, 1)

    def rows(
        self, name: str, num_embeddings: int, local_rows: int, plan_load_factor: float | None = None
    ) -> int:
        if plan_load_factor is not None:
            wanted = math.ceil(plan_load_factor * local_rows)
        elif name in self.cache_rows:
            wanted = math.ceil(self.cache_rows[name] * local_rows / num_embeddings)
        else:
            wanted = math.ceil(self.cache_load_factor * local_rows)
        return min(local_rows, max(self.min_rows, wanted, 1))


@dataclass(frozen=True)
class PreparedStep:
    """A batch checked by one group of cached tables, ready to enter its window."""

    step: int
    lookups: np.ndarray  # ids per table
    batches: list[Any]  # per pool: what its planner's prepare returned
    positions: list[slice | np.ndarray] | None  # per pool, where its ids sit (None: 1 pool)
    # A window's first batch: the slots per table sized for it and the pools' planners,
    # installed when the batch enters (a refused batch leaves the sizing as it was).
    sizing: tuple[list[int], list[CachePlanner]] | None = None


@dataclass(frozen=True)
class StepInput:
    """What a module's ``prepare`` made of a batch: per cached group, the batch checked
    for it; under DMP also the batch as distributed to this rank (TorchRec's context and
    input), which the step's forward consumes, and its hot part for the replicated rows."""

    groups: list[PreparedStep]
    distributed: tuple[Any, Any] | None = None
    replicated: Any = None  # a HotStep (embedding.replicated), with replicated hot rows


@dataclass
class PlannedStep:
    """A step whose plans are made: its row moves and, per cached group, the cache slot
    of each of its ids (what the step's lookups read)."""

    step: int
    moves: StepMoves = field(default_factory=list)
    slots: dict[Any, Any] = field(default_factory=dict)  # cached group -> slots tensor

    def merge(self, other: PlannedStep) -> None:
        """Add ``other``'s moves and slots (another group's plan of the same step)."""
        if other.step != self.step:
            raise ValueError(f"plans of steps {self.step} and {other.step} cannot merge")
        self.moves.extend(other.moves)
        self.slots.update(other.slots)


@dataclass
class StepContext:
    """One batch in the window: made by the stage when the batch enters, completed by the
    pipeline when its step is planned, read by the modules when its step runs."""

    step: int
    batch: Any
    inputs: dict[Any, StepInput] = field(default_factory=dict)  # module -> what it prepared
    planned: PlannedStep | None = None  # filled once batch ``step + L`` has entered
    # An event after the stage's device work on the batch and, once planned, on its plan (the
    # step's slots): what the trainer's stream waits for at the hand-over.
    ready: Any = None


@runtime_checkable
class LookaheadModule(Protocol):
    """What :class:`~torchrec_lookahead.pipeline.LookaheadTrainPipeline` drives: the
    unsharded collection and its sharded form under DMP implement it alike.

    The calls, in order:

    1. ``attach(window)`` when a pipeline is built (on every rank, in the same
       order: a sharded module makes its collectives' process group here); the
       cache is emptied and the window starts at step 0.
    2. For each batch, on the lookahead stage's thread, in data order:
       ``prepare(features, refusal)`` checks it for every cached table and
       changes nothing (``refusal``, the stage's verdict on the batch as a
       whole, is raised, and under DMP voted on so that every rank refuses
       together; the sharded module distributes the batch here); then
       ``enter(prepared)`` lets it into the window and returns the
       :class:`PlannedStep` of the step ``L`` batches back, now complete. The
       stage keeps what ``prepare`` returned (a :class:`StepInput`) in the
       batch's :class:`StepContext`.
    3. At the end of the data, ``finish()`` returns the steps still to plan.
    4. For each step, on the trainer's thread, once its moves have landed:
       ``begin_step(context)``, then the model's forward, whose lookups read
       the step's slots (and, sharded, its distributed input) from there.
    5. ``write_back()`` writes updated cache rows to the store (the end of the
       data; ``state_dict`` does it too).

    ``cache_metrics``, ``cached_groups`` and ``input_dist_s`` report what the
    cache did and what distributing batches cost the stage.
    """

    input_dist_s: float  # CPU seconds the stage spent distributing batches (0 unsharded)

    @property
    def cached_groups(self) -> list[Any]: ...

    def attach(self, window: Window) -> None: ...

    def prepare(
        self, features: KeyedJaggedTensor, refusal: ValueError | None = None
    ) -> StepInput: ...

    def enter(self, prepared: StepInput) -> PlannedStep | None: ...

    def finish(self) -> list[PlannedStep]: ...

    def begin_step(self, context: StepContext) -> None: ...

    def write_back(self) -> None: ...

    def cache_metrics(self) -> dict[str, CacheMetrics]: ...
