"""A cache group's plans made on the device: its batches' ids never go to the host.

Where a group plans on the device (``planner="device"``, see
:class:`~torchrec_lookahead.settings.WindowSettings`), each slot pool's planner is a
:class:`~torchrec_lookahead.oracle.device.DeviceOracleCacher` on the cache's
device and the stage's planning stream. :class:`DevicePlanning` is that
:class:`~torchrec_lookahead.cache.planning.Planning`:

* ``prepare``: the batch's ids become pool ids on the device (the features'
  offsets added, each pool's features taken out) and are deduplicated there;
  the host reads back one small tensor per batch, whether any id lies outside
  its table and the slots each pool's window needs (the group grows a pool
  that needs more, or refuses a batch, before it enters, as on the host);
* ``enter``: each table's distinct ids, counted on the device;
* ``plan``: the step's slots stay on the device; its one move, run by the
  executor, reads the plan back (its counts, its moves, the step's distinct
  ids per table) ``L - d`` steps after the stage's planning stream made it,
  on a stream of its own that waits for that plan alone, so the read waits
  for nothing in practice, and on no thread of the trainer's; then it applies
  the plan on the side stream and counts it. (Read on the side stream, which
  first waits for the trainer to reach the step's issue point, the executor's
  host would wait for the device to finish the step before that one.)
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torchrec_lookahead.streams as streams
from torchrec_lookahead.cache.planning import GroupLayout, Planning, check_lengths
from torchrec_lookahead.checks import check_feature_ids
from torchrec_lookahead.oracle.contract import CachePlanner
from torchrec_lookahead.oracle.device import DeviceOracleCacher, DevicePlan, trimmed_plan
from torchrec_lookahead.settings import WindowSettings
from torchrec_lookahead.steps import StepMoves

if TYPE_CHECKING:
    from torchrec_lookahead.cache.counters import TableCounters
    from torchrec_lookahead.cache.slot_cache import SlotCache

__all__ = ["DevicePlanning"]


class DevicePlanning(Planning):
    """Plans a group's pools with the device oracle, on the cache's device (see the module)."""

    def __init__(
        self, layout: GroupLayout, cache: SlotCache, counters: TableCounters, window: WindowSettings
    ) -> None:
        super().__init__(layout, cache, counters, window)
        self.device = cache.device
        self._distinct: dict[int, torch.Tensor] = {}  # step -> distinct ids per table
        # Per feature: its index, its pool id offset and its rows; the table order; per
        # pool, its tables' first pool ids but the first (bucket edges). Made on the device
        # at the first batch, on the stream that reads them (the stage's).
        self._host_constants = [
            np.arange(len(layout.feature_table)),
            layout.feature_offset,
            layout.feature_rows,
            layout.table_order,
            *[pool.offsets[1:-1] for pool in layout.pools],
        ]
        self._constants: list[torch.Tensor] = []

    def new_oracle(self, slots: int, pool: int) -> CachePlanner[Any]:
        w = self.window
        return DeviceOracleCacher(
            slots,
            w.lookahead,
            w.prefetch_distance,
            num_rows=self.layout.pools[pool].num_rows,
            device=self.device,
        )

    def prepare(
        self,
        features: KeyedJaggedTensor,
        oracles: Sequence[CachePlanner[Any]],
        positions: Sequence[slice | np.ndarray],
        step: int,
    ) -> list[tuple[Any, int]]:
        """Each pool's batch, deduplicated on the device, and the slots its window needs.
        One read back: those counts, and whether an id lies outside its table (then
        ``ValueError`` naming it, as the host check does)."""
        features_index, offset, rows = self._device_constants[:3]
        lengths = features.length_per_key()
        values = features.values()
        check_lengths(lengths, values.numel(), step)
        feature = torch.repeat_interleave(
            features_index,
            self._on_device(np.asarray(lengths, dtype=np.int64)),
            output_size=int(sum(lengths)),
        )
        ids = values.to(torch.int64)
        bad = ((ids < 0) | (ids >= rows.gather(0, feature))).any()
        ids = ids + offset.gather(0, feature)
        prepared = [
            _device(oracle).prepare_device(
                ids[where] if isinstance(where, slice) else ids[self._on_device(where)]
            )
            for oracle, where in zip(oracles, positions)
        ]
        flags = torch.stack([bad, *[batch.pinned_rows for batch in prepared]]).tolist()
        if flags[0]:
            check_feature_ids(
                values.cpu().numpy(),
                lengths,
                features.keys(),
                self.layout.feature_rows,
                f"step {step}",
            )
        return list(zip(prepared, flags[1:]))

    def enter(
        self,
        step: int,
        lookups: np.ndarray,
        oracles: Sequence[CachePlanner[Any]],
        batches: Sequence[Any],
    ) -> list[Any]:
        """The batch's distinct ids are counted on the device (with its plan, on the host)."""
        self.counters.entered(step, lookups, None)
        table_order, *edges = self._device_constants[3:]
        counts = [_bucket_counts(batch.distinct, e) for batch, e in zip(batches, edges)]
        self._distinct[step] = torch.cat(counts).index_select(0, table_order)
        return [_device(oracle).push_device(batch) for oracle, batch in zip(oracles, batches)]

    def finish(self, oracles: Sequence[CachePlanner[Any]]) -> list[list[Any]]:
        return [_device(oracle).finish_device() for oracle in oracles]

    def plan(self, ready: list[DevicePlan]) -> tuple[torch.Tensor, StepMoves]:
        """The step's slots stay on the device; its one move, for the executor, reads the
        plans back once the stage's planning stream has made them (the event marked
        here), and only then: not after the trainer's step, as the side stream's work is."""
        step = ready[0].step
        slots = torch.cat([plan.slots for plan in ready]) if len(ready) > 1 else ready[0].slots
        made = streams.mark(self.device)  # after the plans, on the stage's planning stream
        return slots, [partial(self._move, ready, self._distinct.pop(step), made)]

    def _move(self, plans: Sequence[DevicePlan], distinct: torch.Tensor, made: object) -> None:
        """Apply one step's ``plans`` (one per pool, made before the stage's event ``made``)
        and count them with the step's ``distinct`` ids per table. Run by the executor."""
        readback = streams.readback_stream(self.device)
        readback.wait_for(made)
        with readback.context():  # the reads wait for the stage's plan, not the trainer's step
            streams.record_use([plans, distinct], self.device)  # read here, freed elsewhere
            flags = [torch.stack([p.bad_ids, p.overflow]).to(torch.int64) for p in plans]
            packed = torch.cat([distinct, *flags, *[p.counts for p in plans]])
            head = streams.to_host(packed).numpy()
            if head[len(distinct) : len(distinct) + len(flags) * 2].any():
                raise RuntimeError(
                    f"the device's plan of step {plans[0].step} is void (an id outside its "
                    "table, or a window larger than the cache, reached the device planner)"
                )
            counts = head[len(distinct) + len(flags) * 2 :].reshape(len(plans), 2).tolist()
            moves = torch.cat([p.moves(*n) for p, n in zip(plans, counts)])
            # Copied out of the page-locked buffer: the moves' copies of these arrays to the
            # device, on the side stream, would read it after it went back to the allocator.
            moved = streams.to_host(moves).numpy().copy()
            parts = np.split(moved, np.cumsum([2 * sum(n) for n in counts])[:-1])
        trimmed = [
            trimmed_plan(plan.step, n[0], n[1], part) for plan, n, part in zip(plans, counts, parts)
        ]
        pools, per_table = self.layout.pools, self.layout.per_table
        fetched = per_table(
            [pool.table_counts(plan.fetch_ids) for pool, plan in zip(pools, trimmed)]
        )
        evicted = per_table(
            [pool.table_counts(plan.evict_ids) for pool, plan in zip(pools, trimmed)]
        )
        self.counters.planned(
            plans[0].step, fetched, evicted, self.row_bytes, head[: len(distinct)]
        )
        for p, plan in enumerate(trimmed):
            if len(plan.fetch_ids) or len(plan.evict_ids):
                self.cache.apply(p, plan)

    @property
    def _device_constants(self) -> list[torch.Tensor]:
        if not self._constants:
            self._constants = [self._on_device(values) for values in self._host_constants]
        return self._constants

    def _on_device(self, values: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        return streams.to_device(streams.host_side(tensor), self.device)


def _device(oracle: CachePlanner[Any]) -> DeviceOracleCacher:
    assert isinstance(oracle, DeviceOracleCacher), "a pool planned on the device"
    return oracle


def _bucket_counts(distinct: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """How many of ``distinct`` (ascending, padded with -1 at the end) fall in each table of
    a pool whose tables start at ``edges`` (all but the first): a static shape, no sync,
    and no atomic adds (which would pile onto one dump entry for the padding)."""
    ids = torch.where(distinct >= 0, distinct, torch.iinfo(torch.int64).max)  # ascending
    ends = torch.cat([torch.searchsorted(ids, edges), (distinct >= 0).sum().view(1)])
    return ends.diff(prepend=ends.new_zeros(1))
