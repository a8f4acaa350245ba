"""The project's vocabulary: what crosses its layers, the planner ABC and the module protocol.

Everything here is plain data or an interface, importable without torch (the
oracle layer needs none): a :class:`CachePlanner` turns batches of ids into
:class:`CachePlan`\\ s; a :class:`LookaheadModule` is what the pipeline drives;
a :class:`StepContext` is one batch's state from the moment it enters the
window until its step has run, and travels with the batch (stage -> pipeline
-> module) instead of being kept in per-step tables by each of them. The step
types are named for their grain: a :class:`PreparedGroup` per cached group, a
:class:`ModuleInput` per module, a :class:`StepPlan` and a :class:`StepContext`
per step.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from torchrec_lookahead.settings import check_count, check_fraction

if TYPE_CHECKING:
    import torch
    from torchrec.distributed.embedding_types import KJTList
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    from torchrec.streamable import Pipelineable

    from torchrec_lookahead.metrics import CacheMetrics

__all__ = [
    "CachePlan",
    "CachePlanner",
    "CacheSizing",
    "CachedGroup",
    "LookaheadModule",
    "ModuleInput",
    "PreparedGroup",
    "PreparedIds",
    "StepContext",
    "StepMoves",
    "StepPlan",
    "Window",
]

StepMoves = list[Callable[[], None]]  # the row moves of one step, run by the executor in order


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
    """

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


class CachedGroup(Protocol):
    """A group of tables cached behind one TBE, as the pipeline and the step types see it
    (:class:`~torchrec_lookahead.cache.tables.CachedTables`): a key, and what each step did."""

    step_counts: dict[int, tuple[np.ndarray, np.ndarray]]  # step -> (distinct ids, misses)


@dataclass(frozen=True)
class PreparedGroup:
    """A batch checked by one group of cached tables, ready to enter its window."""

    group: CachedGroup  # the group that checked it
    step: int
    lookups: np.ndarray  # ids per table
    batches: list[PreparedIds]  # per pool: what its planner's prepare returned
    # Where each slot pool's ids sit in the batch, pool after pool (None: one pool), on the
    # device: the step's lookup puts the plan's slots, pool after pool, in the batch's order.
    order: torch.Tensor | None
    # A window's first batch: the slots per table sized for it and the pools' planners,
    # installed when the batch enters (a refused batch leaves the sizing as it was).
    sizing: tuple[list[int], list[CachePlanner[PreparedIds]]] | None = None
    # A window that needs more slots than a pool has: each pool's slots to grow to (and
    # what the window needs), taken when the batch enters, like ``sizing``.
    growth: list[tuple[int, int]] | None = None


@dataclass(frozen=True)
class ModuleInput:
    """What a module's ``prepare`` made of a batch: per cached group, the batch checked
    for it; under DMP also the batch as distributed to this rank (TorchRec's context and
    input), which the step's forward consumes. The context holds whatever else the
    module keeps of the batch (the hot rows' part: ``HotRowsContext``)."""

    groups: list[PreparedGroup]
    distributed: tuple[EmbeddingBagCollectionContext, KJTList] | None = None


@dataclass
class StepPlan:
    """A step whose plans are made: its row moves and, per cached group, the cache slots
    of its ids, pool after pool (the group's lookup takes them out, in the batch's order)."""

    step: int
    moves: StepMoves = field(default_factory=list)
    slots: dict[CachedGroup, torch.Tensor] = field(default_factory=dict)
    # Caches to grow before this step's moves are issued (its moves may use the new
    # slots): run on the trainer's thread between steps, with no move in flight.
    growths: StepMoves = field(default_factory=list)

    def merge(self, other: StepPlan) -> None:
        """Add ``other``'s moves, slots and growths (another group's plan of the same step)."""
        if other.step != self.step:
            raise ValueError(f"plans of steps {self.step} and {other.step} cannot merge")
        self.moves.extend(other.moves)
        self.slots.update(other.slots)
        self.growths.extend(other.growths)


@dataclass
class StepContext:
    """One batch in the window: made by the stage when the batch enters (which numbers
    it: ``step``), completed by the pipeline when its step is planned, and held by the
    modules while its step runs, whose lookups take their slots from it."""

    step: int
    batch: Pipelineable  # what the data loader yields (``batch.sparse_features``: the ids)
    inputs: dict[LookaheadModule, ModuleInput] = field(default_factory=dict)
    plan: StepPlan | None = None  # filled once batch ``step + L`` has entered
    # An event after the stage's device work on the batch and, once planned, on its plan (the
    # step's slots): what the trainer's stream waits for at the hand-over.
    ready: object = None

    def prepared(self, group: CachedGroup) -> PreparedGroup:
        """What ``group`` made of this batch (its ``prepare``)."""
        for module_input in self.inputs.values():
            for prepared in module_input.groups:
                if prepared.group is group:
                    return prepared
        raise KeyError(f"step {self.step} was not prepared by this group")


@runtime_checkable
class LookaheadModule(Protocol):
    """What :class:`~torchrec_lookahead.pipeline.LookaheadTrainPipeline` drives: the
    unsharded collection and its sharded form under DMP implement it alike.

    The calls, in order:

    1. ``attach(window)`` when a pipeline is built (on every rank, in the same
       order: a sharded module makes its collectives' process group here); the
       cache is emptied and the window starts at step 0.
    2. For each batch, on the lookahead stage's thread, in data order:
       ``prepare(features, step, refusal)`` checks it for every cached table and
       changes nothing (``step`` is the number the stage gave the batch;
       ``refusal``, the stage's verdict on the batch as a whole, is raised,
       and under DMP voted on so that every rank refuses together; the
       sharded module distributes the batch here); then ``enter(prepared)``
       lets it into the window and returns the :class:`StepPlan` of the step
       ``L`` batches back, now complete. The stage keeps what ``prepare``
       returned (a :class:`ModuleInput`) in the batch's :class:`StepContext`.
    3. At the end of the data, ``finish()`` returns the steps still to plan.
    4. For each step, on the trainer's thread, once its moves have landed:
       ``begin_step(context)``, then the model's forward. The module holds the
       context until the step's lookups have taken from it their slots (and,
       sharded, the distributed input), as TorchRec's pipelined forward holds
       its context.
    5. ``write_back()`` writes updated cache rows to the store (the end of the
       data; ``state_dict`` does it too).

    ``cache_metrics``, ``cached_groups`` and ``input_dist_s`` report what the
    cache did and what distributing batches cost the stage.
    """

    input_dist_s: float  # CPU seconds the stage spent distributing batches (0 unsharded)

    @property
    def cached_groups(self) -> list[CachedGroup]: ...

    def attach(self, window: Window) -> None: ...

    def prepare(
        self, features: KeyedJaggedTensor, step: int, refusal: ValueError | None = None
    ) -> ModuleInput: ...

    def enter(self, prepared: ModuleInput) -> StepPlan | None: ...

    def finish(self) -> list[StepPlan]: ...

    def begin_step(self, context: StepContext) -> None: ...

    def write_back(self) -> None: ...

    def cache_metrics(self) -> dict[str, CacheMetrics]: ...
