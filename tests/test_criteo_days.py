"""Criteo days in bounded memory: the mapped per-rank reader, its seeded order, the streaming
TSV conversion and the streaming ``.npy`` writer, each against TorchRec's own or a plain read."""

from __future__ import annotations

import gc
import gzip
import importlib.util
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.datasets.criteo import (
    DEFAULT_CAT_NAMES,
    BinaryCriteoUtils,
    InMemoryBinaryCriteoIterDataPipe,
)
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_lookahead.data import contiguous
from torchrec_lookahead.data.contiguous import preprocess_days
from torchrec_lookahead.data.criteo import CriteoDayReader, SampleOrder, find_days, stage_samples
from torchrec_lookahead.data.dedup import deduplicate
from torchrec_lookahead.data.npy import DataError, MappedRows, RowWriter
from torchrec_lookahead.data.tsv import DONE, convert_tsv_day, convert_tsv_days

HASHES = [97 + 3 * i for i in range(26)]
DAY_ROWS = (1000, 700, 900)  # the batches cross day boundaries
KINDS_WRITTEN = ("dense", "labels", "sparse_contig_freq")  # a preprocessed day's files


def write_days(folder: Path, rows=DAY_ROWS, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for day, n in enumerate(rows):
        np.save(folder / f"day_{day}_dense.npy", rng.random((n, 13), dtype=np.float32))
        np.save(folder / f"day_{day}_sparse.npy", rng.integers(0, 10**6, (n, 26)))
        np.save(folder / f"day_{day}_labels.npy", rng.integers(0, 2, (n, 1), dtype=np.int32))
    return folder


def assert_same_batch(a, b) -> None:
    assert torch.equal(a.dense_features, b.dense_features)
    assert torch.equal(a.labels, b.labels)
    for get in ("values", "lengths"):
        x, y = getattr(a.sparse_features, get)(), getattr(b.sparse_features, get)()
        assert x.dtype == y.dtype and torch.equal(x, y), get
    assert a.sparse_features.keys() == b.sparse_features.keys()


def torchrec_rank_share(batch, rank: int, world_size: int):
    """Rank ``rank``'s share of one of TorchRec's global batches, cut by hand."""
    size = batch.labels.numel() // world_size
    features = batch.sparse_features
    lengths = features.lengths().view(26, -1)[:, rank * size : (rank + 1) * size]
    values = features.values().view(26, -1)[:, rank * size : (rank + 1) * size]
    return type(batch)(
        batch.dense_features[rank * size : (rank + 1) * size],
        type(features)(
            keys=features.keys(),
            values=values.reshape(-1),
            lengths=lengths.reshape(-1),
            stride=size,
        ),
        batch.labels[rank * size : (rank + 1) * size],
    )


@pytest.mark.parametrize("world_size", [1, 2])
def test_file_order_reads_what_torchrecs_reader_reads(tmp_path: Path, world_size: int) -> None:
    days = find_days(write_days(tmp_path))
    global_batch = 128
    train = days[:-1]
    theirs = InMemoryBinaryCriteoIterDataPipe(
        "train",
        *([str(p) for p in paths] for paths in zip(*(d.paths() for d in train))),
        batch_size=global_batch,
        rank=0,
        world_size=1,
        drop_last=True,
        hashes=HASHES,
    )
    order = SampleOrder(*stage_samples(days, "train"), global_batch)
    theirs = list(theirs)
    assert len(theirs) == order.steps == 1700 // 128
    for rank in range(world_size):
        ours = CriteoDayReader(days, order, rank, world_size, HASHES)
        for step, batch in enumerate(ours.loader(num_workers=1)):
            assert_same_batch(torchrec_rank_share(theirs[step], rank, world_size), batch)


class _Cycle:
    """Garbage only the cyclic collector frees: an object that refers to itself."""

    def __init__(self) -> None:
        self.me = self


def test_the_loader_collects_garbage_before_it_forks_its_workers(tmp_path: Path) -> None:
    """Defect seen in the suite: a forked worker finalized an earlier test's gloo process
    group (garbage in a reference cycle), whose destructor waits for threads that exist
    only in the parent, and hung. The loader now collects in the parent before forking
    (here with the collector off, so nothing else collects the cycle)."""
    days = find_days(write_days(tmp_path))
    order = SampleOrder(*stage_samples(days, "train"), 128)
    garbage = _Cycle()
    alive = weakref.ref(garbage)
    del garbage
    gc.disable()
    try:
        batches = iter(CriteoDayReader(days, order, 0, 1, HASHES).loader(num_workers=1))
        assert alive() is None
        assert next(batches) is not None
    finally:
        gc.enable()


def test_training_on_it_equals_training_on_torchrecs_reader(tmp_path: Path) -> None:
    """TorchRec's DLRM, trained step by step on each reader's batches (world size 2's
    rank 1 share, cut by hand from TorchRec's global batches), ends bitwise equal."""
    days = find_days(write_days(tmp_path))
    theirs = InMemoryBinaryCriteoIterDataPipe(
        "train",
        *([str(p) for p in paths] for paths in zip(*(d.paths() for d in days[:-1]))),
        batch_size=128,
        rank=0,
        world_size=1,
        drop_last=True,
        hashes=HASHES,
    )
    ours = CriteoDayReader(days, SampleOrder(*stage_samples(days, "train"), 128), 1, 2, HASHES)
    models = []
    for stream in ([torchrec_rank_share(b, 1, 2) for b in theirs], ours.loader(num_workers=1)):
        torch.manual_seed(0)
        tables = [
            EmbeddingBagConfig(
                name=f"t_{k}", embedding_dim=8, num_embeddings=rows, feature_names=[k]
            )
            for k, rows in zip(DEFAULT_CAT_NAMES, HASHES)
        ]
        model = DLRMTrain(
            DLRM(
                embedding_bag_collection=EmbeddingBagCollection(tables),
                dense_in_features=13,
                dense_arch_layer_sizes=[16, 8],
                over_arch_layer_sizes=[16, 1],
            )
        )
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
        for batch in stream:
            optimizer.zero_grad()
            model(batch)[0].backward()
            optimizer.step()
        models.append(model.state_dict())
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])


def test_validation_and_test_are_the_last_days_halves(tmp_path: Path) -> None:
    days = find_days(write_days(tmp_path))
    assert stage_samples(days, "val") == (1700, 450) and stage_samples(days, "test") == (2150, 450)
    labels = np.load(days[-1].labels)
    test = CriteoDayReader(days, SampleOrder(*stage_samples(days, "test"), 50))
    got = torch.cat([b.labels for b in test.loader()])
    assert torch.equal(got, torch.from_numpy(labels[450:].reshape(-1)))


def test_shuffled_order_is_a_seeded_permutation_per_epoch_and_any_world_size(
    tmp_path: Path,
) -> None:
    days = find_days(write_days(tmp_path))
    order = SampleOrder(*stage_samples(days, "train"), 64, epochs=2, seed=5, chunk_samples=300)
    per_epoch = [
        np.concatenate(
            [
                order.step_samples(s + e * order.steps_per_epoch)
                for s in range(order.steps_per_epoch)
            ]
        )
        for e in range(2)
    ]
    for samples in per_epoch:  # each sample at most once per epoch, the dropped tail aside
        assert len(np.unique(samples)) == len(samples) == 1700 // 64 * 64
        assert samples.min() >= 0 and samples.max() < 1700
    assert not np.array_equal(per_epoch[0], per_epoch[1])
    assert not np.array_equal(np.sort(per_epoch[0][:64]), per_epoch[0][:64])  # shuffled within
    again = SampleOrder(*stage_samples(days, "train"), 64, epochs=2, seed=5, chunk_samples=300)
    assert all(np.array_equal(order.step_samples(s), again.step_samples(s)) for s in range(52))
    other = SampleOrder(*stage_samples(days, "train"), 64, epochs=2, seed=6, chunk_samples=300)
    assert not np.array_equal(order.step_samples(0), other.step_samples(0))
    # A global step holds the same samples at world size 1, 2 and 4 (a shrink changes nothing).
    readers = {w: [CriteoDayReader(days, order, r, w, HASHES) for r in range(w)] for w in (1, 2, 4)}
    for step in range(order.steps):
        whole = readers[1][0][step]
        for w in (2, 4):
            shares = [reader[step] for reader in readers[w]]
            assert torch.equal(torch.cat([s.dense_features for s in shares]), whole.dense_features)
            assert torch.equal(torch.cat([s.labels for s in shares]), whole.labels)


def test_a_loader_started_mid_pass_with_workers_gives_the_rest_exactly(tmp_path: Path) -> None:
    days = find_days(write_days(tmp_path))
    order = SampleOrder(*stage_samples(days, "train"), 64, epochs=2, seed=1, chunk_samples=256)
    reader = CriteoDayReader(days, order, 1, 2, HASHES)
    whole = list(reader.loader())
    for workers in (0, 2):
        rest = list(reader.loader(start=17, stop=40, num_workers=workers))
        assert len(rest) == 23
        for a, b in zip(whole[17:40], rest):
            assert_same_batch(a, b)
    assert reader.resume_step(reader.state_dict(17)) == 17
    other = CriteoDayReader(days, SampleOrder(*stage_samples(days, "train"), 32, seed=2), 1, 2)
    with pytest.raises(DataError, match=r"global batch \(samples per rank x ranks\) was 64, is 32"):
        other.resume_step(reader.state_dict(17))
    with pytest.raises(DataError, match=r"the shuffle seed \(None: not shuffled\) was 1, is 2"):
        other.resume_step(reader.state_dict(17))


def test_a_resume_onto_other_data_of_as_many_samples_is_refused(tmp_path: Path) -> None:
    """Another seed's days (as many samples, other contents) were taken silently."""
    days = find_days(write_days(tmp_path / "a"))
    other_days = find_days(write_days(tmp_path / "b", seed=7))
    assert [d.rows for d in days] == [d.rows for d in other_days]
    order = SampleOrder(*stage_samples(days, "train"), 64)
    state = CriteoDayReader(days, order, 0, 1).state_dict(5)
    with pytest.raises(DataError, match="the days hold other data"):
        CriteoDayReader(other_days, order, 0, 1).resume_step(state)
    older = {k: v for k, v in state.items() if k != "data"}  # saved before "data" was
    assert CriteoDayReader(days, order, 0, 1).resume_step(older) == 5


def test_deduplication_in_the_reader_equals_deduplicating_its_batches(tmp_path: Path) -> None:
    days = find_days(write_days(tmp_path))
    rows = np.load(days[0].sparse)
    rows[:, :4] = rows[::8, :4].repeat(8, axis=0)[: len(rows)]  # sessions of 8 share 4 features
    np.save(days[0].sparse, rows)
    order = SampleOrder(0, 512, 128)
    keys = ["cat_0", "cat_1", "cat_2", "cat_3"]
    plain = CriteoDayReader(days, order, 0, 1, HASHES)
    deduped = CriteoDayReader(days, order, 0, 1, HASHES, dedup_keys=keys)
    for a, b in zip(plain.loader(), deduped.loader(num_workers=1)):
        ours = deduplicate(a.sparse_features, keys)
        assert b.sparse_features.variable_stride_per_key()
        assert torch.equal(ours.values(), b.sparse_features.values())
        assert torch.equal(ours.inverse_indices()[1], b.sparse_features.inverse_indices()[1])


def test_page_advice_drops_what_was_read_from_the_mapping(tmp_path: Path) -> None:
    path = tmp_path / "rows.npy"
    np.save(path, np.arange(2**22, dtype=np.int64).reshape(-1, 8))  # 32 MiB
    mapped = MappedRows(path)

    def file_rss_kb() -> int:
        status = Path("/proc/self/status").read_text().split("\n")
        return int(next(line for line in status if line.startswith("RssFile:")).split()[1])

    before = file_rss_kb()
    assert int(mapped.rows.sum()) == (2**22 - 1) * 2**22 // 2  # every page read
    touched = file_rss_kb()
    mapped.will_need(0, 100)
    mapped.done_with(0, mapped.shape[0])
    dropped = file_rss_kb()
    assert touched - before > 30_000 and touched - dropped > 30_000, (before, touched, dropped)
    assert int(mapped.rows[12345, 3]) == 12345 * 8 + 3  # still readable: pages come back
    mapped.close()


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda f: f.with_name("day_1_sparse.npy").write_bytes(
                f.with_name("day_1_sparse.npy").read_bytes()[:-100]
            ),
            "day_1_sparse.npy: .* truncated",
        ),
        (
            lambda f: np.save(f.with_name("day_0_dense.npy"), np.zeros((1000, 12), np.float32)),
            r"day_0_dense.npy: float32 \[1000, 12\]; expected dense \[N, 13\]",
        ),
        (
            lambda f: np.save(f.with_name("day_0_dense.npy"), np.zeros((1000, 13))),
            r"day_0_dense.npy: float64",
        ),
        (
            lambda f: np.save(f.with_name("day_1_labels.npy"), np.zeros((699, 1), np.int32)),
            r"day 1's files disagree on its sample count: \{'dense': 700, .* 'labels': 699",
        ),
        (lambda f: f.with_name("day_2_labels.npy").unlink(), "day 2 lacks"),
        (lambda f: f.with_name("day_0_labels.npy").write_bytes(b"not numpy"), "not a .npy file"),
        (
            lambda f: np.save(f.with_name("day_0_labels.npy"), np.zeros(1000, np.int32)),
            "a 1-D int32 array; expected 2-D",
        ),
    ],
)
def test_bad_day_files_are_refused_naming_the_file(tmp_path: Path, damage, message) -> None:
    folder = write_days(tmp_path)
    damage(folder / "day_0_dense.npy")
    with pytest.raises(DataError, match=message):
        find_days(folder)


def tsv_day(path: Path, lines: int, seed: int, end_newline: bool = True) -> Path:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(lines):
        ints = [str(v) if rng.random() > 0.1 else "" for v in rng.integers(-3, 5000, 13)]
        cats = [f"{v:08x}" if rng.random() > 0.05 else "" for v in rng.integers(0, 2**32, 26)]
        rows.append("\t".join([str(rng.integers(0, 2)), *ints, *cats]))
    path.write_text("\n".join(rows) + ("\n" if end_newline else ""))
    return path


def test_streamed_conversion_equals_torchrecs_and_restarts_where_it_stopped(
    tmp_path: Path,
) -> None:
    tsvs = [tsv_day(tmp_path / f"day_{d}", 2000 + d, d, end_newline=d == 1) for d in range(3)]
    good = tsvs[2].read_text()
    tsvs[2].write_text(good.replace("\t", "\t\t", 1))  # line 1 of day 2: a field too many
    out = tmp_path / "npy"
    with pytest.raises(DataError, match=r"day_2:1: 41 tab-separated fields"):
        convert_tsv_days(tsvs, out, block_bytes=10_000, progress=False)
    assert (
        not (out / DONE).exists()
        and not list(out.glob("day_2_*"))
        and not list(out.glob("*.partial"))
    )
    done_at = (out / "day_0.done").stat().st_mtime_ns
    tsvs[2].write_text(good)
    days = convert_tsv_days(tsvs, out, block_bytes=10_000, progress=False)
    assert (out / "day_0.done").stat().st_mtime_ns == done_at  # days done are not redone
    assert [d.rows for d in days] == [2000, 2001, 2002] and (out / DONE).exists()
    for day, tsv in enumerate(tsvs):
        reference = [tmp_path / f"ref_{day}_{k}.npy" for k in ("dense", "sparse", "labels")]
        BinaryCriteoUtils.tsv_to_npys(str(tsv), *map(str, reference))
        for ours, theirs in zip(days[day].paths(), reference):
            a, b = np.load(ours), np.load(theirs)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    # Other files of the same names (other days): converted again, not taken as done.
    # The earlier code's marker (the day's path) is taken as done, as that code took it.
    (out / "day_0.done").write_text(f"{tsvs[0]}\n")
    converted_at = (out / "day_0_dense.npy").stat().st_mtime_ns
    convert_tsv_days(tsvs, out, block_bytes=10_000, progress=False)
    assert (out / "day_0_dense.npy").stat().st_mtime_ns == converted_at
    (tmp_path / "other").mkdir()
    others = [tsv_day(tmp_path / "other" / f"day_{d}", 300 + d, 7 + d) for d in range(3)]
    again = convert_tsv_days(others, out, block_bytes=10_000, progress=False)
    assert [d.rows for d in again] == [300, 301, 302]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda fields: fields[:-1], r":43: 39 tab-separated fields"),
        (lambda fields: [*fields[:-1], "12zz34ab"], r":43: field 40 is '12zz34ab', not a hex"),
        (lambda fields: [fields[0], "1.5", *fields[2:]], r":43: field 2 is '1.5', not a decimal"),
        (lambda fields: [fields[0], "3000000000", *fields[2:]], r"field 2 .* of 32 bits"),
        (lambda fields: [*fields[:-1], "f" * 16], r"field 40 is 'f{16}', not .* below 2\*\*63"),
        # NUL bytes (a crash-damaged file) were read as numpy's padding: "1\x002" as 0x12.
        (lambda fields: [*fields[:-1], "1\x002"], r"field 40 is '1\\x002', not a hex.*NUL"),
        (lambda fields: [*fields[:-1], "\x00"], r"field 40 is '\\x00', not a hexadecimal id"),
        (lambda fields: [fields[0], "12\x00", *fields[2:]], r"field 2 .* not a decimal .*NUL"),
    ],
)
def test_a_malformed_line_is_named(tmp_path: Path, mutate, message) -> None:
    lines = tsv_day(tmp_path / "day_0", 100, 0).read_text().splitlines()
    lines[42] = "\t".join(mutate(lines[42].split("\t")))
    (tmp_path / "day_0").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=message):
        convert_tsv_days([tmp_path / "day_0"], tmp_path / "npy", progress=False)
    assert not [p for p in (tmp_path / "npy").iterdir() if p.suffix != ".done"]


def _preprocessing_jobs_that_wait(seconds: float) -> None:
    """A preprocessing pass whose two worker processes each wait ``seconds``."""
    jobs = [(time.sleep, (seconds,)), (time.sleep, (seconds,))]
    contiguous._run(jobs, 2, processes=True, desc="", progress=False)


def _stat(pid: int | str) -> list[str]:
    """A process's ``/proc`` stat fields after its name (state, parent, ...); none if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return []


def _children(pid: int) -> list[int]:
    pids = [p.name for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [int(child) for child in pids if _stat(child)[1:2] == [str(pid)]]


def test_preprocessing_workers_end_with_a_parent_killed_by_kill_9() -> None:
    """A preprocessing killed with ``kill -9`` left its worker processes waiting for jobs
    forever; they end with it."""
    parent = multiprocessing.get_context("forkserver").Process(
        target=_preprocessing_jobs_that_wait, args=(60,)
    )
    parent.start()
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers := _children(parent.pid)) < 2:
            assert parent.is_alive() and time.monotonic() < deadline, "no workers started"
            time.sleep(0.05)
    finally:
        parent.kill()  # SIGKILL
        parent.join()
    deadline = time.monotonic() + 30  # a worker gone, or a zombie left to its adopter
    while alive := [pid for pid in workers if _stat(pid)[:1] not in ([], ["Z"])]:
        if time.monotonic() > deadline:
            for pid in alive:
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"workers {alive} outlived their parent, killed with kill -9")
        time.sleep(0.05)


def test_row_writer_publishes_only_whole_files(tmp_path: Path) -> None:
    path = tmp_path / "rows.npy"
    rows = np.arange(90).reshape(30, 3)
    with RowWriter(path, np.int64, 3) as writer:
        for start in range(0, 30, 7):
            writer.append(rows[start : start + 7])
            assert not path.exists()
    assert np.array_equal(np.load(path), rows) and writer.count == 30
    with pytest.raises(RuntimeError), RowWriter(tmp_path / "cut.npy", np.int64, 3) as cut:
        cut.append(np.zeros((5, 3), np.int64))
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == [path]
    with pytest.raises(ValueError, match="rows of shape"), RowWriter(path, np.int64, 3) as bad:
        bad.append(np.zeros((2, 4), np.int64))


def test_orders_and_readers_refuse_bad_settings(tmp_path: Path) -> None:
    days = find_days(write_days(tmp_path))
    with pytest.raises(DataError, match="make no global batch"):
        SampleOrder(0, 100, 128)
    with pytest.raises(ValueError, match="chunk_samples must be a positive integer"):
        SampleOrder(0, 1000, 10, chunk_samples=0)
    with pytest.raises(DataError, match="does not split into 3 ranks"):
        CriteoDayReader(days, SampleOrder(0, 1000, 128), 0, 3)
    with pytest.raises(DataError, match="the days hold 2,600"):
        CriteoDayReader(days, SampleOrder(2000, 1000, 128))
    with pytest.raises(IndexError, match="outside the pass"):
        CriteoDayReader(days, SampleOrder(0, 1000, 128))[7]


# ---------------------------------------------------------------- preprocessing (TorchRec's)

PREPROCESS = Path(__file__).resolve().parents[1] / "examples" / "dlrm" / "preprocess.py"
RAW_DAY_LINES = (1500, 1300, 1400)


def criteo_like_day(path: Path, lines: int, seed: int) -> Path:
    """A raw day with what TorchRec's preprocessing must get right: empty fields, negative
    integers, ids repeated within and across days (Zipf draws from small per-column pools,
    some written in upper case), rare ids seen once, twice or three times over all days
    (uniform draws from a larger pool), and on odd seeds no newline after the last line."""
    rng = np.random.default_rng(seed)
    common = np.random.default_rng(7).integers(0, 2**32, (26, 40))
    rare = np.random.default_rng(8).integers(2**32, 2**40, (26, 400))
    columns = np.arange(26)
    ids = common[columns, (rng.zipf(1.4, (lines, 26)) - 1) % (2 + columns)]
    picked = rng.random((lines, 26)) < 0.15
    ids = np.where(picked, rare[columns, rng.integers(0, 400, (lines, 26))], ids)
    cats = np.char.mod("%08x", ids)
    cats = np.where(rng.random((lines, 26)) < 0.1, np.char.upper(cats), cats)
    cats = np.where(rng.random((lines, 26)) < 0.05, "", cats)
    ints = rng.integers(-3, 5000, (lines, 13)).astype(str)
    ints = np.where(rng.random((lines, 13)) < 0.1, "", ints)
    labels = rng.integers(0, 2, (lines, 1)).astype(str)
    rows = np.concatenate([labels, ints, cats], axis=1).tolist()
    end = "" if seed % 2 else "\n"
    path.write_text("\n".join("\t".join(row) for row in rows) + end)
    return path


@pytest.fixture(scope="module")
def raw_days(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Three raw days, and TorchRec's ``tsv_to_npys`` of each (``day_<n>_{kind}.npy``)."""
    root = tmp_path_factory.mktemp("raw")
    raw, converted = root / "raw", root / "tsv_to_npys"
    raw.mkdir()
    converted.mkdir()
    for day, lines in enumerate(RAW_DAY_LINES):
        criteo_like_day(raw / f"day_{day}", lines, day)
        outputs = [converted / f"day_{day}_{kind}.npy" for kind in ("dense", "sparse", "labels")]
        BinaryCriteoUtils.tsv_to_npys(str(raw / f"day_{day}"), *map(str, outputs))
    return raw, converted


def torchrec_contiguous(converted: Path, threshold: int, out: Path) -> Path:
    """TorchRec's ``sparse_to_contiguous`` over the days, in day order, into ``out``."""
    out.mkdir(exist_ok=True)
    sparse = [str(converted / f"day_{day}_sparse.npy") for day in range(len(RAW_DAY_LINES))]
    BinaryCriteoUtils.sparse_to_contiguous(sparse, str(out), frequency_threshold=threshold)
    return out


def assert_preprocessed_as_torchrec(out: Path, converted: Path, contiguous: Path) -> None:
    """Every array of ``out`` equals TorchRec's (dtype, shape, values; the files byte for
    byte), and the cardinality file holds 2 + the ids each column keeps."""
    for day in range(len(RAW_DAY_LINES)):
        pairs = [
            (out / f"day_{day}_{kind}.npy", converted / f"day_{day}_{kind}.npy")
            for kind in ("dense", "labels")
        ]
        name = f"day_{day}_sparse_contig_freq.npy"
        pairs.append((out / name, contiguous / name))
        for ours, theirs in pairs:
            a, b = np.load(ours), np.load(theirs)
            assert (a.dtype, a.shape) == (b.dtype, b.shape), ours.name
            assert np.array_equal(a, b), ours.name
            assert ours.read_bytes() == theirs.read_bytes(), ours.name
    theirs = np.concatenate(
        [np.load(contiguous / f"day_{d}_sparse_contig_freq.npy") for d in range(len(RAW_DAY_LINES))]
    )
    sizes = [int(s) for s in (out / "num_embeddings_per_feature.txt").read_text().split(",")]
    assert sizes == [2 + len(set(theirs[:, c].tolist()) - {1}) for c in range(26)]
    assert sizes == (theirs.max(axis=0) + 1).tolist()  # every id has its row


@pytest.mark.parametrize("threshold", [0, 1, 2, 3, 15])
def test_preprocess_command_equals_torchrecs_two_steps(
    tmp_path: Path, raw_days: tuple[Path, Path], threshold: int
) -> None:
    """``preprocess.py`` (2 workers, blocks of 20 KB) against TorchRec's ``tsv_to_npys`` per
    day and ``sparse_to_contiguous`` over the days, array for array. Thresholds: 0 and 1
    (no threshold: every id kept), 2 and 3 (ids seen once, or up to twice, become 1) and
    MLPerf's 15 (most of the small pools' ids too)."""
    raw, converted = raw_days
    contiguous = torchrec_contiguous(converted, threshold, tmp_path / "torchrec")
    out = tmp_path / "out"
    done = subprocess.run(
        [
            sys.executable,
            str(PREPROCESS),
            "--input_dir",
            str(raw),
            "--output_dir",
            str(out),
            "--frequency_threshold",
            str(threshold),
            "--workers",
            "2",
            "--block_mb",
            "0.02",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert_preprocessed_as_torchrec(out, converted, contiguous)
    rare = np.load(out / "day_0_sparse_contig_freq.npy") == 1
    assert rare.any() == (threshold > 1)  # the rare ids' row is used only under a threshold
    # Only TorchRec's names and the cardinality file are left, and the state's markers.
    names = {p.name for p in out.iterdir()}
    assert names == {".preprocess", "num_embeddings_per_feature.txt"} | {
        f"day_{d}_{k}.npy" for d in range(3) for k in ("dense", "labels", "sparse_contig_freq")
    }
    assert not list((out / ".preprocess").glob("*.np*"))
    assert [d.sparse.name for d in find_days(out)] == [
        f"day_{d}_sparse_contig_freq.npy" for d in range(3)
    ]


def test_preprocessing_restarts_by_day_and_refuses_other_settings(
    tmp_path: Path, raw_days: tuple[Path, Path]
) -> None:
    raw = tmp_path / "raw"
    shutil.copytree(raw_days[0], raw)
    good = (raw / "day_2").read_text()
    lines = good.split("\n")
    lines[4] = lines[4].replace("\t", "\tx", 1)  # line 5 of day 2: a bad integer
    (raw / "day_2").write_text("\n".join(lines))
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"day_2:5: field 2 is 'x"):
        preprocess_days(raw, out, 2, block_bytes=20_000, progress=False)
    state = out / ".preprocess"
    assert sorted(p.name for p in state.glob("*.counted")) == ["day_0.counted", "day_1.counted"]
    assert not list(out.glob("day_2_*")) and not list(out.glob("*contig*"))
    assert (
        not list(out.rglob("*.partial")) and not (out / "num_embeddings_per_feature.txt").exists()
    )
    with pytest.raises(DataError, match="preprocessing is unfinished"):
        find_days(out)  # training refuses it, naming what to do
    converted_at = (out / "day_0_dense.npy").stat().st_mtime_ns
    (raw / "day_2").write_text(good)
    sizes = preprocess_days(raw, out, 2, block_bytes=20_000, progress=False)
    assert (out / "day_0_dense.npy").stat().st_mtime_ns == converted_at  # not converted again
    contiguous = torchrec_contiguous(raw_days[1], 2, tmp_path / "torchrec")
    assert_preprocessed_as_torchrec(out, raw_days[1], contiguous)
    mapped_at = (out / "day_2_sparse_contig_freq.npy").stat().st_mtime_ns
    assert preprocess_days(raw, out, 2, progress=False) == sizes  # done: nothing redone
    assert (out / "day_2_sparse_contig_freq.npy").stat().st_mtime_ns == mapped_at
    with pytest.raises(DataError, match=r"other frequency_threshold 2 \(now 3\)"):
        preprocess_days(raw, out, 3, progress=False)
    day_0 = (raw / "day_0").read_bytes()
    flipped = bytes(day_0).replace(b"0\t", b"2\t", 1)  # a digit: as many bytes
    assert len(flipped) == len(day_0) and flipped != day_0
    (raw / "day_0").write_bytes(flipped)
    with pytest.raises(DataError, match="day_0, which changed since it was converted"):
        preprocess_days(raw, out, 2, progress=False)
    (raw / "day_0").write_bytes(day_0 + good.split("\n")[0].encode() + b"\n")
    with pytest.raises(DataError, match="day_0, which changed since it was converted"):
        preprocess_days(raw, out, 2, progress=False)
    (raw / "day_0").write_bytes(day_0)  # as it was, though written again: the same day
    assert preprocess_days(raw, out, 2, progress=False) == sizes
    for gone, said in (  # a file of the output removed since: said by a rerun
        (["day_1_dense.npy"], r"day 1 lacks \[.*day_1_dense.npy"),
        ([f"day_2_{k}.npy" for k in KINDS_WRITTEN], "it holds 2 of its 3 days"),
        (["num_embeddings_per_feature.txt"], "num_embeddings_per_feature.txt is gone"),
    ):
        moved = [out / name for name in gone]
        for path in moved:
            path.rename(tmp_path / path.name)
        with pytest.raises(DataError, match=rf"its preprocessing is done, but .*{said}"):
            preprocess_days(raw, out, 2, progress=False)
        for path in moved:
            (tmp_path / path.name).rename(path)
        assert preprocess_days(raw, out, 2, progress=False) == sizes
    with pytest.raises(DataError, match="already holds .npy days that this preprocessing did"):
        preprocess_days(raw, raw_days[1], 2, progress=False)  # TorchRec's own output folder
    (state / "day_0.counted").write_text("{}")  # not a day's record
    with pytest.raises(DataError, match=r"day_0.counted: damaged \(not a day's record\)"):
        preprocess_days(raw, out, 2, progress=False)
    recorded = state / "state.json"
    recorded.write_text(recorded.read_text()[:5])  # damaged: a JSON error, named
    with pytest.raises(DataError, match=r"state.json: damaged \(.*\); remove .*out to start"):
        preprocess_days(raw, out, 2, progress=False)


def npy_day(folder: Path, day: int, sparse: str = "sparse", rows: int = 10) -> None:
    folder.mkdir(exist_ok=True)
    np.save(folder / f"day_{day}_dense.npy", np.zeros((rows, 13), np.float32))
    np.save(folder / f"day_{day}_{sparse}.npy", np.zeros((rows, 26), np.int64))
    np.save(folder / f"day_{day}_labels.npy", np.zeros((rows, 1), np.int32))


def raw_day(folder: Path, name: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text("\t".join(["1"] + ["2"] * 13 + ["3a"] * 26) + "\n")


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda f: [raw_day(f, f"day_{d}") for d in (0, 5, 23)],
            r"the days are numbered 0, 5, 23, with days 1-4, 6-22 missing",
        ),
        (
            lambda f: [raw_day(f, n) for n in ("day_0", "day_1.gz", "day_2.GZ")],
            r"compressed files day_1.gz, day_2.GZ: decompress them first",
        ),
        (
            lambda f: [raw_day(f, n) for n in ("day_0", "day_1", "day_01", "day_2.tsv")],
            r"files that are no Criteo day: day_01, day_2.tsv",
        ),
        (lambda f: None, r"no raw Criteo days"),
        (
            lambda f: [raw_day(f, "day_0"), (f / "day_1").symlink_to("/nonexistent/day_1")],
            r"day_1 named as days but not readable files \(a folder, or a link to nothing",
        ),
        (
            lambda f: [raw_day(f, "day_0"), (f / "day_1").mkdir()],
            r"day_1 named as days but not readable files",
        ),
        (  # refused at its turn before, after the days ahead of it were converted
            lambda f: [raw_day(f, "day_0"), *[(f / f"day_{d}").write_bytes(b"") for d in (1, 2)]],
            r"raw days day_1, day_2 are empty files \(no samples\)",
        ),
        (  # refused at its turn before, as a line of one field
            lambda f: [raw_day(f, "day_0"), (f / "day_1").write_bytes(gzip.compress(b"1\t2"))],
            r"raw days day_1 hold compressed data under a plain day's name: decompress them",
        ),
    ],
)
def test_preprocessing_refuses_bad_day_sets_before_writing(tmp_path: Path, make, message) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    make(raw)
    with pytest.raises(DataError, match=message):
        preprocess_days(raw, tmp_path / "out", 0, progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda f: [npy_day(f, d) for d in (0, 1, 3)], r"numbered 0-1, 3, with days 2 missing"),
        (
            lambda f: [npy_day(f, d, "sparse_contig_freq") for d in (0, 5, 23)],
            r"numbered 0, 5, 23, with days 1-4, 6-22 missing",
        ),
        (
            lambda f: [npy_day(f, 0), npy_day(f, 1), npy_day(f, 1, "sparse_contig_freq")],
            r"day 1 has both day_1_sparse.npy and day_1_sparse_contig_freq.npy",
        ),
        (
            lambda f: [npy_day(f, 0), npy_day(f, 1, "sparse_contig_freq")],
            r"mix their kinds of ids \(day_<n>_sparse.npy for days 0; "
            r"day_<n>_sparse_contig_freq.npy for days 1\)",
        ),
        (
            lambda f: [npy_day(f, 0), npy_day(f, 1), raw_day(f, "day_2")],
            r"raw Criteo TSV days day_2 are not converted; convert them first: python "
            r"examples/dlrm/preprocess.py --input_dir .* --output_dir OUT --frequency_threshold T",
        ),
        (lambda f: [raw_day(f, "day_0"), raw_day(f, "day_1")], r"day_0, day_1 are not converted"),
        (
            lambda f: [npy_day(f, 0), npy_day(f, 1), (f / "day_1_sparse.npy.gz").write_text("")],
            r"compressed files day_1_sparse.npy.gz",
        ),
        (
            lambda f: [
                npy_day(f, 0),
                npy_day(f, 1),
                (f / "day_0_sparse_multi_hot.npz").write_text(""),
            ],
            r"no Criteo day: day_0_sparse_multi_hot.npz",
        ),
        (lambda f: None, r"found no day"),
        (
            lambda f: [
                *(npy_day(f, d) for d in (0, 1, 2)),
                (f / "day_3_dense.npy").symlink_to("/nonexistent/day_3_dense.npy"),
            ],
            r"day_3_dense.npy named as days but not readable files",
        ),
    ],
)
def test_training_day_sets_are_checked_by_name(tmp_path: Path, make, message) -> None:
    folder = tmp_path / "days"
    folder.mkdir()
    make(folder)
    with pytest.raises(DataError, match=message):
        find_days(folder)


def test_torchrecs_names_are_read_as_they_are(tmp_path: Path) -> None:
    """Contiguous ids under TorchRec's name, no renaming; plain ids; raw days kept beside
    their converted days; markers, hidden files and other names left alone."""
    contiguous, plain = tmp_path / "contiguous", tmp_path / "plain"
    for day in range(3):
        npy_day(contiguous, day, "sparse_contig_freq", rows=10 + day)
        npy_day(plain, day, rows=10 + day)
        raw_day(plain, f"day_{day}")
    for name in ("done", "day_0.done", "spec.json", ".hidden", "num_embeddings_per_feature.txt"):
        (contiguous / name).write_text("")
    for folder, sparse in ((contiguous, "sparse_contig_freq"), (plain, "sparse")):
        days = find_days(folder)
        assert [d.sparse.name for d in days] == [f"day_{d}_{sparse}.npy" for d in range(3)]
        assert [d.rows for d in days] == [10, 11, 12]


def test_lines_off_the_canonical_form_convert_as_torchrec_converts_them(tmp_path: Path) -> None:
    """The compiled parser takes canonical lines; a block with any other line goes the
    general way, which must still give TorchRec's arrays: signs, spaces and underscores
    in integers (Python's int() takes them), CRLF endings, upper-case and 16-digit ids,
    the 32-bit limits."""
    lines = tsv_day(tmp_path / "base", 60, 3).read_text().splitlines()
    odd = {
        5: lambda f: [f[0], "+7", " 12", "1_000", "12 ", *f[5:]],
        9: lambda f: [*f[:14], "7FFFFFFFFFFFFFFF", "00000000000000ab", *f[16:]],
        20: lambda f: [f[0], "-2147483648", "2147483647", *f[3:]],
    }
    for at, change in odd.items():
        lines[at] = "\t".join(change(lines[at].split("\t")))
    day = tmp_path / "day_0"
    day.write_bytes(("\r\n".join(lines[:30]) + "\n" + "\n".join(lines[30:])).encode())
    (tmp_path / "ours").mkdir()
    convert_tsv_day(day, tmp_path / "ours", 0, block_bytes=2_000)
    reference = [tmp_path / f"ref_{kind}.npy" for kind in ("dense", "sparse", "labels")]
    BinaryCriteoUtils.tsv_to_npys(str(day), *map(str, reference))
    for kind, theirs in zip(("dense", "sparse", "labels"), reference):
        a, b = np.load(tmp_path / "ours" / f"day_0_{kind}.npy"), np.load(theirs)
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), kind


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--input_dir", "FILE", "--output_dir", "OUT"],
            "--input_dir FILE: is a file, not a folder",
        ),
        (["--input_dir", "RAW", "--output_dir", "FILE/x"], "cannot be created: FILE is a file"),
        (
            ["--input_dir", "RAW", "--output_dir", "OUT", "--block_mb", "inf"],
            "--block_mb must be a positive number, got inf",
        ),
    ],
)
def test_preprocess_command_names_a_bad_flag(tmp_path: Path, flags, message) -> None:
    """A file given for a folder said "no such folder", or failed with the OS's error; an
    infinite block size failed with a traceback."""
    (tmp_path / "file").write_text("")
    raw_day(tmp_path / "raw", "day_0")
    names = {
        "FILE": str(tmp_path / "file"),
        "RAW": str(tmp_path / "raw"),
        "OUT": str(tmp_path / "out"),
    }
    argv = [names.get(f.split("/")[0], f.split("/")[0]) + f[len(f.split("/")[0]) :] for f in flags]
    done = subprocess.run(
        [sys.executable, str(PREPROCESS), *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert message.replace("FILE", names["FILE"]) in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()


def test_preprocess_reads_an_input_folder_it_cannot_write(tmp_path: Path) -> None:
    """Raw days on a read-only mount were refused ("cannot be written"). ``/proc``: a
    folder root too can read and not write; it passes, and is refused for its files."""
    done = subprocess.run(
        [sys.executable, str(PREPROCESS), "--input_dir", "/proc", "--output_dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and done.stderr.startswith("error: /proc: "), done.stderr[-2000:]
    assert "cannot be" not in done.stderr


def test_a_failed_write_names_the_output_folder_and_its_space(tmp_path: Path) -> None:
    """A full disk ended with "error: 4096 requested and 4080 written" (numpy's words for a
    short write): no file, no folder, no word of space. Here the kernel refuses writes
    past 300 bytes a file (EFBIG, as ENOSPC on a full disk)."""
    import resource
    import signal

    def limited() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300, resource.RLIM_INFINITY))

    for day in range(2):
        raw_day(tmp_path / "raw", f"day_{day}")
    out = tmp_path / "out"

    def preprocess(into: Path, limit: Callable[[], None] | None) -> subprocess.CompletedProcess:
        flags = ["--input_dir", str(tmp_path / "raw"), "--output_dir", str(into), "--quiet"]
        return subprocess.run(
            [sys.executable, str(PREPROCESS), *flags],
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=limit,
        )

    # Once without the limit: numba's compiled passes are cached (in the package's
    # folders, past 300 bytes a file), as on a machine whose disk filled up later.
    assert preprocess(tmp_path / "warm", None).returncode == 0
    done = preprocess(out, limited)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: preprocessing into {out} failed (") and "GiB free there" in line
    assert line.endswith("run again to go on"), line
    # An input file's error is not blamed on the output's disk. (Loaded by path: the name
    # ``preprocess`` is also a benchmark's, which the suite may have imported.)
    spec = importlib.util.spec_from_file_location("dlrm_preprocess", PREPROCESS)
    assert spec is not None and spec.loader is not None
    command = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(command)
    disk_problem = command.disk_problem
    unreadable = PermissionError(13, "Permission denied", str(tmp_path / "raw" / "day_1"))
    assert disk_problem(unreadable, str(out)) == f"{tmp_path}/raw/day_1: Permission denied"
