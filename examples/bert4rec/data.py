"""Item histories for the BERT4Rec example, and its batches of masked sequences.

* Synthetic (default): ``--num_users`` users, each with a history of items. An item is
  either a fresh draw from a Zipf popularity over ``--num_items`` items, or (with
  probability ``FOLLOW``) one of the previous item's few related items, so the order
  carries information a sequence model can learn. The popularity drifts: users are in
  time order, and the ranking slides over the items as time passes (``--drift``: by
  how many ranks from the first user to the last), so the hot items of early users are
  not those of late users.
* MovieLens (``--dataset_path DIR``): ``DIR/ratings.dat``, lines of
  ``UserID::MovieID::Rating::Timestamp`` (ml-1m's format, the one TorchRec's example
  reads). Each user's ratings sorted by time make the history; movies are renumbered
  0..N-1 in the order of their ids, users ordered by their first rating.

The last item of every history is held out for evaluation; the items before it train.
A training sample is a user's last ``max_len`` training items with some replaced by the
mask token (``mask_prob``, at least one), the originals its labels. The masks come from
``(seed, epoch, user)`` alone, so a global step holds the same samples at any world size
for the same global batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from torchrec_lookahead.data.npy import DataError

__all__ = [
    "ITEM_FEATURE",
    "NOT_A_TARGET",
    "History",
    "MaskedSequences",
    "SyntheticSpec",
    "eval_batches",
    "read_ratings",
    "synthetic_histories",
    "train_batches",
    "train_steps",
]

ITEM_FEATURE = "item"  # the one sparse feature: a sample's sequence of item ids
NOT_A_TARGET = -1  # a label where the position is neither masked nor held out
FOLLOW = 0.5  # synthetic: how often the next item is one of the previous item's related ones
RELATED = 4  # synthetic: related items per item


@dataclass
class MaskedSequences(Pipelineable):
    """A batch: each sample's item sequence (``sparse_features``, feature ``item``, some
    ids replaced by the mask token) and, per position, the item to predict there
    (``labels``, ``[batch, max_len]``; ``NOT_A_TARGET`` where there is none)."""

    sparse_features: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> MaskedSequences:
        return MaskedSequences(
            self.sparse_features.to(device=device, non_blocking=non_blocking),
            self.labels.to(device=device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.sparse_features.record_stream(stream)
        self.labels.record_stream(stream)

    def pin_memory(self) -> MaskedSequences:
        return MaskedSequences(self.sparse_features.pin_memory(), self.labels.pin_memory())


@dataclass(frozen=True)
class History:
    """Every user's items in time order (user ``u``'s are ``items[offsets[u]:offsets[u + 1]]``,
    at least two each) and the number of distinct items."""

    items: np.ndarray
    offsets: np.ndarray
    num_items: int

    @property
    def num_users(self) -> int:
        return len(self.offsets) - 1

    def of(self, user: int) -> np.ndarray:
        return self.items[self.offsets[user] : self.offsets[user + 1]]


@dataclass(frozen=True)
class SyntheticSpec:
    """What a synthetic data set is made of."""

    num_users: int
    num_items: int
    zipf_exponent: float
    drift: float
    min_history: int
    max_history: int
    seed: int


def synthetic_histories(spec: SyntheticSpec) -> History:
    """Histories of Zipf-popular items whose popularity drifts from user to user, with
    runs of related items (see the module's docstring)."""
    rng = np.random.default_rng([spec.seed, 42])
    n, users = spec.num_items, spec.num_users
    popularity = 1.0 / np.arange(1, n + 1) ** spec.zipf_exponent
    by_rank = rng.permutation(n)  # the item at each popularity rank, for the first user
    related = rng.integers(0, n, (n, RELATED))
    lengths = rng.integers(spec.min_history, spec.max_history + 1, users)
    longest = int(lengths.max())
    ranks = rng.choice(n, size=(users, longest), p=popularity / popularity.sum())
    # The ranking slides over the items with time: user u sees rank r as item
    # by_rank[(r + shift_u) % n].
    shift = np.fmod(np.floor(spec.drift * np.arange(users) / users), n).astype(np.int64)
    fresh = by_rank[(ranks + shift[:, None]) % n]
    follow = rng.random((users, longest)) < FOLLOW
    pick = rng.integers(0, RELATED, (users, longest))
    items = np.empty((users, longest), dtype=np.int64)
    items[:, 0] = fresh[:, 0]
    for j in range(1, longest):
        items[:, j] = np.where(follow[:, j], related[items[:, j - 1], pick[:, j]], fresh[:, j])
    keep = np.arange(longest)[None, :] < lengths[:, None]
    return History(items[keep], np.concatenate([[0], np.cumsum(lengths)]), n)


def read_ratings(folder: str | Path, min_rating: int = 0, min_user_count: int = 5) -> History:
    """The histories of ``folder/ratings.dat`` (``UserID::MovieID::Rating::Timestamp``):
    ratings below ``min_rating`` dropped, then users with fewer than ``min_user_count``
    (and fewer than 2) ratings; each user's ratings in time order (file order between
    equal times). Raises ``DataError`` naming the line of a malformed rating."""
    path = Path(folder) / "ratings.dat"
    if not path.is_file():
        raise DataError(
            f"{path}: no such file (MovieLens ratings: UserID::MovieID::Rating::Timestamp)"
        )
    text = path.read_text(encoding="latin-1")
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise DataError(f"{path}: holds no ratings")
    table = parsed(lines)
    if table is None:
        raise malformed(path, text)
    table = table[table[:, 2] >= min_rating]
    users, per_user = np.unique(table[:, 0], return_counts=True)
    kept = users[per_user >= max(min_user_count, 2)]
    table = table[np.isin(table[:, 0], kept)]
    if not len(table):
        raise DataError(
            f"{path}: no user has {max(min_user_count, 2)} ratings of at least {min_rating}"
        )
    movies, items = np.unique(table[:, 1], return_inverse=True)
    order = np.lexsort((np.arange(len(table)), table[:, 3], table[:, 0]))  # by user, then time
    table, items = table[order], items[order]
    users, starts, counts = np.unique(table[:, 0], return_index=True, return_counts=True)
    by_first_rating = np.lexsort((users, table[starts, 3]))
    pieces = [items[starts[u] : starts[u] + counts[u]] for u in by_first_rating]
    offsets = np.concatenate([[0], np.cumsum(counts[by_first_rating])])
    return History(np.concatenate(pieces), offsets, len(movies))


def parsed(lines: list[str]) -> np.ndarray | None:
    """``[N, 4]`` integers from lines of four ``::``-separated integers, or None if a line
    is not one (all lines parsed at once: ml-1m has a million)."""
    if any(line.count("::") != 3 for line in lines):
        return None
    fields = "\n".join(lines).replace("::", "\n").split("\n")
    if len(fields) != 4 * len(lines):
        return None
    try:
        return np.array(fields, dtype=np.int64).reshape(-1, 4)
    except (ValueError, OverflowError):  # an empty field, a word, a fraction, past int64
        return None


def malformed(path: Path, text: str) -> DataError:
    """The error naming the first line of ``text`` that is not a rating."""
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip() and parsed([line]) is None:
            return DataError(
                f"{path} line {number}: expected UserID::MovieID::Rating::Timestamp "
                f"(integers), got {line.strip()[:80]!r}"
            )
    raise AssertionError("parsed() refused lines that each parse")


def train_steps(history: History, batch_size: int, world_size: int, epochs: int) -> int:
    """Global steps in ``epochs`` passes over the users, ``batch_size`` per rank (a last
    partial batch is dropped); ``DataError`` if the users fill no global batch."""
    steps = history.num_users // (batch_size * world_size) * epochs
    if not steps:
        raise DataError(
            f"too few users ({history.num_users}) for one global batch of {batch_size} "
            f"users per rank x {world_size} ranks; lower --train_batch_size"
        )
    return steps


def train_batches(
    history: History,
    batch_size: int,
    rank: int,
    world_size: int,
    max_len: int,
    mask_prob: float,
    seed: int,
    steps: int,
) -> Iterator[MaskedSequences]:
    """This rank's share of ``steps`` global training steps: users in time order, pass
    after pass, ``batch_size`` per rank; rank ``r`` takes the ``r``-th share of each
    global batch."""
    per_epoch = history.num_users // (batch_size * world_size)
    for step in range(steps):
        epoch, within = divmod(step, per_epoch)
        first = (within * world_size + rank) * batch_size
        sequences, labels = [], []
        for user in range(first, first + batch_size):
            training = history.of(user)[:-1][-max_len:]
            masked, targets = mask(training, history.num_items, mask_prob, (seed, epoch, user))
            sequences.append(masked)
            labels.append(targets)
        yield batch(sequences, labels, max_len)


def mask(
    items: np.ndarray, mask_token: int, mask_prob: float, key: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """``items`` with each masked at ``mask_prob`` (at least one: a sample teaches
    something), drawn from ``key``; and the labels (the items masked, else NOT_A_TARGET)."""
    rng = np.random.default_rng(key)
    chosen = rng.random(len(items)) < mask_prob
    if not chosen.any():
        chosen[rng.integers(len(items))] = True
    return np.where(chosen, mask_token, items), np.where(chosen, items, NOT_A_TARGET)


def eval_batches(
    history: History, batch_size: int, rank: int, world_size: int, max_len: int, limit: int | None
) -> Iterator[tuple[MaskedSequences, torch.Tensor]]:
    """This rank's share of the evaluation, and which of its samples count: every user's
    last ``max_len - 1`` training items and the mask token, the held-out item its label.
    Every rank runs as many batches of ``batch_size`` as the others (the sharded
    lookups are collectives); samples past the last user repeat the first and do not
    count."""
    users = history.num_users
    global_batch = batch_size * world_size
    steps = -(-users // global_batch)
    for step in range(min(steps, limit or steps)):
        first = (step * world_size + rank) * batch_size
        chosen = np.arange(first, first + batch_size)
        counted = torch.from_numpy(chosen < users)
        sequences, labels = [], []
        for user in np.where(chosen < users, chosen, 0):
            items = history.of(int(user))
            context = np.append(items[:-1][-(max_len - 1) :], history.num_items)
            target = np.full(len(context), NOT_A_TARGET)
            target[-1] = items[-1]
            sequences.append(context)
            labels.append(target)
        yield batch(sequences, labels, max_len), counted


def batch(sequences: list[np.ndarray], labels: list[np.ndarray], max_len: int) -> MaskedSequences:
    """The samples as a batch: the sequences jagged, the labels padded to ``max_len``."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    padded = np.full((len(labels), max_len), NOT_A_TARGET, dtype=np.int64)
    for row, targets in zip(padded, labels):
        row[: len(targets)] = targets
    features = KeyedJaggedTensor.from_lengths_sync(
        [ITEM_FEATURE], torch.from_numpy(np.concatenate(sequences).astype(np.int64)), lengths
    )
    return MaskedSequences(features, torch.from_numpy(padded))
