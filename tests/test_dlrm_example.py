"""The DLRM example end to end: exact against plain TorchRec, real-format data, resume, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.launch import run_example
from torchrec_lookahead.data import CRITEO_KAGGLE_TABLE_SIZES
from torchrec_lookahead.data.days import find_days

ROOT = Path(__file__).resolve().parents[1]
MAIN = str(ROOT / "examples" / "dlrm" / "dlrm_main.py")
MAIN_DATA = Path("examples") / "dlrm" / "data.py"
TINY = [
    "--scale",
    "0.001",
    "--synthetic_samples_per_day",
    "4096",
    "--batch_size",
    "128",
    "--limit_val_batches",
    "4",
    "--limit_test_batches",
    "4",
    "--lookahead",
    "4",
]


def run(
    tmp: Path, *flags: str, ranks: int = 1, restarts: int = 0
) -> tuple[subprocess.CompletedProcess, dict | None]:
    """The example on ``ranks`` processes, forked from the warm server (``tests.launch``),
    or under torchrun when it is to restart a failed worker group up to ``restarts``
    times; its output and summary."""
    out = tmp / "out"
    done = run_example(
        "--data_cache",
        str(tmp.parent / "data-cache"),
        "--out",
        str(out),
        *flags,
        ranks=ranks,
        restarts=restarts,
    )
    summary = out / "summary.json"
    return done, json.loads(summary.read_text()) if summary.exists() else None


@pytest.mark.parametrize("ranks", [1, 2])
def test_lookahead_matches_plain_torchrec(tmp_path: Path, ranks: int) -> None:
    interaction = ["--interaction_type", "dcn"] if ranks == 1 else []  # both archs covered
    schedule = ["--lr_warmup_steps", "5", "--lr_decay_start", "12", "--lr_decay_steps", "15"]
    # Hot rows on auto, the link stated slow (0.01 Gbit/s): rows pay there even when the
    # replicas' work, timed at start, is slowed by a loaded machine.
    slow_link = ["--link_gbps", "0.01"] if ranks == 2 else []
    done, summary = run(
        tmp_path,
        *TINY,
        *interaction,
        *schedule,
        *slow_link,
        "--limit_train_batches",
        "30",
        "--baseline",
        "--adagrad",
        "--plan_sample_batches",
        "10",
        ranks=ranks,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert summary["world_size"] == ranks
    look, base = summary["runs"]
    assert summary["weights_match"] is True and look["auroc"] == base["auroc"]
    assert summary["weights_max_difference"] == 0
    assert summary["weights_agreement"] == "bitwise equal"
    assert summary["steps_run"] == summary["steps_asked"] == 30
    assert len(look["loss"]) == 30 and look["loss"] == base["loss"]  # step for step
    if ranks == 2:  # hot rows replicated (auto, on a slow link), bitwise plain TorchRec's too
        assert "hot rows: auto: link 0.01 Gbit/s (stated)" in done.stdout, done.stdout[-2000:]
        assert look["hot_share"] > 0.5 and "hot rows:" in done.stdout
        embedding = [
            sum(v for k, v in r["bytes_per_step"].items() if k != "dense") for r in (look, base)
        ]
        assert look["bytes_per_step"]["hot_sync"] > 0 and embedding[0] < embedding[1] / 2
    assert 0 < look["auroc"]["val"] < 1
    assert 0 < look["cache"]["hit_rate"] < 1 and len(look["hit_rate"]) == 30
    assert "bitwise equal" in _summary_row(done.stdout, "final weights")
    assert (tmp_path / "out" / "training.png").exists()
    # Steady samples/s leaves out the first step (the window's fill, warm-up).
    for column in (look, base):
        steps = column["step_s"]
        steady = column["samples"] * (len(steps) - 1) / len(steps) / sum(steps[1:])
        assert f"{steady:,.0f}" in _summary_row(done.stdout, "samples/s after step 1")
        assert f"{1000 * steps[0]:,.0f}" in _summary_row(done.stdout, "first step ms")


def test_data_that_ends_before_the_limit_is_said(tmp_path: Path) -> None:
    done, summary = run(tmp_path, *TINY, "--synthetic_days", "2", "--limit_train_batches", "100000")
    assert done.returncode == 0, done.stderr[-3000:]
    ran = summary["steps_run"]
    assert summary["steps_asked"] == 100000 and 0 < ran < 100000
    assert len(summary["runs"][0]["step_s"]) == ran
    warning = f"--limit_train_batches 100000: the training data holds {ran} batches"
    assert warning in done.stderr
    assert f"{ran} of the 100000 steps asked" in done.stdout


def _summary_row(stdout: str, label: str) -> str:
    return next(line for line in stdout.splitlines() if line.strip().startswith(label))


def test_deduplicated_sessions_match_plain_torchrec_and_report_savings(tmp_path: Path) -> None:
    done, summary = run(
        tmp_path,
        *TINY,
        "--limit_train_batches",
        "20",
        "--baseline",
        "--session_size",
        "8",
        "--dedup",
        "--num_workers",
        "1",
        ranks=2,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert summary["weights_match"] is True
    look, base = summary["runs"]
    assert look["dedup"] == base["dedup"]
    counts = look["dedup"]
    # 13 of 26 features shared by sessions of 8: about 7/16 of the ids go.
    assert 0.40 < 1 - counts["ids_after"] / counts["ids_before"] < 0.44
    assert "ids saved by dedup" in done.stdout and "sparse bytes saved" in done.stdout


def test_shuffled_sessions_deduplicate_alike_on_every_rank(tmp_path: Path) -> None:
    """Shuffled, few samples share a session: a rank whose part shared none sent a plain
    batch beside the other's deduplicated one, and TorchRec's input dist broke (plain
    TorchRec's too: gloo's "collective mismatch")."""
    done, summary = run(
        tmp_path,
        "--batch_size",
        "256",
        "--synthetic_samples_per_day",
        "16384",
        "--limit_train_batches",
        "20",
        "--baseline",
        "--session_size",
        "4",
        "--dedup",
        "--shuffle",
        ranks=2,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert summary["weights_match"] is True and summary["steps_run"] == 20


def test_planned_cache_sizes_are_reported_and_training_stays_exact(tmp_path: Path) -> None:
    done, summary = run(
        tmp_path,
        *TINY,
        "--limit_train_batches",
        "20",
        "--baseline",
        "--plan_cache_sizes",
        "--plan_sample_batches",
        "10",
        "--cache_budget_mb",
        "0.5",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cache load" in done.stdout and "ms/step beyond compute" in done.stdout
    assert "sized by the lookahead planner" in done.stdout
    assert summary["weights_match"] is True


def raw_criteo_days(folder: Path, days: int = 2, lines: int = 600) -> Path:
    """Raw Criteo TSV days: empty fields, ids repeated (small pools) and rare."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    for day in range(days):
        rows = []
        for _ in range(lines):
            label = str(rng.integers(0, 2))
            ints = [str(v) if rng.random() > 0.1 else "" for v in rng.integers(-2, 50, 13)]
            cats = [f"{v:08x}" if rng.random() > 0.05 else "" for v in rng.integers(0, 40, 26)]
            rows.append("\t".join([label, *ints, *cats]))
        (folder / f"day_{day}").write_text("\n".join(rows) + "\n")
    return folder


def test_trains_on_days_preprocessed_as_torchrec_does(tmp_path: Path) -> None:
    """Raw days are refused (one line naming the command); preprocess.py converts them;
    training reads TorchRec's day_<n>_sparse_contig_freq.npy as named, and the table
    sizes from the cardinality file the preprocessing wrote."""
    raw = raw_criteo_days(tmp_path / "criteo")
    flags = ["--batch_size", "64", "--limit_train_batches", "8", "--lookahead", "2"]
    refused, _ = run(tmp_path, "--dataset_path", str(raw), *flags)
    assert refused.returncode == 2 and refused.stderr.count("error:") == 1, refused.stderr
    assert "are not converted; convert them first: python examples/dlrm/preprocess.py" in (
        refused.stderr
    )
    assert "Traceback" not in refused.stderr and not (raw / "npy").exists()
    out = tmp_path / "npy"
    preprocess = [
        sys.executable,
        str(ROOT / "examples" / "dlrm" / "preprocess.py"),
        "--input_dir",
        str(raw),
        "--output_dir",
        str(out),
        "--frequency_threshold",
        "2",
        "--quiet",
    ]
    converted = subprocess.run(preprocess, capture_output=True, text=True, timeout=300)
    assert converted.returncode == 0, converted.stderr[-3000:]
    sizes = [int(s) for s in (out / "num_embeddings_per_feature.txt").read_text().split(",")]
    assert sizes == [2 + 40] * 26  # 40 ids each, every one seen twice or more
    done, summary = run(tmp_path, "--dataset_path", str(out), *flags, "--baseline")
    assert done.returncode == 0, done.stderr[-3000:]
    assert summary["weights_match"] is True
    assert summary["config"]["num_embeddings"] == sizes


def test_loader_workers_by_default_only_where_a_rank_has_cores_to_spare() -> None:
    import flags as example_flags

    assert example_flags.loader_workers(local_ranks=1, cores=2) == 0  # this project's machine
    assert example_flags.loader_workers(local_ranks=2, cores=2) == 0
    assert example_flags.loader_workers(local_ranks=1, cores=4) == 1
    assert example_flags.loader_workers(local_ranks=2, cores=8) == 1
    assert example_flags.loader_workers(local_ranks=3, cores=8) == 0
    assert example_flags.parse_args(["--num_workers", "2"]).num_workers == 2


def test_table_sizes_come_as_a_list_or_a_file(tmp_path: Path, capsys) -> None:
    import flags as example_flags

    days = tmp_path / "days"
    days.mkdir()
    for day in range(2):  # TorchRec's tsv_to_npys names: plain ids
        np.save(days / f"day_{day}_dense.npy", np.zeros((10, 13), np.float32))
        np.save(days / f"day_{day}_sparse.npy", np.zeros((10, 26), np.int64))
        np.save(days / f"day_{day}_labels.npy", np.zeros((10, 1), np.int32))
    sizes = [7 + i for i in range(26)]
    listed = ",".join(map(str, sizes))
    (tmp_path / "sizes.txt").write_text(listed + "\n")
    base = [*TINY, "--out", str(tmp_path / "out"), "--dataset_path", str(days)]
    for value in (listed, f"@{tmp_path / 'sizes.txt'}", str(tmp_path / "sizes.txt")):
        args = example_flags.parse_args([*base, "--num_embeddings_per_feature", value])
        assert args.num_embeddings == sizes
    assert example_flags.parse_args(base).num_embeddings == list(CRITEO_KAGGLE_TABLE_SIZES)
    (days / "num_embeddings_per_feature.txt").write_text(listed)
    assert example_flags.parse_args(base).num_embeddings == sizes  # the folder's own file
    (tmp_path / "superscripts.txt").write_text(",".join(["²"] * 26))
    for value, message in (
        (f"@{tmp_path / 'none.txt'}", "none.txt: no such file"),
        ("1,2,3", "needs 26 positive comma-separated integers"),
        (str(days / "day_0_dense.npy"), "expected 26 comma-separated"),
        # Digits str.isdigit takes: "٥" was read as 5, "²" failed in int() with a traceback.
        (",".join(["٥"] * 26), "no such file"),
        (f"@{tmp_path / 'superscripts.txt'}", "expected 26 comma-separated"),
    ):
        with pytest.raises(SystemExit):
            example_flags.parse_args([*base, "--num_embeddings_per_feature", value])
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_old_checkpoints_are_pruned_never_the_latest_or_one_being_written(
    tmp_path: Path,
) -> None:
    from checkpoint import prune

    root = tmp_path / "ckpt"
    for step in (5, 10, 15, 20, 25, 30):
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / ".metadata").write_text("")
    (root / ".step_00000035.partial").mkdir()  # being written
    (root / ".pruning.step_00000001").mkdir()  # left by a prune that was killed
    (root / "latest").write_text("step_00000010")  # an older one, as after a rollback
    assert prune(str(root), 0) == []  # 0: keep them all (a killed prune's leftovers go)
    assert len(list(root.glob("step_*"))) == 6 and not list(root.glob(".pruning.*"))
    (root / ".pruning.step_00000002").mkdir()
    assert prune(str(root), 2) == ["step_00000005", "step_00000015", "step_00000020"]
    assert sorted(p.name for p in root.iterdir()) == [
        ".step_00000035.partial",
        "latest",
        "step_00000010",
        "step_00000025",
        "step_00000030",
    ]
    with pytest.raises(ValueError, match="keep must be 0"):
        prune(str(root), -1)


def test_resume_continues_exactly(tmp_path: Path) -> None:
    """Shuffled, with loader workers: a run stopped at step 13 and resumed (without workers)
    ends bitwise where an uninterrupted run ends, reading only the steps after 13."""
    shuffled = [*TINY, "--shuffle", "--shuffle_chunk", "1000"]
    whole, whole_summary = run(
        tmp_path / "whole",
        *shuffled,
        "--limit_train_batches",
        "24",
        "--save_dir",
        str(tmp_path / "ckpt-whole"),
        "--checkpoint_every",
        "10",
        "--num_workers",
        "2",
        "--keep_checkpoints",
        "2",
    )
    assert whole.returncode == 0, whole.stderr[-3000:]
    names = sorted(p.name for p in (tmp_path / "ckpt-whole").iterdir())
    assert names == ["latest", "step_00000020", "step_00000024"]  # the 2 newest are kept
    first, _ = run(
        tmp_path / "first",
        *shuffled,
        "--limit_train_batches",
        "13",
        "--save_dir",
        str(tmp_path / "ckpt"),
        "--num_workers",
        "1",
    )
    assert first.returncode == 0, first.stderr[-3000:]
    second, resumed = run(
        tmp_path / "second",
        *shuffled,
        "--limit_train_batches",
        "24",
        "--save_dir",
        str(tmp_path / "ckpt"),
        "--resume",
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "step 13" in second.stdout
    assert resumed["weights_digest"] == whole_summary["weights_digest"]
    assert len(resumed["runs"][0]["data_wait_s"]) == 11  # the 11 steps left, trained
    # Said as steps 14-24, not as "11 of the 24 steps asked" (which means the data ended).
    assert "steps 14-24 (resumed at step 13)" in second.stdout and " asked" not in second.stdout
    assert "Warning" not in second.stderr, second.stderr[-3000:]  # DCP's notices hidden
    assert resumed["first_step"] == 13 and resumed["steps_run"] == 11
    other_order, _ = run(
        tmp_path / "other",
        *TINY,
        "--shuffle",
        "--limit_train_batches",
        "24",
        "--save_dir",
        str(tmp_path / "ckpt"),
        "--resume",
    )
    assert other_order.returncode == 1
    assert "error: the checkpoint's data position does not fit this run" in other_order.stderr
    assert "the shuffle chunk (samples) was " in other_order.stderr


def bad_npy_folder(tmp: Path) -> str:
    folder = tmp / "bad"
    folder.mkdir()
    for day in range(2):
        np.save(folder / f"day_{day}_dense.npy", np.zeros((10, 13), np.float32))
        np.save(folder / f"day_{day}_sparse.npy", np.zeros((10, 25), np.int64))
        np.save(folder / f"day_{day}_labels.npy", np.zeros((10, 1), np.int32))
    return str(folder)


def day_set_folder(folder: Path, kind: str) -> str:
    """Days numbered 0, 1, 3 (GAPPED); days 0, 1 and a day_2.gz (GZIPPED); raw TSV days (RAW)."""
    folder.mkdir()
    numbers = {"GAPPED": (0, 1, 3), "GZIPPED": (0, 1), "RAW": ()}[kind]
    for day in numbers:
        np.save(folder / f"day_{day}_dense.npy", np.zeros((10, 13), np.float32))
        np.save(folder / f"day_{day}_sparse.npy", np.zeros((10, 26), np.int64))
        np.save(folder / f"day_{day}_labels.npy", np.zeros((10, 1), np.int32))
    if kind == "GZIPPED":
        (folder / "day_2.gz").write_bytes(b"")
    if kind == "RAW":
        for day in range(2):
            (folder / f"day_{day}").write_text("\t".join(["1"] * 14 + ["a"] * 26) + "\n")
    return str(folder)


@pytest.mark.parametrize(
    "flags, code, message",
    [
        (["--dataset_path", "/nonexistent/criteo"], 2, "no such folder"),
        (["--dataset_path", "FILE"], 2, "--dataset_path FILE: is a file, not a folder"),
        (["--save_dir", "FILE"], 2, "--save_dir FILE: is a file"),
        (["--out", "FILE/out"], 2, "--out FILE/out: cannot be created: FILE is a file"),
        (["--out", "/proc/out"], 2, "--out /proc/out: cannot be created in /proc"),
        (["--save_dir", "/proc/ckpt"], 2, "--save_dir /proc/ckpt: cannot be created in /proc"),
        (["--data_cache", "FILE"], 2, "--data_cache FILE: is a file"),
        (["--save_dir", "DANGLING"], 2, "which is missing"),
        (["--scale", "0"], 2, "--scale must be a positive number"),
        (["--hot_budget_mb", "-1"], 2, "--hot_budget_mb must be a positive number"),
        (["--scale", "100"], 1, "TorchRec's planner found no plan for the lookahead model"),
        (["--test_batch_size", "100000"], 1, "the val split: 2,048 samples make no global"),
        (["--torchrec_plan"], 2, "--torchrec_plan plans the plain TorchRec model"),
        (["--scale", "nan"], 2, "--scale must be a positive number"),
        (["--interaction_type", "dcn", "--dcn_low_rank_dim", "0"], 2, "--dcn_low_rank_dim"),
        (["--embedding_dim", "6", "--dense_arch_layer_sizes", "64,6"], 2, "multiple of 4"),
        (["--dataset_path", "EMPTY"], 2, "found no day"),
        (["--dataset_path", "GAPPED"], 2, "numbered 0-1, 3, with days 2 missing"),
        (["--dataset_path", "GZIPPED"], 2, "compressed files day_2.gz: decompress them"),
        (["--dataset_path", "RAW"], 2, "day_0, day_1 are not converted; convert them first"),
        (["--keep_checkpoints", "-1"], 2, "--keep_checkpoints must be 0 (keep all) or more"),
        (["--dataset_path", "BAD_NPY"], 1, "expected dense [N, 13] float32, sparse [N, 26]"),
        (["--lookahead", "0"], 2, "--lookahead must be at least 1"),
        (["--seed", "-1"], 2, "--seed must be an integer in [0, 2**63), got -1"),
        (["--cache_load_factor", "1.5"], 2, "--cache_load_factor must be in (0, 1]"),
        (["--resume"], 2, "need --save_dir"),
        (["--async_checkpoint"], 2, "--async_checkpoint needs --save_dir"),
        (
            "--save_dir EMPTY --async_checkpoint --store_dir EMPTY".split(),
            2,
            "--async_checkpoint copies every table into RAM",
        ),
        (
            "--save_dir EMPTY --checkpoint_every 10 --fail_at_step 15 --fail_in checkpoint".split(),
            2,
            "a multiple of --checkpoint_every",
        ),
        (["--dense_arch_layer_sizes", "64,8"], 2, "must end in --embedding_dim"),
        (["--session_size", "0"], 2, "--session_size must be a positive integer"),
        (["--dataset_path", "EMPTY", "--session_size", "4"], 2, "--session_size shapes the"),
    ],
)
def test_bad_input_gets_one_clear_message(tmp_path: Path, flags, code, message, capsys) -> None:
    """Flags and paths are checked as the arguments are read (in this process: exit 2 and
    one ``error:`` line); data is checked when it is read (exit 1, a run of the example)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("")
    (tmp_path / "dangling").mkdir()
    (tmp_path / "dangling" / "latest").write_text("step_00000005")
    paths = {
        "EMPTY": tmp_path / "empty",
        "FILE": tmp_path / "file",
        "DANGLING": tmp_path / "dangling",
    }

    def substituted(flag: str) -> str:  # a placeholder at the start of a flag, made real
        if flag == "BAD_NPY":
            return bad_npy_folder(tmp_path)
        if flag in ("GAPPED", "GZIPPED", "RAW"):
            return day_set_folder(tmp_path / flag.lower(), flag)
        for name, path in paths.items():
            if flag.startswith(name):
                return str(path) + flag[len(name) :]
        return flag

    flags = [substituted(f) for f in flags]
    message = message.replace("FILE", str(tmp_path / "file"))
    if code == 2:
        import flags as example_flags

        with pytest.raises(SystemExit) as exited:
            example_flags.parse_args([*TINY, "--out", str(tmp_path / "out"), *flags])
        returncode, stderr = exited.value.code, capsys.readouterr().err
    else:
        done, _ = run(tmp_path, *TINY, *flags)
        returncode, stderr = done.returncode, done.stderr
    assert returncode == code, stderr[-2000:]
    assert stderr.count("error:") == 1 and message in stderr, stderr[-2000:]
    assert "Traceback" not in stderr
    assert not (tmp_path / "out").exists()  # nothing written


def test_folders_only_read_are_not_written_into(tmp_path: Path, capsys) -> None:
    """Data on a read-only mount was refused ("cannot be written"): the write probe ran
    on every folder flag, and left and removed a folder in the user's data folder.
    ``/proc``: a folder any user, root too, can read and cannot write into."""
    import flags as example_flags
    from folders import folder_problem

    assert folder_problem("/proc", must_exist=True, written=False) is None
    assert (folder_problem("/proc", must_exist=True) or "").startswith("cannot be written")
    data = tmp_path / "days"
    data.mkdir()
    assert folder_problem(str(data), must_exist=True, written=False) is None
    assert not list(data.iterdir())  # nothing made in it, not even for a moment
    with pytest.raises(SystemExit):  # /proc holds no days: the days' check refuses it
        example_flags.parse_args([*TINY, "--out", str(tmp_path / "out"), "--dataset_path", "/proc"])
    stderr = capsys.readouterr().err
    assert "--dataset_path: /proc:" in stderr and "cannot be" not in stderr, stderr


def test_resume_onto_another_model_names_the_flags(tmp_path: Path, capsys) -> None:
    first, _ = run(
        tmp_path / "first",
        *TINY,
        "--limit_train_batches",
        "3",
        "--save_dir",
        str(tmp_path / "ckpt"),
    )
    assert first.returncode == 0, first.stderr[-3000:]
    other_models = {
        "--dense_arch, --embedding_dim": [
            "--embedding_dim",
            "8",
            "--dense_arch_layer_sizes",
            "64,8",
        ],
        "--adagrad, --dcn_low_rank_dim, --dcn_num_layers, --interaction_type": [
            "--adagrad",
            "--interaction_type",
            "dcn",
        ],
        "--num_embeddings": ["--scale", "0.002"],
    }
    import flags as example_flags  # the check is the flags' own: no process needed

    for changed, flags in other_models.items():
        again = [*TINY, "--out", str(tmp_path / "again"), "--save_dir", str(tmp_path / "ckpt")]
        with pytest.raises(SystemExit) as exited:
            example_flags.parse_args([*again, "--limit_train_batches", "6", "--resume", *flags])
        assert exited.value.code == 2
        assert f"holds a model with other {changed};" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step_00000003"]


def test_the_learning_rate_schedule_warms_up_holds_and_decays() -> None:
    import torch
    from schedule import FLOOR, RateSchedule

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    schedule = RateSchedule(optimizer, 0.2, warmup=4, decay_start=6, decay_steps=2)
    rates = []
    for step in range(10):
        schedule.set(step)
        rates.append(optimizer.param_groups[0]["lr"])
    assert rates == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.2, 0.2, 0.2, 0.05, FLOOR, FLOOR])


def test_ctrl_c_ends_with_one_line_naming_the_checkpoint_to_resume(tmp_path: Path) -> None:
    """A SIGINT mid-run (Ctrl-C) printed a KeyboardInterrupt traceback from every rank; it
    ends with one line and the shell's status for SIGINT, the latest checkpoint intact."""
    import os
    import signal
    import time

    save = tmp_path / "ckpt"
    flags = [*TINY, "--epochs", "50", "--save_dir", str(save), "--checkpoint_every", "2"]
    cache = ["--data_cache", str(tmp_path.parent / "data-cache"), "--out", str(tmp_path / "o")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(
        [sys.executable, MAIN, *cache, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as job:
        deadline = time.monotonic() + 240
        while not (save / "latest").exists() and job.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.2)
        job.send_signal(signal.SIGINT)
        _, stderr = job.communicate(timeout=120)
    assert job.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    line = next(line for line in stderr.splitlines() if line.startswith("interrupted"))
    assert "the latest checkpoint is" in line and line.endswith("continue with --resume")
    saved = int(line.split("step_")[1].split(":")[0])  # the checkpoint intact: it resumes
    limit = str(saved + 2)
    resumed, summary = run(
        tmp_path, *TINY, "--save_dir", str(save), "--resume", "--limit_train_batches", limit
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary is not None and len(summary["runs"][0]["step_s"]) == 2


@pytest.mark.parametrize("example", ["dlrm/dlrm_main.py", "bert4rec/bert4rec_main.py"])
def test_ctrl_c_while_the_example_starts_ends_with_one_line(example: str) -> None:
    """A Ctrl-C during the seconds torch and TorchRec take to import printed the traceback
    of the module being imported; it ends with one line and the shell's status for SIGINT."""
    import signal
    import time

    with subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / example), "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as job:
        deadline = time.monotonic() + 60
        while "libtorch" not in Path(f"/proc/{job.pid}/maps").read_text():  # importing torch
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.01)
        job.send_signal(signal.SIGINT)
        stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.splitlines()[-1] == "interrupted while starting (nothing trained or written)"
    assert "usage" not in stdout  # it ended before its main


def test_a_program_importing_the_examples_keeps_its_own_ctrl_c() -> None:
    """Only a process running an example's script hands Ctrl-C to the examples' start-up
    handler; the tests import the examples' modules and keep Python's."""
    import importlib
    import signal

    import startup

    importlib.reload(startup)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # pytest's


def test_the_start_up_ctrl_c_ends_the_start_once_and_hands_ctrl_c_back(capfd) -> None:
    """A start that fails before the example's main must not leave its handler behind:
    the one Ctrl-C it takes ends the start, a later one is Python's again."""
    import signal

    import startup

    signal.signal(signal.SIGINT, startup._interrupted_while_starting)
    try:
        with pytest.raises(SystemExit) as ended:
            signal.raise_signal(signal.SIGINT)
        handler = signal.getsignal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert ended.value.code == 130 and handler is signal.default_int_handler
    assert capfd.readouterr().err == "interrupted while starting (nothing trained or written)\n"


def test_the_steps_trained_are_said_as_trained() -> None:
    from report import trained_steps

    assert trained_steps(0, 20, None) == "20 steps"
    assert trained_steps(0, 20, 20) == "20 steps"
    assert trained_steps(0, 12, 20) == "12 of the 20 steps asked"  # the data ended
    assert trained_steps(10, 10, 20) == "steps 11-20 (resumed at step 10)"
    assert trained_steps(10, 5, 20) == "steps 11-15 (resumed at step 10), of the 20 asked"
    assert trained_steps(20, 0, 20) == "no steps (resumed at step 20)"


def test_synthetic_data_stopped_mid_write_leaves_no_staging_folder(
    tmp_path: Path, monkeypatch
) -> None:
    """A Ctrl-C while the days were written left a hidden staging folder of the data set's
    size behind, which no later run removed."""
    import importlib.util

    # By path: another test's "data" (the BERT4Rec example's) may hold the plain name.
    spec_of = importlib.util.spec_from_file_location("dlrm_example_data", ROOT / MAIN_DATA)
    assert spec_of is not None and spec_of.loader is not None
    example_data = importlib.util.module_from_spec(spec_of)
    sys.modules[spec_of.name] = example_data  # (its dataclasses look their module up)
    spec_of.loader.exec_module(example_data)
    spec = example_data.SyntheticSpec(0.001, 1.1, 2, 512, 0)
    saves = []
    real_save = np.save

    def save_then_stop(path, array) -> None:
        real_save(path, array)
        saves.append(path)
        if len(saves) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(example_data.np, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        example_data.synthetic_days(spec, tmp_path)
    assert saves and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(example_data.np, "save", real_save)
    folder = example_data.synthetic_days(spec, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]
    assert len(find_days(str(folder))) == 2


def test_a_run_whose_loss_is_not_a_number_is_said_to_have_diverged() -> None:
    from report import Run, diverged

    runs = [Run("lookahead", first_step=10, loss=[0.5, float("nan")]), Run("baseline", loss=[0.5])]
    assert diverged(runs) == [
        "warning: the lookahead run diverged: its loss is nan at step 12 (a smaller learning rate?)"
    ]
