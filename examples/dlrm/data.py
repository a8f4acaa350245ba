"""Data for the DLRM example: Criteo's preprocessed ``.npy`` layout, synthetic or real.

Everything ends up as ``day_{i}_dense.npy`` (float32 [N, 13]),
``day_{i}_sparse.npy`` (int64 [N, 26]) and ``day_{i}_labels.npy`` (int32
[N, 1]), read with TorchRec's ``InMemoryBinaryCriteoIterDataPipe``: every day
but the last trains, the last day's halves are validation and test.

* Synthetic (default): Criteo-shaped ids with per-table Zipf skew, and labels
  drawn from a fixed logistic function of the dense features and of the ids
  (so a model can learn and AUROC means something). Generated once per set
  of settings into a cache folder and reused.
* Sessions (``--session_size k``): k consecutive samples come from one user
  and share the user-side features (``USER_FEATURES``: the first 13 sparse,
  ``USER_DENSE`` dense); labels stay the same fixed function of each
  sample's features. ``--dedup`` then sends each batch in TorchRec's
  deduplicated form (:func:`deduplicated`).
* Real: ``--dataset_path`` with ``day_*.npy`` files, or raw Criteo TSV days
  (label, 13 integers, 26 hex ids per line), converted once with TorchRec's
  ``BinaryCriteoUtils.tsv_to_npys`` into ``npy/`` beside them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from iopath.common.file_io import PathManager
from torchrec.datasets.criteo import (
    CAT_FEATURE_COUNT,
    DEFAULT_CAT_NAMES,
    INT_FEATURE_COUNT,
    BinaryCriteoUtils,
    InMemoryBinaryCriteoIterDataPipe,
)
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_lookahead.data import SyntheticCriteo
from torchrec_lookahead.data.dedup import DedupCounts, deduplicate

USER_FEATURES = DEFAULT_CAT_NAMES[:13]  # sparse features a session shares
USER_DENSE = 6  # dense features a session shares (the first ones)

PATHS = PathManager()


class DataError(ValueError):
    """The data set is missing, malformed or laid out wrongly."""


@dataclass(frozen=True)
class SyntheticSpec:
    """What a synthetic data set is made of; its hash names the cache folder."""

    scale: float
    zipf_exponent: float
    days: int
    samples_per_day: int
    seed: int
    session_size: int = 1

    def folder(self, root: Path) -> Path:
        digest = hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()
        return root / f"synthetic-{digest[:12]}"


def synthetic_days(spec: SyntheticSpec, root: Path) -> Path:
    """The folder of the synthetic data set, generated (atomically) if not there yet."""
    folder = spec.folder(root)
    if (folder / "spec.json").exists():
        return folder
    source = SyntheticCriteo(scale=spec.scale, zipf_exponent=spec.zipf_exponent, seed=spec.seed)
    effects = np.random.default_rng([spec.seed, 7]).uniform(-1.0, 1.0, CAT_FEATURE_COUNT)
    dense_weights = np.linspace(-0.8, 0.8, INT_FEATURE_COUNT)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".partial-"))
    for day in range(spec.days):
        rng = np.random.default_rng([spec.seed, day, 11])
        sparse = np.stack(
            source.batch(day, spec.samples_per_day).values, axis=1
        )  # [N, 26]: one id per feature, as in Criteo
        counts = rng.poisson(np.exp(rng.normal(1.0, 1.2, (spec.samples_per_day, 13))))
        if spec.session_size > 1:  # each session's first sample gives its user's features
            first = np.arange(spec.samples_per_day) // spec.session_size * spec.session_size
            sparse[:, : len(USER_FEATURES)] = sparse[first, : len(USER_FEATURES)]
            counts[:, :USER_DENSE] = counts[first, :USER_DENSE]
        dense = np.log(counts + 2.0).astype(np.float32)  # the log transform TorchRec applies
        # Each id of a table pushes the click rate up or down by a fixed amount.
        id_effect = np.cos(sparse * 0.618 + np.arange(CAT_FEATURE_COUNT)) @ effects
        logits = (dense - dense.mean()) @ dense_weights + 0.6 * id_effect - 1.3
        labels = (rng.random(spec.samples_per_day) < 1 / (1 + np.exp(-logits))).astype(np.int32)
        np.save(staging / f"day_{day}_dense.npy", dense)
        np.save(staging / f"day_{day}_sparse.npy", sparse.astype(np.int64))
        np.save(staging / f"day_{day}_labels.npy", labels.reshape(-1, 1))
    (staging / "spec.json").write_text(json.dumps(asdict(spec)))
    try:
        os.replace(staging, folder)  # another process may have won the race: fine
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def real_days(path: str) -> Path:
    """The folder holding ``day_*.npy`` for ``path``; raw TSV days are converted once."""
    if not PATHS.exists(path):
        raise DataError(f"--dataset_path {path}: no such folder")
    folder = Path(path)
    if list(folder.glob("day_*_dense.npy")):
        return folder
    tsvs = sorted(
        p for p in folder.iterdir() if p.suffix in (".tsv", ".txt") or p.name.startswith("day_")
    )
    if not tsvs:
        raise DataError(
            f"--dataset_path {path}: expected day_<i>_dense/sparse/labels.npy files or raw "
            "Criteo TSV days (day_0, day_1, ... or *.tsv), found neither"
        )
    out = folder / "npy"
    if not (out / "done").exists():
        staging = Path(tempfile.mkdtemp(dir=folder, prefix=".npy-partial-"))
        for day, tsv in enumerate(tsvs):
            try:
                BinaryCriteoUtils.tsv_to_npys(
                    str(tsv),
                    *(str(staging / f"day_{day}_{k}.npy") for k in ("dense", "sparse", "labels")),
                )
            except (ValueError, IndexError) as error:
                shutil.rmtree(staging, ignore_errors=True)
                raise DataError(f"{tsv}: not a Criteo TSV file ({error})") from error
        (staging / "done").write_text("")
        os.replace(staging, out)
    return out


def day_files(folder: Path) -> list[tuple[str, str, str]]:
    """``(dense, sparse, labels)`` paths per day, checked for shape and agreement."""
    days = []
    day = 0
    while (folder / f"day_{day}_dense.npy").exists():
        paths = tuple(str(folder / f"day_{day}_{k}.npy") for k in ("dense", "sparse", "labels"))
        missing = [p for p in paths if not Path(p).exists()]
        if missing:
            raise DataError(f"{folder}: day {day} lacks {missing}")
        shapes = [np.load(p, mmap_mode="r").shape for p in paths]
        want = [(INT_FEATURE_COUNT,), (CAT_FEATURE_COUNT,), (1,)]
        if [s[1:] for s in shapes] != want or len({s[0] for s in shapes}) != 1:
            raise DataError(
                f"{folder}: day {day} has shapes {shapes}; expected dense [N, 13], "
                "sparse [N, 26] and labels [N, 1] with the same N"
            )
        days.append(paths)
        day += 1
    if len(days) < 2:
        raise DataError(
            f"{folder}: need at least 2 days (train, then validation/test), found {len(days)}"
        )
    return days


def loader(
    days: list[tuple[str, str, str]],
    stage: str,
    batch_size: int,
    rank: int,
    world_size: int,
    num_embeddings: list[int],
    shuffle_batches: bool = False,
) -> InMemoryBinaryCriteoIterDataPipe:
    """TorchRec's in-memory Criteo reader for ``stage`` (train, val or test); shuffling
    (within each batch, seeded, so every run sees the same order) applies to training."""
    chosen = days[:-1] if stage == "train" else days[-1:]
    dense, sparse, labels = (list(paths) for paths in zip(*chosen))
    return InMemoryBinaryCriteoIterDataPipe(
        stage, dense, sparse, labels, batch_size=batch_size, rank=rank, world_size=world_size,
        drop_last=stage == "train", hashes=num_embeddings,
        shuffle_batches=shuffle_batches and stage == "train",
    )  # fmt: skip


def rank_slices(batches: Iterable[Batch], rank: int, world_size: int) -> Iterator[Batch]:
    """This rank's share of each global batch: samples ``[rank * B, (rank + 1) * B)`` of
    it, ``B`` = global batch / ``world_size``. So a global step holds the same samples at
    any world size (the same data order, and a run can continue at another size).
    At world size 1 the global batch is the rank's, passed on as it is."""
    if world_size == 1:
        yield from batches
        return
    for batch in batches:
        samples = batch.labels.numel()
        if samples % world_size:
            raise DataError(f"a global batch of {samples} samples does not split into "
                            f"{world_size} ranks")  # fmt: skip
        size = samples // world_size
        first, keys = rank * size, batch.sparse_features.keys()
        lengths = batch.sparse_features.lengths().view(len(keys), samples)
        kept = torch.zeros_like(lengths, dtype=torch.bool)
        kept[:, first : first + size] = True
        take = torch.repeat_interleave(kept.reshape(-1), lengths.reshape(-1))
        weights = batch.sparse_features.weights_or_none()
        features = KeyedJaggedTensor(
            keys=keys, values=batch.sparse_features.values()[take],
            weights=None if weights is None else weights[take],
            lengths=lengths[:, first : first + size].reshape(-1), stride=size,
        )  # fmt: skip
        yield Batch(batch.dense_features[first : first + size], features,
                    batch.labels[first : first + size])  # fmt: skip


def deduplicated(batches: Iterable[Batch], counts: DedupCounts) -> Iterator[Batch]:
    """``batches`` with the samples sharing all their ``USER_FEATURES`` sending them once
    (TorchRec's variable-stride form with inverse indices); ``counts`` sums what is saved."""
    for batch in batches:
        features = deduplicate(batch.sparse_features, USER_FEATURES, counts)
        yield Batch(batch.dense_features, features, batch.labels)
