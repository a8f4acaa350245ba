"""``LookaheadTrainPipeline``: TorchRec's train-pipeline contract with a lookahead window."""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipeline
from torchrec.distributed.types import ShardedModule

from torchrec_lookahead.checks import not_sharded
from torchrec_lookahead.metrics import CacheMetrics
from torchrec_lookahead.oracle import load_kernels
from torchrec_lookahead.pipeline.batch_check import BatchCheck
from torchrec_lookahead.pipeline.executor import PlanExecutor
from torchrec_lookahead.pipeline.forward import StepForward
from torchrec_lookahead.pipeline.stage import LookaheadStage
from torchrec_lookahead.settings import WindowSettings, check_count
from torchrec_lookahead.steps import LookaheadModule, StepContext
from torchrec_lookahead.votes import VoteGroup

__all__ = ["LookaheadTrainPipeline"]

logger = logging.getLogger(__name__)


class LookaheadTrainPipeline(TrainPipeline):
    """Trains a model of ``LookaheadEmbeddingBagCollection`` modules, a batch per ``progress``.

    The :class:`~torchrec_lookahead.pipeline.stage.LookaheadStage` (on a background thread
    of idle priority, or inline; see ``stage_thread`` below) reads
    batches ahead, distributes them (under ``DistributedModelParallel``) and
    plans them with every table's oracle; the trainer keeps a window of the
    next ``lookahead + prefetch_distance`` planned batches. The row moves of
    step ``s`` are handed to a background executor at the start of step
    ``s - prefetch_distance`` and step ``s`` waits only until they have landed.
    The model is called as TorchRec's pipelines call it: ``losses, output =
    model(batch)``, then backward and ``optimizer.step()`` (the embedding update
    is fused into the backward). Batches carry their sparse features as
    ``batch.sparse_features`` (a ``KeyedJaggedTensor``), as
    ``torchrec.datasets.utils.Batch`` does. Under ``DistributedModelParallel`` the
    lookahead-cached collections must take ``batch.sparse_features`` as their input
    (as TorchRec's models do): the stage distributes it when the batch enters the
    window, and the step's forward uses that distributed input.

    ``planning_workers > 1`` plans each slot pool as that many hash partitions on
    as many threads (:class:`~torchrec_lookahead.oracle.partitioned.PartitionedOracle`):
    worth it only with cores to spare; plans stay exact, misses change little.

    ``planner`` says where each step's plan is made: ``"host"`` (the default: the numba
    oracle, a batch's ids copied to the host) or ``"device"`` (the device oracle, on the
    cache's device and the stage's planning stream: no id leaves the device, and the
    host's part of planning is launching kernels and reading each plan back on the
    executor's thread; not for a disk store's tables, nor with ``planning_workers > 1``).
    Plans and training are the same either way
    (:mod:`~torchrec_lookahead.cache.device_plans`).

    ``stage_thread`` runs the stage on its own thread (``True``; the default on the
    CPU), which takes only the cycles the trainer leaves idle (see
    :mod:`~torchrec_lookahead.pipeline.stage`), or inline on the trainer's (``False``;
    the default on CUDA, where NCCL wants each rank's collectives issued by one thread:
    :func:`stage_on_thread`). Inline, the trainer's thread only distributes each batch
    (the stage's collectives), a step before it takes its plan; a thread of the stage's
    reads (the loader, the checks on the host batch, its copy to the device) and
    another plans.

    The first ``progress`` binds the data iterator; the stage reads it until it
    ends. A batch that cannot be planned (malformed, see
    :mod:`~torchrec_lookahead.checks`; an unknown feature, a bad id, a window that
    does not fit a cache) makes ``progress`` raise ``ValueError`` naming the
    step (:class:`~torchrec_lookahead.checks.BatchTypeError`, a ``TypeError`` too,
    for a tensor of the wrong type), before any state changes; the batch is
    dropped (on every rank) and training can go on. A loader with worker processes can
    make those host checks itself (:class:`~torchrec_lookahead.pipeline.batch_check.BatchCheck`:
    ``collate_fn=BatchCheck.of(model).collate()``). Any other exception, Ctrl-C
    included, stops the stage and the executor before it propagates; so does the
    end of the data and :meth:`close`. The pipeline is also a context manager that closes itself.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device | str,
        lookahead: int = 16,
        prefetch_distance: int = 1,
        planning_workers: int = 1,
        stage_thread: bool | None = None,
        planner: str = "host",
    ) -> None:
        super().__init__()
        device = torch.device(device)
        lookahead = check_count("lookahead", lookahead, 1)
        prefetch_distance = check_count("prefetch_distance", prefetch_distance, 0)
        planning_workers = check_count("planning_workers", planning_workers, 1)
        self._model = model
        self._optimizer = optimizer
        self._device = device
        self.lookahead = lookahead
        self.prefetch_distance = prefetch_distance
        self._cached = [m for m in model.modules() if isinstance(m, LookaheadModule)]
        if not self._cached:
            raise ValueError("the model holds no LookaheadEmbeddingBagCollection")
        _check_sharded(model)
        load_kernels()  # not on the first step's critical path
        window = WindowSettings(lookahead, prefetch_distance, planning_workers, planner)
        _close_others(self._cached)  # every check passed: from here on things change
        for module in self._cached:
            module.open_window(window)
        self._window_settings = window
        self._vote = _reading_vote(self._cached, device)
        self._stage = LookaheadStage(
            self._cached,
            BatchCheck.of(model),
            device,
            threaded=stage_on_thread(device, stage_thread),
            vote=self._vote,
        )
        # Batches entered, not yet run, in step order: the first is the step progress() runs
        # next, the last the newest that entered (the stage numbers them).
        self._window: deque[StepContext] = deque()
        self._issued = 0  # steps whose moves went to the executor
        self._data: Iterator[Any] | None = None  # the iterator the stage reads
        self._data_done = False
        self._closed = False
        self._executor = PlanExecutor(device)
        # The step whose forward runs (None between steps): what each lookahead module's
        # forward, stood in for by a StepForward as TorchRec's pipelines do, hands it.
        self._running: StepContext | None = None
        self._forwards = [StepForward.install(m, lambda: self._running) for m in self._cached]
        # Seconds the trainer spent: waiting for the stage's next planned batch (planning
        # on the critical path), waiting for rows to land, and in forward / backward /
        # optimizer. The stage's own busy time is in ``stage_timings``.
        self.timings = {"stage_s": 0.0, "wait_s": 0.0, "compute_s": 0.0}
        _OPEN.add(self)

    @property
    def stage_timings(self) -> dict[str, float]:
        """CPU seconds the stage spent distributing (DMP) and planning batches (inline,
        the distributing on the trainer's thread, within ``timings["stage_s"]``)."""
        return dict(self._stage.timings)

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        try:
            return self._progress(dataloader_iter)
        except (StopIteration, ValueError):
            raise
        except BaseException:
            self.close()
            raise

    def cache_metrics(self) -> dict[str, CacheMetrics]:
        """Counters per table (``module_path.table``; this rank's shards under DMP) and
        their sum under ``"total"``."""
        named = {id(m): name for name, m in self._model.named_modules()}
        per_table = {
            f"{named[id(m)]}.{table}".lstrip("."): metrics
            for m in self._cached
            for table, metrics in m.cache_metrics().items()
        }
        total = sum(per_table.values(), CacheMetrics())
        total.wait_s, total.stage_s = self.timings["wait_s"], self.timings["stage_s"]
        total.plan_s = self._stage.timings["plan_s"]
        return per_table | {"total": total}

    def hit_rates(self) -> list[float]:
        """Per step planned so far, the share of its distinct ids (over every cached table
        of this rank) that were already resident: a hit-rate curve over training."""
        counts: dict[int, list[int]] = {}
        for group in (g for m in self._cached for g in m.cached_groups):
            for step, (unique, misses) in group.step_counts.items():
                total = counts.setdefault(step, [0, 0])
                total[0] += int(unique.sum())
                total[1] += int(misses.sum())
        return [
            1 - misses / unique if unique else 1.0 for _, (unique, misses) in sorted(counts.items())
        ]

    def close(self) -> None:
        """Stop the stage and the executor (after the moves already issued), and destroy
        the process groups made for this pipeline once no thread of its stage can be
        inside one of their collectives; idempotent."""
        _OPEN.discard(self)
        self._closed = True
        self._stage.close()
        self._executor.close()
        for forward in self._forwards:
            forward.restore()
        if self._stage.stopped:  # else a thread blocked in one keeps them (left, not broken)
            for module in self._cached:
                module.close_window(self._window_settings)
            if self._vote is not None:
                self._vote.close()

    def __enter__(self) -> LookaheadTrainPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _progress(self, dataloader_iter: Iterator[Any]) -> Any:
        if self._closed and not self._data_done:
            raise RuntimeError(
                "this LookaheadTrainPipeline is closed (by close(), the end of its with "
                "block, or an error it raised): build a new one to train on"
            )
        if self._data_done and dataloader_iter is not self._data:
            raise RuntimeError(
                "this LookaheadTrainPipeline's data ended, and it closed: build a new one "
                "for each epoch (TorchRec's TrainPipelineSparseDist takes a new iterator; "
                "this one would train nothing on it)"
            )
        if not self._stage.started:
            self._data = dataloader_iter
            self._stage.start(dataloader_iter)
        self._fill()
        if not self._window:
            for module in self._cached:
                module.write_back()
            self.close()
            raise StopIteration
        step = self._window[0].step
        self._issue(through=step + self.prefetch_distance)
        self.timings["wait_s"] += self._executor.wait(step)
        context = self._window.popleft()

        start = time.perf_counter()
        self._stage.hand_over(context)
        if self._model.training:
            self._optimizer.zero_grad()
        self._running = context
        try:
            losses, output = self._model(context.batch)
        finally:
            self._running = None
        if self._model.training:
            torch.sum(losses, dim=0).backward()
            self._optimizer.step()
        self.timings["compute_s"] += time.perf_counter() - start
        return output

    def _fill(self) -> None:
        """Take planned batches until the window holds steps ``next .. next + L + d``."""
        start = time.perf_counter()
        try:
            while (
                not self._data_done and len(self._window) <= self.lookahead + self.prefetch_distance
            ):
                item = self._stage.get()
                if item.error is not None:
                    raise item.error
                if item.context is not None:
                    self._window.append(item.context)
                for plan in item.plans:  # the plans of steps still in the window
                    context = self._window[plan.step - self._window[0].step]
                    if context.plan is None:
                        context.plan = plan
                    else:
                        context.plan.merge(plan)
                    # The step's slots were made on the stage's planning stream with this
                    # item: the step's hand-over waits for it (a later event than its
                    # batch's own).
                    context.ready = item.ready
                if item.end:
                    self._data_done = True
        finally:
            self.timings["stage_s"] += time.perf_counter() - start

    def _issue(self, through: int) -> None:
        """Hand the moves of steps up to ``through`` to the executor (their issue points).

        Step ``s`` is planned once batch ``s + L`` has entered (or the data ended);
        a step may have no moves, e.g. on a rank that owns no cached shard. A plan
        made after a cache grew grows the cache first, here, between steps, once
        the moves issued before have landed (see ``SlotCache.grow``).
        """
        entered = self._window[-1].step + 1
        planned = entered if self._data_done else entered - self.lookahead
        while self._issued <= min(through, planned - 1):
            plan = self._window[self._issued - self._window[0].step].plan
            if plan is not None and plan.growths:
                self._executor.settle()
                for grow in plan.growths:
                    grow()
            self._executor.submit(self._issued, plan.moves if plan else [])
            self._issued += 1


def stage_on_thread(device: torch.device, asked: bool | None = None) -> bool:
    """Whether the stage runs on its own thread: as ``asked``, else on the CPU (gloo) but
    not on CUDA. There the stage's collectives (the vote, the hot rows' union, the input
    all-to-all) would run on one NCCL communicator while the trainer's (the output
    all-to-all, DDP, the hot rows' sums) run on others, issued in another interleaving on
    each rank: NCCL does not promise that such concurrent use progresses, gloo does (a
    process group's ops run on its own connections). Inline, every NCCL collective of a
    rank is issued by one thread, in the same order on every rank (the votes, on gloo
    groups of their own, are each taken by one thread of the stage's)."""
    return asked if asked is not None else device.type == "cpu"


def _reading_vote(modules: Sequence[Any], device: torch.device) -> VoteGroup | None:
    """Under DMP with several ranks, the vote the stage takes on each batch it reads (made
    here, by every rank alike); ``None`` on one rank."""
    envs = [m.env for m in modules if isinstance(m, ShardedModule)]
    if not envs or envs[0].world_size == 1:
        return None
    return VoteGroup(dist.get_process_group_ranks(envs[0].process_group), device)


def _close_others(modules: Sequence[Any]) -> None:
    """Close the pipelines not closed whose windows hold any of ``modules``: opening a
    window empties the caches and restarts the oracles, under such a pipeline's running
    steps. Closed, a pipeline only refuses to go on (its steps not run are dropped, as
    by ``close``); one left open, e.g. at a loop's early end, is often unreachable."""
    mine = {id(module) for module in modules}
    for pipeline in list(_OPEN):
        if any(id(module) in mine for module in pipeline._cached):
            logger.warning(
                "closing a LookaheadTrainPipeline still open on this model's lookahead "
                "modules before building another (close a pipeline when done with it)"
            )
            pipeline.close()


def _check_sharded(model: torch.nn.Module) -> None:
    """Refuse a lookahead collection left unsharded inside ``DistributedModelParallel``
    (its sharder forgotten): DMP wraps it as a dense module, which trains a copy of every
    table on every rank, or fails deep in DDP's backward hooks."""
    for dmp in (m for m in model.modules() if isinstance(m, DistributedModelParallel)):
        for path, module in dmp.module.named_modules():  # the user's paths, not DDP's
            if isinstance(module, LookaheadModule) and not isinstance(module, ShardedModule):
                raise not_sharded(type(module).__name__, f"module {path!r}")


# Pipelines not closed yet: an exception that leaves one open (a refused batch the caller
# does not catch) must not leave its threads running into interpreter shutdown, where a
# thread torn down inside a collective aborts the process (SIGABRT) instead of exit 1.
_OPEN: weakref.WeakSet[LookaheadTrainPipeline] = weakref.WeakSet()


@atexit.register
def _close_open_pipelines() -> None:
    for pipeline in list(_OPEN):
        pipeline.close()
