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
    python examples/dlrm/dlrm_main.py --dataset_path /data/criteo  # day_*.npy: see preprocess.py

Checkpoints (``--save_dir``, ``--checkpoint_every``, ``--async_checkpoint``) make a
job survive failures: under ``torchrun --max-restarts N`` a restarted worker group
resumes from the latest complete checkpoint by itself, redoes the steps after it
and ends with the weights of an uninterrupted run. ``--fail_at_step`` kills a
rank on purpose to show it. A Ctrl-C ends the job with one line: the checkpoint to
resume from, or, while torch and TorchRec still import, that nothing was done.
"""

from __future__ import annotations

# isort: off
import startup  # (first: a Ctrl-C while torch and TorchRec import ends with one line)
import notices  # noqa: F401  (before TorchRec: it warns while it is imported)

# isort: on
import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torchmetrics
from checkpoint import Checkpointer, CheckpointError, latest
from compare import mean_over_ranks, replica_metrics, weights_digest, weights_gap
from data import SyntheticSpec, reader, real_days, synthetic_days
from faults import attempt_store, fail_here
from flags import MODEL_FILE, model_config, parse_args
from model import build, cache_planner, hot_rows
from report import Run, progress_postfix, report
from schedule import RateSchedule
from torchrec.datasets.utils import Batch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from tqdm import tqdm

from torchrec_lookahead import BatchCheck, LookaheadTrainPipeline
from torchrec_lookahead.data.criteo import DayFiles, find_days
from torchrec_lookahead.data.npy import DataError
from torchrec_lookahead.determinism import deterministic_cuda
from torchrec_lookahead.pipeline import CheckedBatch
from torchrec_lookahead.steps import LookaheadModule
from torchrec_lookahead.store.files import anonymous_rss_bytes
from torchrec_lookahead.traffic import CollectiveBytes


def init_distributed() -> tuple[int, int, torch.device]:
    """torchrun's process group, or a one-process group; gloo on CPU, NCCL on CUDA."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    if torch.cuda.is_available():
        # A GPU per local rank; with fewer GPUs than ranks, ranks share them (NCCL may
        # refuse two ranks of one communicator on one GPU).
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
    dist.init_process_group(backend, **attempt_store())
    return dist.get_rank(), dist.get_world_size(), device


def dataset(args: argparse.Namespace, rank: int) -> list[DayFiles]:
    if args.dataset_path:
        folder = real_days(args.dataset_path) if rank == 0 else None
    else:
        spec = SyntheticSpec(
            args.scale,
            args.zipf,
            args.synthetic_days,
            args.synthetic_samples_per_day,
            args.seed,
            args.session_size,
        )
        folder = synthetic_days(spec, Path(args.data_cache)) if rank == 0 else None
    shared = [str(folder) if folder else None]
    dist.broadcast_object_list(shared, src=0)  # rank 0 generated or converted it
    return find_days(shared[0])


def metered(
    batches: Iterator[Batch | CheckedBatch], run: Run, dedup: bool, waited: bool
) -> Iterator[Batch | CheckedBatch]:
    """``batches``, counting what --dedup saved and, when ``waited`` (the trainer's own
    thread reads them: plain TorchRec's pipeline), timing each read into
    ``run.data_wait_s``. The lookahead stage reads on its own thread; there the trainer's
    wait for data is its wait for the stage (``train``)."""
    while True:
        asked = time.perf_counter()
        batch = next(batches, None)
        if batch is None:
            return
        if waited:
            run.data_wait_s.append(time.perf_counter() - asked)
        if dedup:
            checked = isinstance(batch, CheckedBatch)  # the loader's workers checked it
            run.dedup.add((batch.batch if checked else batch).sparse_features)
        yield batch


def train(
    args,
    name: str,
    dmp,
    optimizer,
    days,
    rank,
    world_size,
    device,
    start_step: int,
    checkpointer: Checkpointer | None = None,
) -> Run:
    """One pass over --epochs of training data through ``name``'s pipeline, checkpointed
    by ``checkpointer`` (every --checkpoint_every steps and at the end) if given."""
    run = Run(name, first_step=start_step, steps_asked=args.limit_train_batches)
    lookahead = name == "lookahead"
    if lookahead:
        pipeline = LookaheadTrainPipeline(
            dmp,
            optimizer,
            device,
            lookahead=args.lookahead,
            prefetch_distance=args.prefetch_distance,
            planner=args.planner,
        )
    else:
        pipeline = TrainPipelineSparseDist(dmp, optimizer, device)
    train_reader = reader(args, days, "train", rank, world_size)
    total = min(args.limit_train_batches or len(train_reader), len(train_reader))
    if start_step > total:
        raise ValueError(
            f"--resume: the checkpoint is at step {start_step}, past this run's {total} steps"
        )
    # With loader workers, lookahead's host check of each batch is made there, not in this
    # process (docs/guides/bad-input.md).
    checked = lookahead and args.num_workers > 0
    collate = BatchCheck.of(dmp).collate() if checked else None
    loader = train_reader.loader(start_step, total, args.num_workers, collate)
    batches = metered(iter(loader), run, args.dedup, waited=not lookahead)  # workers start
    schedule = RateSchedule(
        optimizer,
        args.learning_rate,
        args.lr_warmup_steps,
        args.lr_decay_start,
        args.lr_decay_steps,
    )
    bar = tqdm(desc=f"train {name}", total=total - start_step, unit="step", disable=rank != 0)
    step = start_step
    dmp.train()
    losses = []  # kept on the device, read once at the end: no sync per step
    with CollectiveBytes() as sent, bar:  # every thread's collectives, the stage's too
        while True:
            if schedule.active:
                schedule.set(step)
            start = time.perf_counter()
            staged = pipeline.timings["stage_s"] if lookahead else 0.0
            try:
                loss, _, _ = pipeline.progress(batches)  # DLRMTrain's (loss, logits, labels)
            except StopIteration:
                break
            losses.append(loss)
            elapsed = time.perf_counter() - start
            if lookahead:  # the trainer's wait for the stage: data read, planned, distributed
                run.data_wait_s.append(pipeline.timings["stage_s"] - staged)
            step += 1
            run.step_s.append(elapsed)
            run.seconds += elapsed
            run.samples += args.batch_size * world_size
            if step % 20 == 1:  # the cache counters are summed over tables: not every step
                run.private_mb = max(run.private_mb, anonymous_rss_bytes() / 2**20)
                bar.set_postfix(progress_postfix(run, pipeline if lookahead else None))
            bar.update()
            fail_here(args, rank, "step", step)
            if checkpointer and args.checkpoint_every and step % args.checkpoint_every == 0:
                checkpointer.save(
                    step,
                    partial(checkpoint_state, dmp, optimizer, step, train_reader.state_dict(step)),
                )
        if run.seconds:  # the whole run's figures, whatever its length
            bar.set_postfix(progress_postfix(run, pipeline if lookahead else None))
    run.loss = torch.stack(losses).tolist() if losses else []
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
            # The first step waits for the whole window to be planned (the rest: the
            # summary's data wait).
            "window_fill_ms": 1000 * run.data_wait_s[0] if run.data_wait_s else 0.0,
            "planning_ms_per_step": 1000 * metrics.plan_s / steps,
        }
        if checkpointer:
            checkpointer.save(
                step, partial(checkpoint_state, dmp, optimizer, step, train_reader.state_dict(step))
            )
    else:
        pipeline.detach()  # TorchRec's pipeline rewrote the forward; give it back for eval
    return run


def checkpoint_state(dmp, optimizer, step: int, data: dict | None = None) -> dict:
    """What a checkpoint holds; ``data`` is the training reader's position (its
    ``state_dict``), kept as JSON."""
    return {
        "model": dmp.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "data": json.dumps(data),
    }


STAGES = ("train", "val", "test")


def readable(args, days: list[DayFiles], stage: str, rank: int, world_size: int) -> None:
    """Raise ``DataError`` naming the stage and its flag if ``stage``'s split holds no
    global batch (the validation split failed only when evaluated, after training)."""
    try:
        reader(args, days, stage, rank, world_size)
    except DataError as error:
        flag = "--batch_size" if stage == "train" else "--test_batch_size (else --batch_size)"
        ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
        raise DataError(f"the {stage} split: {error}, which is {flag} x {ranks}") from None


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


def run(args: argparse.Namespace) -> int:
    if args.deterministic or args.baseline:
        deterministic_cuda()  # before any CUDA work; FBGEMM's backward order is fixed then
    rank, world_size, device = init_distributed()
    if args.fail_at_step is not None and args.fail_rank >= world_size:
        raise ValueError(f"--fail_rank {args.fail_rank} is not a rank of world size {world_size}")
    days = dataset(args, rank)
    for stage in STAGES:  # each stage's batches fit its split, found before training
        readable(args, days, stage, rank, world_size)
    planner = None
    if args.plan_cache_sizes:
        planner, proposal = cache_planner(args, days, world_size, device)
    models = []
    if not args.baseline_only:
        hot, hot_decision = hot_rows(args, days, world_size, device)
        look, look_opt = build(
            args,
            lookahead=True,
            world_size=world_size,
            device=device,
            planner=planner,
            hot=hot.hot if hot else None,
        )
        models.append(("lookahead", look, look_opt))
        if rank == 0:
            from planners import hot_rows_report, plan_report

            if planner is not None:
                print(plan_report(look.plan, proposal))
            if world_size > 1:
                print(f"hot rows: {hot_decision}")
            if hot is not None:
                print(hot_rows_report(hot))
    runs = []
    if args.baseline or args.baseline_only:
        base, base_opt = build(args, lookahead=False, world_size=world_size, device=device)
        models.append(("baseline", base, base_opt))
        if not args.torchrec_plan and not args.baseline_only:  # same weights: a checkpoint
            look.load_state_dict(base.state_dict())
    checkpointer = None
    if args.save_dir:
        written = None
        if args.fail_at_step is not None and args.fail_in == "checkpoint":
            written = partial(fail_here, args, rank, "checkpoint")
        checkpointer = Checkpointer(
            args.save_dir,
            args.async_checkpoint,
            written,
            {MODEL_FILE: json.dumps(model_config(args), indent=1)},
            keep=args.keep_checkpoints,
        )
    start_step = 0
    if args.resume:
        state = checkpoint_state(look, look_opt, 0)
        try:
            path = checkpointer.load(state)
            if path:
                look.load_state_dict(state["model"])
                look_opt.load_state_dict(state["optimizer"])
        except (RuntimeError, KeyError, dcp.CheckpointException) as error:
            raise ValueError(
                f"--resume: the latest checkpoint in {args.save_dir} does not fit "
                f"this model ({type(error).__name__}); resume with the flags that "
                "wrote it"
            ) from error
        if path:
            start_step = reader(args, days, "train", rank, world_size).resume_step(
                json.loads(state["data"])
            )  # the data set and order it was trained on
            if rank == 0:
                print(f"resumed from {path} at step {start_step}")

    available = len(reader(args, days, "train", rank, world_size))
    if (args.limit_train_batches or 0) > available and rank == 0:
        print(
            f"warning: --limit_train_batches {args.limit_train_batches}: the training data "
            f"holds {available} batches of {args.batch_size} samples per rank at world size "
            f"{world_size}; training {available} steps",
            file=sys.stderr,
        )
    try:
        for name, dmp, optimizer in models:
            lookahead = name == "lookahead"
            result = train(
                args,
                name,
                dmp,
                optimizer,
                days,
                rank,
                world_size,
                device,
                start_step if lookahead else 0,
                checkpointer if lookahead else None,
            )
            for stage in STAGES[1:]:
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
    compared = args.baseline and not args.baseline_only
    same = weights_digest(look) == weights_digest(base) if compared else None
    comparable = compared and not args.torchrec_plan
    gap = weights_gap((look, look_opt), (base, base_opt), device) if comparable else None
    digest = weights_digest(models[0][1])
    sharded = [m for _, dmp, _ in models for m in dmp.modules() if isinstance(m, LookaheadModule)]
    cached = torch.tensor(
        [sum(sum(g.pool_slots) for m in sharded for g in m.cached_groups)], device=device
    )
    dist.all_reduce(cached)  # every rank caches only its own shards
    if rank == 0:
        report(args, runs, same, gap, digest, world_size, int(cached.item()))
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    startup.started()
    args = parse_args(argv)
    try:
        return run(args)
    except (DataError, ValueError, CheckpointError) as error:  # one line, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: a save in flight was published (run's finally)
        if os.environ.get("RANK", "0") == "0":  # one line for the job, not one per rank
            print(interrupted(args.save_dir), file=sys.stderr)
        return startup.INTERRUPTED


def interrupted(save_dir: str | None) -> str:
    """What a Ctrl-C leaves: the checkpoint to resume from, if any."""
    if not save_dir:
        return "interrupted (nothing saved: --save_dir and --checkpoint_every keep progress)"
    try:
        saved = latest(save_dir)
    except ValueError as error:
        return f"interrupted; {error}"
    if saved is None:
        return f"interrupted before the first checkpoint in {save_dir}"
    return f"interrupted; the latest checkpoint is {saved}: continue with --resume"


if __name__ == "__main__":
    sys.exit(main())
