"""TorchRec's BERT4Rec example, trained with lookahead embedding caching.

BERT4Rec (masked item prediction with a transformer encoder over the item
embeddings, as TorchRec's ``examples/bert4rec``) with its item table in a
``LookaheadEmbeddingCollection``, sharded by ``DistributedModelParallel`` with
``lookahead_sharders()`` and trained by ``LookaheadTrainPipeline``; gloo on CPU,
NCCL on CUDA, ``torchrun`` for several processes. ``--baseline`` trains plain
TorchRec (``EmbeddingCollection``, ``TrainPipelineSparseDist``) beside it from
the same weights on the same data and compares the final weights and the
ranking metrics (Recall@10, NDCG@10 of each user's held-out last item).

    python examples/bert4rec/bert4rec_main.py --baseline               # synthetic histories
    torchrun --standalone --nproc_per_node 2 examples/bert4rec/bert4rec_main.py --baseline
    python examples/bert4rec/bert4rec_main.py --dataset_path /data/ml-1m  # its ratings.dat
"""

from __future__ import annotations

# isort: off
import shared  # (first: a quiet Ctrl-C while TorchRec imports; it hides its notices)

# isort: on
import argparse
import os
import socket
import sys
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
from data import (
    History,
    MaskedSequences,
    SyntheticSpec,
    eval_batches,
    read_ratings,
    synthetic_histories,
    train_batches,
    train_steps,
)
from flags import parse_args
from model import build
from report import Run, report
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from tqdm import tqdm

from torchrec_lookahead import LookaheadTrainPipeline
from torchrec_lookahead.data.npy import DataError
from torchrec_lookahead.determinism import deterministic_cuda
from torchrec_lookahead.traffic import CollectiveBytes

TOP_K = 10  # Recall@10 and NDCG@10


def init_distributed() -> tuple[int, int, torch.device]:
    """torchrun's process group, or a one-process group; gloo on CPU, NCCL on CUDA.

    On the CPU each rank computes on one thread. The model's operations are small (a
    batch is 64 sequences of 20 rows of 32), so a second thread of torch's pool saves
    little and waits at every operation for its partner, which on a busy machine may
    not be running: on the 2-core machine, loaded by other jobs, a step took 58 ms on
    one thread and 1.1-1.4 s on two (2026-11-27). The other core is left to the
    lookahead stage and the row moves."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(1)
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), device


def histories(args: argparse.Namespace) -> History:
    """The users' histories (every rank builds the same), and their counts in ``args``."""
    if args.dataset_path:
        history = read_ratings(args.dataset_path, args.min_rating, args.min_user_count)
    else:
        spec = SyntheticSpec(
            args.num_users,
            args.num_items,
            args.zipf,
            args.drift,
            args.min_history,
            args.max_history,
            args.seed,
        )
        history = synthetic_histories(spec)
    args.num_users, args.num_items = history.num_users, history.num_items
    return history


def dropout_seed(seed: int, rank: int, step: int) -> int:
    """The seed of a step's dropout on a rank: the same in both runs, whatever ran before."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])


def train(
    args: argparse.Namespace,
    name: str,
    dmp: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    history: History,
    rank: int,
    world_size: int,
    device: torch.device,
) -> Run:
    """--num_epochs passes over the users (at most --limit_train_batches steps) through
    ``name``'s pipeline."""
    available = train_steps(history, args.train_batch_size, world_size, args.num_epochs)
    total = min(args.limit_train_batches or available, available)
    run = Run(name, steps_asked=args.limit_train_batches)
    pipeline: LookaheadTrainPipeline | TrainPipelineSparseDist
    if name == "lookahead":
        pipeline = LookaheadTrainPipeline(
            dmp,
            optimizer,
            device,
            lookahead=args.lookahead,
            prefetch_distance=args.prefetch_distance,
        )
    else:
        pipeline = TrainPipelineSparseDist(dmp, optimizer, device)
    batches: Iterator[MaskedSequences] = train_batches(
        history,
        args.train_batch_size,
        rank,
        world_size,
        args.max_len,
        args.mask_prob,
        args.seed,
        total,
    )
    bar = tqdm(desc=f"train {name}", total=total, unit="step", disable=rank != 0)
    dmp.train()
    losses = []  # kept on the device, read once at the end: no sync per step
    lookahead = pipeline if isinstance(pipeline, LookaheadTrainPipeline) else None
    with CollectiveBytes() as sent, bar:
        for step in range(total + 1):  # the last call finds the data's end
            torch.manual_seed(dropout_seed(args.seed, rank, step))
            start = time.perf_counter()
            try:
                loss, _, _ = pipeline.progress(batches)
            except StopIteration:
                break
            elapsed = time.perf_counter() - start
            losses.append(loss)
            run.step_s.append(elapsed)
            run.seconds += elapsed
            run.samples += args.train_batch_size * world_size
            if step % 20 == 0:  # the cache counters are summed over tables: not every step
                bar.set_postfix(shared.progress_postfix(run, lookahead))
            bar.update()
        if run.seconds:  # the whole run's figures, whatever its length
            bar.set_postfix(shared.progress_postfix(run, lookahead))
    run.loss = torch.stack(losses).tolist() if losses else []
    run.bytes_per_step = shared.mean_over_ranks(sent.bytes, max(len(run.step_s), 1), device)
    if isinstance(pipeline, LookaheadTrainPipeline):
        run.cache, run.hit_rate = cache_summary(pipeline, len(run.step_s), device)
    else:
        pipeline.detach()  # TorchRec's pipeline rewrote the forward; give it back for eval
    return run


def cache_summary(
    pipeline: LookaheadTrainPipeline, steps: int, device: torch.device
) -> tuple[dict[str, float], list[float]]:
    """What the caches of every rank did over ``steps`` steps (a collective): the hit rate,
    rows fetched and written back per step (all ranks), planning CPU per step and rank,
    the slots held; and the hit rate per step of the rank whose shards saw the most ids
    (with one table sharded table-wise: its owner's)."""
    total = pipeline.cache_metrics()["total"]
    counts = torch.tensor(
        [total.unique_ids, total.misses, total.rows_written_back, total.cache_rows, total.plan_s],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(counts)
    unique, misses, written, rows, plan_s = counts.tolist()
    curves: list[tuple[int, list[float]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(curves, (total.unique_ids, pipeline.hit_rates()))
    busiest = max((c for c in curves if c is not None), key=lambda c: c[0])
    per_step = max(steps, 1)
    summary = {
        "hit_rate": 1 - misses / unique if unique else 0.0,
        "rows_fetched_per_step": misses / per_step,
        "rows_written_back_per_step": written / per_step,
        "planning_ms_per_step": 1000 * plan_s / per_step / dist.get_world_size(),
        "cache_rows": rows,
    }
    return summary, busiest[1]


def evaluate(
    args: argparse.Namespace,
    dmp: torch.nn.Module,
    history: History,
    rank: int,
    world_size: int,
    device: torch.device,
) -> tuple[dict[str, float], int]:
    """Recall@10, NDCG@10 and the cross entropy of every user's held-out last item, ranked
    among all items after the user's training items and the mask token (the lookahead
    model reads its current weights); and the number of users evaluated."""
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # hits, gains, losses, users
    dmp.eval()
    with torch.no_grad():
        for batch, counted in eval_batches(
            history, args.test_batch_size, rank, world_size, args.max_len, args.limit_test_batches
        ):
            _, (_, scores, targets) = dmp(batch.to(device))
            counted = counted.to(device)
            target_scores = scores.gather(1, targets[:, None])
            # The held-out item's rank, from 0; a NaN score (a diverged model) ranks it last.
            above = ((scores > target_scores) | scores.isnan()).sum(1)
            above = torch.where(target_scores[:, 0].isnan(), scores.shape[1], above)
            top = counted & (above < TOP_K)
            losses = torch.nn.functional.cross_entropy(scores, targets, reduction="none")
            sums += torch.stack(
                [
                    top.sum(),
                    (top / torch.log2(above + 2.0)).sum(),
                    (losses * counted).sum(),
                    counted.sum(),
                ]
            ).double()
    dmp.train()
    dist.all_reduce(sums)
    hits, gains, loss, users = sums.tolist()
    metrics = {
        f"recall@{TOP_K}": hits / users,
        f"ndcg@{TOP_K}": gains / users,
        "loss": loss / users,
    }
    return metrics, int(users)


def run(args: argparse.Namespace) -> int:
    if args.baseline:
        deterministic_cuda()  # before any CUDA work; FBGEMM's backward order is fixed then
    # Bad data fails here, on every rank, before any collective.
    history = histories(args)
    available = train_steps(
        history, args.train_batch_size, int(os.environ.get("WORLD_SIZE", "1")), args.num_epochs
    )
    rank, world_size, device = init_distributed()
    models = [("lookahead", *build(args, lookahead=True, world_size=world_size, device=device))]
    if args.baseline:
        base = build(args, lookahead=False, world_size=world_size, device=device)
        models[0][1].load_state_dict(base[0].state_dict())  # the same weights: a checkpoint
        models.append(("baseline", *base))
    if (args.limit_train_batches or 0) > available and rank == 0:
        print(
            f"warning: --limit_train_batches {args.limit_train_batches}: {args.num_epochs} "
            f"epoch(s) of {args.num_users} users hold {available} batches of "
            f"{args.train_batch_size} users per rank at world size {world_size}; training "
            f"{available} steps",
            file=sys.stderr,
        )
    runs, evaluated = [], 0
    for name, dmp, optimizer in models:
        result = train(args, name, dmp, optimizer, history, rank, world_size, device)
        result.metrics, evaluated = evaluate(args, dmp, history, rank, world_size, device)
        runs.append(result)
    look = models[0][1:]
    same = gap = None
    if args.baseline:
        base_model, base_optimizer = models[1][1:]
        same = shared.weights_digest(look[0]) == shared.weights_digest(base_model)
        gap = shared.weights_gap(look, (base_model, base_optimizer), device)
    digest = shared.weights_digest(look[0])
    if rank == 0:
        report(args, runs, same, gap, digest, world_size, evaluated)
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    shared.started()
    args = parse_args(argv)
    try:
        return run(args)
    except (DataError, ValueError) as error:  # bad data or settings: one line, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 1
    except MemoryError as error:  # sizes past this machine's memory (numpy says how much)
        print(f"error: out of memory: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line for the job, not a traceback per rank
        if os.environ.get("RANK", "0") == "0":
            print("interrupted", file=sys.stderr)
        return shared.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
