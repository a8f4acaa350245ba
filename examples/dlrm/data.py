"""Data for the DLRM example: Criteo's preprocessed ``.npy`` layout, synthetic or real.

Everything ends up as ``day_{i}_dense.npy`` (float32 [N, 13]),
``day_{i}_sparse.npy`` or ``day_{i}_sparse_contig_freq.npy`` (int64 [N, 26])
and ``day_{i}_labels.npy`` (int32 [N, 1]), read by
:class:`torchrec_lookahead.data.criteo.CriteoDayReader` (mapped, each rank its
own samples): every day but the last trains, the last day's halves are
validation and test.

* Synthetic (default): Criteo-shaped ids with per-table Zipf skew, and labels
  drawn from a fixed logistic function of the dense features and of the ids
  (so a model can learn and AUROC means something). Generated once per set
  of settings into a cache folder and reused.
* Sessions (``--session_size k``): k consecutive samples come from one user
  and share the user-side features (``USER_FEATURES``: the first 13 sparse,
  ``USER_DENSE`` dense); labels stay the same fixed function of each
  sample's features. ``--dedup`` then sends each batch in TorchRec's
  deduplicated form (in the loader's workers).
* Real: ``--dataset_path``, a folder of ``.npy`` days under TorchRec's names
  (``day_<i>_sparse.npy`` or ``day_<i>_sparse_contig_freq.npy`` for the ids).
  Raw Criteo TSV days are converted before training, by ``preprocess.py`` (its
  own command, restartable by day): training refuses them, and converts
  nothing, so no conversion ever runs while other ranks wait in a collective.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, DEFAULT_CAT_NAMES, INT_FEATURE_COUNT

from torchrec_lookahead.data import SyntheticCriteo
from torchrec_lookahead.data.criteo import CriteoDayReader, DayFiles, SampleOrder, stage_samples
from torchrec_lookahead.data.days import npy_day_paths

USER_FEATURES = DEFAULT_CAT_NAMES[:13]  # sparse features a session shares
USER_DENSE = 6  # dense features a session shares (the first ones)


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
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=".partial-"))
    try:
        _write_days(spec, staging)
        try:
            os.replace(staging, folder)
        except OSError:  # another process won the race: its folder holds the same data
            pass
    finally:  # also when stopped (Ctrl-C): no staging folder of a data set's size is left
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _write_days(spec: SyntheticSpec, staging: Path) -> None:
    """The synthetic days of ``spec`` and its ``spec.json``, written into ``staging``."""
    source = SyntheticCriteo(scale=spec.scale, zipf_exponent=spec.zipf_exponent, seed=spec.seed)
    effects = np.random.default_rng([spec.seed, 7]).uniform(-1.0, 1.0, CAT_FEATURE_COUNT)
    dense_weights = np.linspace(-0.8, 0.8, INT_FEATURE_COUNT)
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


def real_days(path: str) -> Path:
    """The folder of ``.npy`` days ``path`` names, its day set checked by name (no gaps,
    no stray or compressed files, no raw TSV days left unconverted: those are
    ``preprocess.py``'s to convert); the files' contents are ``find_days``'s to check."""
    npy_day_paths(path)
    return Path(path)


def reader(args, days: list[DayFiles], stage: str, rank: int, world_size: int) -> CriteoDayReader:
    """This rank's reader of ``stage`` (train, val or test).

    A global step holds ``--batch_size`` (evaluation: ``--test_batch_size``)
    samples per rank, and rank ``r`` reads its ``r``-th share of it: so global
    step s holds the same samples at any world size, and a run can continue at
    another world size (see docs/guides/failures.md). Training runs --epochs
    passes, in --shuffle's seeded order if asked, deduplicated with --dedup.
    """
    first, samples = stage_samples(days, stage)
    train = stage == "train"
    batch_size = args.batch_size if train else args.test_batch_size or args.batch_size
    order = SampleOrder(
        first,
        samples,
        batch_size * world_size,
        args.epochs if train else 1,
        args.seed if train and args.shuffle else None,
        args.shuffle_chunk,
    )
    return CriteoDayReader(
        days,
        order,
        rank,
        world_size,
        args.num_embeddings,
        USER_FEATURES if train and args.dedup else None,
    )
