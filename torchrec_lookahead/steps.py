"""One step's state and the module protocol: what crosses the pipeline, cache and module layers.

A :class:`LookaheadModule` is what the pipeline drives; a :class:`StepContext` is
one batch's state from the moment it enters the window until its step has run,
and travels with the batch (stage -> pipeline -> module) instead of being kept in
per-step tables by each of them. The step types are named for their grain: a
:class:`PreparedGroup` per cache group, a :class:`ModuleInput` per module, a
:class:`StepPlan` and a :class:`StepContext` per step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from torchrec_lookahead.oracle.contract import CachePlanner, PreparedIds
from torchrec_lookahead.settings import WindowSettings

if TYPE_CHECKING:
    import torch
    from torchrec.distributed.embedding_types import KJTList
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext
    from torchrec.distributed.types import Awaitable
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    from torchrec.streamable import Pipelineable

    from torchrec_lookahead.metrics import CacheMetrics

__all__ = [
    "CacheGroupLike",
    "LookaheadModule",
    "ModuleInput",
    "PreparedGroup",
    "StepContext",
    "StepMoves",
    "StepPlan",
]

StepMoves = list[Callable[[], None]]  # the row moves of one step, run by the executor in order


class CacheGroupLike(Protocol):
    """A group of tables cached behind one TBE, as the pipeline and the step types see it
    (:class:`~torchrec_lookahead.cache.group.CacheGroup`): a key, and what each step did."""

    step_counts: dict[int, tuple[np.ndarray, np.ndarray]]  # step -> (distinct ids, misses)


@dataclass(frozen=True)
class PreparedGroup:
    """A batch checked by one group of cached tables, ready to enter its window."""

    group: CacheGroupLike  # the group that checked it
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
    slots: dict[CacheGroupLike, torch.Tensor] = field(default_factory=dict)
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

    def prepared(self, group: CacheGroupLike) -> PreparedGroup:
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

    1. ``open_window(window)`` when a pipeline is built (on every rank, in the same
       order: a sharded module makes its collectives' process group here); the
       cache is emptied and the window starts at step 0.
    2. For each batch, as the stage reads it (on the host, before it moves to the
       device): ``batch_kind_refusal(features)``, why the module cannot take a batch
       of this kind, if it cannot; the stage's checks and these refusals are voted
       on by every rank (:mod:`~torchrec_lookahead.votes`), and a batch refused
       anywhere goes no further on any rank.
    3. For each batch every rank took, in data order, on the thread that issues the
       stage's collectives (the trainer's on CUDA): ``distribute(features)`` starts
       the batch's way to this rank's shards (the sharded module's input dist) and
       returns a TorchRec ``Awaitable`` of it (an unsharded module:
       ``NoWait(features)``), which the same thread waits for; inline, after it has
       started the next batch's, as TorchRec's ``TrainPipelineSparseDist`` splits a
       batch's input dist. Then, on the stage's planning thread: ``prepare(distributed,
       step)``, with what the wait gave, checks it for every cached table and
       changes nothing (``step`` is the number the stage gave the batch); then
       ``enter(prepared)`` lets it into the window and returns the
       :class:`StepPlan` of the step ``L`` batches back, now complete. The stage
       keeps what ``prepare`` returned (a :class:`ModuleInput`) in the batch's
       :class:`StepContext`.
    4. At the end of the data, ``finish()`` returns the steps still to plan.
    5. For each step, on the trainer's thread, once its moves have landed: the
       model's forward, in which the module's forward is
       ``step_forward(context, ...)`` (the pipeline stands in for the module's
       forward, as TorchRec's pipelines do: :mod:`~torchrec_lookahead.pipeline.forward`).
       Its lookups take their slots (and, sharded, the distributed input) from
       ``context``.
    6. ``write_back()`` writes updated cache rows to the store (the end of the
       data; ``state_dict`` does it too).
    7. ``close_window(window)`` when the pipeline that opened ``window`` closes and
       no thread of its stage runs: a sharded module destroys the process groups it
       made for that window (nothing, if a later window replaced it).

    ``cache_metrics`` and ``cached_groups`` report what the cache did.
    """

    @property
    def cached_groups(self) -> list[CacheGroupLike]: ...

    def open_window(self, window: WindowSettings) -> None: ...

    def close_window(self, window: WindowSettings) -> None: ...

    def batch_kind_refusal(self, features: KeyedJaggedTensor) -> ValueError | None: ...

    def distribute(self, features: KeyedJaggedTensor) -> Awaitable[Any]: ...

    def prepare(self, distributed: Any, step: int) -> ModuleInput: ...

    def enter(self, prepared: ModuleInput) -> StepPlan | None: ...

    def finish(self) -> list[StepPlan]: ...

    def step_forward(self, context: StepContext, *args: Any, **kwargs: Any) -> Any: ...

    def write_back(self) -> None: ...

    def cache_metrics(self) -> dict[str, CacheMetrics]: ...
