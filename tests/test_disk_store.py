"""The disk store: tables and optimizer state in mapped files, trained exactly like in RAM.

Training with ``store_dir`` must equal training with every row resident
(and so with the in-memory store), bitwise, for the three CPU optimizers;
the files must hold the same initial values ``EmbeddingBagCollection`` gives
for the same seed; bad directories and store files are refused with errors
naming the path, before anything is built.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import torchrec_lookahead.embedding.cached as modules
from tests.models import (
    assert_same_training_state,
    batches,
    lookahead_model,
    reference_twin,
    train_lookahead,
    train_reference,
)
from torchrec_lookahead import LookaheadEmbeddingBagCollection
from torchrec_lookahead.store.files import StoreFiles, advise_rows

DATA = batches(60)


def tables(sizes=((1001, 8), (7, 12), (333, 4))) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=n, feature_names=[f"f{i}"])
        for i, (n, d) in enumerate(sizes)
    ]


def test_store_files_hold_what_embedding_bag_collection_initialises(tmp_path, monkeypatch):
    monkeypatch.setattr(modules, "DRAW_CHUNK", 64)  # several chunks per table, odd remainders
    torch.manual_seed(3)
    plain = EmbeddingBagCollection(tables=tables())
    after_plain = torch.rand(4)
    torch.manual_seed(3)
    on_disk = LookaheadEmbeddingBagCollection(tables=tables(), store_dir=tmp_path)
    assert torch.equal(torch.rand(4), after_plain), "the generator must end where it would"
    for key, value in plain.state_dict().items():
        assert torch.equal(on_disk.state_dict()[key], value), key
    stored = torch.from_file(str(tmp_path / "t0.weight.f32"), size=1001 * 8).view(1001, 8)
    assert torch.equal(stored, plain.state_dict()["embedding_bags.t0.weight"])


@pytest.mark.parametrize(
    ("optimizer", "workers"),
    [("sgd", 1), ("adagrad", 1), ("rowwise_adagrad", 1), ("rowwise_adagrad", 2)],
)
def test_training_on_disk_matches_all_resident_training(optimizer, workers, tmp_path):
    model = lookahead_model(optimizer, cache_load_factor=0.1, store_dir=tmp_path)
    twin = reference_twin(model, optimizer)
    expected = train_reference(twin, DATA)
    outputs, pipeline = train_lookahead(model, DATA, 8, 1, planning_workers=workers)
    for step, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert torch.equal(got, want), f"step {step} output differs"
    assert_same_training_state(model, twin)
    metrics = pipeline.cache_metrics()["total"]
    assert metrics.rows_written_back > 0 and metrics.misses < metrics.unique_ids
    # The store is the files: what state_dict() returns is read back from disk.
    state = model.unweighted.state_dict()["embedding_bags.t2.weight"]
    on_disk = torch.from_file(str(tmp_path / "t0" / "t2.weight.f32"), size=state.numel())
    assert torch.equal(on_disk.view_as(state), state)
    if optimizer != "sgd":
        assert (tmp_path / "t0" / "t2.state0.f32").exists()
    # The oracles' per-row tables are store files too (one per pool and partition).
    assert len(list((tmp_path / "t0").glob("oracle.*.i64"))) >= workers


def test_later_pipelines_may_plan_with_other_workers(tmp_path):
    """The oracles' row tables are scratch: a pipeline with another number of planning
    workers makes its own (shapes change with the partitions), and leaves no stale ones."""
    model = lookahead_model("rowwise_adagrad", cache_load_factor=0.1, store_dir=tmp_path)
    twin = reference_twin(model, "rowwise_adagrad")
    expected = train_reference(twin, DATA)
    outputs = []
    for workers, part in ((2, DATA[:20]), (1, DATA[20:40]), (3, DATA[40:])):
        got, _ = train_lookahead(model, part, 8, 1, planning_workers=workers)
        outputs += got
        row_tables = list((tmp_path / "t0").glob("oracle.t0.0.*.i64"))  # pool 0's
        assert len(row_tables) == workers, sorted(p.name for p in row_tables)
    for step, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert torch.equal(got, want), f"step {step} output differs"
    assert_same_training_state(model, twin)


def test_state_dicts_are_interchangeable_with_plain_torchrec(tmp_path):
    torch.manual_seed(0)
    on_disk = LookaheadEmbeddingBagCollection(tables=tables(), store_dir=tmp_path)
    plain = EmbeddingBagCollection(tables=tables())  # other values (the generator moved on)
    on_disk.load_state_dict(plain.state_dict())
    for key, value in plain.state_dict().items():
        assert torch.equal(on_disk.state_dict()[key], value), key
    torch.nn.init.zeros_(on_disk.embedding_bags["t1"].weight)
    plain.load_state_dict(on_disk.state_dict())
    assert not plain.embedding_bags["t1"].weight.any()


def test_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not an existing directory"):
        LookaheadEmbeddingBagCollection(tables=tables(), store_dir=tmp_path / "missing")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="not an existing directory"):
        LookaheadEmbeddingBagCollection(tables=tables(), store_dir=tmp_path / "file")


def test_a_directory_in_use_is_refused(tmp_path):
    first = LookaheadEmbeddingBagCollection(tables=tables(), store_dir=tmp_path)
    with pytest.raises(ValueError, match="in use by another store"):
        LookaheadEmbeddingBagCollection(tables=tables(), store_dir=tmp_path)
    assert first.embedding_bags["t0"].weight.shape == (1001, 8)


def test_a_store_of_another_model_or_damaged_is_refused(tmp_path):
    StoreFiles(tmp_path).tensor("t0.weight", (10, 8))  # then released with the object
    with pytest.raises(ValueError, match="t0.weight.f32.*another model"):
        LookaheadEmbeddingBagCollection(tables=tables(), store_dir=tmp_path)
    os.truncate(tmp_path / "t0.weight.f32", 100)
    with pytest.raises(ValueError, match="t0.weight.f32.*damaged"):
        LookaheadEmbeddingBagCollection(tables=tables(), store_dir=tmp_path)
    (tmp_path / "layout.json").write_text(json.dumps({"t0.weight": [10, 8]}))
    with pytest.raises(ValueError, match="layout.json.*not a store's"):
        StoreFiles(tmp_path)
    layout = {"t0.weight": {"shape": [10, 8], "dtype": "f32"}}
    (tmp_path / "layout.json").write_text(json.dumps(layout))
    os.truncate(tmp_path / "t0.weight.f32", 320)  # whole again: the store opens
    StoreFiles(tmp_path).close()
    for shape in (["ten", 8], [10.5, 8], "10x8", [-10, 8]):
        (tmp_path / "layout.json").write_text(
            json.dumps({"t0.weight": {"shape": shape, "dtype": "f32"}})
        )
        with pytest.raises(ValueError, match="layout.json.*not a store's"):
            StoreFiles(tmp_path)


@pytest.mark.parametrize("name", ["layout.json", ".lock"])
def test_a_layout_or_lock_that_is_a_directory_is_refused(tmp_path, name):
    (tmp_path / name).mkdir()
    with pytest.raises(ValueError, match=f"{name}' "):
        LookaheadEmbeddingBagCollection(tables=tables(), store_dir=tmp_path)


def test_a_store_larger_than_the_free_disk_is_refused_before_writing(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    rows = free // (4 * 64) + 1
    huge = [
        EmbeddingBagConfig(name="big", embedding_dim=64, num_embeddings=rows, feature_names=["f"])
    ]
    with pytest.raises(ValueError, match="no space in store_dir .* for the tables"):
        LookaheadEmbeddingBagCollection(tables=huge, store_dir=tmp_path)
    assert {p.name for p in tmp_path.iterdir()} <= {".lock"}
    files = StoreFiles(tmp_path)
    with pytest.raises(ValueError, match=r"no space for store file .*big.f32': it needs .* GB"):
        files.tensor("big", (rows, 64))
    assert {p.name for p in tmp_path.iterdir()} <= {".lock"}


def test_a_full_disk_is_found_before_training_not_at_its_first_step(tmp_path, monkeypatch):
    """The tables fit, their optimizer state and the oracles' tables do not: the pipeline
    is refused when it is built, naming the store, and no state file is written."""
    import torchrec_lookahead.store.files as disk
    from torchrec_lookahead import LookaheadTrainPipeline

    model = lookahead_model("adagrad", cache_load_factor=0.2, store_dir=tmp_path)
    written = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    monkeypatch.setattr(disk, "_free_bytes", lambda directory: 4096)
    with pytest.raises(ValueError, match="no space in store_dir .* for the optimizer state"):
        LookaheadTrainPipeline(
            model, torch.optim.SGD(model.over.parameters(), lr=0.1), torch.device("cpu")
        )
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == written


def test_a_layout_that_cannot_be_written_leaves_no_partial_file(tmp_path, monkeypatch):
    files = StoreFiles(tmp_path)

    def full_disk(self, text):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(tmp_path), "write_text", full_disk)
    with pytest.raises(ValueError, match="layout.json' cannot be written: No space left"):
        files.tensor("t", (4, 4))
    assert not (tmp_path / "layout.json.tmp").exists()


def test_small_sizes_are_reported_in_small_units() -> None:
    from torchrec_lookahead.store.files import _size

    assert [_size(n) for n in (12, 4_096, 3_500_000, 2 * 10**9)] == [
        "12 bytes",
        "4.10 kB",
        "3.50 MB",
        "2.00 GB",
    ]


def test_read_ahead_advises_each_run_of_pages_once(tmp_path):
    files = StoreFiles(tmp_path)
    table = files.tensor("t", (4096, 64))  # 256-byte rows: 16 per 4 KiB page
    fd, base = files.region(table[100:])
    assert base == 100 * 256
    rows = torch.tensor([0, 1, 15, 16, 40, 1000]).numpy()
    # table rows 100+r start at byte 256 * (100+r): pages 6, 6, 7, 7, 8 (one run), 68
    assert advise_rows(fd, base, rows, 256, 4096, os.POSIX_FADV_WILLNEED) == 2
    assert advise_rows(fd, base, rows[:2], 256, 4096, os.POSIX_FADV_WILLNEED) == 1
    files.close()


def test_dcp_checkpoints_are_interchangeable_with_plain_torchrec(tmp_path):
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    plain = EmbeddingBagCollection(tables=tables())
    (tmp_path / "store").mkdir()
    on_disk = LookaheadEmbeddingBagCollection(tables=tables(), store_dir=tmp_path / "store")
    dcp.save(plain.state_dict(), checkpoint_id=tmp_path / "plain")
    state = on_disk.state_dict()
    dcp.load(state, checkpoint_id=tmp_path / "plain")  # in place, into the mapped files
    for key, value in plain.state_dict().items():
        assert torch.equal(on_disk.state_dict()[key], value), key
    torch.nn.init.ones_(on_disk.embedding_bags["t2"].weight)
    dcp.save(on_disk.state_dict(), checkpoint_id=tmp_path / "disk")
    back = plain.state_dict()
    dcp.load(back, checkpoint_id=tmp_path / "disk")
    assert bool((plain.embedding_bags["t2"].weight == 1).all())


def test_streamed_dcp_checkpoints_are_saved_in_chunks_and_load_anywhere(tmp_path):
    import torch.distributed.checkpoint as dcp

    from torchrec_lookahead.store.checkpoint import StreamingSavePlanner

    (tmp_path / "store").mkdir()
    torch.manual_seed(0)
    on_disk = LookaheadEmbeddingBagCollection(tables=tables(), store_dir=tmp_path / "store")
    torch.manual_seed(1)
    plain = EmbeddingBagCollection(tables=tables())
    streamed = StreamingSavePlanner
    dcp.save(on_disk.state_dict(), checkpoint_id=tmp_path / "disk", planner=streamed(1024))
    saved = dcp.FileSystemReader(tmp_path / "disk").read_metadata().state_dict_metadata
    # 1001 x 8 floats in 32-row chunks; 7 x 1 in one; 333 x 4 in 64-row chunks
    assert [len(saved[f"embedding_bags.t{i}.weight"].chunks) for i in range(3)] == [32, 1, 6]
    state = plain.state_dict()
    dcp.load(state, checkpoint_id=tmp_path / "disk")
    for key, value in on_disk.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value), key
    torch.nn.init.ones_(plain.embedding_bags["t0"].weight)  # and back, chunk by chunk
    dcp.save(plain.state_dict(), checkpoint_id=tmp_path / "plain", planner=streamed(1024))
    state = on_disk.state_dict()
    dcp.load(state, checkpoint_id=tmp_path / "plain")
    assert bool((on_disk.embedding_bags["t0"].weight == 1).all())
    with pytest.raises(ValueError, match="chunk_bytes must be positive"):
        StreamingSavePlanner(0)
