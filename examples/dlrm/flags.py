"""The example's command line: TorchRec's DLRM example's flags, the cache's, checked."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch
from checkpoint import latest
from faults import first_attempt
from folders import folder_problem
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES

from torchrec_lookahead.data import CRITEO_KAGGLE_TABLE_SIZES, SyntheticCriteo
from torchrec_lookahead.data.contiguous import CARDINALITY_FILE, read_cardinalities
from torchrec_lookahead.data.days import npy_day_paths
from torchrec_lookahead.data.npy import DataError

__all__ = ["MODEL_FILE", "loader_workers", "model_config", "parse_args"]

CORES_FOR_A_WORKER = 4  # cores per rank from which a loader worker is the default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="DLRM with lookahead embedding caching (TorchRec)")
    # As in TorchRec's DLRM example.
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch_size", type=int, default=1024, help="per rank")
    p.add_argument("--test_batch_size", type=int, default=None)
    p.add_argument("--limit_train_batches", type=int, default=None)
    p.add_argument("--limit_val_batches", type=int, default=None)
    p.add_argument("--limit_test_batches", type=int, default=None)
    p.add_argument("--embedding_dim", type=int, default=16)
    p.add_argument("--dense_arch_layer_sizes", type=str, default="64,16")
    p.add_argument("--over_arch_layer_sizes", type=str, default="64,32,1")
    p.add_argument("--interaction_type", choices=["original", "dcn"], default="original")
    p.add_argument("--dcn_num_layers", type=int, default=3)
    p.add_argument("--dcn_low_rank_dim", type=int, default=16)
    p.add_argument("--learning_rate", type=float, default=0.1)
    p.add_argument(
        "--lr_warmup_steps",
        type=int,
        default=0,
        help="raise the rates linearly from 0 over this many steps",
    )
    p.add_argument(
        "--lr_decay_start",
        type=int,
        default=0,
        help="the step at which the rates start to decay (after the warm-up)",
    )
    p.add_argument(
        "--lr_decay_steps",
        type=int,
        default=0,
        help="decay the rates quadratically to 0 over this many steps, then hold",
    )
    p.add_argument("--adagrad", action="store_true", help="row-wise Adagrad / Adagrad, not SGD")
    p.add_argument(
        "--num_embeddings_per_feature",
        type=str,
        default=None,
        help="26 comma-separated table sizes (real data: ids are taken modulo these), or a "
        "file holding them (@FILE or a path, e.g. preprocess.py's "
        f"{CARDINALITY_FILE}); default with --dataset_path: that folder's "
        f"{CARDINALITY_FILE} if it has one, else Criteo Kaggle's sizes",
    )
    p.add_argument(
        "--dataset_path",
        type=str,
        default=None,
        help="a folder of .npy days: day_<i>_dense.npy, day_<i>_labels.npy and "
        "day_<i>_sparse.npy or day_<i>_sparse_contig_freq.npy (TorchRec's names); raw "
        "TSV days are converted first, by examples/dlrm/preprocess.py",
    )
    p.add_argument(
        "--shuffle",
        action="store_true",
        help="train in a seeded order: chunks of --shuffle_chunk samples in a random "
        "order, samples within each chunk too (same on every rank and restart)",
    )
    p.add_argument("--shuffle_chunk", type=int, default=2**20, help="samples; the shuffle's memory")
    p.add_argument(
        "--num_workers",
        type=int,
        default=None,
        help="DataLoader worker processes reading, building, deduplicating and (lookahead) "
        "checking batches (0: the lookahead stage's thread does it). Default: 1 where a rank "
        f"has at least {CORES_FOR_A_WORKER} cores of this host to itself, else 0 (see "
        "loader_workers)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--print_sharding_plan", action="store_true")
    # Synthetic data (when no --dataset_path).
    p.add_argument("--scale", type=float, default=0.01, help="Criteo Kaggle table sizes times this")
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--synthetic_days", type=int, default=3)
    p.add_argument("--synthetic_samples_per_day", type=int, default=131072)
    p.add_argument("--data_cache", type=str, default=".cache/dlrm-data")
    p.add_argument(
        "--session_size",
        type=int,
        default=1,
        help="consecutive samples of one user, sharing its features",
    )
    p.add_argument(
        "--dedup",
        action="store_true",
        help="send the user-side features once per session (TorchRec's deduplicated batches, RecD)",
    )
    # Lookahead caching.
    p.add_argument("--lookahead", type=int, default=16)
    p.add_argument("--prefetch_distance", type=int, default=1)
    p.add_argument(
        "--planner",
        choices=["host", "device"],
        default="host",
        help="where each step's plan is made: the numba oracle on the host, or the device "
        "oracle on the training device (LookaheadTrainPipeline's planner=)",
    )
    p.add_argument("--cache_load_factor", type=float, default=0.1)
    p.add_argument(
        "--store_dir",
        type=str,
        default=None,
        help="keep the full tables in files in this existing directory "
        "(for tables larger than RAM); one subdirectory per rank",
    )
    hot = p.add_mutually_exclusive_group()
    hot.add_argument(
        "--hot_rows",
        dest="hot_rows",
        action="store_const",
        const="on",
        default="auto",
        help="replicate on every rank every row whose replicas save bytes per step, as "
        "planners/hot.py finds them on --plan_sample_batches batches (several ranks, "
        "without --dedup). The default, 'auto', keeps only the rows whose bytes cost the "
        "link more time than their lookups cost the replicas (the link probed at start, "
        "or --link_gbps), which on a fast link is none",
    )
    hot.add_argument(
        "--no_hot_rows",
        dest="hot_rows",
        action="store_const",
        const="off",
        help="replicate no rows across ranks",
    )
    p.add_argument(
        "--link_gbps",
        type=float,
        default=None,
        help="the link's rate per host in Gbit/s, for choosing hot rows (default: measured "
        "at start with a short all-to-all)",
    )
    p.add_argument(
        "--baseline_only",
        action="store_true",
        help="train plain TorchRec alone (with --torchrec_plan: its planner's plan), for "
        "benchmarks that time it apart",
    )
    p.add_argument(
        "--hot_budget_mb",
        type=float,
        default=None,
        help="memory for the replicated hot rows on each rank (default: every row "
        "that saves bytes)",
    )
    p.add_argument("--baseline", action="store_true", help="also train plain TorchRec and compare")
    p.add_argument(
        "--sharding_type",
        choices=("table_wise", "row_wise"),
        default="table_wise",
        help="how both models shard every table (row_wise: each table's rows split over "
        "the ranks; on CUDA only, where TorchRec's sharder offers it)",
    )
    p.add_argument(
        "--torchrec_plan",
        action="store_true",
        help="plan the --baseline model with TorchRec's planner as it likes (data-"
        "parallel small tables, ...), not table-wise like the lookahead model; "
        "it then starts from its own weights (benchmarks/comm.py)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic CUDA algorithms, so runs compare bitwise (implied by "
        "--baseline; the CPU is deterministic already)",
    )
    p.add_argument(
        "--plan_cache_sizes",
        action="store_true",
        help="size each table's cache with the lookahead planner from sample batches",
    )
    p.add_argument("--plan_sample_batches", type=int, default=50)
    p.add_argument("--cache_budget_mb", type=float, default=None, help="device memory for caches")
    p.add_argument(
        "--step_compute_ms",
        type=float,
        default=10.0,
        help="compute time per step that prefetches hide behind (planning)",
    )
    # Checkpoints and output.
    p.add_argument("--save_dir", type=str, default=None)
    p.add_argument("--checkpoint_every", type=int, default=None, help="steps; also at the end")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from --save_dir's latest complete checkpoint (from step 0 if it has "
        "none). Implied when torchrun restarts the job (--max-restarts), so a restart "
        "resumes by itself; without it, --save_dir must hold no checkpoint",
    )
    p.add_argument(
        "--keep_checkpoints",
        type=int,
        default=3,
        help="keep the newest N checkpoints in --save_dir, removing older ones as new ones "
        "are published (never the one 'latest' names; 0: keep them all)",
    )
    p.add_argument(
        "--async_checkpoint",
        action="store_true",
        help="stall training only to copy the state; write the files in the background",
    )
    # Failure injection (tests and benchmarks/failures.py), on torchrun's first attempt only.
    p.add_argument(
        "--fail_at_step",
        type=int,
        default=None,
        help="kill --fail_rank (SIGKILL) after this training step, or while it "
        "writes this step's checkpoint (--fail_in checkpoint)",
    )
    p.add_argument("--fail_rank", type=int, default=0)
    p.add_argument("--fail_in", choices=["step", "checkpoint"], default="step")
    p.add_argument("--out", type=str, default="results/dlrm", help="summary JSON and PNG")
    args = p.parse_args(argv)

    def positive(name: str, allow_none: bool = True) -> None:
        value = getattr(args, name)
        if (value is None and not allow_none) or (value is not None and value < 1):
            p.error(f"--{name} must be a positive integer, got {value}")

    def positive_number(name: str, allow_zero: bool = False) -> None:
        value = getattr(args, name)
        if value is not None and not (
            math.isfinite(value) and (value > 0 or allow_zero and value == 0)
        ):
            p.error(
                f"--{name} must be a {'non-negative' if allow_zero else 'positive'} "
                f"number, got {value}"
            )

    for name in (
        "epochs",
        "batch_size",
        "embedding_dim",
        "synthetic_days",
        "synthetic_samples_per_day",
        "test_batch_size",
        "limit_train_batches",
        "limit_val_batches",
        "limit_test_batches",
        "checkpoint_every",
        "session_size",
        "dcn_num_layers",
        "dcn_low_rank_dim",
        "plan_sample_batches",
        "shuffle_chunk",
    ):
        positive(name)
    if args.sharding_type == "row_wise" and not torch.cuda.is_available():
        p.error("--sharding_type row_wise needs CUDA (TorchRec shards row-wise only there)")
    if args.keep_checkpoints < 0:
        p.error(f"--keep_checkpoints must be 0 (keep all) or more, got {args.keep_checkpoints}")
    if args.num_workers is None:
        args.num_workers = loader_workers(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    elif args.num_workers < 0:
        p.error(f"--num_workers must be 0 or more, got {args.num_workers}")
    for name in ("scale", "zipf", "learning_rate", "cache_budget_mb", "link_gbps", "hot_budget_mb"):
        positive_number(name)
    if args.torchrec_plan and not (args.baseline or args.baseline_only):
        p.error(
            "--torchrec_plan plans the plain TorchRec model: give --baseline or --baseline_only"
        )
    positive_number("step_compute_ms", allow_zero=True)
    if args.embedding_dim % 4:
        p.error(
            f"--embedding_dim must be a multiple of 4 (FBGEMM's kernels need row widths "
            f"in multiples of 4), got {args.embedding_dim}"
        )
    for name, must_exist, written in (
        ("dataset_path", True, False),  # only read: a read-only mount is fine
        ("store_dir", True, True),
        ("save_dir", False, True),
        ("data_cache", False, True),
        ("out", False, True),
    ):
        if problem := folder_problem(getattr(args, name), must_exist, written):
            p.error(f"--{name} {getattr(args, name)}: {problem}")
    if not 0 <= args.seed < 2**63:  # numpy's seeds are non-negative, torch's 64-bit
        p.error(f"--seed must be an integer in [0, 2**63), got {args.seed}")
    for name in ("lr_warmup_steps", "lr_decay_start", "lr_decay_steps"):
        if getattr(args, name) < 0:
            p.error(f"--{name} must be 0 or more, got {getattr(args, name)}")
    if args.lr_decay_steps and args.lr_decay_start < args.lr_warmup_steps:
        p.error(
            "the learning-rate warm-up must end before the decay starts "
            f"(--lr_decay_start {args.lr_decay_start} < --lr_warmup_steps "
            f"{args.lr_warmup_steps})"
        )
    if args.lookahead < 1:
        p.error(
            f"--lookahead must be at least 1 (the oracle needs to see ahead), got {args.lookahead}"
        )
    if args.prefetch_distance < 0:
        p.error(f"--prefetch_distance must be >= 0, got {args.prefetch_distance}")
    if not 0 < args.cache_load_factor <= 1:
        p.error(f"--cache_load_factor must be in (0, 1], got {args.cache_load_factor}")
    if args.session_size > 1 and args.dataset_path:
        p.error(
            "--session_size shapes the synthetic data; real data has its own sessions "
            "(--dedup finds them)"
        )
    if args.synthetic_days < 2:
        p.error("--synthetic_days must be at least 2 (train, then validation/test)")
    if (args.resume or args.checkpoint_every) and not args.save_dir:
        p.error("--resume and --checkpoint_every need --save_dir")
    if args.baseline_only and (args.resume or args.save_dir or args.baseline):
        p.error(
            "--baseline_only trains plain TorchRec alone, from the start: no --baseline, "
            "--resume or --save_dir"
        )
    if args.resume and args.baseline:
        p.error("--resume continues the lookahead run only; run --baseline from the start")
    if args.async_checkpoint and not args.save_dir:
        p.error("--async_checkpoint needs --save_dir")
    if args.async_checkpoint and args.store_dir:
        p.error(
            "--async_checkpoint copies every table into RAM; with --store_dir checkpoints "
            "are written in the foreground, streamed from the store files"
        )
    try:
        found = latest(args.save_dir) if args.save_dir else None
    except ValueError as error:
        p.error(f"--save_dir: {error}")
    if args.save_dir and not args.resume and first_attempt() and found:
        p.error(
            f"--save_dir {args.save_dir} already holds a checkpoint "
            f"({os.path.basename(found)}); pass --resume to continue from it, or choose "
            "an empty folder"
        )
    args.resume = args.resume or (args.save_dir is not None and not first_attempt())
    if args.fail_at_step is not None:
        positive("fail_at_step")
        if args.fail_rank < 0:
            p.error(f"--fail_rank must be >= 0, got {args.fail_rank}")
        if args.fail_in == "checkpoint" and (
            not args.checkpoint_every or args.fail_at_step % args.checkpoint_every
        ):
            p.error(
                "--fail_in checkpoint needs --fail_at_step to be a multiple of --checkpoint_every"
            )
    try:
        args.dense_arch = [int(x) for x in args.dense_arch_layer_sizes.split(",")]
        args.over_arch = [int(x) for x in args.over_arch_layer_sizes.split(",")]
    except ValueError:
        p.error("layer sizes are comma-separated integers, e.g. --dense_arch_layer_sizes 64,16")
    if args.dense_arch[-1] != args.embedding_dim:
        p.error(
            f"the dense arch must end in --embedding_dim ({args.embedding_dim}), "
            f"got {args.dense_arch_layer_sizes}"
        )
    if args.over_arch[-1] != 1:
        p.error(f"the over arch must end in 1, got {args.over_arch_layer_sizes}")
    if args.dataset_path:
        try:  # the day set, by name, on every rank before any collective (contents: later)
            npy_day_paths(args.dataset_path)
        except DataError as error:
            p.error(f"--dataset_path: {error}")
    found_sizes = Path(args.dataset_path or ".", CARDINALITY_FILE)
    if args.num_embeddings_per_feature is not None:
        try:
            args.num_embeddings = table_sizes(args.num_embeddings_per_feature)
        except DataError as error:
            p.error(f"--num_embeddings_per_feature: {error}")
    elif args.dataset_path and found_sizes.is_file():
        try:
            args.num_embeddings = read_cardinalities(found_sizes)
        except DataError as error:
            p.error(f"--dataset_path: {error}")
    elif args.dataset_path:
        args.num_embeddings = list(CRITEO_KAGGLE_TABLE_SIZES)
    else:
        args.num_embeddings = list(SyntheticCriteo(scale=args.scale).num_embeddings)
    if args.resume and found and (changed := model_changes(args, found)):
        p.error(
            f"--resume: {found} holds a model with other {changed}; resume with the "
            "flags that wrote it, or choose another --save_dir"
        )
    return args


def loader_workers(local_ranks: int, cores: int | None = None) -> int:
    """Loader workers per rank by default: one where each of the host's ``local_ranks``
    has ``CORES_FOR_A_WORKER`` cores (the trainer's, the lookahead stage's, the
    worker's, and one for the rest), else none. On fewer cores a worker takes cycles
    from the trainer or the stage: on the 2-core machine this project is measured on,
    one worker lowered the demo's samples/s for both plain TorchRec and lookahead
    (docs/guides/large-data.md)."""
    if cores is None:  # the cores this process may run on (Linux), else the machine's
        affinity = getattr(os, "sched_getaffinity", None)
        cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    return 1 if cores // max(local_ranks, 1) >= CORES_FOR_A_WORKER else 0


def table_sizes(value: str) -> list[int]:
    """``--num_embeddings_per_feature``: 26 comma-separated sizes, or a file holding them
    (``@FILE``, or any value that is not digits and commas, is a path)."""
    if value.startswith("@") or not _digits(value.replace(",", "")):
        path = Path(value.removeprefix("@"))
        if not path.is_file():
            raise DataError(
                f"{value}: no such file (expected 26 comma-separated table "
                "sizes, or a file holding them)"
            )
        return read_cardinalities(path)
    sizes = value.split(",")
    if len(sizes) != len(DEFAULT_CAT_NAMES) or not all(_digits(s) and int(s) > 0 for s in sizes):
        raise DataError("needs 26 positive comma-separated integers (or a file holding them)")
    return [int(s) for s in sizes]


MODEL_FILE = "model.json"  # in every checkpoint folder: the flags that shaped its model


# The flags that shape the model a checkpoint holds (a resumed run must match them).
MODEL_FLAGS = (
    "embedding_dim",
    "num_embeddings",
    "dense_arch",
    "over_arch",
    "interaction_type",
    "dcn_num_layers",
    "dcn_low_rank_dim",
    "adagrad",
)


def model_config(args: argparse.Namespace) -> dict[str, object]:
    config = {name: getattr(args, name) for name in MODEL_FLAGS}
    if args.interaction_type != "dcn":  # the DCN flags do not shape a DLRM
        config.pop("dcn_num_layers"), config.pop("dcn_low_rank_dim")
    return config


def model_changes(args: argparse.Namespace, checkpoint: str) -> str | None:
    """The model flags (as ``--flag``s) that differ from those ``checkpoint`` was saved
    with (its ``model.json``); None if none differ or it does not say."""
    recorded = Path(checkpoint) / MODEL_FILE
    if not recorded.is_file():
        return None
    saved = json.loads(recorded.read_text())
    wanted = json.loads(json.dumps(model_config(args)))  # lists as JSON gives them back
    changed = [f"--{k}" for k in sorted(set(saved) | set(wanted)) if saved.get(k) != wanted.get(k)]
    return ", ".join(changed) or None


def _digits(text: str) -> bool:
    """ASCII digits only (``str.isdigit`` takes "²" and "٥", which ``int`` refuses or reads)."""
    return text.isascii() and text.isdigit()
