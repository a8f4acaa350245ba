"""A batch split by the lookahead stage into its cold part (for the owners) and its hot part.

The split runs ``L`` steps ahead of the step, on the stage's thread, and
starts no collective: the union of the hot rows every rank touches is
exchanged by :func:`~torchrec_lookahead.embedding.hot.sync.start_union`,
which the caller starts explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.embedding.hot.layout import HotLayout

__all__ = ["HotSplit", "split_batch"]

# Where the hot tables hold at most this many rows together, a map of 4 bytes per row
# (16 MiB at most) finds a batch's hot ids in one gather instead of a search per id.
DIRECT_ROWS = 1 << 22


@dataclass(frozen=True)
class HotSplit:
    """One batch's hot part: what the step's lookup and update read.

    Bags are numbered feature-major in the collection's key order
    (``key * batch + sample``). ``lookups[g]`` are group ``g``'s replica rows
    (group-local) bag by bag and the offsets of every bag. ``rows`` and
    ``bags`` list each hot id's replica row and bag in the order the owner's
    FBGEMM backward adds its gradients (round by round, see
    :mod:`~torchrec_lookahead.embedding.hot.sync`); ``round_ends`` says where
    each round ends.
    """

    batch: int
    lookups: list[tuple[torch.Tensor, torch.Tensor]]
    rows: torch.Tensor
    bags: torch.Tensor
    round_ends: tuple[int, ...]
    touched: torch.Tensor  # per replica row: touched by this rank's batch (see sync.py)
    packed: bool  # ``touched`` holds 8 rows a byte (else a byte a row)
    ids: int  # ids of the collection's features in the batch (hot or not)
    host_rows: np.ndarray  # ``rows`` on the host, for the union's positions (sync.py)


def split_batch(
    layout: HotLayout,
    features: KeyedJaggedTensor,
    variable_batch: bool,
    device: torch.device,
    row_of: np.ndarray | None = None,
) -> tuple[KeyedJaggedTensor, HotSplit]:
    """The cold part of ``features`` (a batch for the owners) and its hot part.

    ``variable_batch``: a cold feature of a hot table keeps only the bags with
    cold ids and one empty bag for every sample without any (TorchRec's
    deduplicated form), so hot-only bags leave the pooled all-to-all; else its
    bags stay, emptied of hot ids. ``device`` is where the hot part's tensors
    go; ``row_of`` is :func:`direct_map`'s map, if made.
    """
    names = features.keys()
    batch = features.stride()
    lengths = features.lengths().cpu().numpy().reshape(len(names), batch)
    values = features.values().cpu().numpy()
    bag_of = np.repeat(np.arange(lengths.size), lengths.reshape(-1))
    table_of = dict(zip(layout.keys, layout.key_tables))
    shift = np.array([layout.code_shift.get(table_of.get(n, ""), -1) for n in names])
    per_key = lengths.sum(axis=1)
    in_hot_table = np.repeat(shift >= 0, per_key)
    codes = values + np.repeat(shift, per_key)
    if row_of is not None:
        found = row_of[np.where(in_hot_table, codes, 0)].astype(np.int64)
        hot = (found >= 0) & in_hot_table
    else:
        at = np.minimum(np.searchsorted(layout.codes, codes), len(layout.codes) - 1)
        hot = (layout.codes[at] == codes) & in_hot_table
        found = layout.code_rows[at]
    cold = ~hot
    cold_lengths = np.bincount(bag_of[cold], minlength=lengths.size).reshape(lengths.shape)
    cold_features = _cold_batch(names, values[cold], cold_lengths, variable_batch, shift >= 0)
    # The owners' input dist runs on the batch's device (NCCL takes CUDA tensors only).
    cold_features = cold_features.to(features.values().device, non_blocking=True)
    # The hot ids feature-major in the collection's key order, each bag's in batch order.
    order = [names.index(key) for key in layout.keys]
    ends = np.cumsum(per_key)
    starts = ends - per_key
    picked = np.concatenate(
        [np.zeros(0, dtype=np.int64)]
        + [np.flatnonzero(hot[starts[k] : ends[k]]) + starts[k] for k in order]
    )
    rows = found[picked]
    name_of_id = bag_of[picked] // batch
    collection_key = np.full(len(names), -1)
    collection_key[order] = np.arange(len(layout.keys))
    keys_of_ids = collection_key[name_of_id]
    bags = keys_of_ids * batch + bag_of[picked] % batch
    rounds = np.asarray(layout.key_rounds, dtype=np.int64)[keys_of_ids]
    groups = np.asarray(layout.group_of_key, dtype=np.int64)[keys_of_ids]
    bag_count = len(layout.keys) * batch
    lookups = []
    for g, group in enumerate(layout.groups):
        mine = groups == g
        counts = np.bincount(bags[mine], minlength=bag_count)
        offsets = np.concatenate([[0], np.cumsum(counts)])
        lookups.append((_tensor(rows[mine] - group.start, device), _tensor(offsets, device)))
    update = np.argsort(rounds, kind="stable")
    round_ends = tuple(np.searchsorted(rounds[update], np.arange(layout.num_rounds), "right"))
    touched = np.zeros(layout.num_rows, dtype=bool)
    touched[rows] = True
    # NCCL (the collectives of CUDA tensors) reduces no bitwise OR: a byte per row there,
    # whose MAX is the OR.
    packed = device.type != "cuda"
    bits = np.packbits(touched) if packed else touched.view(np.uint8)
    ids = int(sum(per_key[k] for k in order))
    return cold_features, HotSplit(
        batch=batch,
        lookups=lookups,
        rows=_tensor(rows[update], device),
        bags=_tensor(bags[update], device),
        round_ends=tuple(int(e) for e in round_ends),
        touched=_tensor(bits, device),
        packed=packed,
        ids=ids,
        host_rows=rows[update],
    )


def direct_map(layout: HotLayout) -> np.ndarray | None:
    """A replica row (or -1) per code of the hot tables, where they are small enough."""
    if layout.code_space > DIRECT_ROWS:
        return None
    row_of = np.full(layout.code_space, -1, dtype=np.int32)
    row_of[layout.codes] = layout.code_rows
    return row_of


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device``; to a GPU through pinned memory, so the copy does not make
    the stage's thread wait."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _cold_batch(
    names: list[str],
    values: np.ndarray,
    cold_lengths: np.ndarray,
    variable_batch: bool,
    has_hot: np.ndarray,
) -> KeyedJaggedTensor:
    """The cold ids as a batch for the owners. As a variable batch, a hot table's feature
    keeps only the bags with cold ids, and one empty bag for every sample without any."""
    keys, batch = cold_lengths.shape
    if not variable_batch:
        return KeyedJaggedTensor(
            keys=names,
            values=torch.from_numpy(values),
            lengths=torch.from_numpy(cold_lengths.reshape(-1)),
            stride=batch,
        )
    kept = (cold_lengths > 0) | ~has_hot[:, None]
    count = kept.sum(axis=1)
    empty = count < batch  # the features that need the empty bag
    inverse = np.where(kept, np.cumsum(kept, axis=1) - 1, count[:, None])
    with_empty = np.hstack([cold_lengths, np.zeros((keys, 1), dtype=cold_lengths.dtype)])
    lengths = with_empty[np.hstack([kept, empty[:, None]])]  # per key: kept bags, then empty
    return KeyedJaggedTensor(
        keys=names,
        values=torch.from_numpy(values),
        lengths=torch.from_numpy(lengths),
        stride_per_key_per_rank=[[int(n)] for n in count + empty],
        inverse_indices=(names, torch.from_numpy(inverse)),
    )
