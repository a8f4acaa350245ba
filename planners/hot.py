"""Which rows to replicate on every rank: those whose replicas save bytes every step.

Sharded, a lookup from a rank other than the row's owner (``(W - 1) / W`` of
them) sends its id to the owner (8 bytes), and its bag's pooled row comes
back with its gradient going out again (``2 x 4 D`` bytes; a bag leaves the
all-to-all only when all its ids are hot, so per id ``8 D / pooling`` for a
table's mean ids per bag). Replicated, a row costs every step a bit of the
union's OR-reduce, and, in the steps whose batches touch it, its gradient in
the ring all-reduce (``2 (W - 1) / W x 4 D``). Per row and step, measured on
sample global batches (``a`` lookups per step and rank, touched in a share
``p`` of the steps), the bytes a rank saves:

    (W - 1) / W x (a (8 + 8 D / pooling) - p 8 D - 1 / 4)

Rows that save bytes are hot, best first (bytes saved per byte of replica),
until a memory budget is spent: a replica costs ``4 (D + state)`` bytes on
every rank. Hot rows take their lookups off the owners' caches too.

Bytes saved are time saved only where a byte costs time. Given a
:class:`LinkCost` (what a byte on the link costs, measured or stated, and what
the replicas' work costs per hot lookup and per step, measured on this
machine), a row is hot only if the time its bytes take on the link exceeds
the time its lookups cost the replicas, and no row is hot unless together
they pay for the replicas' fixed cost per step too. On a fast link (or
loopback) none pay, and training runs as without hot rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["HotRowsProposal", "LinkCost", "hot_rows_report", "propose_hot_rows"]


@dataclass(frozen=True)
class LinkCost:
    """Seconds: a byte a rank sends on the link, a hot lookup's work on the replicas
    (split, pooling, gradient, update), and the replicas' fixed work per step (the
    union's exchange and the ordered reduction's hops)."""

    per_byte: float
    per_lookup: float
    per_step: float

    def __post_init__(self) -> None:
        for name in ("per_byte", "per_lookup", "per_step"):
            value = getattr(self, name)
            if not (value >= 0 and np.isfinite(value)):
                raise ValueError(f"LinkCost.{name} must be a finite number >= 0, got {value}")


@dataclass(frozen=True)
class HotRowsProposal:
    """The rows to replicate per table, and what the sample says they bring (per rank)."""

    hot: dict[str, np.ndarray]  # sorted ids per table (tables without hot rows left out)
    lookup_share: dict[str, float]  # share of the table's sample lookups on its hot rows
    saved_bytes_per_step: dict[str, float]  # bytes a rank sends less per step
    replica_bytes: dict[str, int]  # memory of the replicas (weights and optimizer state)

    @property
    def rows(self) -> int:
        return sum(len(ids) for ids in self.hot.values())


def propose_hot_rows(
    batches: Mapping[str, Sequence[np.ndarray]],
    world_size: int,
    dim: int,
    state_floats: int,
    budget_bytes: int | None = None,
    bags_per_step: Mapping[str, int] | None = None,
    link: LinkCost | None = None,
) -> HotRowsProposal:
    """The hot rows of every table from sample global batches (``batches[table][step]``:
    the ids every rank looks up in that step, together).

    Args:
        world_size: the ranks training; one rank has nothing to replicate.
        dim: the tables' row width.
        state_floats: optimizer state per row, in floats (``optimizer_state_floats``).
        budget_bytes: replica memory per rank, all tables (None: every row that pays).
        bags_per_step: bags per step of each table (global batch size, the default, for
            one bag per sample), for its mean ids per bag.
        link: what bytes and the replicas' work cost (None: every row that saves bytes
            pays, as on a slow link).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    row_bytes = 4 * (dim + state_floats)
    share = (world_size - 1) / world_size
    candidates = []  # (saved per replica byte, table, id, saved bytes)
    lookups = {}
    for name, steps in batches.items():
        if not steps:
            raise ValueError(f"{name}: no sample batches")
        ids = np.concatenate([np.asarray(s, dtype=np.int64).reshape(-1) for s in steps])
        lookups[name] = len(ids)
        if world_size == 1 or not len(ids):
            continue
        bags = (bags_per_step or {}).get(name) or max(len(np.asarray(s).reshape(-1)) for s in steps)
        pooling = max(len(ids) / (bags * len(steps)), 1.0)
        rows, counts = np.unique(ids, return_counts=True)
        touched = np.concatenate([np.unique(np.asarray(s).reshape(-1)) for s in steps])
        _, steps_touched = np.unique(touched, return_counts=True)  # same rows, same order
        a, p = counts / len(steps) / world_size, steps_touched / len(steps)  # a: per rank
        saved = share * (a * (8 + 8 * dim / pooling) - p * 8 * dim - 0.25)
        pays = saved > 0
        if link is not None:  # the bytes' time against the lookups' work on the replicas
            pays &= saved * link.per_byte > a * link.per_lookup
        for row, value, per_rank in zip(rows[pays], saved[pays], a[pays]):
            candidates.append((value / row_bytes, name, int(row), float(value), float(per_rank)))
    candidates.sort(key=lambda c: -c[0])
    if budget_bytes is not None:
        candidates = candidates[: max(budget_bytes, 0) // row_bytes]
    if link is not None:  # together they must pay for the replicas' fixed work too
        net = sum(c[3] * link.per_byte - c[4] * link.per_lookup for c in candidates)
        if net <= link.per_step:
            candidates = []
    hot: dict[str, list[int]] = {}
    saved_bytes: dict[str, float] = {}
    for _, name, row, value, _ in candidates:
        hot.setdefault(name, []).append(row)
        saved_bytes[name] = saved_bytes.get(name, 0.0) + value
    chosen = {name: np.sort(np.array(rows, dtype=np.int64)) for name, rows in hot.items()}
    lookup_share = {}
    for name, steps in batches.items():
        ids = np.concatenate([np.asarray(s, dtype=np.int64).reshape(-1) for s in steps])
        in_hot = np.isin(ids, chosen[name]) if name in chosen else np.zeros(len(ids), bool)
        lookup_share[name] = float(in_hot.mean()) if len(ids) else 0.0
    return HotRowsProposal(
        hot=chosen,
        lookup_share=lookup_share,
        saved_bytes_per_step={name: saved_bytes.get(name, 0.0) for name in batches},
        replica_bytes={name: row_bytes * len(chosen.get(name, [])) for name in batches},
    )


def hot_rows_report(proposal: HotRowsProposal) -> str:
    """A line per table: hot rows, their share of its lookups, bytes saved, replica memory."""
    row = "{:<16} {:>10} {:>12} {:>14} {:>12}"
    lines = [row.format("table", "hot rows", "hot lookups", "KiB saved/step", "replica MiB")]
    for name, share in proposal.lookup_share.items():
        lines.append(
            row.format(
                name,
                len(proposal.hot.get(name, [])),
                f"{share:.1%}",
                f"{proposal.saved_bytes_per_step[name] / 1024:.1f}",
                f"{proposal.replica_bytes[name] / 2**20:.2f}",
            )
        )
    total = sum(proposal.replica_bytes.values())
    lines.append(
        f"{proposal.rows:,} hot rows: {total / 2**20:.2f} MiB on every rank, "
        f"{sum(proposal.saved_bytes_per_step.values()) / 1024:.1f} KiB less sent "
        "per step and rank (sample estimate)"
    )
    return "\n".join(lines)
