"""TorchRec's DLRM example, trained with lookahead embedding caching.

The flags and behaviour follow TorchRec's DLRM example (``torchrec_dlrm/
dlrm_main.py``): DLRM or DCN interaction, ``EmbeddingShardingPlanner``,
``DistributedModelParallel``, fused embedding optimizer, ``torchrun`` for several
processes, gloo on CPU and NCCL on CUDA. On top: ``--lookahead``,
``--prefetch_distance`` and ``--cache_load_factor`` for the cache, and
``--baseline`` to train plain TorchRec (every row resident) beside it from the
same weights on the same data and compare.

    python examples/dlrm/dlrm_main.py --baseline                   # synthetic Criteo-shaped data
    torchrun --standalone --nproc_per_node 2 examples/dlrm/dlrm_main.py
    python examples/dlrm/dlrm_main.py --dataset_path /data/criteo  # day_*.npy or raw TSV days

Checkpoints (``--save_dir``, ``--checkpoint_every``, ``--async_checkpoint``) make a
job survive failures: under ``torchrun --max-restarts N`` a restarted worker group
resumes from the latest complete checkpoint by itself, redoes the steps after it
and ends with the weights of an uninterrupted run. ``--fail_at_step`` kills a
rank on purpose to show it.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import math
import os
import signal
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def quiet_library_notices() -> None:
    """Hide the warnings TorchRec, FBGEMM and torch print about their own internals, or
    about calls this example makes as TorchRec's DLRM example does, which a user of the
    example cannot act on. Only these messages, from these places: any other warning
    still shows. (Before the imports: some are raised while TorchRec is imported.)"""
    hide = partial(warnings.filterwarnings, "ignore")
    # Import-time notices for FBGEMM kernels (SSD, Adam variants) not built into this
    # FBGEMM package; the example uses only SGD and row-wise Adagrad.
    hide(r"(?s).*Failed to import: fbgemm_gpu\.", DeprecationWarning, r"fbgemm_gpu\.")
    # TorchRec itself imports this FBGEMM module; nothing here names it.
    hide(r"(?s).*The Python module fbgemm_gpu\.split_table_batched_embeddings_ops is now "
         "DEPRECATED", DeprecationWarning, r"fbgemm_gpu\.")  # fmt: skip
    # Raised while TorchRec and FBGEMM define their modules at import; this file
    # scripts nothing with torch.jit.
    hide(r"`torch\.jit\.(script|interface)` is deprecated", DeprecationWarning, r"torch\.jit\.")
    # TorchRec's public apply_optimizer_in_backward (as in TorchRec's DLRM example) forwards
    # to torch's private _apply_optimizer_in_backward: the same call, without a stable name.
    hide(r"This API is deprecated\. Please use Pytorch Distributed's "
         "_apply_optimizer_in_backward", DeprecationWarning,
         r"torchrec\.optim\.apply_optimizer_in_backward")  # fmt: skip
    # TorchRec's planner default; it warns of misestimated dense sizes in dry runs (no
    # tensors), but this example plans with its dense layers built and the plan is fixed
    # (table-wise, one kernel) for both models.
    hide(r"HeuristicalStorageReservation is known to cause issues", FutureWarning,
         r"torchrec\.distributed\.planner\.planners")  # fmt: skip
    # torch's DDP on the argument TorchRec's DistributedModelParallel passes it internally.
    hide(r"`broadcast_buffers` is deprecated", FutureWarning,
         r"torchrec\.distributed\.model_parallel")  # fmt: skip
    logged = {
        # The same dry-run notice as HeuristicalStorageReservation's above, once per plan.
        "torchrec.distributed.planner.storage_reservations":
            "There is a known issue with TorchRec's dense tensor size calculation in dry run",
        # A Topology of world size and device type on TorchRec's default hardware figures,
        # as TorchRec's DLRM example builds it; this TorchRec only warns ("will fail" is
        # a future plan), and both models share the plan it gives.
        "torchrec.distributed.planner.types":
            "The topology was constructed directly rather than via TopologyFactory",
        # Logged the first time anything asks whether fx is tracing: TorchRec's
        # KeyedJaggedTensor asks at every construction. A note to torch's callers.
        "torch.fx._symbolic_trace": "is_fx_tracing will return true for both fx.symbolic_trace",
    }  # fmt: skip
    for name, start in logged.items():
        logging.getLogger(name).addFilter(lambda record, s=start: not
                                          record.getMessage().startswith(s))  # fmt: skip


quiet_library_notices()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torchmetrics  # noqa: E402
from checkpoint import Checkpointer, latest  # noqa: E402
from data import USER_FEATURES, SyntheticSpec, real_days, synthetic_days  # noqa: E402
from schedule import RateSchedule  # noqa: E402
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES  # noqa: E402
from torchrec.datasets.utils import Batch  # noqa: E402
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # noqa: E402
from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: E402
from torchrec.distributed.planner import (  # noqa: E402
    EmbeddingShardingPlanner,
    ParameterConstraints,
    Topology,
)
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist  # noqa: E402
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402
from torchrec.optim import SGD, RowWiseAdagrad  # noqa: E402
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward  # noqa: E402
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper  # noqa: E402
from torchrec.optim.optimizers import in_backward_optimizer_filter  # noqa: E402
from tqdm import tqdm  # noqa: E402

from torchrec_lookahead import (  # noqa: E402
    LookaheadEmbeddingBagCollection,
    LookaheadEmbeddingBagCollectionSharder,
    LookaheadTrainPipeline,
)
from torchrec_lookahead.data import CRITEO_KAGGLE_TABLE_SIZES, SyntheticCriteo  # noqa: E402
from torchrec_lookahead.data.criteo import (  # noqa: E402
    CriteoDayReader,
    DayFiles,
    SampleOrder,
    find_days,
    stage_samples,
)
from torchrec_lookahead.data.dedup import DedupCounts  # noqa: E402
from torchrec_lookahead.data.npy import DataError  # noqa: E402
from torchrec_lookahead.store.files import anonymous_rss_bytes  # noqa: E402
from torchrec_lookahead.testing.determinism import deterministic_cuda  # noqa: E402
from torchrec_lookahead.traffic import (  # noqa: E402
    EMBEDDING_KINDS,
    KINDS,
    CollectiveBytes,
    count_data_parallel,
)


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
    p.add_argument("--lr_warmup_steps", type=int, default=0,
                   help="raise the rates linearly from 0 over this many steps")
    p.add_argument("--lr_decay_start", type=int, default=0,
                   help="the step at which the rates start to decay (after the warm-up)")
    p.add_argument("--lr_decay_steps", type=int, default=0,
                   help="decay the rates quadratically to 0 over this many steps, then hold")
    p.add_argument("--adagrad", action="store_true", help="row-wise Adagrad / Adagrad, not SGD")
    p.add_argument(
        "--num_embeddings_per_feature",
        type=str,
        default=None,
        help="26 comma-separated table sizes (real data: ids are taken modulo these)",
    )
    p.add_argument(
        "--dataset_path",
        type=str,
        default=None,
        help="day_<i>_{dense,sparse,labels}.npy or raw Criteo TSV days",
    )
    p.add_argument("--shuffle", action="store_true",
                   help="train in a seeded order: chunks of --shuffle_chunk samples in a random "
                        "order, samples within each chunk too (same on every rank and restart)")
    p.add_argument("--shuffle_chunk", type=int, default=2**20, help="samples; the shuffle's memory")
    p.add_argument("--num_workers", type=int, default=0,
                   help="DataLoader worker processes reading, building and deduplicating batches "
                        "(0: the lookahead stage's thread does it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--print_sharding_plan", action="store_true")
    # Synthetic data (when no --dataset_path).
    p.add_argument("--scale", type=float, default=0.01, help="Criteo Kaggle table sizes times this")
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--synthetic_days", type=int, default=3)
    p.add_argument("--synthetic_samples_per_day", type=int, default=131072)
    p.add_argument("--data_cache", type=str, default=".cache/dlrm-data")
    p.add_argument("--session_size", type=int, default=1,
                   help="consecutive samples of one user, sharing its features")  # fmt: skip
    p.add_argument("--dedup", action="store_true",
                   help="send the user-side features once per session (TorchRec's "
                        "deduplicated batches, RecD)")  # fmt: skip
    # Lookahead caching.
    p.add_argument("--lookahead", type=int, default=16)
    p.add_argument("--prefetch_distance", type=int, default=1)
    p.add_argument("--cache_load_factor", type=float, default=0.1)
    p.add_argument("--store_dir", type=str, default=None,
                   help="keep the full tables in files in this existing directory "
                        "(for tables larger than RAM); one subdirectory per rank")  # fmt: skip
    hot = p.add_mutually_exclusive_group()
    hot.add_argument("--hot_rows", dest="hot_rows", action="store_true", default=True,
                     help="replicate on every rank the rows whose replicas save bytes per "
                          "step, as planners/hot.py finds them on --plan_sample_batches "
                          "batches (the default; several ranks, without --dedup)")
    hot.add_argument("--no_hot_rows", dest="hot_rows", action="store_false",
                     help="replicate no rows across ranks")
    p.add_argument("--hot_budget_mb", type=float, default=None,
                   help="memory for the replicated hot rows on each rank (default: every row "
                        "that saves bytes)")  # fmt: skip
    p.add_argument("--baseline", action="store_true", help="also train plain TorchRec and compare")
    p.add_argument("--torchrec_plan", action="store_true",
                   help="plan the --baseline model with TorchRec's planner as it likes (data-"
                        "parallel small tables, ...), not table-wise like the lookahead model; "
                        "it then starts from its own weights (benchmarks/comm.py)")  # fmt: skip
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic CUDA algorithms, so runs compare bitwise (implied by "
                        "--baseline; the CPU is deterministic already)")  # fmt: skip
    p.add_argument(
        "--plan_cache_sizes",
        action="store_true",
        help="size each table's cache with the lookahead planner from sample batches",
    )
    p.add_argument("--plan_sample_batches", type=int, default=50)
    p.add_argument("--cache_budget_mb", type=float, default=None, help="device memory for caches")
    p.add_argument("--step_compute_ms", type=float, default=10.0,
                   help="compute time per step that prefetches hide behind (planning)")  # fmt: skip
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
        "--async_checkpoint",
        action="store_true",
        help="stall training only to copy the state; write the files in the background",
    )
    # Failure injection (tests and benchmarks/failures.py), on torchrun's first attempt only.
    p.add_argument("--fail_at_step", type=int, default=None,
                   help="kill --fail_rank (SIGKILL) after this training step, or while it "
                        "writes this step's checkpoint (--fail_in checkpoint)")  # fmt: skip
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
        if value is not None and not (math.isfinite(value) and (value > 0 or
                                                                 allow_zero and value == 0)):
            p.error(f"--{name} must be a {'non-negative' if allow_zero else 'positive'} "
                    f"number, got {value}")  # fmt: skip

    for name in ("epochs", "batch_size", "embedding_dim", "synthetic_days",
                 "synthetic_samples_per_day", "test_batch_size", "limit_train_batches",
                 "limit_val_batches", "limit_test_batches", "checkpoint_every",
                 "session_size", "dcn_num_layers", "dcn_low_rank_dim",
                 "plan_sample_batches", "shuffle_chunk"):  # fmt: skip
        positive(name)
    if args.num_workers < 0:
        p.error(f"--num_workers must be 0 or more, got {args.num_workers}")
    for name in ("scale", "zipf", "learning_rate", "cache_budget_mb"):
        positive_number(name)
    positive_number("step_compute_ms", allow_zero=True)
    if args.embedding_dim % 4:
        p.error(f"--embedding_dim must be a multiple of 4 (FBGEMM's kernels need row widths "
                f"in multiples of 4), got {args.embedding_dim}")  # fmt: skip
    for name, must_exist in (("dataset_path", True), ("store_dir", True), ("save_dir", False),
                             ("data_cache", False), ("out", False)):  # fmt: skip
        if problem := folder_problem(getattr(args, name), must_exist):
            p.error(f"--{name} {getattr(args, name)}: {problem}")
    for name in ("lr_warmup_steps", "lr_decay_start", "lr_decay_steps"):
        if getattr(args, name) < 0:
            p.error(f"--{name} must be 0 or more, got {getattr(args, name)}")
    if args.lr_decay_steps and args.lr_decay_start < args.lr_warmup_steps:
        p.error("the learning-rate warm-up must end before the decay starts "
                f"(--lr_decay_start {args.lr_decay_start} < --lr_warmup_steps "
                f"{args.lr_warmup_steps})")
    if args.lookahead < 1:
        p.error(
            f"--lookahead must be at least 1 (the oracle needs to see ahead), got {args.lookahead}"
        )
    if args.prefetch_distance < 0:
        p.error(f"--prefetch_distance must be >= 0, got {args.prefetch_distance}")
    if not 0 < args.cache_load_factor <= 1:
        p.error(f"--cache_load_factor must be in (0, 1], got {args.cache_load_factor}")
    if args.session_size > 1 and args.dataset_path:
        p.error("--session_size shapes the synthetic data; real data has its own sessions "
                "(--dedup finds them)")  # fmt: skip
    if args.synthetic_days < 2:
        p.error("--synthetic_days must be at least 2 (train, then validation/test)")
    if (args.resume or args.checkpoint_every) and not args.save_dir:
        p.error("--resume and --checkpoint_every need --save_dir")
    if args.resume and args.baseline:
        p.error("--resume continues the lookahead run only; run --baseline from the start")
    if args.async_checkpoint and not args.save_dir:
        p.error("--async_checkpoint needs --save_dir")
    if args.async_checkpoint and args.store_dir:
        p.error("--async_checkpoint copies every table into RAM; with --store_dir checkpoints "
                "are written in the foreground, streamed from the store files")  # fmt: skip
    try:
        found = latest(args.save_dir) if args.save_dir else None
    except ValueError as error:
        p.error(f"--save_dir: {error}")
    if args.save_dir and not args.resume and first_attempt() and found:
        p.error(f"--save_dir {args.save_dir} already holds a checkpoint "
                f"({os.path.basename(found)}); pass --resume to continue from it, or choose "
                "an empty folder")  # fmt: skip
    args.resume = args.resume or (args.save_dir is not None and not first_attempt())
    if args.fail_at_step is not None:
        positive("fail_at_step")
        if args.fail_rank < 0:
            p.error(f"--fail_rank must be >= 0, got {args.fail_rank}")
        if args.fail_in == "checkpoint" and (
            not args.checkpoint_every or args.fail_at_step % args.checkpoint_every
        ):
            p.error("--fail_in checkpoint needs --fail_at_step to be a multiple of "
                    "--checkpoint_every")  # fmt: skip
    try:
        args.dense_arch = [int(x) for x in args.dense_arch_layer_sizes.split(",")]
        args.over_arch = [int(x) for x in args.over_arch_layer_sizes.split(",")]
    except ValueError:
        p.error("layer sizes are comma-separated integers, e.g. --dense_arch_layer_sizes 64,16")
    if args.dense_arch[-1] != args.embedding_dim:
        p.error(f"the dense arch must end in --embedding_dim ({args.embedding_dim}), "
                f"got {args.dense_arch_layer_sizes}")  # fmt: skip
    if args.over_arch[-1] != 1:
        p.error(f"the over arch must end in 1, got {args.over_arch_layer_sizes}")
    if args.num_embeddings_per_feature is not None:
        sizes = args.num_embeddings_per_feature.split(",")
        if len(sizes) != len(DEFAULT_CAT_NAMES) or not all(
            s.isdigit() and int(s) > 0 for s in sizes
        ):
            p.error("--num_embeddings_per_feature needs 26 positive comma-separated integers")
        args.num_embeddings = [int(s) for s in sizes]
    elif args.dataset_path:
        args.num_embeddings = list(CRITEO_KAGGLE_TABLE_SIZES)
    else:
        args.num_embeddings = list(SyntheticCriteo(scale=args.scale).num_embeddings)
    if args.resume and found and (changed := model_changes(args, found)):
        p.error(f"--resume: {found} holds a model with other {changed}; resume with the "
                "flags that wrote it, or choose another --save_dir")  # fmt: skip
    return args


def folder_problem(path: str | None, must_exist: bool) -> str | None:
    """What is wrong with ``path`` as a folder to read (``must_exist``) or to create, if
    anything: a file where a folder is expected, here or above."""
    if path is None:
        return None
    folder = Path(path)
    if folder.exists():
        return None if folder.is_dir() else "is a file, not a folder"
    if must_exist:
        return "no such folder"
    above = next((p for p in folder.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        return f"cannot be created: {above} is a file"
    return None


MODEL_FILE = "model.json"  # in every checkpoint folder: the flags that shaped its model
# The flags that shape the model a checkpoint holds (a resumed run must match them).
MODEL_FLAGS = ("embedding_dim", "num_embeddings", "dense_arch", "over_arch", "interaction_type",
               "dcn_num_layers", "dcn_low_rank_dim", "adagrad")  # fmt: skip


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

# ------------------------------------------------------------------ set-up


def first_attempt() -> bool:
    """Whether this is torchrun's first start of the worker group (or a plain run)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0


def fail_here(args: argparse.Namespace, rank: int, where: str, step: int) -> None:
    """Kill this process as a lost machine dies (SIGKILL: no clean-up) if ``--fail_at_step``
    names this point (``where``: ``step`` or ``checkpoint``) and rank, on the first attempt."""
    if (step, where, rank) == (args.fail_at_step, args.fail_in, args.fail_rank) and first_attempt():
        print(f"rank {rank}: killed at step {step} ({where}, --fail_at_step)", file=sys.stderr,
              flush=True)  # fmt: skip
        os.kill(os.getpid(), signal.SIGKILL)


def init_distributed() -> tuple[int, int, torch.device]:
    """torchrun's process group, or a one-process group; gloo on CPU, NCCL on CUDA."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    dist.init_process_group(backend, **attempt_store())
    return dist.get_rank(), dist.get_world_size(), device


def attempt_store() -> dict:
    """Under torchrun, the agent's store with keys of this restart only.

    torchrun keeps one store for all restarts of the worker group (its shared
    TCPStore, pytorch/pytorch#135712), and process groups publish their
    addresses there under the same keys every time: a restarted rank could read
    the address of a rank that died and fail to connect (or hang). A prefix per
    restart keeps the attempts apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return {}
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False)  # fmt: skip
    return {
        "store": dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", agent),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


def dataset(args: argparse.Namespace, rank: int) -> list[DayFiles]:
    if args.dataset_path:
        folder = real_days(args.dataset_path) if rank == 0 else None
    else:
        spec = SyntheticSpec(args.scale, args.zipf, args.synthetic_days,
                             args.synthetic_samples_per_day, args.seed,
                             args.session_size)  # fmt: skip
        folder = synthetic_days(spec, Path(args.data_cache)) if rank == 0 else None
    shared = [str(folder) if folder else None]
    dist.broadcast_object_list(shared, src=0)  # rank 0 generated or converted it
    return find_days(shared[0])


def tables(args: argparse.Namespace) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t_{name}", embedding_dim=args.embedding_dim,
                           num_embeddings=rows, feature_names=[name])
        for name, rows in zip(DEFAULT_CAT_NAMES, args.num_embeddings)
    ]  # fmt: skip


def sample_ids(args, days, world_size: int) -> dict[str, list[torch.Tensor]]:
    """Per table, the ids of the first --plan_sample_batches global steps (every rank's
    share of a step together, read locally): what the planners measure."""
    per_rank = []
    for r in range(world_size):
        train = reader(args, days, "train", r, world_size)
        per_rank.append([train[s] for s in range(min(args.plan_sample_batches, len(train)))])
    return {
        t.name: [torch.cat([b.sparse_features[t.feature_names[0]].values() for b in step])
                 for step in zip(*per_rank)]
        for t in tables(args)
    }  # fmt: skip


def embedding_optimizer(args):  # noqa: ANN201
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return EmbOptimType.EXACT_ROWWISE_ADAGRAD if args.adagrad else EmbOptimType.EXACT_SGD


def cache_planner(args, days, world_size: int, device: torch.device):
    """``lookahead_planner`` sized from the first training batches of every rank (read locally)."""
    from planners import LookaheadCacheStatistics, lookahead_planner

    samples = sample_ids(args, days, world_size)
    stats = {
        t.name: LookaheadCacheStatistics(samples[t.name], t.num_embeddings, args.lookahead,
                                         args.prefetch_distance, t.name)
        for t in tables(args)
    }  # fmt: skip
    optimizer = embedding_optimizer(args)
    budget = None if args.cache_budget_mb is None else int(args.cache_budget_mb * 2**20)
    table_wise = {t.name: ParameterConstraints(sharding_types=["table_wise"]) for t in tables(args)}
    return lookahead_planner(
        Topology(world_size=world_size, compute_device=device.type), args.batch_size, tables(args),
        stats, optimizer, args.step_compute_ms, budget, table_wise,
    )  # fmt: skip


def hot_rows(args, days, world_size: int):  # noqa: ANN201
    """The rows worth replicating on every rank (``planners.hot``), or None: one rank,
    --no_hot_rows, --dedup (deduplicated batches are not split), or no row that saves
    bytes."""
    from planners import optimizer_state_floats, propose_hot_rows

    if world_size == 1 or not args.hot_rows or args.dedup:
        return None
    samples = {name: [ids.numpy() for ids in steps]
               for name, steps in sample_ids(args, days, world_size).items()}  # fmt: skip
    budget = None if args.hot_budget_mb is None else int(args.hot_budget_mb * 2**20)
    state = optimizer_state_floats(embedding_optimizer(args), args.embedding_dim)
    proposal = propose_hot_rows(samples, world_size, args.embedding_dim, state, budget)
    return proposal if proposal.rows else None


def build(args, lookahead: bool, world_size: int, device: torch.device, planner=None,
          hot: dict | None = None):  # fmt: skip
    """The DLRM training model under DMP, with the fused embedding optimizer configured
    (``hot``: the rows the lookahead model replicates on every rank)."""
    meta = torch.device("meta")
    if lookahead:
        # A table whose share is below what the window touches gets that at the first
        # batch (small tables are cached whole): no setting is too small for the window.
        ebc = LookaheadEmbeddingBagCollection(tables(args), device=meta,
                                              cache_load_factor=args.cache_load_factor,
                                              store_dir=args.store_dir, hot_rows=hot)  # fmt: skip
        sharders = [LookaheadEmbeddingBagCollectionSharder()]
    else:
        ebc = EmbeddingBagCollection(tables(args), device=meta)
        sharders = [EmbeddingBagCollectionSharder()]
    torch.manual_seed(args.seed)
    if args.interaction_type == "dcn":
        net = DLRM_DCN(embedding_bag_collection=ebc, dense_in_features=13,
                       dense_arch_layer_sizes=args.dense_arch, over_arch_layer_sizes=args.over_arch,
                       dcn_num_layers=args.dcn_num_layers, dcn_low_rank_dim=args.dcn_low_rank_dim,
                       dense_device=device)  # fmt: skip
    else:
        net = DLRM(embedding_bag_collection=ebc, dense_in_features=13,
                   dense_arch_layer_sizes=args.dense_arch, over_arch_layer_sizes=args.over_arch,
                   dense_device=device)  # fmt: skip
    model = DLRMTrain(net)
    embedding_optimizer = RowWiseAdagrad if args.adagrad else SGD
    apply_optimizer_in_backward(embedding_optimizer, model.model.sparse_arch.parameters(),
                                {"lr": args.learning_rate})  # fmt: skip
    # Both models get the same plan (table-wise, fused), so they can be compared.
    kernel = "fused_uvm_caching" if device.type == "cuda" else "fused"
    same_plan = {
        t.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=[kernel])
        for t in tables(args)
    }
    free = not lookahead and args.torchrec_plan  # TorchRec's own choice of sharding
    planner = planner or EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device=device.type),
        batch_size=args.batch_size, constraints=None if free else same_plan,
    )  # fmt: skip
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    if args.print_sharding_plan and dist.get_rank() == 0:
        print(plan)
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
    count_data_parallel(dmp)  # data-parallel tables' all-reduces, in the bytes sent
    dense_class = torch.optim.Adagrad if args.adagrad else torch.optim.SGD
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda ps: dense_class(ps, lr=args.learning_rate))  # fmt: skip
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


# ---------------------------------------------------------------- training


@dataclass
class Run:
    """What one training run measured."""

    name: str
    first_step: int = 0  # where training began: a resumed run's checkpoint step
    step_s: list[float] = field(default_factory=list)
    hit_rate: list[float] = field(default_factory=list)
    samples: int = 0
    seconds: float = 0.0
    auroc: dict[str, float] = field(default_factory=dict)
    cache: dict[str, float] = field(default_factory=dict)
    checkpoint_stall_s: list[float] = field(default_factory=list)  # per save, slowest rank
    private_mb: float = 0.0  # the most anonymous RSS seen (sampled every 20 steps), rank 0
    dedup: DedupCounts = field(default_factory=DedupCounts)  # --dedup: what it saved, rank 0
    loader_wait_s: list[float] = field(default_factory=list)  # per batch read, rank 0
    bytes_per_step: dict[str, float] = field(default_factory=dict)  # sent per rank, by kind
    hot_share: float | None = None  # share of the lookups the replicated hot rows served

    @property
    def steady_samples_per_s(self) -> float:
        """Samples/s after the first step, which holds one-time costs: the lookahead
        window's fill (L + d batches read and planned, the cache built) and whatever the
        process warms up first (the data reader's load: the first run of the process
        pays it)."""
        later = self.seconds - (self.step_s[0] if self.step_s else 0.0)
        per_step = self.samples / len(self.step_s) if self.step_s else 0
        return per_step * (len(self.step_s) - 1) / later if later > 0 else 0.0

    @property
    def loader_wait_ms_per_step(self) -> float:
        """Mean wait for a batch after the first (which starts the loader's workers)."""
        later = self.loader_wait_s[1:]
        return 1000 * sum(later) / len(later) if later else 0.0


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
    order = SampleOrder(first, samples, batch_size * world_size, args.epochs if train else 1,
                        args.seed if train and args.shuffle else None, args.shuffle_chunk)
    return CriteoDayReader(days, order, rank, world_size, args.num_embeddings,
                           USER_FEATURES if train and args.dedup else None)  # fmt: skip


def metered(batches: Iterator[Batch], run: Run, dedup: bool, read: CriteoDayReader,
            start: int) -> Iterator[Batch]:  # fmt: skip
    """``batches`` (steps ``start, start + 1, ...`` of ``read``), timing the wait for each
    (``run.loader_wait_s``) and counting what --dedup saved.

    The wait is how long after it was asked for the reader finished the batch (0 if
    it had it ready): the time the lookahead stage waited for data. (Not the wall
    time of the call: the stage's thread runs at idle priority and shares the
    interpreter with the trainer, so its calls take long for reasons not the data's.)
    """
    for step in itertools.count(start):
        asked = time.monotonic()
        batch = next(batches, None)
        if batch is None:
            return
        run.loader_wait_s.append(max(0.0, read.finished_at(step) - asked))
        if dedup:
            run.dedup.add(batch.sparse_features)
        yield batch


def train(args, name: str, dmp, optimizer, days, rank, world_size, device, start_step: int,
          checkpointer: Checkpointer | None = None) -> Run:  # fmt: skip
    """One pass over --epochs of training data through ``name``'s pipeline, checkpointed
    by ``checkpointer`` (every --checkpoint_every steps and at the end) if given."""
    run = Run(name, first_step=start_step)
    lookahead = name == "lookahead"
    if lookahead:
        pipeline = LookaheadTrainPipeline(dmp, optimizer, device, lookahead=args.lookahead,
                                          prefetch_distance=args.prefetch_distance)  # fmt: skip
    else:
        pipeline = TrainPipelineSparseDist(dmp, optimizer, device)
    train_reader = reader(args, days, "train", rank, world_size)
    total = min(args.limit_train_batches or len(train_reader), len(train_reader))
    if start_step > total:
        raise ValueError(f"--resume: the checkpoint is at step {start_step}, past this run's "
                         f"{total} steps")  # fmt: skip
    loader = train_reader.loader(start_step, total, args.num_workers)
    batches = metered(iter(loader), run, args.dedup, train_reader, start_step)  # workers start
    schedule = RateSchedule(optimizer, args.learning_rate, args.lr_warmup_steps,
                            args.lr_decay_start, args.lr_decay_steps)  # fmt: skip
    bar = tqdm(desc=f"train {name}", total=total - start_step, unit="step",
               disable=rank != 0)  # fmt: skip
    step, first_stage_s = start_step, 0.0
    dmp.train()
    with CollectiveBytes() as sent:  # every thread's collectives, the stage's too
        while True:
            if schedule.active:
                schedule.set(step)
            start = time.perf_counter()
            try:
                pipeline.progress(batches)
            except StopIteration:
                break
            elapsed = time.perf_counter() - start
            step += 1
            run.step_s.append(elapsed)
            run.seconds += elapsed
            run.samples += args.batch_size * world_size
            if lookahead and step == start_step + 1:
                first_stage_s = pipeline.timings["stage_s"]
            if step % 20 == 1:  # the cache counters are summed over tables: not every step
                run.private_mb = max(run.private_mb, anonymous_rss_bytes() / 2**20)
                postfix = {"samples/s": f"{args.batch_size * world_size / elapsed:,.0f}"}
                if lookahead:
                    postfix["hit rate"] = f"{pipeline.cache_metrics()['total'].hit_rate:.3f}"
                bar.set_postfix(postfix)
            bar.update()
            fail_here(args, rank, "step", step)
            if checkpointer and args.checkpoint_every and step % args.checkpoint_every == 0:
                checkpointer.save(step, partial(checkpoint_state, dmp, optimizer, step,
                                                train_reader.state_dict(step)))
    bar.close()
    run.private_mb = max(run.private_mb, anonymous_rss_bytes() / 2**20)
    run.bytes_per_step = mean_over_ranks(sent.bytes, max(step - start_step, 1), device)
    if lookahead and (served := replica_metrics(dmp)) is not None:
        run.hot_share = served.hot_share
    if lookahead:
        run.hit_rate = pipeline.hit_rates()
        metrics = pipeline.cache_metrics()["total"]
        steps = max(metrics.steps, 1)
        run.cache = {
            "hit_rate": metrics.hit_rate,
            "rows_fetched_per_step": metrics.rows_fetched / steps,
            "rows_written_back_per_step": metrics.rows_written_back / steps,
            "executor_wait_ms_per_step": 1000 * metrics.wait_s / steps,
            # The first step waits for the whole window to be planned; the rest only for
            # what the stage thread has not planned ahead: planning on the critical path.
            "window_fill_ms": 1000 * first_stage_s,
            "stage_ms_per_step": 1000 * (metrics.stage_s - first_stage_s) / max(steps - 1, 1),
            "planning_ms_per_step": 1000 * metrics.plan_s / steps,
        }
        if checkpointer:
            checkpointer.save(step, partial(checkpoint_state, dmp, optimizer, step,
                                            train_reader.state_dict(step)))
    else:
        pipeline.detach()  # TorchRec's pipeline rewrote the forward; give it back for eval
    return run


def mean_over_ranks(sent: dict[str, int], steps: int, device: torch.device) -> dict[str, float]:
    """Bytes sent per step and rank, by kind: the mean over ranks (a collective)."""
    totals = torch.tensor([float(sent[k]) for k in KINDS], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    return {k: v / steps / dist.get_world_size() for k, v in zip(KINDS, totals.tolist())}


def replica_metrics(dmp):  # noqa: ANN201
    """What the lookahead model's replicated hot rows served (None without them)."""
    return next((m.replica_metrics for m in dmp.modules()
                 if getattr(m, "replica_metrics", None) is not None), None)  # fmt: skip


def weights_gap(look, base, device: torch.device) -> float:
    """The largest difference between the two models' weights and optimizer state (each a
    ``(model, optimizer)``), over every rank."""
    gap = 0.0
    pairs = [(look[0].state_dict(), base[0].state_dict())]
    pairs += [(a, b) for a, b in zip(look[1].state_dict()["state"].values(),
                                     base[1].state_dict()["state"].values(), strict=True)]
    for mine, theirs in pairs:
        for a, b in zip(mine.values(), theirs.values(), strict=True):
            for x, y in zip(local_tensors(a), local_tensors(b), strict=True):
                if x.numel():
                    gap = max(gap, float((x.float() - y.float()).abs().max()))
    worst = torch.tensor([gap], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())


def checkpoint_state(dmp, optimizer, step: int, data: dict | None = None) -> dict:
    """What a checkpoint holds; ``data`` is the training reader's position (its
    ``state_dict``), kept as JSON."""
    return {"model": dmp.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
            "data": json.dumps(data)}  # fmt: skip


def evaluate(args, dmp, days, stage: str, rank, world_size, device) -> float:
    """AUROC over ``stage`` (val or test); the lookahead model reads its current weights."""
    limit = args.limit_val_batches if stage == "val" else args.limit_test_batches
    auroc = torchmetrics.AUROC(task="binary").to(device)
    evaluated = reader(args, days, stage, rank, world_size)
    batches = evaluated.loader(0, min(limit or len(evaluated), len(evaluated)), args.num_workers)
    dmp.eval()
    with torch.no_grad():
        for batch in batches:
            _, (_, logits, labels) = dmp(batch.to(device))
            auroc.update(torch.sigmoid(logits), labels.int())
    dmp.train()
    return float(auroc.compute())


def local_tensors(value) -> list[torch.Tensor]:  # noqa: ANN001
    """This rank's tensors of a state-dict value: a sharded table's local shards, or itself."""
    return [s.tensor for s in value.local_shards()] if hasattr(value, "local_shards") else [value]


def weights_digest(dmp) -> str:
    """A hash of every table's shards and every dense parameter, over all ranks (in rank
    order): equal digests mean equal weights everywhere."""
    digest = hashlib.sha256()
    for key, value in dmp.state_dict().items():
        for tensor in local_tensors(value):
            digest.update(key.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, digest.hexdigest())
    return hashlib.sha256("".join(per_rank).encode()).hexdigest()


def run(args: argparse.Namespace) -> int:
    if args.deterministic or args.baseline:
        deterministic_cuda()  # before any CUDA work; FBGEMM's backward order is fixed then
    rank, world_size, device = init_distributed()
    if args.fail_at_step is not None and args.fail_rank >= world_size:
        raise ValueError(f"--fail_rank {args.fail_rank} is not a rank of world size {world_size}")
    days = dataset(args, rank)
    planner = None
    if args.plan_cache_sizes:
        planner, proposal = cache_planner(args, days, world_size, device)
    hot = hot_rows(args, days, world_size)
    look, look_opt = build(args, lookahead=True, world_size=world_size, device=device,
                           planner=planner, hot=hot.hot if hot else None)  # fmt: skip
    if rank == 0 and (planner is not None or hot is not None):
        from planners import hot_rows_report, plan_report

        if planner is not None:
            print(plan_report(look.plan, proposal))
        if hot is not None:
            print(hot_rows_report(hot))
    runs = []
    if args.baseline:
        base, base_opt = build(args, lookahead=False, world_size=world_size, device=device)
        if not args.torchrec_plan:  # same starting weights, from a plain checkpoint
            look.load_state_dict(base.state_dict())
    checkpointer = None
    if args.save_dir:
        written = None
        if args.fail_at_step is not None and args.fail_in == "checkpoint":
            written = partial(fail_here, args, rank, "checkpoint")
        checkpointer = Checkpointer(args.save_dir, args.async_checkpoint, written,
                                    {MODEL_FILE: json.dumps(model_config(args), indent=1)})
    start_step = 0
    if args.resume:
        state = checkpoint_state(look, look_opt, 0)
        try:
            path = checkpointer.load(state)
            if path:
                look.load_state_dict(state["model"])
                look_opt.load_state_dict(state["optimizer"])
        except (RuntimeError, KeyError, dcp.CheckpointException) as error:
            raise ValueError(f"--resume: the latest checkpoint in {args.save_dir} does not fit "
                             f"this model ({type(error).__name__}); resume with the flags that "
                             "wrote it") from error  # fmt: skip
        if path:
            start_step = reader(args, days, "train", rank, world_size).resume_step(
                json.loads(state["data"]))  # the data set and order it was trained on
            if rank == 0:
                print(f"resumed from {path} at step {start_step}")

    models = [("lookahead", look, look_opt)] + (
        [("baseline", base, base_opt)] if args.baseline else []
    )
    try:
        for name, dmp, optimizer in models:
            lookahead = name == "lookahead"
            result = train(args, name, dmp, optimizer, days, rank, world_size, device,
                           start_step if lookahead else 0,
                           checkpointer if lookahead else None)  # fmt: skip
            for stage in ("val", "test"):
                result.auroc[stage] = evaluate(args, dmp, days, stage, rank, world_size, device)
            runs.append(result)
    finally:
        if checkpointer:
            checkpointer.close()  # the last save is published before anything else
    if checkpointer and checkpointer.stall_s:
        # Collectives take tensors of the group's device (NCCL: CUDA only).
        stalls = torch.tensor(checkpointer.stall_s, dtype=torch.float64, device=device)
        dist.all_reduce(stalls, op=dist.ReduceOp.MAX)
        runs[0].checkpoint_stall_s = stalls.tolist()
    same = weights_digest(look) == weights_digest(base) if args.baseline else None
    comparable = args.baseline and not args.torchrec_plan
    gap = weights_gap((look, look_opt), (base, base_opt), device) if comparable else None
    digest = weights_digest(look)
    sharded = [m for m in look.modules() if hasattr(m, "cached_groups")]
    cached = torch.tensor([sum(sum(g.cache_rows) for m in sharded for g in m.cached_groups)],
                          device=device)  # fmt: skip
    dist.all_reduce(cached)  # every rank caches only its own shards
    if rank == 0:
        report(args, runs, same, gap, digest, world_size, int(cached.item()))
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------ output


def cells(run: Run, embedding_dim: int) -> dict[str, str]:
    """One column of the summary table."""
    cache = run.cache
    return {
        "samples/s": f"{run.samples / run.seconds:,.0f}" if run.seconds else "-",
        "samples/s after step 1": f"{run.steady_samples_per_s:,.0f}" if run.seconds else "-",
        "first step ms": f"{1000 * run.step_s[0]:,.0f}" if run.step_s else "-",
        "val AUROC": f"{run.auroc['val']:.4f}",
        "test AUROC": f"{run.auroc['test']:.4f}",
        "cache hit rate": f"{cache['hit_rate']:.3f}" if cache else "all resident",
        "rows fetched / step": f"{cache['rows_fetched_per_step']:,.0f}" if cache else "-",
        "rows written back / step": f"{cache['rows_written_back_per_step']:,.0f}" if cache else "-",
        "executor wait ms / step": f"{cache['executor_wait_ms_per_step']:.2f}" if cache else "-",
        "planning CPU ms / step": f"{cache['planning_ms_per_step']:.2f}" if cache else "-",
        "plan wait ms / step": f"{cache['stage_ms_per_step']:.3f}" if cache else "-",
        "private memory MB": f"{run.private_mb:,.0f}",
        "loader wait ms / step": f"{run.loader_wait_ms_per_step:.3f}",
        "embedding KiB sent / step": (
            f"{sum(run.bytes_per_step[k] for k in EMBEDDING_KINDS) / 1024:,.1f}"
            if run.bytes_per_step
            else "-"
        ),
        "hot-row lookups": f"{run.hot_share:.1%}" if run.hot_share is not None else "-",
        **dedup_cells(run, embedding_dim),
        "checkpoint stall ms / save": (
            f"{1000 * statistics.median(run.checkpoint_stall_s):.1f}"
            if run.checkpoint_stall_s
            else "-"
        ),
    }


def dedup_cells(run: Run, embedding_dim: int) -> dict[str, str]:
    """With --dedup: ids and sparse bytes per step and rank (the input all-to-all's ids and
    lengths at 8 bytes, the output all-to-all's pooled rows at 4 bytes a float), after
    deduplication, and the share saved."""
    counts, steps = run.dedup, max(len(run.step_s), 1)
    if not counts.ids_before:
        return {}

    def sparse_bytes(ids: int, bags: int) -> float:
        return ids * 8 + bags * (8 + 4 * embedding_dim)

    before = sparse_bytes(counts.ids_before, counts.bags_before)
    after = sparse_bytes(counts.ids_after, counts.bags_after)
    return {
        "ids / step (dedup)": f"{counts.ids_after / steps:,.0f}",
        "ids saved by dedup": f"{counts.ids_saved:.1%}",
        "sparse MB / step (dedup)": f"{after / steps / 2**20:.2f}",
        "sparse bytes saved": f"{1 - after / before:.1%}",
    }


def report(args, runs: list[Run], same: bool | None, gap: float | None, digest: str,
           world_size: int, cache_rows: int) -> None:  # fmt: skip
    table = [cells(r, args.embedding_dim) for r in runs]
    names = [r.name for r in runs]
    rows = sum(args.num_embeddings)
    sizing = ("sized by the lookahead planner" if args.plan_cache_sizes
              else f"{args.cache_load_factor:.0%} per table, raised to what the window "
                   "touches")  # fmt: skip
    print(f"\nDLRM ({args.interaction_type}), world size {world_size}, batch {args.batch_size} "
          f"per rank, {len(runs[0].step_s)} steps, lookahead {args.lookahead}; cache "
          f"{cache_rows:,} of {rows:,} rows ({cache_rows / rows:.1%}: {sizing})")  # fmt: skip
    print(f"{'':>26}" + "".join(f"{n:>16}" for n in names))
    for label in table[0]:
        print(f"{label:>26}" + "".join(f"{column[label]:>16}" for column in table))
    if gap is not None:
        print(f"{'final weights':>26}{agreement(gap):>16}")
        print(f"{'largest difference':>26}{gap:>16.2g}")
    elif same is not None:  # --torchrec_plan: other starting weights, nothing to compare
        print(f"{'final weights':>26}{'not compared':>16}")
    print(f"{'weights digest':>26}  {digest}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"config": {k: v for k, v in vars(args).items()},
               "runs": [{**asdict(r), "loader_wait_ms_per_step": r.loader_wait_ms_per_step}
                        for r in runs],
               "weights_match": same, "weights_max_difference": gap,
               "weights_agreement": agreement(gap) if gap is not None else None,
               "weights_digest": digest, "world_size": world_size,
               "cache_rows": cache_rows, "rows": rows}  # fmt: skip
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    plot(runs, out / "training.png")
    print(f"wrote {out / 'summary.json'} and {out / 'training.png'}")


TOLERANCE = 1e-5  # where summation orders differ (hot rows' bags mixing hot and cold ids)


def agreement(gap: float) -> str:
    """What the largest difference between the two runs' final state says."""
    if gap == 0:
        return "bitwise equal"
    return f"within {TOLERANCE:g}" if gap <= TOLERANCE else "DIFFERENT"


# The runs' colours and the hit rate's own (a property of the lookahead run, not a third run).
RUN_COLOURS = {"lookahead": "tab:blue", "baseline": "tab:orange"}
HIT_RATE_COLOUR = "tab:green"


def step_time_ceiling(runs: list[Run]) -> float | None:
    """The step-time axis' top in ms: the 99th percentile of every run's steps after the
    first, plus 25%. The first step holds the window fill and the process' warm-up (often
    10x a step) and would flatten the rest. None when no run has a step after the first."""
    later = sorted(1000 * s for r in runs for s in r.step_s[1:])
    if not later:
        return None
    return 1.25 * later[min(len(later) - 1, math.ceil(0.99 * len(later)) - 1)]


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    look = runs[0]
    first = len(look.step_s) - len(look.hit_rate) + 1  # a resumed run plans only its own steps
    dot = {"marker": "o", "markersize": 3}  # a series of one step draws no line: a dot
    top.plot(range(first, first + len(look.hit_rate)), look.hit_rate, color=HIT_RATE_COLOUR,
             linewidth=1, **dot if len(look.hit_rate) == 1 else {})  # fmt: skip
    top.set_ylabel("cache hit rate")
    top.set_ylim(0, 1)
    top.grid(alpha=0.3)
    for r in runs:
        bottom.plot(range(1, len(r.step_s) + 1), [1000 * s for s in r.step_s], label=r.name,
                    color=RUN_COLOURS.get(r.name), linewidth=1,
                    **dot if len(r.step_s) == 1 else {})  # fmt: skip
    ceiling = step_time_ceiling(runs)
    if ceiling is not None and any(1000 * s > ceiling for r in runs for s in r.step_s):
        bottom.set_ylim(0, ceiling)
        firsts = [f"{r.name} {1000 * r.step_s[0]:,.0f} ms" for r in runs
                  if 1000 * r.step_s[0] > ceiling]  # fmt: skip
        later = sum(1000 * s > ceiling for r in runs for s in r.step_s[1:])
        clipped = [f"step 1 ({', '.join(firsts)}; window fill, warm-up)"] if firsts else []
        if later:
            clipped.append(f"{later} later step{'s' if later > 1 else ''}")
        bottom.set_title(f"clipped at {ceiling:.1f} ms: {', '.join(clipped)}", fontsize=8,
                         loc="left")  # fmt: skip
    else:
        bottom.set_ylim(bottom=0)
    bottom.set_ylabel("step time (ms)")
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    bottom.grid(alpha=0.3)
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (DataError, ValueError) as error:  # bad data or settings: one line, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
