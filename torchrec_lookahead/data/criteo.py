"""Criteo's ``.npy`` day layout, read in bounded memory in an order every rank knows.

The layout (TorchRec's): ``day_{i}_dense.npy`` (float32 [N, 13], log-scaled),
``day_{i}_sparse.npy`` or ``day_{i}_sparse_contig_freq.npy`` (integer [N, 26])
and ``day_{i}_labels.npy`` (integer [N, 1]) per day. Every day but the last
trains; the last day's first half (rounded up) validates and its second half
tests.

Three parts, in data order:

* :func:`find_days` (:mod:`.days`) checks a folder's days once, by name (no
  gaps, no stray or compressed files) and then each file (shapes, types,
  sizes, the three files agreeing), so a bad day fails before training,
  naming the file.
* :class:`SampleOrder` says which samples global step ``s`` holds: a pure
  function of the step and the settings, identical on every rank and across
  restarts. Shuffled, it is a seeded permutation of chunks of consecutive
  samples plus a permutation within each chunk: memory ``O(chunk)``, whatever
  the size of the data.
* :class:`CriteoDayReader` is a map-style dataset over steps: item ``s`` is
  this rank's share of global step ``s`` (samples ``[rank * B, (rank + 1) * B)``
  of it), read from the mapped days, so a global step holds the same samples at
  any world size and no rank copies another's samples. Being random access, it
  starts at any step without reading the ones before, and runs in PyTorch
  ``DataLoader`` workers (:meth:`CriteoDayReader.loader`).
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, DEFAULT_CAT_NAMES
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.data.days import COLUMNS, KINDS, DayFiles, find_days
from torchrec_lookahead.data.dedup import deduplicate
from torchrec_lookahead.data.npy import DataError, MappedRows
from torchrec_lookahead.idle import run_when_idle

__all__ = ["CriteoDayReader", "DayFiles", "SampleOrder", "find_days", "stage_samples"]

_MERGE_GAP_ROWS = 256  # page advice: row runs closer than this are advised as one range


def stage_samples(days: Sequence[DayFiles], stage: str) -> tuple[int, int]:
    """``(first sample, sample count)`` of ``stage`` (train, val or test) in the days' order."""
    last_start = sum(d.rows for d in days[:-1])
    half = (days[-1].rows + 1) // 2
    spans = {
        "train": (0, last_start),
        "val": (last_start, half),
        "test": (last_start + half, days[-1].rows - half),
    }
    if stage not in spans:
        raise ValueError(f"stage must be one of {sorted(spans)}, not {stage!r}")
    return spans[stage]


@dataclass(frozen=True)
class SampleOrder:
    """Which samples each global step holds.

    The pass covers samples ``[first, first + samples)`` of the days laid end to
    end, ``epochs`` times, in global batches of ``global_batch`` (a partial last
    batch is dropped). Unshuffled (``seed=None``), step ``s`` of an epoch holds the
    ``s``-th run of consecutive samples. Shuffled, the epoch's batches are cut
    into chunks of ``chunk_samples`` consecutive samples (whole batches), the
    chunks come in a permutation seeded by ``(seed, epoch)``, and a chunk's
    samples in a permutation seeded by ``(seed, epoch, chunk)``.
    """

    first: int
    samples: int
    global_batch: int
    epochs: int = 1
    seed: int | None = None
    chunk_samples: int = 2**20

    def __post_init__(self) -> None:
        for name in ("global_batch", "epochs", "chunk_samples"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        if self.samples < self.global_batch:
            raise DataError(
                f"{self.samples:,} samples make no global batch of {self.global_batch:,}"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.samples // self.global_batch

    @property
    def steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    @property
    def chunk_batches(self) -> int:
        return max(1, self.chunk_samples // self.global_batch)

    def key(self) -> str:
        """What fixes the order (not the number of epochs): equal keys, equal steps."""
        settings = asdict(self)
        del settings["epochs"]
        return json.dumps(settings, sort_keys=True)

    def chunk(self, step: int) -> tuple[int, int, int]:
        """``(epoch, chunk, batch within the chunk)`` of global step ``step``."""
        if not 0 <= step < self.steps:
            raise IndexError(f"step {step} is outside the pass's {self.steps} steps")
        epoch, position = divmod(step, self.steps_per_epoch)
        if self.seed is None:
            chunk, within = divmod(position, self.chunk_batches)
            return epoch, chunk, within
        order, ends = _chunk_order(self.seed, epoch, self.steps_per_epoch, self.chunk_batches)
        slot = int(np.searchsorted(ends, position, side="right"))
        return epoch, int(order[slot]), position - (int(ends[slot - 1]) if slot else 0)

    def next_chunk(self, step: int) -> tuple[int, int] | None:
        """``(epoch, chunk)`` read after the chunk of ``step``; None at the end of the pass."""
        epoch, chunk, within = self.chunk(step)
        after = step - within + self._chunk_size(chunk)
        return self.chunk(after)[:2] if after < self.steps else None

    def chunk_batch_samples(self, epoch: int, chunk: int) -> np.ndarray:
        """The samples of every batch of one chunk: ``[batches, global_batch]``, in order."""
        return self._chunk_samples(epoch, chunk, slice(None)).reshape(-1, self.global_batch)

    def step_samples(self, step: int) -> np.ndarray:
        """The samples of global step ``step``, in batch order."""
        epoch, chunk, within = self.chunk(step)
        batch = slice(within * self.global_batch, (within + 1) * self.global_batch)
        return self._chunk_samples(epoch, chunk, batch)

    def _chunk_samples(self, epoch: int, chunk: int, part: slice) -> np.ndarray:
        """Part ``part`` of one chunk's samples, in order."""
        size = self._chunk_size(chunk) * self.global_batch
        start = self.first + chunk * self.chunk_batches * self.global_batch
        if self.seed is None:
            return start + np.arange(*part.indices(size), dtype=np.int64)
        return start + _within_chunk(self.seed, epoch, chunk, size)[part]

    def _chunk_size(self, chunk: int) -> int:
        """Batches in ``chunk`` (the last chunk of an epoch may be short)."""
        return min(self.chunk_batches, self.steps_per_epoch - chunk * self.chunk_batches)


@functools.lru_cache(maxsize=2)
def _chunk_order(
    seed: int, epoch: int, batches: int, per_chunk: int
) -> tuple[np.ndarray, np.ndarray]:
    """An epoch's chunks in their seeded order, and where each ends (in batches)."""
    count = -(-batches // per_chunk)
    order = np.random.default_rng([seed, epoch]).permutation(count)
    sizes = np.minimum(per_chunk, batches - order * per_chunk)
    return order, np.cumsum(sizes)


@functools.lru_cache(maxsize=3)  # the chunk being read, the next, the one being dropped
def _within_chunk(seed: int, epoch: int, chunk: int, size: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, chunk]).permutation(size)


def _one_buffer(
    dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray
) -> tuple[torch.Tensor, ...]:
    """Dense features, values (feature-major, as TorchRec's Criteo readers lay them),
    lengths (ones) and labels as views of one buffer: a loader worker hands a batch
    over as one shared-memory segment rather than four (half the receiving cost)."""
    samples, features = sparse.shape
    parts = (
        (torch.int64, sparse.size),
        (torch.float32, dense.size),
        (torch.int32, sparse.size),
        (torch.int32, samples),
    )
    buffer = torch.empty(sum(dtype.itemsize * n for dtype, n in parts), dtype=torch.uint8)
    views, offset = [], 0
    for dtype, count in parts:  # the widest first: every view stays aligned
        views.append(buffer[offset : offset + dtype.itemsize * count].view(dtype))
        offset += dtype.itemsize * count
    values, dense_t, lengths, labels_t = views
    values.numpy().reshape(features, samples)[:] = sparse.T
    dense_t.numpy()[:] = dense.reshape(-1)
    lengths.fill_(1)
    labels_t.numpy()[:] = labels.reshape(-1)
    return dense_t.view(dense.shape), values, lengths, labels_t


class _ForkedLoader(DataLoader):
    """A ``DataLoader`` that collects the parent's garbage before it forks its workers.

    A forked worker inherits the parent's garbage, and its collector may finalize it
    there: a process group left in a reference cycle then waits, in its destructor, for
    threads that exist only in the parent, and the worker hangs (seen: an earlier
    pipeline's gloo group, in the test process). Collected in the parent first, nothing
    of the kind is left to inherit.
    """

    def __iter__(self) -> Any:
        if self.num_workers > 0:
            gc.collect()
        return super().__iter__()


def _idle_priority(worker: int) -> None:
    """A loader worker reads ahead of the trainer, as the lookahead stage plans ahead."""
    run_when_idle()


class CriteoDayReader(Dataset):
    """This rank's share of each global step of ``order``, read from ``days``.

    Item ``s`` is a TorchRec ``Batch`` of ``B = global_batch / world_size``
    samples: dense features, one id per sparse feature (taken modulo ``hashes``
    if given) and labels, laid out as TorchRec's Criteo readers lay them out.
    With ``dedup_keys``, the sparse features come deduplicated on those keys
    (:func:`~torchrec_lookahead.data.dedup.deduplicate`), in the worker.

    Memory: the days are mapped (page cache, not private memory); a process
    holds the permutations of at most three chunks. When a process starts on a
    chunk it asks the kernel to read its samples of the next chunk, and it
    drops from the page cache the chunk it read two chunks ago.
    """

    def __init__(
        self,
        days: Sequence[DayFiles],
        order: SampleOrder,
        rank: int = 0,
        world_size: int = 1,
        hashes: Sequence[int] | None = None,
        dedup_keys: Sequence[str] | None = None,
    ) -> None:
        if order.global_batch % world_size:
            raise DataError(
                f"a global batch of {order.global_batch} samples does not split "
                f"into {world_size} ranks"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not a rank of world size {world_size}")
        total = sum(d.rows for d in days)
        if order.first + order.samples > total:
            raise DataError(
                f"the pass reads up to sample {order.first + order.samples:,}; "
                f"the days hold {total:,}"
            )
        if hashes is not None and len(hashes) != CAT_FEATURE_COUNT:
            raise ValueError(f"hashes: {len(hashes)} table sizes for {CAT_FEATURE_COUNT} features")
        self.days = list(days)
        self.order = order
        self.rank, self.world_size = rank, world_size
        self.batch_size = order.global_batch // world_size
        self.hashes = None if hashes is None else np.asarray(hashes, np.int64).reshape(1, -1)
        self.dedup_keys = None if dedup_keys is None else list(dedup_keys)
        self._ends = np.cumsum([d.rows for d in self.days])
        self._opened: list[tuple[MappedRows, ...]] | None = None  # per process, on first use
        self._entered: list[tuple[int, int]] = []  # chunks this process started, newest last

    def __len__(self) -> int:
        return self.order.steps

    def __getitem__(self, step: int) -> Batch:
        epoch, chunk, _ = self.order.chunk(step)
        if not self._entered or self._entered[-1] != (epoch, chunk):
            self._enter_chunk(step, (epoch, chunk))
        mine = self.order.step_samples(step)[self.rank * self.batch_size :][: self.batch_size]
        dense, sparse, labels = self._gather(mine)
        if self.hashes is not None:
            sparse %= self.hashes
        dense_t, values, lengths, labels_t = _one_buffer(dense, sparse, labels)
        features = KeyedJaggedTensor(
            keys=DEFAULT_CAT_NAMES, values=values, lengths=lengths, stride=len(mine)
        )
        if self.dedup_keys is not None:
            features = deduplicate(features, self.dedup_keys)
        return Batch(dense_t, features, labels_t)

    def loader(
        self,
        start: int = 0,
        stop: int | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[Batch], Any] | None = None,
    ) -> DataLoader:
        """A ``DataLoader`` over steps ``[start, stop)`` (``stop``: the end of the pass):
        the batches in order, read by ``num_workers`` worker processes (0: by the thread
        that iterates), each passed through ``collate_fn`` there if given (for example
        a lookahead pipeline's host check, :class:`~torchrec_lookahead.BatchCheck`).
        Steps before ``start`` are not read."""
        stop = len(self) if stop is None else stop
        if not 0 <= start <= stop <= len(self):
            raise ValueError(f"steps [{start}, {stop}) are outside the pass's {len(self)} steps")
        return _ForkedLoader(
            self,
            batch_size=None,
            sampler=range(start, stop),
            num_workers=num_workers,
            collate_fn=collate_fn,
            worker_init_fn=_idle_priority,
        )

    def state_dict(self, step: int) -> dict[str, Any]:
        """The position after ``step`` trained steps, for a checkpoint: the order, the days'
        samples, what the days hold (:func:`days_fingerprint`) and the step."""
        return {
            "order": self.order.key(),
            "rows": [d.rows for d in self.days],
            "data": self._fingerprint,
            "step": step,
        }

    def resume_step(self, state: dict[str, Any]) -> int:
        """The step to start at from :meth:`state_dict`'s ``state``; ``DataError`` naming
        what differs if the order or the data do (the same steps would hold other
        samples). A state saved before it recorded the data's contents is checked without
        them."""
        changes = _position_changes(state, self.state_dict(state["step"]))
        if changes:
            raise DataError(
                "the checkpoint's data position does not fit this run (its steps would hold "
                f"other samples): {'; '.join(changes)}"
            )
        return int(state["step"])

    @functools.cached_property
    def _fingerprint(self) -> str:
        return days_fingerprint(self.days)

    # ------------------------------------------------------------ reading

    def __getstate__(self) -> dict[str, Any]:  # a spawned worker opens its own mappings
        return {**self.__dict__, "_opened": None, "_entered": []}

    def _files(self) -> list[tuple[MappedRows, ...]]:
        if self._opened is None:
            self._opened = [tuple(MappedRows(p) for p in day.paths()) for day in self.days]
        return self._opened

    def _gather(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Dense, sparse (int64) and label rows of ``samples`` (global sample numbers)."""
        files = self._files()
        day = np.searchsorted(self._ends, samples, side="right")
        if day[0] == day[-1] and (day == day[0]).all():  # the usual case: one day
            rows = samples - (self._ends[day[0]] - self.days[day[0]].rows)
            dense, sparse, labels = (f.rows[rows] for f in files[day[0]])
            return dense, sparse.astype(np.int64, copy=False), labels
        out = [
            np.empty((len(samples), COLUMNS[k]), files[0][i].rows.dtype)
            for i, k in enumerate(KINDS)
        ]
        out[1] = out[1].astype(np.int64, copy=False)
        for d in np.unique(day):
            picked = day == d
            rows = samples[picked] - (self._ends[d] - self.days[d].rows)
            for target, mapped in zip(out, files[d]):
                target[picked] = mapped.rows[rows]
        return out[0], out[1], out[2]

    def _enter_chunk(self, step: int, chunk: tuple[int, int]) -> None:
        """Page advice on starting ``chunk``: read ahead this rank's samples of it (on the
        first chunk) and of the next one; drop the chunk entered two chunks ago."""
        ahead = [chunk] if not self._entered else []
        following = self.order.next_chunk(step)
        ahead += [following] if following is not None else []
        for epoch, number in ahead:
            self._advise(epoch, number, MappedRows.will_need)
        self._entered.append(chunk)
        if len(self._entered) > 2:
            self._advise(*self._entered.pop(0), MappedRows.done_with)

    def _advise(self, epoch: int, chunk: int, advice: Any) -> None:
        batches = self.order.chunk_batch_samples(epoch, chunk)
        mine = np.sort(batches[:, self.rank * self.batch_size :][:, : self.batch_size], axis=None)
        cut = np.flatnonzero(np.diff(mine) > _MERGE_GAP_ROWS) + 1
        for run in np.split(mine, cut):
            first, last = int(run[0]), int(run[-1]) + 1
            for d in range(int(np.searchsorted(self._ends, first, side="right")), len(self.days)):
                start = int(self._ends[d]) - self.days[d].rows
                if start >= last:
                    break
                for mapped in self._files()[d]:
                    advice(mapped, max(first - start, 0), min(last, int(self._ends[d])) - start)


# The order's fields, as a resumed run's refusal names them.
_ORDER_FIELDS = {
    "global_batch": "the global batch (samples per rank x ranks)",
    "seed": "the shuffle seed (None: not shuffled)",
    "chunk_samples": "the shuffle chunk (samples)",
    "first": "the pass's first sample",
    "samples": "the pass's samples",
}


def _position_changes(then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's data position and this run's, in words."""
    changes = []
    saved, mine = json.loads(then["order"]), json.loads(now["order"])
    for key in sorted(set(saved) | set(mine)):
        if saved.get(key) != mine.get(key):
            what = _ORDER_FIELDS.get(key, key)
            changes.append(f"{what} was {saved.get(key)}, is {mine.get(key)}")
    if then["rows"] != now["rows"]:
        changes.append(f"the days' samples were {then['rows']}, are {now['rows']}")
    elif "data" in then and then["data"] != now["data"]:
        changes.append("the days hold other data (as many samples, other contents)")
    return changes


def days_fingerprint(days: Sequence[DayFiles], head: int = 1 << 16) -> str:
    """A digest of the days' files: each one's size and first ``head`` bytes. Other data
    of as many samples (another seed's synthetic days, another preprocessing) differs
    there; reading it costs ``3 * head`` bytes a day."""
    digest = hashlib.sha256()
    for day in days:
        for path in day.paths():
            with open(path, "rb") as file:
                digest.update(file.read(head))
            digest.update(str(path.stat().st_size).encode())
    return digest.hexdigest()[:16]
