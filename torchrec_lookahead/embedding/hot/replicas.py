"""The replicas of the hot rows on one rank: a FBGEMM TBE per replica group.

Each :class:`~torchrec_lookahead.embedding.hot.layout.ReplicaGroup` is one
TBE table of its replica rows, with its owners' optimizer settings, so the
replicas are updated by the kernel that updates the owners' rows. The lookup
pools with ``embedding_bag`` over the TBE's weights (bitwise FBGEMM's CPU
forward); the update feeds the TBE's fused backward one bag per row with the
row's summed gradient (see :mod:`~torchrec_lookahead.embedding.hot.sync`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
import torch.distributed as dist

from torchrec_lookahead.embedding.hot.layout import HotLayout, ReplicaGroup
from torchrec_lookahead.embedding.hot.split import HotSplit
from torchrec_lookahead.embedding.hot.sync import TouchedReplicas
from torchrec_lookahead.tbe import set_learning_rate, training_tbe

__all__ = ["ReplicaTables", "ShardReader"]

# Reads local rows of one shard: weights, then optimizer state (the owner's store).
ShardReader = Callable[[np.ndarray], list[torch.Tensor]]


class ReplicaTables:
    """The replica rows of a :class:`HotLayout`, with their optimizer state, on ``device``."""

    def __init__(self, layout: HotLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.tbes = [
            training_tbe(
                [group.rows],
                layout.dim,
                group.optimizer,
                dict(group.params),
                device,
                features_per_table=2 if group.shared else 1,
            )
            for group in layout.groups
        ]

    def tensors(self, group: int) -> list[torch.Tensor]:
        """Group ``group``'s replicas: weights, then optimizer state (views, rows first)."""
        tbe = self.tbes[group]
        states = tbe.split_optimizer_states() or [[]]
        return [tbe.split_embedding_weights()[0].data, *(s.data for s in states[0])]

    # ---------------------------------------------------------------- lookup

    def pooled(self, split: HotSplit) -> torch.Tensor:
        """The hot part of each sample's pooled features, ``[batch, keys * dim]`` in the
        collection's key order (zero where a bag has no hot id)."""
        keys, dim = len(self.layout.keys), self.layout.dim
        out: torch.Tensor | None = None
        for group, (rows, offsets) in enumerate(split.lookups):
            weights = self.tbes[group].split_embedding_weights()[0].detach()
            bags = torch.nn.functional.embedding_bag(
                rows, weights, offsets, mode="sum", include_last_offset=True
            )
            out = bags if out is None else out + bags
        assert out is not None
        return out.view(keys, split.batch, dim).transpose(0, 1).reshape(split.batch, keys * dim)

    # ---------------------------------------------------------------- update

    def apply(self, union: TouchedReplicas, sums: torch.Tensor, rates: np.ndarray) -> None:
        """Update the union's replica rows with their summed gradients ``sums``, each table
        at its owner's learning rate ``rates[table]``."""
        bounds = [g.start for g in self.layout.groups] + [self.layout.num_rows]
        cut = np.searchsorted(union.host, bounds).tolist()
        table_rates = rates[self.layout.table_of_row[union.host]]
        for g, group in enumerate(self.layout.groups):
            part = slice(cut[g], cut[g + 1])
            if part.start == part.stop:
                continue
            rows, grads = union.rows[part] - group.start, sums[part]
            rows_rates = table_rates[part]
            if (rows_rates == rows_rates[0]).all():  # one rate, unless the owners' differ
                self._update(g, group, rows, grads, float(rows_rates[0]))
                continue
            for rate in np.unique(rows_rates):
                chosen = torch.from_numpy(np.flatnonzero(rows_rates == rate)).to(self.device)
                self._update(g, group, rows[chosen], grads[chosen], float(rate))

    def _update(
        self, g: int, group: ReplicaGroup, rows: torch.Tensor, grads: torch.Tensor, rate: float
    ) -> None:
        tbe = self.tbes[g]
        set_learning_rate(tbe, rate)
        count = len(rows)
        offsets = torch.arange(count + 1, device=self.device)
        if group.shared:  # every bag under the first of two features, none under the other
            offsets = torch.cat([offsets, offsets.new_full((count,), count)])
            grads = torch.cat([grads, torch.zeros_like(grads)], dim=1)
        with torch.enable_grad():  # FBGEMM's fused backward applies the update
            tbe(rows, offsets).backward(grads)

    # ------------------------------------------------------------ the owners

    def load(
        self, readers: Mapping[tuple[str, int], ShardReader], group: dist.ProcessGroup | None
    ) -> None:
        """Fill the replicas from the owners' shards: each shard's hot rows broadcast by
        its rank. ``readers[(table, start)]`` reads this rank's shard starting at row
        ``start``. A collective: every rank calls it alike."""
        rank = dist.get_rank(group) if group is not None else 0
        several = group is not None and dist.get_world_size(group) > 1
        for g, replica_group in enumerate(self.layout.groups):
            targets = self.tensors(g)
            for name in replica_group.tables:
                ids = self.layout.hot[name]
                for shard in self.layout.shards[name]:
                    inside = np.flatnonzero((ids >= shard.start) & (ids < shard.stop))
                    if not len(inside):
                        continue
                    at = inside + self.layout.first[name] - replica_group.start
                    replica = torch.from_numpy(at).to(self.device)
                    if shard.rank == rank:
                        parts = readers[(name, shard.start)](ids[inside] - shard.start)
                    else:
                        parts = [
                            torch.empty((len(inside), *t.shape[1:]), dtype=t.dtype) for t in targets
                        ]
                    for target, part in zip(targets, parts, strict=True):
                        part = part.to(target.device)
                        if group is not None and several:
                            dist.broadcast(part, dist.get_global_rank(group, shard.rank), group)
                        target.index_copy_(0, replica, part)

    def fold(
        self, name: str, start: int, stop: int
    ) -> tuple[np.ndarray, torch.Tensor, list[torch.Tensor]] | None:
        """The replicas of table ``name``'s rows ``[start, stop)``: their local rows in
        that shard, weights and optimizer state (what the owner writes into its shard)."""
        ids = self.layout.hot.get(name)
        if ids is None:
            return None
        inside = np.flatnonzero((ids >= start) & (ids < stop))
        if not len(inside):
            return None
        g = self.layout.groups.index(self.layout.group_of(name))
        at = inside + self.layout.first[name] - self.layout.groups[g].start
        replica = torch.from_numpy(at).to(self.device)
        weights, *states = self.tensors(g)
        return (
            ids[inside] - start,
            weights.index_select(0, replica),
            [s.index_select(0, replica) for s in states],
        )
