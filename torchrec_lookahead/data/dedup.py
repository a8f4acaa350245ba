"""Deduplicating a batch (RecD): samples that share their user-side bags carry them once.

Consecutive samples of one user session repeat the user's features. RecD
sends each repeated bag once and expands the pooled embeddings back to the
batch; TorchRec carries such batches as a ``KeyedJaggedTensor`` with a stride
per key and ``inverse_indices`` (see :mod:`torchrec_lookahead.variable_batch`).
:func:`deduplicate` makes that form from a plain batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["DedupCounts", "deduplicate"]


@dataclass
class DedupCounts:
    """Ids and bags before and after deduplication, summed over the batches seen."""

    ids_before: int = 0
    ids_after: int = 0
    bags_before: int = 0
    bags_after: int = 0

    @property
    def ids_saved(self) -> float:
        """Share of the ids deduplication removed."""
        return 1 - self.ids_after / self.ids_before if self.ids_before else 0.0

    def add(self, features: KeyedJaggedTensor) -> None:
        """Count one batch as it is sent, plain or deduplicated: what it carries, and
        what its plain form would (every key's bags expanded by its inverse indices).
        Counting from the batch lets it be deduplicated elsewhere (a loader's worker)."""
        lengths = features.lengths()
        self.ids_after += int(lengths.sum())
        self.bags_after += lengths.numel()
        if not features.variable_stride_per_key():
            self.ids_before += int(lengths.sum())
            self.bags_before += lengths.numel()
            return
        _, inverse = features.inverse_indices()
        per_key = torch.split(lengths, features.stride_per_key())
        self.ids_before += sum(int(key[rows].sum()) for key, rows in zip(per_key, inverse))
        self.bags_before += inverse.numel()


def deduplicate(features: KeyedJaggedTensor, keys: Sequence[str]) -> KeyedJaggedTensor:
    """``features`` in TorchRec's deduplicated form for ``keys``.

    Samples whose bags agree on every key of ``keys`` (a user's features) share
    one bag per key, kept in the order of their first sample; the other keys
    keep one bag per sample. ``inverse_indices`` give every key's bag of each
    sample, so expanding the pooled output restores the plain batch exactly.
    A batch where no two samples share takes that form too: under DMP each rank
    deduplicates its own part, and every rank must send the same kind of batch
    (one rank's plain batch beside another's deduplicated one breaks TorchRec's
    input dist, a collective).
    """
    names = features.keys()
    unknown = [k for k in keys if k not in names]
    if unknown:
        raise ValueError(f"cannot deduplicate features {unknown}: the batch has {names}")
    if features.variable_stride_per_key():
        raise ValueError("the batch is deduplicated already (it has a stride per key)")
    batch = features.stride()
    lengths = features.lengths().view(len(names), batch).cpu().numpy()
    values = features.values().cpu().numpy()
    weights = features.weights_or_none()
    weights = None if weights is None else weights.cpu().numpy()
    starts = np.concatenate([[0], np.cumsum(lengths.reshape(-1))])[:-1].reshape(lengths.shape)
    group = [names.index(k) for k in keys]
    first, inverse = _shared_bags(values, lengths[group], starts[group])
    # Keep every bag of the other keys and each shared bag's first sample (``first`` is in
    # sample order), key by key as the values lie.
    kept = np.ones(lengths.shape, dtype=bool)
    kept[group] = False
    kept[np.ix_(group, first)] = True
    pick = np.repeat(kept.reshape(-1), lengths.reshape(-1))
    inverse_rows = np.tile(np.arange(batch), (len(names), 1))
    inverse_rows[group] = inverse
    return KeyedJaggedTensor(
        keys=names,
        values=torch.from_numpy(values[pick]),
        weights=None if weights is None else torch.from_numpy(weights[pick]),
        lengths=torch.from_numpy(lengths[kept]),
        stride_per_key_per_rank=[[int(n)] for n in kept.sum(axis=1)],
        inverse_indices=(names, torch.from_numpy(inverse_rows)),
    )


def _shared_bags(
    values: np.ndarray, lengths: np.ndarray, starts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Samples whose bags agree on every key given: the first sample of each distinct
    combination (in sample order), and each sample's combination."""
    batch = lengths.shape[1]
    columns = [lengths.T]
    for key_lengths, key_starts in zip(lengths, starts):
        width = int(key_lengths.max(initial=0))
        padded = np.full((batch, width), -1, dtype=np.int64)
        within = np.arange(width) < key_lengths[:, None]
        padded[within] = values[(key_starts[:, None] + np.arange(width))[within]]
        columns.append(padded)
    rows = np.hstack(columns)
    # Group by a 64-bit hash of each row (sorting 1-D keys is ~10x faster than rows), then
    # check that every row equals its group's first: a collision falls back to the rows.
    multipliers = np.random.default_rng(0).integers(1, 2**63, rows.shape[1], dtype=np.uint64) | 1
    hashes = (rows.astype(np.uint64) * multipliers).sum(axis=1)  # wraps modulo 2**64
    _, first, combination = np.unique(hashes, return_index=True, return_inverse=True)
    if not np.array_equal(rows[first[combination]], rows):
        _, first, combination = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return first[order], rank[combination.reshape(-1)]
