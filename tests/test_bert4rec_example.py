"""The BERT4Rec example end to end: bitwise plain TorchRec's at 1 and 2 ranks, the summary,
MovieLens' ratings.dat read as TorchRec's example reads it, and bad input refused."""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch.multiprocessing as mp

from tests.launch import free_port

ROOT = Path(__file__).resolve().parents[1]
MAIN = ROOT / "examples" / "bert4rec" / "bert4rec_main.py"
TINY = [
    "--num_users",
    "1024",
    "--num_items",
    "5000",
    "--train_batch_size",
    "32",
    "--test_batch_size",
    "128",
    "--emb_dim",
    "16",
    "--num_layers",
    "1",
    "--lookahead",
    "4",
]


def example_module(name: str) -> ModuleType:
    """``examples/bert4rec/<name>.py`` loaded by path as ``bert4rec_<name>`` (the DLRM
    example's tests import its modules by their plain names: ``flags``, ``data``). Its
    ``import shared`` finds this example's, as when the example runs (the DLRM example
    has none)."""
    if name != "shared" and "shared" not in sys.modules:
        sys.modules["shared"] = example_module("shared")
    spec = importlib.util.spec_from_file_location(f"bert4rec_{name}", MAIN.parent / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def _rank(index: int, argv: list[str], ranks: int, port: int, folder: str) -> None:
    """One rank of the example, in a process forked from the tests' warm server
    (``tests.launch``): torchrun's environment at several ranks, output appended to the
    shared files, its exit code written to ``rc<index>``."""
    if ranks > 1:
        os.environ.update(
            RANK=str(index),
            LOCAL_RANK=str(index),
            WORLD_SIZE=str(ranks),
            LOCAL_WORLD_SIZE=str(ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(Path(folder, name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    sys.argv = [str(MAIN), *argv]
    sys.path.insert(0, str(MAIN.parent))
    try:
        runpy.run_path(str(MAIN), run_name="__main__")
        code = 0
    except SystemExit as exited:
        code = exited.code if isinstance(exited.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    Path(folder, f"rc{index}").write_text(str(code))


def run(tmp: Path, *flags: str, ranks: int = 1) -> tuple[int, str, str, dict | None]:
    """The example at ``ranks`` ranks (gloo): its exit code (the first nonzero of the
    ranks'), stdout, stderr and summary."""
    out, logs = tmp / "out", tmp / "logs"
    logs.mkdir()
    argv = [*flags, "--out", str(out)]
    mp.start_processes(
        _rank, (argv, ranks, free_port(), str(logs)), nprocs=ranks, start_method="forkserver"
    )
    codes = [int((logs / f"rc{r}").read_text()) for r in range(ranks)]
    stdout, stderr = (
        (logs / n).read_text() if (logs / n).exists() else "" for n in ("stdout", "stderr")
    )
    summary = out / "summary.json"
    loaded = json.loads(summary.read_text()) if summary.exists() else None
    return next((c for c in codes if c), 0), stdout, stderr, loaded


def row(stdout: str, label: str) -> str:
    return next(line for line in stdout.splitlines() if line.strip().startswith(label))


@pytest.mark.parametrize(
    ("ranks", "optimizer"), [(1, []), (2, ["--adagrad"])], ids=["1-rank-sgd", "2-ranks-adagrad"]
)
def test_lookahead_trains_bitwise_as_plain_torchrec(
    tmp_path: Path, ranks: int, optimizer: list[str]
) -> None:
    code, stdout, stderr, summary = run(
        tmp_path,
        *TINY,
        *optimizer,
        "--limit_train_batches",
        "8",
        "--limit_test_batches",
        "2",
        "--baseline",
        ranks=ranks,
    )
    assert code == 0, stderr[-3000:]
    assert summary is not None
    assert summary["world_size"] == ranks
    assert summary["weights_match"] is True and summary["weights_max_difference"] == 0
    assert summary["weights_agreement"] == "bitwise equal"
    assert "bitwise equal" in row(stdout, "final weights")
    look, base = summary["runs"]
    assert (look["name"], base["name"]) == ("lookahead", "baseline")
    assert summary["steps_run"] == summary["steps_asked"] == 8
    assert len(look["loss"]) == 8 and look["loss"] == base["loss"]  # step for step
    assert look["metrics"] == base["metrics"]
    metrics = look["metrics"]
    assert set(metrics) == {"recall@10", "ndcg@10", "loss"}
    assert 0 <= metrics["ndcg@10"] <= metrics["recall@10"] <= 1
    assert f"{metrics['recall@10']:.4f}" in row(stdout, "test Recall@10")
    assert f"{metrics['ndcg@10']:.4f}" in row(stdout, "test NDCG@10")
    # Two evaluation batches of 128 users per rank, every one a user.
    assert summary["users_evaluated"] == 2 * 128 * ranks
    config = summary["config"]
    assert (config["num_users"], config["num_items"]) == (1024, 5000)
    assert config["adagrad"] is bool(optimizer)
    assert summary["rows"] == 5001  # the items and the mask token
    assert 0 < summary["cache_rows"] < summary["rows"]
    assert 0 < look["cache"]["hit_rate"] < 1 and len(look["hit_rate"]) == 8
    assert look["cache"]["rows_fetched_per_step"] > 0 and not base["cache"]
    assert (tmp_path / "out" / "training.png").stat().st_size > 0
    # The bars end with the whole run's figures (they showed step 1's in runs of 20 steps
    # or fewer), the hit rate the summary's.
    bars = [line for line in stderr.replace("\r", "\n").splitlines() if "train " in line]
    for r in (look, base):
        shown = next(b for b in reversed(bars) if f"train {r['name']}" in b)
        assert f"samples/s={r['samples'] / r['seconds']:,.0f}" in shown, shown
        if r is look and ranks == 1:  # (the summary's counts every rank's, the bar rank 0's)
            assert f"hit rate={look['cache']['hit_rate']:.3f}" in shown, shown


def ratings_file(folder: Path, lines: list[str]) -> Path:
    folder.mkdir()
    (folder / "ratings.dat").write_text("".join(f"{line}\n" for line in lines))
    return folder


# Users 7 and 3 (7 rates first), out of time order in the file, 7 rating two movies at
# one time (file order between them); user 5 has one rating left after the low one is
# dropped; movie ids sparse.
RATINGS = [
    "7::500::4::1000",
    "3::20::5::1300",
    "7::30::3::1200",
    "3::500::4::1100",
    "7::20::5::1100",
    "5::30::1::900",
    "5::20::4::950",
    "3::999::2::1200",
    "7::999::4::1200",
]


def test_movielens_ratings_become_time_ordered_histories_of_dense_ids(tmp_path: Path) -> None:
    data = example_module("data")
    history = data.read_ratings(ratings_file(tmp_path / "ml", RATINGS), min_user_count=2)
    assert history.num_items == 4  # movies 20, 30, 500, 999 as 0..3
    assert history.num_users == 3  # by first rating: 5 (900), 7 (1000), 3 (1100)
    assert [history.of(u).tolist() for u in range(3)] == [[1, 0], [2, 0, 1, 3], [2, 3, 0]]
    kept = data.read_ratings(tmp_path / "ml", min_rating=3, min_user_count=2)
    # User 5 has one rating of 3 or more; user 3's rating of movie 999 is a 2.
    assert kept.num_users == 2
    assert [kept.of(u).tolist() for u in range(2)] == [[2, 0, 1, 3], [2, 0]]


def test_a_global_step_holds_the_same_samples_at_any_world_size() -> None:
    """Two ranks of 8 users read, together, what one rank of 16 reads: the same users,
    the same masks (drawn from the seed, the epoch and the user)."""
    data = example_module("data")
    spec = data.SyntheticSpec(200, 500, 1.1, 20.0, 4, 30, seed=3)
    history = data.synthetic_histories(spec)
    assert history.num_users == 200 and history.items.max() < 500
    steps = data.train_steps(history, 16, 1, 2)  # two epochs: 12 steps each
    assert steps == 24 == data.train_steps(history, 8, 2, 2)

    def read(batch_size: int, rank: int, world_size: int) -> list:
        return list(data.train_batches(history, batch_size, rank, world_size, 10, 0.2, 0, steps))

    whole = read(16, 0, 1)
    halves = zip(read(8, 0, 2), read(8, 1, 2))
    for one, (first, second) in zip(whole, halves, strict=True):
        features = one.sparse_features
        assert features.values().tolist() == (
            first.sparse_features.values().tolist() + second.sparse_features.values().tolist()
        )
        assert features.lengths().tolist() == (
            first.sparse_features.lengths().tolist() + second.sparse_features.lengths().tolist()
        )
        assert one.labels.tolist() == first.labels.tolist() + second.labels.tolist()
        masked = one.labels != data.NOT_A_TARGET
        assert masked.any(dim=1).all()  # every sample has an item to predict
    assert not all(
        a.labels.equal(b.labels) for a, b in zip(whole[:12], whole[12:])
    )  # each epoch draws its own masks


def test_synthetic_popularity_is_skewed_and_drifts() -> None:
    data = example_module("data")
    spec = data.SyntheticSpec(4000, 5000, 1.1, 50.0, 4, 30, seed=0)
    history = data.synthetic_histories(spec)
    assert history.of(0).size >= 4 and history.num_items == 5000
    again = data.synthetic_histories(spec)
    assert np.array_equal(history.items, again.items)  # deterministic

    def top(users: range) -> set[int]:
        counts = np.bincount(np.concatenate([history.of(u) for u in users]), minlength=5000)
        return set(np.argsort(counts)[-10:].tolist())

    first, last = top(range(1000)), top(range(3000, 4000))
    counts = np.bincount(history.items, minlength=5000)
    assert np.sort(counts)[-50:].sum() > 0.2 * counts.sum()  # a few items take many lookups
    assert len(first & last) < 5  # the hot items of early and late users differ


def test_trains_on_a_movielens_ratings_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    lines = [
        f"{user}::{movie}::{rng.integers(1, 6)}::{978300000 + int(rng.integers(0, 10**6))}"
        for user in range(1, 201)
        for movie in rng.choice(np.arange(1, 3000, 7), int(rng.integers(3, 30)), replace=False)
    ]
    folder = ratings_file(tmp_path / "ml", lines)
    history = example_module("data").read_ratings(folder)
    code, _, stderr, summary = run(
        tmp_path,
        "--dataset_path",
        str(folder),
        "--train_batch_size",
        "32",
        "--test_batch_size",
        "64",
        "--emb_dim",
        "16",
        "--num_layers",
        "1",
        "--lookahead",
        "2",
        "--baseline",
    )
    assert code == 0, stderr[-3000:]
    assert summary is not None and summary["weights_match"] is True
    config = summary["config"]
    assert (config["num_users"], config["num_items"]) == (history.num_users, history.num_items)
    assert summary["steps_run"] == history.num_users // 32  # one epoch
    assert summary["users_evaluated"] == history.num_users


@pytest.mark.parametrize(
    ("lines", "flags", "code", "message"),
    [
        (None, [], 2, "holds no ratings.dat"),
        (["1::2::3::4", "1::2::3"], [], 1, "ratings.dat line 2: expected UserID::MovieID"),
        (["1::2::x::4"], [], 1, "line 1: expected UserID::MovieID::Rating::Timestamp"),
        (["1::2::3::4", "1::5::3::6"], ["--min_user_count", "3"], 1, "no user has 3 ratings"),
        ([], ["--min_user_count", "2"], 1, "too few users (1) for one global batch of 64 users"),
        ([], ["--max_len", "1"], 2, "--max_len must be at least 2"),
        ([], ["--emb_dim", "18", "--nhead", "2"], 2, "--emb_dim must be a multiple of 4"),
        ([], ["--mask_prob", "1"], 2, "--mask_prob must be in (0, 1)"),
        ([], ["--out", "/proc/out"], 2, "--out /proc/out: cannot be created in /proc"),
        # Accepted and ignored before: synthetic flags beside MovieLens' ratings.
        ([], ["--num_items", "5", "--zipf", "3"], 2, "--num_items, --zipf shape the synthetic"),
        ([], ["--seed", "-1"], 2, "--seed must be an integer in [0, 2**63), got -1"),
        # An OverflowError's traceback before: an id past 64 bits.
        (["1::99999999999999999999::4::978300000"], [], 1, "line 1: expected UserID::MovieID"),
    ],
)
def test_bad_input_gets_one_clear_message(
    tmp_path: Path, lines: list[str] | None, flags: list[str], code: int, message: str, capsys
) -> None:
    """Flags and the folder are checked as the arguments are read (in this process: exit 2
    and one ``error:`` line); the ratings when they are read (exit 1, a run of the
    example), before anything is written."""
    folder = tmp_path / "ml"
    if lines is None:
        folder.mkdir()
    else:
        ratings_file(folder, lines or ["1::2::3::4", "1::3::3::5"])
    argv = ["--dataset_path", str(folder), *flags]
    if code == 2:
        with pytest.raises(SystemExit) as exited:
            example_module("flags").parse_args(["--out", str(tmp_path / "out"), *argv])
        returncode, stderr = exited.value.code, capsys.readouterr().err
    else:
        returncode, _, stderr, _ = run(tmp_path, *argv)
    assert returncode == code, stderr[-2000:]
    assert stderr.count("error:") == 1 and message in stderr, stderr[-2000:]
    assert "Traceback" not in stderr and not (tmp_path / "out").exists()


def test_a_diverged_model_is_said_diverged_not_ranked_first(tmp_path: Path) -> None:
    """With NaN scores every held-out item ranked first (Recall@10 1.0), and the two runs'
    NaN weights compared as "bitwise equal" (a NaN difference dropped by ``max``)."""
    code, stdout, stderr, summary = run(
        tmp_path, *TINY, "--lr", "1e30", "--limit_train_batches", "4", "--limit_test_batches", "2"
    )
    assert code == 0, stderr[-3000:]
    assert summary is not None and summary["runs"][0]["metrics"]["recall@10"] == 0.0
    assert "warning: the lookahead run diverged: its loss is nan at step" in stdout
    import torch
    from compare import largest_difference as gap  # the DLRM example's, which this one uses

    number, nan = torch.tensor([1.0, 2.0]), torch.tensor([1.0, float("nan")])
    assert gap(number, nan) == float("inf") and gap(nan, nan.clone()) == 0.0
    assert gap(number, number + 0.5) == 0.5
    infinite = torch.tensor([float("inf")])
    assert gap(infinite, infinite.clone()) == 0.0 and gap(infinite, number[:1]) == float("inf")


def test_movielens_flags_without_its_ratings_and_a_file_for_a_folder_are_refused(
    tmp_path: Path, capsys
) -> None:
    """``--min_rating`` without ``--dataset_path`` was accepted and ignored; a ratings
    file given for its folder said "no such folder"."""
    parse = example_module("flags").parse_args
    (tmp_path / "ratings.dat").write_text("1::2::3::4\n")
    for argv, message in (
        (["--min_rating", "4"], "--min_rating filter MovieLens' ratings: they need --dataset_path"),
        (["--dataset_path", str(tmp_path / "ratings.dat")], "is a file, not a folder"),
    ):
        with pytest.raises(SystemExit):
            parse(["--out", str(tmp_path / "out"), *argv])
        assert message in capsys.readouterr().err
