"""Criteo days in bounded memory: the mapped per-rank reader, its seeded order, the streaming
TSV conversion and the streaming ``.npy`` writer, each against TorchRec's own or a plain read."""

from __future__ import annotations

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

from torchrec_lookahead.data.criteo import CriteoDayReader, SampleOrder, find_days, stage_samples
from torchrec_lookahead.data.dedup import deduplicate
from torchrec_lookahead.data.npy import DataError, MappedRows, RowWriter
from torchrec_lookahead.data.tsv import DONE, convert_tsv_days

HASHES = [97 + 3 * i for i in range(26)]
DAY_ROWS = (1000, 700, 900)  # the batches cross day boundaries


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
    return type(
        batch
    )(
        batch.dense_features[rank * size : (rank + 1) * size],
        type(features)(
            keys=features.keys(),
            values=values.reshape(-1),
            lengths=lengths.reshape(-1),
            stride=size,
        ),  # fmt: skip
        batch.labels[rank * size : (rank + 1) * size],
    )


@pytest.mark.parametrize("world_size", [1, 2])
def test_file_order_reads_what_torchrecs_reader_reads(tmp_path: Path, world_size: int) -> None:
    days = find_days(write_days(tmp_path))
    global_batch = 128
    train = days[:-1]
    theirs = InMemoryBinaryCriteoIterDataPipe(
        "train", *([str(p) for p in paths] for paths in zip(*(d.paths() for d in train))),
        batch_size=global_batch, rank=0, world_size=1, drop_last=True, hashes=HASHES,
    )  # fmt: skip
    order = SampleOrder(*stage_samples(days, "train"), global_batch)
    theirs = list(theirs)
    assert len(theirs) == order.steps == 1700 // 128
    for rank in range(world_size):
        ours = CriteoDayReader(days, order, rank, world_size, HASHES)
        for step, batch in enumerate(ours.loader(num_workers=1)):
            assert_same_batch(torchrec_rank_share(theirs[step], rank, world_size), batch)


def test_training_on_it_equals_training_on_torchrecs_reader(tmp_path: Path) -> None:
    """TorchRec's DLRM, trained step by step on each reader's batches (world size 2's
    rank 1 share, cut by hand from TorchRec's global batches), ends bitwise equal."""
    days = find_days(write_days(tmp_path))
    theirs = InMemoryBinaryCriteoIterDataPipe(
        "train", *([str(p) for p in paths] for paths in zip(*(d.paths() for d in days[:-1]))),
        batch_size=128, rank=0, world_size=1, drop_last=True, hashes=HASHES,
    )  # fmt: skip
    ours = CriteoDayReader(days, SampleOrder(*stage_samples(days, "train"), 128), 1, 2, HASHES)
    models = []
    for stream in ([torchrec_rank_share(b, 1, 2) for b in theirs], ours.loader(num_workers=1)):
        torch.manual_seed(0)
        tables = [EmbeddingBagConfig(name=f"t_{k}", embedding_dim=8, num_embeddings=rows,
                                     feature_names=[k])
                  for k, rows in zip(DEFAULT_CAT_NAMES, HASHES)]  # fmt: skip
        model = DLRMTrain(DLRM(embedding_bag_collection=EmbeddingBagCollection(tables),
                               dense_in_features=13, dense_arch_layer_sizes=[16, 8],
                               over_arch_layer_sizes=[16, 1]))  # fmt: skip
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
        np.concatenate([order.step_samples(s + e * order.steps_per_epoch)
                        for s in range(order.steps_per_epoch)])
        for e in range(2)
    ]  # fmt: skip
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
    other = CriteoDayReader(days, SampleOrder(*stage_samples(days, "train"), 64, seed=2), 1, 2)
    with pytest.raises(DataError, match="order differ"):
        other.resume_step(reader.state_dict(17))


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
        (lambda f: f.with_name("day_1_sparse.npy").write_bytes(
            f.with_name("day_1_sparse.npy").read_bytes()[:-100]), "day_1_sparse.npy: .* truncated"),
        (lambda f: np.save(f.with_name("day_0_dense.npy"), np.zeros((1000, 12), np.float32)),
         r"day_0_dense.npy: float32 \[1000, 12\]; expected dense \[N, 13\]"),
        (lambda f: np.save(f.with_name("day_0_dense.npy"), np.zeros((1000, 13))),
         r"day_0_dense.npy: float64"),
        (lambda f: np.save(f.with_name("day_1_labels.npy"), np.zeros((699, 1), np.int32)),
         r"day 1's files disagree on its sample count: \{'dense': 700, .* 'labels': 699"),
        (lambda f: f.with_name("day_2_labels.npy").unlink(), "day 2 lacks"),
        (lambda f: f.with_name("day_0_labels.npy").write_bytes(b"not numpy"), "not a .npy file"),
        (lambda f: np.save(f.with_name("day_0_labels.npy"), np.zeros(1000, np.int32)),
         "a 1-D int32 array; expected 2-D"),
    ],
)  # fmt: skip
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
    days = convert_tsv_days(tsvs, out, block_bytes=10_000, progress=False)  # fmt: skip
    assert (out / "day_0.done").stat().st_mtime_ns == done_at  # days done are not redone
    assert [d.rows for d in days] == [2000, 2001, 2002] and (out / DONE).exists()
    for day, tsv in enumerate(tsvs):
        reference = [tmp_path / f"ref_{day}_{k}.npy" for k in ("dense", "sparse", "labels")]
        BinaryCriteoUtils.tsv_to_npys(str(tsv), *map(str, reference))
        for ours, theirs in zip(days[day].paths(), reference):
            a, b = np.load(ours), np.load(theirs)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda fields: fields[:-1], r":43: 39 tab-separated fields"),
        (lambda fields: [*fields[:-1], "12zz34ab"], r":43: field 40 is '12zz34ab', not a hex"),
        (lambda fields: [fields[0], "1.5", *fields[2:]], r":43: field 2 is '1.5', not a decimal"),
        (lambda fields: [fields[0], "3000000000", *fields[2:]], r"field 2 .* of 32 bits"),
        (lambda fields: [*fields[:-1], "f" * 16], r"field 40 is 'f{16}', not .* below 2\*\*63"),
    ],
)  # fmt: skip
def test_a_malformed_line_is_named(tmp_path: Path, mutate, message) -> None:
    lines = tsv_day(tmp_path / "day_0", 100, 0).read_text().splitlines()
    lines[42] = "\t".join(mutate(lines[42].split("\t")))
    (tmp_path / "day_0").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=message):
        convert_tsv_days([tmp_path / "day_0"], tmp_path / "npy", progress=False)
    assert not [p for p in (tmp_path / "npy").iterdir() if p.suffix != ".done"]


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
