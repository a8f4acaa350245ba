"""A cache group's plans made on the device: its batches' ids never go to the host.

Where a group plans on the device (``planner="device"``, see
:class:`~torchrec_lookahead.settings.WindowSettings`), each slot pool's planner is a
:class:`~torchrec_lookahead.oracle.device.DeviceOracleCacher` on the cache's
device and the stage's stream. :class:`DevicePlanning` is what the group does
differently then:

* ``prepare``: the batch's ids become pool ids on the device (the features'
  offsets added, each pool's features taken out) and are deduplicated there;
  the host reads back one small tensor per batch, whether any id lies outside
  its table and the slots each pool's window needs (the group grows a pool
  that needs more, or refuses a batch, before it enters, as on the host);
* ``distinct``: each table's distinct ids, counted on the device;
* ``move``: a step's plan, still padded on the device, is trimmed and applied
  by the executor, on the side stream: it reads the plan back (its counts, its
  moves, the step's distinct ids per table) ``L - d`` steps after the stage's
  stream made it, so the read waits for nothing in practice, and on no thread
  of the trainer's. The step's slots never leave the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torchrec_lookahead.streams as streams
from torchrec_lookahead.cache.pools import SlotPool
from torchrec_lookahead.checks import check_feature_ids
from torchrec_lookahead.oracle.contract import CachePlanner
from torchrec_lookahead.oracle.device import DeviceOracleCacher, DevicePlan, trimmed_plan

if TYPE_CHECKING:
    from torchrec_lookahead.cache.counters import TableCounters
    from torchrec_lookahead.cache.slot_cache import SlotCache

__all__ = ["DevicePlanning"]


class DevicePlanning:
    """The device side of a cache group's planning (see the module).

    Args:
        pools: the group's slot pools.
        feature_tables, feature_offset, feature_rows: per feature in lookup order, its
            table, the pool id of its table's row 0, and its table's rows.
        pool_features: each pool's features (indices in lookup order).
        table_order: table ``t``'s place when per-pool counts are concatenated.
        device: the cache's device.
    """

    def __init__(
        self,
        pools: Sequence[SlotPool],
        feature_tables: np.ndarray,
        feature_offset: np.ndarray,
        feature_rows: np.ndarray,
        pool_features: Sequence[np.ndarray],
        table_order: np.ndarray,
        device: torch.device,
    ) -> None:
        self.device = device
        self._pools = list(pools)
        self._pool_features = list(pool_features)
        self._host_order = table_order
        # Per feature: its index, its pool id offset and its rows; per pool, its tables'
        # first pool ids but the first (bucket edges); the table order. Made on the device
        # at the first batch, on the stream that reads them (the stage's).
        self._host_constants = [
            np.arange(len(feature_tables)),
            feature_offset,
            feature_rows,
            table_order,
            *[pool.offsets[1:-1] for pool in self._pools],
        ]
        self._constants: list[torch.Tensor] = []

    @property
    def _device_constants(self) -> list[torch.Tensor]:
        if not self._constants:
            self._constants = [self._on_device(values) for values in self._host_constants]
        return self._constants

    def new_oracle(self, slots: int, lookahead: int, d: int, pool: int) -> DeviceOracleCacher:
        return DeviceOracleCacher(
            slots, lookahead, d, num_rows=self._pools[pool].num_rows, device=self.device
        )

    def prepare(
        self,
        features: KeyedJaggedTensor,
        oracles: Sequence[CachePlanner[Any]],
        step: int,
        feature_rows: np.ndarray,
    ) -> list[tuple[Any, int]]:
        """Each pool's batch, deduplicated on the device, and the slots its window needs.
        One read back: those counts, and whether an id lies outside its table (then
        ``ValueError`` naming it, as the host check does)."""
        features_index, offset, rows = self._device_constants[:3]
        lengths = features.length_per_key()
        values = features.values()
        feature = torch.repeat_interleave(
            features_index,
            self._on_device(np.asarray(lengths, dtype=np.int64)),
            output_size=int(sum(lengths)),
        )
        ids = values.to(torch.int64)
        bad = ((ids < 0) | (ids >= rows.gather(0, feature))).any()
        ids = ids + offset.gather(0, feature)
        edges = np.concatenate([[0], np.cumsum(lengths)])
        prepared = [
            _device(oracle).prepare_device(self._take(ids, edges, wanted))
            for oracle, wanted in zip(oracles, self._pool_features)
        ]
        flags = torch.stack([bad, *[batch.pinned_rows for batch in prepared]]).tolist()
        if flags[0]:
            check_feature_ids(
                values.cpu().numpy(), lengths, features.keys(), feature_rows, f"step {step}"
            )
        return list(zip(prepared, flags[1:]))

    def push(
        self, oracles: Sequence[CachePlanner[Any]], batches: Sequence[Any]
    ) -> list[DevicePlan | None]:
        """Each pool's prepared batch into its planner's window: the plans now due."""
        return [_device(oracle).push_device(batch) for oracle, batch in zip(oracles, batches)]

    def finish(self, oracles: Sequence[CachePlanner[Any]]) -> list[list[DevicePlan]]:
        """End of the data: each pool's plans still due."""
        return [_device(oracle).finish_device() for oracle in oracles]

    def distinct(self, batches: Sequence[Any]) -> torch.Tensor:
        """Each table's distinct ids in ``batches`` (one per pool), in table order."""
        table_order, *edges = self._device_constants[3:]
        counts = [_bucket_counts(batch.distinct, e) for batch, e in zip(batches, edges)]
        return torch.cat(counts).index_select(0, table_order)

    def move(
        self,
        cache: SlotCache,
        counters: TableCounters,
        plans: Sequence[DevicePlan],
        distinct: torch.Tensor,
        made: object,
        row_bytes: np.ndarray,
    ) -> None:
        """Apply one step's ``plans`` (one per pool, made before the stage's event ``made``)
        and count them with the step's ``distinct`` ids per table. Run by the executor."""
        side = streams.side_stream(self.device)
        side.wait_for(made)
        with side.context():  # the reads wait for the stage's plan, not the trainer's step
            streams.record_use([plans, distinct], self.device)  # read here, freed elsewhere
            flags = [torch.stack([p.bad_ids, p.overflow]).to(torch.int64) for p in plans]
            head = self._to_host(torch.cat([distinct, *flags, *[p.counts for p in plans]]))
            if head[len(distinct) : len(distinct) + len(flags) * 2].any():
                raise RuntimeError(
                    f"the device's plan of step {plans[0].step} is void (an id outside its "
                    "table, or a window larger than the cache, reached the device planner)"
                )
            counts = head[len(distinct) + len(flags) * 2 :].reshape(len(plans), 2).tolist()
            moves = torch.cat([p.moves(*n) for p, n in zip(plans, counts)])
            parts = np.split(self._to_host(moves), np.cumsum([2 * sum(n) for n in counts])[:-1])
        trimmed = [
            trimmed_plan(plan.step, n[0], n[1], part) for plan, n, part in zip(plans, counts, parts)
        ]
        fetched = np.concatenate(
            [pool.table_counts(plan.fetch_ids) for pool, plan in zip(self._pools, trimmed)]
        )[self._host_order]
        evicted = np.concatenate(
            [pool.table_counts(plan.evict_ids) for pool, plan in zip(self._pools, trimmed)]
        )[self._host_order]
        counters.planned(plans[0].step, fetched, evicted, row_bytes, head[: len(distinct)])
        for p, plan in enumerate(trimmed):
            if len(plan.fetch_ids) or len(plan.evict_ids):
                cache.apply(p, plan)

    def _to_host(self, tensor: torch.Tensor) -> np.ndarray:
        """``tensor`` (on the side stream) in host memory: copied into page-locked memory
        without blocking the stream; the host then waits for the side stream."""
        if tensor.device.type == "cpu":
            return tensor.numpy()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        streams.host_side(host).copy_(tensor, non_blocking=True)
        streams.side_stream(self.device).drain()
        return host.numpy()

    def _take(self, ids: torch.Tensor, edges: np.ndarray, features: np.ndarray) -> torch.Tensor:
        """The ids of ``features`` (``edges``: where each feature's ids start): a view
        where they are consecutive, as for a pool of one table or of every table."""
        if features[-1] - features[0] + 1 == len(features):
            return ids[int(edges[features[0]]) : int(edges[features[-1] + 1])]
        where = np.concatenate([np.arange(edges[f], edges[f + 1]) for f in features])
        return ids.index_select(0, self._on_device(where))

    def _on_device(self, values: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        return streams.to_device(streams.host_side(tensor), self.device)


def _device(oracle: CachePlanner[Any]) -> DeviceOracleCacher:
    assert isinstance(oracle, DeviceOracleCacher), "a pool planned on the device"
    return oracle


def _bucket_counts(distinct: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """How many of ``distinct`` (padded with -1) fall in each table of a pool whose tables
    start at ``edges`` (all but the first): a static shape, no sync."""
    table = torch.bucketize(distinct, edges, right=True) + 1  # 1 + the table's place
    table = torch.where(distinct >= 0, table, 0)  # padding to the dump entry
    counts = torch.zeros(len(edges) + 2, dtype=torch.int64, device=distinct.device)
    return counts.index_add_(0, table, torch.ones_like(table))[1:]
