"""Criteo days as TorchRec's users prepare them: raw TSV to ``.npy`` days with contiguous ids.

The result is, array for array, what TorchRec's two steps give (tested):
``BinaryCriteoUtils.tsv_to_npys`` per day (``day_<n>_dense.npy``,
``day_<n>_labels.npy``), then ``BinaryCriteoUtils.sparse_to_contiguous`` over
all the days with the same frequency threshold (``day_<n>_sparse_contig_freq.npy``):
per column, an id seen at least ``threshold`` times in all the days (every id
when the threshold is 0 or 1) gets the next integer from 2, in the order of
its first occurrence (day by day, line by line), and a rarer id gets 1. So a
column's table needs ``2 + kept ids`` rows (row 0 unused, row 1 the rare
ids); :func:`preprocess_days` writes the 26 sizes, comma-separated, to
``num_embeddings_per_feature.txt``.

TorchRec holds all the days in memory at once (as Python dicts). Here, three
passes, each in parallel:

1. per day, ``workers`` days at once (processes): the TSV streamed in blocks
   (:func:`~torchrec_lookahead.data.tsv.convert_tsv_day`) into the day's dense
   and label files (final) and its raw ids (kept for pass 3), while one hash
   table per column counts the day's distinct ids in the order they first
   occur (the day's vocabulary, saved);
2. per column, ``workers`` columns at once (threads: the compiled code runs
   without the GIL): the days' vocabularies merged in day order into the
   column's counts, and from them its lookup table (kept id -> contiguous id);
3. per day, ``workers`` days at once: the raw ids mapped through the lookup
   tables, a block at a time.

Memory is bounded by the distinct ids, never by the lines. Peak private
memory, besides the interpreter's:

* pass 1, per worker: a block of text (``block_bytes``, 32 MiB) twice and its
  parsed rows (about 100 MB in all; several times more for a block with a line
  off Criteo's form, which the general parser takes), plus 48-96 bytes per
  distinct (column, id) of its day (144 for a moment while a table doubles);
* pass 2: 40-80 bytes (120 while doubling) per distinct id of each of the
  ``workers`` columns being merged, plus that column's vocabulary of one day;
* pass 3, per worker: two blocks of rows (2**18 lines each, 109 MB); the lookup
  tables are mapped read-only (page cache, shared by the workers: 16-32 bytes
  per kept id).

Disk, besides the output (264 bytes a line): the raw ids of the days not yet
mapped (208 bytes a line) and the vocabularies (16 bytes per distinct
(column, id) of each day).

Restartable by day, all state in ``<output>/.preprocess/``: each day's pass 1
and pass 3 end with a marker, pass 2 with one for all columns, and every file
appears under its name only complete, so a run that is stopped and started
again with the same flags goes on where it stopped. A run with other flags
or other input days on the same output folder is refused.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import (
    Executor,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    as_completed,
)
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from torchrec_lookahead.data.days import (
    CAT_FEATURE_COUNT,
    CONTIGUOUS,
    PREPROCESS_STATE,
    file_fingerprint,
    npy_day_paths,
    raw_day_paths,
    scan_days,
)
from torchrec_lookahead.data.id_counts import IdCounts, lookup_ids, table_shift
from torchrec_lookahead.data.npy import DataError, MappedRows, RowWriter
from torchrec_lookahead.data.tsv import convert_tsv_day
from torchrec_lookahead.settings import check_count

__all__ = ["CARDINALITY_FILE", "preprocess_days", "read_cardinalities"]

CARDINALITY_FILE = "num_embeddings_per_feature.txt"
MAP_ROWS = 2**18  # lines a pass-3 block maps at once
Job = tuple[Callable[..., Any], tuple[Any, ...]]  # a function and its arguments
# ------------------------------------------------------------------ the three passes


def preprocess_days(
    input_dir: str | Path,
    output_dir: str | Path,
    frequency_threshold: int,
    workers: int = 1,
    block_bytes: int = 32 * 2**20,
    progress: bool = True,
) -> list[int]:
    """Preprocess the raw days of ``input_dir`` into ``output_dir`` (the module docstring);
    returns the 26 table sizes. Days already done are kept. Bad input (the day set, the
    settings, an output folder holding other data) is refused before anything is written."""
    threshold = check_count("frequency_threshold", frequency_threshold, 0)
    workers = check_count("workers", workers, 1)
    tsvs = raw_day_paths(input_dir)
    out = Path(output_dir)
    state = out / PREPROCESS_STATE
    settings = {"frequency_threshold": threshold, "days": [p.name for p in tsvs]}
    _check_output(out, state, settings, tsvs)
    if (state / "done").exists():
        _check_done(out, len(tsvs))
        return read_cardinalities(out / CARDINALITY_FILE)
    state.mkdir(parents=True, exist_ok=True)
    if not (state / "state.json").exists():
        _write_text(state / "state.json", json.dumps(settings, indent=1))
    _warm_kernels()  # compiled once here, before any worker is forked

    todo = [d for d in range(len(tsvs)) if not (state / f"day_{d}.counted").exists()]
    counting: list[Job] = [
        (_convert_and_count, (tsvs[d], state, out, d, block_bytes)) for d in todo
    ]
    _run(counting, workers, processes=True, desc="1/3 convert, count ids", progress=progress)

    if not (state / "tables.done").exists():
        merging: list[Job] = [
            (_column_table, (state, len(tsvs), c, threshold)) for c in range(CAT_FEATURE_COUNT)
        ]
        sizes = _run(merging, workers, processes=False, desc="2/3 merge columns", progress=progress)
        _write_text(out / CARDINALITY_FILE, ",".join(map(str, sizes)) + "\n")
        (state / "tables.done").write_text("")
    for d in range(len(tsvs)):
        (state / f"day_{d}.vocab.npz").unlink(missing_ok=True)

    todo = [d for d in range(len(tsvs)) if not (state / f"day_{d}.mapped").exists()]
    mapping: list[Job] = [(_map_day, (state, out, d, threshold)) for d in todo]
    _run(mapping, workers, processes=True, desc="3/3 map ids", progress=progress)

    for c in range(CAT_FEATURE_COUNT):
        for part in ("keys", "values"):
            (state / f"column_{c}.{part}.npy").unlink(missing_ok=True)
    for d in range(len(tsvs)):  # a day mapped just before a stop may have left its raw ids
        (state / f"day_{d}_sparse.npy").unlink(missing_ok=True)
    (state / "done").write_text("")
    return read_cardinalities(out / CARDINALITY_FILE)


def _check_done(out: Path, days: int) -> None:
    """A finished preprocessing's output is still whole (by name): a file removed since
    is said by a rerun, not found by training later."""
    try:
        found = len(npy_day_paths(out))
        problem = None if found == days else f"it holds {found} of its {days} days"
    except DataError as error:
        problem = str(error)
    if problem is None and not (out / CARDINALITY_FILE).is_file():
        problem = f"{CARDINALITY_FILE} is gone"
    if problem is not None:
        raise DataError(
            f"{out}: its preprocessing is done, but its output changed since ({problem}); "
            "a finished output is not redone in place: put back what changed, or "
            "preprocess again into a new --output_dir"
        )


def read_cardinalities(path: str | Path) -> list[int]:
    """The 26 table sizes of a cardinality file (comma-separated positive integers)."""
    text = Path(path).read_bytes()[:4096].decode(errors="replace").strip()
    sizes = text.split(",")
    if len(sizes) != CAT_FEATURE_COUNT or not all(
        s.strip().isascii() and s.strip().isdigit() and int(s) > 0 for s in sizes
    ):
        raise DataError(
            f"{path}: expected {CAT_FEATURE_COUNT} comma-separated positive "
            f"integers, found {text[:80]!r}"
        )
    return [int(s) for s in sizes]


def _check_output(out: Path, state: Path, settings: dict[str, Any], tsvs: list[Path]) -> None:
    """Refuse an output folder this preprocessing cannot (re)write: a file, a run with
    other settings or from days that changed since, or ``.npy`` days another tool wrote."""
    if out.exists() and not out.is_dir():
        raise DataError(f"{out}: is a file, not a folder")
    recorded = state / "state.json"
    if recorded.exists():
        before = _recorded(recorded)
        changed = [
            f"{key} {_shown(before.get(key))} (now {_shown(value)})"
            for key, value in settings.items()
            if before.get(key) != value
        ]
        for day, tsv in enumerate(tsvs):
            marker = state / f"day_{day}.counted"
            if not changed and marker.exists() and _changed(marker, tsv):
                changed.append(f"{tsv.name}, which changed since it was converted")
        if changed:
            raise DataError(
                f"{out} holds a preprocessing with other {'; '.join(changed)}: rerun with "
                "the flags and days that started it, choose another --output_dir, or remove "
                "it to start again"
            )
        return
    if out.exists():
        found = scan_days(out)
        if found.npy or (out / CARDINALITY_FILE).exists():
            raise DataError(
                f"{out} already holds .npy days that this preprocessing did not write: "
                "choose an empty --output_dir"
            )


def _changed(recorded: Path, tsv: Path) -> bool:
    """Whether ``tsv`` differs from what its day's marker recorded (``file_fingerprint``;
    a marker of an earlier version holds its name and size only)."""
    then = _recorded(recorded)
    now = json.loads(file_fingerprint(tsv))
    if "bytes" not in then or not then.keys() <= now.keys():
        raise DataError(
            f"{recorded}: damaged (not a day's record); remove {recorded.parent.parent}"
        )
    return any(then[key] != now[key] for key in then)


def _recorded(path: Path) -> dict[str, Any]:
    """A state file of the preprocessing (JSON), or ``DataError`` naming it if damaged."""
    try:
        recorded = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise DataError(
            f"{path}: damaged ({error}); remove {path.parent.parent} to start again"
        ) from error
    if not isinstance(recorded, dict):
        raise DataError(f"{path}: damaged (not a JSON object); remove {path.parent.parent}")
    return recorded


def _shown(value: Any) -> str:
    if isinstance(value, list) and len(value) > 3:
        return f"{value[0]} .. {value[-1]} ({len(value)} days)"
    return str(value)


def _run(
    jobs: Sequence[Job],
    workers: int,
    processes: bool,
    desc: str,
    progress: bool,
) -> list[Any]:
    """Run ``jobs`` (function, arguments), ``workers`` at a time (forked processes or
    threads; in this thread when one), and return their results in order. The first
    error cancels the jobs not started and is raised once the running ones end."""
    bar = tqdm(total=len(jobs), desc=desc, unit="job", disable=not progress or not jobs)
    try:
        if workers == 1 or len(jobs) <= 1:
            results = []
            for function, arguments in jobs:
                results.append(function(*arguments))
                bar.update()
            return results
        pool: Executor
        if processes:
            pool = ProcessPoolExecutor(
                min(workers, len(jobs)),
                mp_context=multiprocessing.get_context("fork"),
                initializer=_end_with,
                initargs=(os.getpid(),),
            )
        else:
            pool = ThreadPoolExecutor(min(workers, len(jobs)), thread_name_prefix="preprocess")
        with pool:
            futures: list[Future] = [pool.submit(f, *a) for f, a in jobs]
            try:
                for future in as_completed(futures):
                    future.result()
                    bar.update()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
            return [f.result() for f in futures]
    finally:
        bar.close()


def _end_with(parent: int) -> None:
    """A worker's first step: it ends when its parent does, even one killed (``kill -9``),
    which else leaves it waiting for jobs that never come (on Linux; elsewhere only a
    parent already gone is seen)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (AttributeError, OSError):  # a libc without it: the check below only
            pass
    if os.getppid() != parent:  # gone before that took hold: end as the signal would
        os.kill(os.getpid(), signal.SIGKILL)


def _convert_and_count(tsv: Path, state: Path, out: Path, day: int, block_bytes: int) -> None:
    """Pass 1 for one day: its dense and label files into ``out``, its raw ids and its
    vocabulary (per column: distinct ids in order of first occurrence, and counts)
    into ``state``."""
    source = file_fingerprint(tsv)  # before reading it: a day changed meanwhile differs
    columns = [IdCounts(record_ids=True) for _ in range(CAT_FEATURE_COUNT)]

    def count(ids: np.ndarray) -> None:
        for column, counts in enumerate(columns):
            counts.add(ids[:, column])

    convert_tsv_day(tsv, state, day, block_bytes, on_ids=count)
    vocabulary: dict[str, Any] = {}
    for column, counts in enumerate(columns):
        vocabulary[f"ids_{column}"] = counts.ids[: counts.size]
        vocabulary[f"counts_{column}"] = counts.counts[: counts.size]
    _write_atomically(state / f"day_{day}.vocab.npz", lambda f: np.savez(f, **vocabulary))
    for kind in ("dense", "labels"):
        os.replace(state / f"day_{day}_{kind}.npy", out / f"day_{day}_{kind}.npy")
    _write_text(state / f"day_{day}.counted", source)


def _column_table(state: Path, days: int, column: int, threshold: int) -> int:
    """Pass 2 for one column: the days' vocabularies merged in day order, its lookup table
    saved; returns the column's table size."""
    counts = IdCounts()
    for day in range(days):
        with np.load(state / f"day_{day}.vocab.npz") as vocabulary:
            counts.add(vocabulary[f"ids_{column}"], vocabulary[f"counts_{column}"])
    keys, values, size = counts.lookup_table(threshold)
    del counts
    _write_atomically(state / f"column_{column}.keys.npy", lambda f: np.save(f, keys))
    _write_atomically(state / f"column_{column}.values.npy", lambda f: np.save(f, values))
    return size


def _map_day(state: Path, out: Path, day: int, threshold: int) -> None:
    """Pass 3 for one day: its raw ids through the columns' lookup tables."""
    tables = [
        tuple(
            np.load(state / f"column_{c}.{part}.npy", mmap_mode="r") for part in ("keys", "values")
        )
        for c in range(CAT_FEATURE_COUNT)
    ]
    absent = 1 if threshold > 1 else -1  # below the threshold: 1; otherwise every id is there
    raw = MappedRows(state / f"day_{day}_sparse.npy")
    try:
        with RowWriter(out / f"day_{day}_{CONTIGUOUS}.npy", np.int64, CAT_FEATURE_COUNT) as mapped:
            for start in range(0, raw.shape[0], MAP_ROWS):
                block = np.array(raw.rows[start : start + MAP_ROWS])  # no view outlives the map
                result = np.empty(block.shape, np.int64)
                for c, (keys, values) in enumerate(tables):
                    bad = lookup_ids(
                        block[:, c], keys, values, table_shift(keys), absent, result[:, c]
                    )
                    if bad >= 0:
                        raise DataError(
                            f"{raw.path}: id {block[bad, c]} of column {c} (line "
                            f"{start + bad + 1}) was never counted: the state in "
                            f"{state} is damaged; remove it to start again"
                        )
                mapped.append(result)
                raw.done_with(start, start + MAP_ROWS)
    finally:
        raw.close()
    (state / f"day_{day}.mapped").write_text("")
    (state / f"day_{day}_sparse.npy").unlink()


def _warm_kernels() -> None:
    """Compile (or load) the kernels for the argument types the passes use."""
    counts = IdCounts(record_ids=True, capacity=2)
    block = np.arange(12, dtype=np.int64).reshape(4, 3)
    counts.add(block[:, 1])
    counts.add(np.arange(3, dtype=np.int64), np.ones(3, np.int64))
    keys, values, _ = counts.lookup_table(2)
    for array in (keys, values, block):  # as mapped from their files
        array.flags.writeable = False
    lookup_ids(block[:, 1], keys, values, table_shift(keys), 1, np.empty((4, 3), np.int64)[:, 1])


def _write_atomically(path: Path, write: Callable[[Any], None]) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


def _write_text(path: Path, text: str) -> None:
    _write_atomically(path, lambda f: f.write(text.encode()))
