"""Criteo day sets: which files of a folder are days, checked by name before anything reads them.

Two layouts, TorchRec's names:

* raw: ``day_0``, ``day_1``, ... (tab-separated text, as Criteo ships the days
  once decompressed);
* ``.npy``: per day ``day_<n>_dense.npy``, ``day_<n>_labels.npy`` and either
  ``day_<n>_sparse.npy`` (the ids as in the text: TorchRec's ``tsv_to_npys``)
  or ``day_<n>_sparse_contig_freq.npy`` (contiguous ids: TorchRec's
  ``sparse_to_contiguous``, or ``examples/dlrm/preprocess.py``).

The rules, so that a day set is never silently cut, renumbered or mixed:
days are numbered ``0 .. N-1`` with no gap (``day_0``, ``day_5``, ``day_23``
is refused, not read as days 0-2); a file whose name starts with ``day_`` but
is no day of either layout (``day_01``, ``day_3_sparse_multi_hot.npz``) is
refused, as is a day's name on a folder or a link to nothing; so is a compressed
file (``.gz``, ...) anywhere in the folder. Each refusal lists the files. Other
names are left alone: markers (``done``, ``day_<n>.done``), ``spec.json``, the
cardinality file, hidden files and the ``.partial`` files of writes in progress.

Nothing here imports torch, so the preprocessing command starts fast.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from torchrec_lookahead.data.npy import DataError, MappedRows

__all__ = [
    "CAT_FEATURE_COUNT",
    "CONTIGUOUS",
    "INT_FEATURE_COUNT",
    "PREPROCESS_STATE",
    "DayFiles",
    "DaySet",
    "file_fingerprint",
    "find_days",
    "npy_day_paths",
    "raw_day_paths",
    "scan_days",
]

INT_FEATURE_COUNT = 13  # TorchRec's Criteo constants (torchrec.datasets.criteo), without torch
CAT_FEATURE_COUNT = 26
KINDS = ("dense", "sparse", "labels")
COLUMNS = {"dense": INT_FEATURE_COUNT, "sparse": CAT_FEATURE_COUNT, "labels": 1}
CONTIGUOUS = "sparse_contig_freq"  # TorchRec's name for contiguous ids (sparse_to_contiguous)
SPARSE_KINDS = ("sparse", CONTIGUOUS)
PREPROCESS_STATE = ".preprocess"  # the preprocessing's own folder inside its output folder
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip", ".7z", ".tar")
_RAW = re.compile(r"day_(0|[1-9][0-9]*)")
_NPY = re.compile(r"day_(0|[1-9][0-9]*)_(dense|labels|sparse|sparse_contig_freq)\.npy")
_MARKER = re.compile(r"day_(0|[1-9][0-9]*)\.done")
CONVERT_HINT = (
    "convert them first: python examples/dlrm/preprocess.py --input_dir {folder} "
    "--output_dir OUT --frequency_threshold T, then train with --dataset_path OUT"
)


@dataclass(frozen=True)
class DayFiles:
    """One day's three files and its sample count."""

    dense: Path
    sparse: Path
    labels: Path
    rows: int

    def paths(self) -> tuple[Path, Path, Path]:
        return self.dense, self.sparse, self.labels


@dataclass(frozen=True)
class DaySet:
    """A folder's files sorted by layout: raw days and ``.npy`` days by number."""

    folder: Path
    raw: dict[int, Path] = field(default_factory=dict)
    npy: dict[int, dict[str, Path]] = field(default_factory=dict)  # day -> kind -> path


def file_fingerprint(path: str | Path, samples: int = 16, block: int = 1 << 16) -> str:
    """What a converted day records of the file it came from: its name, size and a digest
    of ``samples`` blocks of ``block`` bytes spread over it, its first and last included.
    An edit that keeps the size (labels flipped) changes the digest wherever it touches
    a block; a copy of the file does not (no times are recorded). Reads ``samples *
    block`` bytes a day (1 MiB by default), however long the day."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for i in range(samples):
            file.seek(max(0, size - block) * i // max(1, samples - 1))
            digest.update(file.read(block))
    return json.dumps({"name": path.name, "bytes": size, "sampled": digest.hexdigest()[:16]})


def scan_days(folder: str | Path) -> DaySet:
    """The days in ``folder`` by layout; ``DataError`` listing compressed files and
    ``day_*`` names that are no day (the module docstring)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder}: no such folder")
    raw: dict[int, Path] = {}
    npy: dict[int, dict[str, Path]] = {}
    compressed, extra, not_files = [], [], []
    for path in sorted(folder.iterdir()):
        name = path.name
        if name.startswith(".") or name.endswith(".partial"):
            continue
        if not path.is_file():  # a day's name on a folder or a dangling link: not skipped
            if _RAW.fullmatch(name) or _NPY.fullmatch(name):
                not_files.append(name)
            continue
        if name.lower().endswith(COMPRESSED):
            compressed.append(name)
        elif match := _RAW.fullmatch(name):
            raw[int(match[1])] = path
        elif match := _NPY.fullmatch(name):
            npy.setdefault(int(match[1]), {})[match[2]] = path
        elif name.startswith("day_") and not _MARKER.fullmatch(name):
            extra.append(name)
    if compressed:
        raise DataError(
            f"{folder}: compressed files {_listed(compressed)}: decompress them first "
            f"(e.g. gunzip -k {compressed[0]}) and remove the compressed copies; days are "
            "read as plain TSV or .npy"
        )
    if not_files:
        raise DataError(
            f"{folder}: {_listed(not_files)} named as days but not readable files (a "
            "folder, or a link to nothing: a disk not mounted?)"
        )
    if extra:
        raise DataError(
            f"{folder}: files that are no Criteo day: {_listed(extra)}; a day is day_<n> "
            "(raw TSV) or day_<n>_{dense,labels,sparse,sparse_contig_freq}.npy: move the "
            "others out of the folder"
        )
    return DaySet(folder, dict(sorted(raw.items())), dict(sorted(npy.items())))


# The first bytes of gzip, bzip2, xz and zstd data: a day that is none of TSV text.
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")


def raw_day_paths(folder: str | Path) -> list[Path]:
    """The raw TSV days of ``folder``, day 0 first, checked by name (no gaps, nothing
    compressed, no stray ``day_*`` files) and by their first bytes: no empty file (a
    download that never wrote), no compressed data under a plain day's name. All before
    any day is converted; ``.npy`` days beside them are ignored."""
    days = scan_days(folder)
    if not days.raw:
        raise DataError(f"{days.folder}: no raw Criteo days (day_0, day_1, ... as TSV text)")
    _check_numbering(days.folder, sorted(days.raw), "day_{}")
    paths = list(days.raw.values())
    heads = {}
    for path in paths:
        with path.open("rb") as file:
            heads[path.name] = file.read(max(map(len, _COMPRESSED)))
    empty = [name for name, head in heads.items() if not head]
    if empty:
        raise DataError(f"{days.folder}: raw days {_listed(empty)} are empty files (no samples)")
    packed = [name for name, head in heads.items() if head.startswith(_COMPRESSED)]
    if packed:
        raise DataError(
            f"{days.folder}: raw days {_listed(packed)} hold compressed data under a plain "
            f"day's name: decompress them first (e.g. mv {packed[0]} {packed[0]}.gz && "
            f"gunzip {packed[0]}.gz)"
        )
    return paths


def npy_day_paths(folder: str | Path) -> list[tuple[Path, Path, Path]]:
    """``(dense, sparse, labels)`` of each ``.npy`` day of ``folder``, day 0 first, checked by
    name: no gaps, each day whole, one kind of sparse file for all days, no raw day
    left unconverted, no preprocessing left unfinished. The files' contents are
    :func:`find_days`'s to check."""
    days = scan_days(folder)
    state = days.folder / PREPROCESS_STATE
    if state.is_dir() and not (state / "done").exists():
        raise DataError(
            f"{days.folder}: its preprocessing is unfinished ({state} has no done marker); "
            "run examples/dlrm/preprocess.py again with the same flags to finish it"
        )
    unconverted = sorted(set(days.raw) - set(days.npy))
    if unconverted:
        names = [days.raw[d].name for d in unconverted]
        raise DataError(
            f"{days.folder}: raw Criteo TSV days {_listed(names)} are not converted; "
            + CONVERT_HINT.format(folder=days.folder)
        )
    if not days.npy:
        raise DataError(
            f"{days.folder}: expected day_<i>_dense/labels/sparse.npy files (or "
            "day_<i>_sparse_contig_freq.npy), found no day"
        )
    _check_numbering(days.folder, sorted(days.npy), "day_{}_*.npy")
    kinds: dict[str, list[int]] = {}
    out = []
    for day, files in days.npy.items():
        sparse = [k for k in SPARSE_KINDS if k in files]
        if len(sparse) > 1:
            raise DataError(
                f"{days.folder}: day {day} has both day_{day}_sparse.npy and "
                f"day_{day}_{CONTIGUOUS}.npy: which ids to train on is ambiguous; move one away"
            )
        missing = [
            str(days.folder / f"day_{day}_{kind}.npy")
            for kind in ("dense", "sparse", "labels")
            if kind not in files and not (kind == "sparse" and sparse)
        ]
        if missing:
            raise DataError(f"{days.folder}: day {day} lacks {missing}")
        kinds.setdefault(sparse[0], []).append(day)
        out.append((files["dense"], files[sparse[0]], files["labels"]))
    if len(kinds) > 1:
        shown = "; ".join(f"day_<n>_{k}.npy for days {_ranges(v)}" for k, v in kinds.items())
        raise DataError(
            f"{days.folder}: the days mix their kinds of ids ({shown}): convert all "
            "of them the same way"
        )
    return out


def find_days(folder: str | Path) -> list[DayFiles]:
    """The days in ``folder``, checked by name (:func:`npy_day_paths`) and then each file:
    whole, of the right shape and type, the three with one sample count."""
    days: list[DayFiles] = []
    for day, paths in enumerate(npy_day_paths(folder)):
        rows = {}
        for kind, path in zip(KINDS, paths):
            mapped = MappedRows(path)  # checks the header against the file's size
            shape, dtype = mapped.shape, mapped.rows.dtype
            mapped.close()
            right_type = dtype == np.float32 if kind == "dense" else dtype.kind in "iu"
            if shape[1] != COLUMNS[kind] or not right_type:
                raise DataError(
                    f"{path}: {dtype} {list(shape)}; expected dense [N, 13] float32, "
                    "sparse [N, 26] and labels [N, 1] integers"
                )
            rows[kind] = shape[0]
        if len(set(rows.values())) != 1:
            raise DataError(f"{folder}: day {day}'s files disagree on its sample count: {rows}")
        days.append(DayFiles(paths[0], paths[1], paths[2], rows=rows["dense"]))
    if len(days) < 2:
        raise DataError(
            f"{folder}: need at least 2 days (train, then validation/test), found {len(days)}"
        )
    return days


def _check_numbering(folder: Path, numbers: list[int], pattern: str) -> None:
    """``DataError`` unless ``numbers`` are ``0 .. N-1``: a gap is never renumbered away."""
    if numbers == list(range(len(numbers))):
        return
    missing = sorted(set(range(numbers[-1] + 1)) - set(numbers))
    raise DataError(
        f"{folder}: the days are numbered {_ranges(numbers)}, with days {_ranges(missing)} "
        f"missing; days must run 0..N-1 without gaps ({pattern.format('<n>')}), so that no "
        "day is silently renumbered: add the missing days or renumber the files yourself"
    )


def _ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5, 23]`` as ``0-2, 5, 23``."""
    parts, start = [], None
    for i, n in enumerate(numbers):
        start = n if start is None else start
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            parts.append(f"{start}" if start == n else f"{start}-{n}")
            start = None
    return ", ".join(parts)


def _listed(names: list[str], most: int = 12) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
