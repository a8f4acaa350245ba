"""A group of tables cached behind one TBE: slot pools, their oracles, and each step's slots.

The unsharded ``LookaheadEmbeddingBagCollection`` owns one group; under
``DistributedModelParallel`` each lookahead kernel (one per grouped shard
config on a rank) owns one. The lookahead stage drives every group the same
way: ``prepare`` a batch's features (for the step the stage numbered it),
``enter`` them (a step's plan comes back as a
:class:`~torchrec_lookahead.steps.StepPlan`: its moves for the executor, its
slots for the lookups), ``begin_step`` with the step's
:class:`~torchrec_lookahead.steps.StepContext` (the module's ``step_forward`` does),
whose ``lookup`` then takes the step's slots from that context. Tables of equal row width
share a slot pool and one oracle (:mod:`~torchrec_lookahead.cache.pools`), so
planning costs one oracle call per pool and step whatever the number of tables.
How many slots each table brings, and how a pool grows, is
:mod:`~torchrec_lookahead.cache.sizing`'s; what the cache did per table is
counted by :mod:`~torchrec_lookahead.cache.counters`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from torchrec.modules.embedding_configs import DataType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torchrec_lookahead.streams as streams
from torchrec_lookahead.cache.counters import TableCounters
from torchrec_lookahead.cache.device_plans import DevicePlanning
from torchrec_lookahead.cache.host_plans import HostPlanning
from torchrec_lookahead.cache.planning import GroupLayout, Planning
from torchrec_lookahead.cache.pools import slot_pools
from torchrec_lookahead.cache.sizing import TableSlots
from torchrec_lookahead.cache.slot_cache import SlotCache
from torchrec_lookahead.metrics import CacheMetrics
from torchrec_lookahead.oracle.contract import CachePlanner
from torchrec_lookahead.settings import WindowSettings
from torchrec_lookahead.steps import PreparedGroup, StepContext, StepMoves, StepPlan
from torchrec_lookahead.store.stores import HostStore
from torchrec_lookahead.variable_batch import check_variable_batch_optimizer

__all__ = ["CacheGroup", "enter_groups", "finish_groups"]

logger = logging.getLogger(__name__)


class CacheGroup:
    """Tables whose rows are cached together in one :class:`SlotCache`.

    Args:
        names: table names (for metrics), in the group's table order.
        num_rows: rows of each table (of the shard, under sharding).
        dims: row width of each table; tables of equal width share a pool
            (where the optimizer allows, see :mod:`~torchrec_lookahead.cache.pools`).
        feature_tables: the table of each feature, in lookup order; a table's
            features are consecutive.
        table_slots: the slots each table brings to its pool.
        table_caps: the most slots each table may bring (``max_cache_rows``; ``None``,
            the default: its rows): a pool grows up to the sum of its tables' caps (see
            :mod:`~torchrec_lookahead.cache.sizing`).
        store: the full tables (and optimizer state) behind the cache.
        optimizer, device, pooling, fbgemm_params: the cache TBE's settings.
        data_type: the tables' data type (one per group, as TorchRec groups a TBE's
            tables): the cache holds rows in it.
    """

    def __init__(
        self,
        names: Sequence[str],
        num_rows: Sequence[int],
        dims: Sequence[int],
        feature_tables: Sequence[int],
        table_slots: Sequence[int],
        store: HostStore,
        optimizer: EmbOptimType,
        device: torch.device,
        pooling: PoolingMode = PoolingMode.SUM,
        fbgemm_params: dict[str, Any] | None = None,
        data_type: DataType = DataType.FP32,
        table_caps: Sequence[int | None] | None = None,
    ) -> None:
        self.names = list(names)
        self.num_rows = list(num_rows)
        self.pools = slot_pools(self.num_rows, dims, optimizer)
        self._sizes = TableSlots(self.names, self.num_rows, self.pools, table_slots, table_caps)
        self._optimizer = optimizer
        self.cache = SlotCache(
            self.pools,
            self._sizes.per_pool(table_slots),
            feature_tables,
            optimizer,
            store,
            device,
            pooling,
            fbgemm_params,
            data_type,
        )
        tables = np.asarray(feature_tables, dtype=np.int64)
        pool_of_table = np.empty(len(names), dtype=np.int64)
        offset_of_table = np.empty(len(names), dtype=np.int64)
        for p, pool in enumerate(self.pools):
            pool_of_table[list(pool.tables)] = p
            offset_of_table[list(pool.tables)] = pool.offsets[:-1]
        self._layout = GroupLayout(
            self.names,
            self.pools,
            feature_table=tables,
            feature_offset=offset_of_table[tables],
            feature_rows=np.asarray(self.num_rows, dtype=np.int64)[tables],
            # A table's features are consecutive, so a pool of one table (or of every
            # table) reads one slice of the batch.
            pool_features=[
                np.flatnonzero(pool_of_table[tables] == p) for p in range(len(self.pools))
            ],
            table_order=np.argsort(np.concatenate([p.tables for p in self.pools])),
        )
        self._window = WindowSettings(1, 1)  # set by open_window
        self._planning: Planning | None = None  # set by open_window
        self._oracles: list[CachePlanner[Any]] | None = None  # built at the window's first batch
        self._context: StepContext | None = None  # the step being run, until its lookup
        self._dirty = False  # cache rows updated since the last write-back
        self._logged: set[str] = set()
        self._pending_growth: list[int] | None = None  # pools' slots for the cache to grow to
        self._counters = TableCounters(len(names))
        # step -> (distinct ids, misses) per table: one small entry per step trained
        self.step_counts = self._counters.step_counts

    @property
    def optimizer(self) -> EmbOptimType:
        """The fused optimizer the cache trains its rows with."""
        return self._optimizer

    @property
    def table_slots(self) -> list[int]:
        """Slots each table brings to its pool."""
        return self._sizes.slots

    @property
    def pool_slots(self) -> list[int]:
        """Slots of each pool."""
        return self.cache.slots

    @property
    def metrics(self) -> list[CacheMetrics]:
        """Counters per table (a table's misses are its rows fetched into its pool)."""
        return self._counters.metrics(self.table_slots)

    @property
    def sized(self) -> bool:
        """Whether the pools have their sizes: a batch entered the window since ``open_window``."""
        return self._oracles is not None

    @property
    def context(self) -> StepContext | None:
        """The context of the step being run, from ``begin_step`` until its lookup."""
        return self._context

    def open_window(self, window: WindowSettings) -> None:
        """Start a new window: the cache written back and emptied; oracles at the first batch."""
        self.write_back()
        self.cache.clear()
        self._window = window
        self._planning = self._planning_for(window)
        self._oracles = None
        self._pending_growth = None  # the next window's first batch sizes the cache
        self._context = None
        self._counters.new_window()

    def prepare(
        self, features: KeyedJaggedTensor, step: int, bound: Mapping[str, int] | None = None
    ) -> PreparedGroup:
        """Check the batch of ``step`` for every table (ids, capacity) without changing anything.

        At a window's first batch the pools are sized for it: a table whose
        share is smaller than the rows ``d + 1`` such batches can touch brings
        that many instead (at most all its rows). ``bound`` (per table name)
        says how many ids a batch like this one can bring a table where that
        is more than this one has: a shard's share of a batch varies (row-wise
        shards, hot ids split off), its whole batch does not. The sizing and
        the pools' planners travel with the prepared group and take effect at
        ``enter``. So does a growth: a pool whose window needs more slots than it
        has grows (see :meth:`~torchrec_lookahead.cache.sizing.TableSlots.growth`),
        and only a pool over its cap refuses.
        """
        if self.cache.device.type != "cpu":  # the CPU pools variable batches padded, any optimizer
            check_variable_batch_optimizer(features, self._optimizer, f"step {step}")
        lengths = features.length_per_key()
        edges = np.concatenate([[0], np.cumsum(lengths)])
        positions = [_positions(edges, features) for features in self._layout.pool_features]
        order = None
        if len(self.pools) > 1:
            places = np.concatenate([np.arange(edges[-1])[where] for where in positions])
            order = streams.to_device(torch.from_numpy(places), self.cache.device)
        lookups = np.bincount(
            self._layout.feature_table, weights=lengths, minlength=len(self.names)
        )
        lookups = lookups.astype(np.int64)
        oracles, sizing, table_slots = self._oracles, None, self.table_slots
        if oracles is None:
            most = lookups
            if bound:
                extra = np.asarray([bound.get(name, 0) for name in self.names], dtype=np.int64)
                most = np.maximum(lookups, extra)
            table_slots = self._sizes.sized_for(most, self._window.prefetch_distance)
            oracles = [
                self._built_planning.new_oracle(slots, p)
                for p, slots in enumerate(self._sizes.per_pool(table_slots))
            ]
            sizing = (table_slots, oracles)
        sized = self._built_planning.prepare(features, oracles, positions, step)
        batches = [batch for batch, _ in sized]
        growth = self._sizes.growth(
            self._sizes.per_pool(table_slots),
            [n for _, n in sized],
            step,
            self._window.prefetch_distance,
            [oracle.partitions for oracle in oracles],
        )
        return PreparedGroup(self, step, lookups, batches, order, sizing, growth)

    def enter(self, prepared: PreparedGroup) -> StepPlan | None:
        """A prepared batch enters the window (its planners check that it is their next
        step); returns the plan of a step now complete."""
        if prepared.sizing is not None:
            self._install(*prepared.sizing)
        if prepared.growth is not None:
            self._grow(prepared.growth, prepared.step)
        step, oracles = prepared.step, self._built_oracles
        plans = self._built_planning.enter(step, prepared.lookups, oracles, prepared.batches)
        return self._planned(plans)

    def finish(self) -> list[StepPlan]:
        """End of the data: the steps still to plan, with shorter windows."""
        remaining = self._built_planning.finish(self._oracles or [])
        return [planned for step in zip(*remaining) if (planned := self._planned(list(step)))]

    def begin_step(self, context: StepContext) -> None:
        """The next ``lookup`` runs ``context``'s step: it takes this group's slots from there."""
        if context.plan is None or self not in context.plan.slots:
            raise RuntimeError("a step runs before its plan was made: the window is broken")
        self._context = context

    def lookup(
        self,
        offsets: torch.Tensor,
        num_ids: int,
        per_sample_weights: torch.Tensor | None,
        **variable_batch: Any,
    ) -> torch.Tensor:
        """The running step's embeddings through the cache: pooled per bag, or a row per id
        under pooling ``NONE`` (``variable_batch``: FBGEMM's arguments for a deduplicated
        batch)."""
        context, self._context = self._context, None
        slots = None if context is None else self._step_slots(context)
        if slots is None or slots.numel() != num_ids:
            raise RuntimeError(
                f"the batch has {num_ids} ids but its plan has "
                f"{None if slots is None else slots.numel()}: forward must run the batches "
                "in the order they were planned, one forward per step"
            )
        self._dirty = True
        return self.cache.forward(slots, offsets, per_sample_weights, **variable_batch)

    def write_back(self) -> None:
        """Write updated cache rows back to the store (the rows stay cached)."""
        if self._dirty:
            self.cache.write_back_all()
            self._dirty = False

    # ------------------------------------------------------------ internals

    @property
    def _built_planning(self) -> Planning:
        """How the pools are planned in this window (set by ``open_window``)."""
        assert self._planning is not None, "open_window first"
        return self._planning

    @property
    def _built_oracles(self) -> list[CachePlanner[Any]]:
        """The pools' planners (made at a window's first batch, so only then)."""
        assert self._oracles is not None, "no batch has entered the window"
        return self._oracles

    def _grow(self, growth: list[tuple[int, int]], step: int) -> None:
        """A batch whose window needs more slots enters: the pools' planners grow now,
        the cache before the first plan that may use the new slots (``_planned``)."""
        before = self._sizes.per_pool(self.table_slots)
        for p, ((slots, needed), have) in enumerate(zip(growth, before)):
            if slots == have:
                continue
            self._built_oracles[p].grow(slots)
            tables = list(self.pools[p].tables)
            extra = self._sizes.add(p, slots - have)
            self._counters.grown(tables[int(np.argmax(extra))])
            d = self._window.prefetch_distance
            logger.info(
                "tables %s: cache grown from %d to %d rows at step %d (steps %d..%d use "
                "%d distinct rows)",
                [self.names[t] for t in tables],
                have,
                slots,
                step,
                max(step - d, 0),
                step,
                needed,
            )
        self._pending_growth = self._sizes.per_pool(self.table_slots)

    def _install(self, table_slots: list[int], oracles: list[CachePlanner[Any]]) -> None:
        """A window's first batch enters: the pools take their sizes, the planners their place."""
        for t, (share, slots) in enumerate(zip(self._sizes.shares, table_slots)):
            if slots > share and self.names[t] not in self._logged:
                self._logged.add(self.names[t])
                logger.info(
                    "table %s: cache raised from %d to %d rows, what %d batches like "
                    "the first can touch",
                    self.names[t],
                    share,
                    slots,
                    self._window.prefetch_distance + 1,
                )
        self._sizes.slots = table_slots
        store = self.cache.store
        row_bytes = [store.bytes_per_row(t) for t in range(len(self.names))]
        self._built_planning.row_bytes = np.array(row_bytes, dtype=np.int64)
        if self._sizes.per_pool(table_slots) != self.cache.slots:
            self.cache.resize(self._sizes.per_pool(table_slots))
        self._oracles = oracles

    def _step_slots(self, context: StepContext) -> torch.Tensor:
        """The cache slot of each id of ``context``'s batch, in the batch's order: this
        group's entry of the step's plan, taken out, its pools' slots put where their ids
        sit in the batch."""
        assert context.plan is not None  # checked by begin_step
        slots = context.plan.slots.pop(self)
        order = context.prepared(self).order
        if order is None:
            return slots
        in_batch = torch.empty_like(slots)
        in_batch[order] = slots
        return in_batch

    def _planning_for(self, window: WindowSettings) -> Planning:
        """Where this group's plans are made in ``window`` (``WindowSettings.planner``)."""
        if window.planner == "host":
            return HostPlanning(self._layout, self.cache, self._counters, window)
        if self.cache.store.reads_ahead:
            raise ValueError(
                "planner='device' cannot plan tables in a disk store (store_dir): it reads "
                "rows ahead from the host's plans; use planner='host'"
            )
        return DevicePlanning(self._layout, self.cache, self._counters, window)

    def _planned(self, plans: list[Any]) -> StepPlan | None:
        ready = [plan for plan in plans if plan is not None]  # the pools plan in lockstep
        if not ready:
            return None
        slots, moves = self._built_planning.plan(ready)
        return StepPlan(ready[0].step, moves, {self: slots}, self._take_growths())

    def _take_growths(self) -> StepMoves:
        """The cache's growth, for the first plan made since a pool's planner grew (it may
        use the new slots)."""
        if self._pending_growth is None:
            return []
        growth, self._pending_growth = self._pending_growth, None
        return [partial(self.cache.grow, growth)]


def enter_groups(
    groups: Sequence[CacheGroup], prepared: Sequence[PreparedGroup]
) -> StepPlan | None:
    """A batch prepared by each of a module's ``groups`` enters their windows; returns the
    step now complete, its plans of every group merged (the groups plan in lockstep)."""
    return _merged([group.enter(p) for group, p in zip(groups, prepared)])


def finish_groups(groups: Sequence[CacheGroup]) -> list[StepPlan]:
    """End of the data for a module's ``groups``: the steps still to plan, merged."""
    per_group = [group.finish() for group in groups]
    return [merged for step in zip(*per_group) if (merged := _merged(list(step)))]


def _merged(planned: list[StepPlan | None]) -> StepPlan | None:
    """One step's plans from several groups."""
    steps = [p for p in planned if p is not None]
    if not steps:
        return None
    merged = StepPlan(steps[0].step)
    for step in steps:
        merged.merge(step)
    return merged


def _positions(edges: np.ndarray, features: np.ndarray) -> slice | np.ndarray:
    """Where ``features`` (consecutive or not) sit among a batch's ids."""
    if features[-1] - features[0] + 1 == len(features):
        return slice(int(edges[features[0]]), int(edges[features[-1] + 1]))
    return np.concatenate([np.arange(edges[f], edges[f + 1]) for f in features])
