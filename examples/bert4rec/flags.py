"""The example's command line: TorchRec's BERT4Rec example's flags, the cache's, checked."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import shared

__all__ = ["parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="BERT4Rec with lookahead embedding caching (TorchRec)")
    # As in TorchRec's BERT4Rec example.
    p.add_argument("--num_epochs", type=int, default=1, help="passes over the users")
    p.add_argument("--train_batch_size", type=int, default=64, help="users per rank and step")
    p.add_argument("--test_batch_size", type=int, default=256, help="users per rank")
    p.add_argument("--lr", type=float, default=0.1, help="embedding and dense learning rate")
    p.add_argument("--emb_dim", type=int, default=32)
    p.add_argument("--nhead", type=int, default=2)
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--max_len", type=int, default=20, help="the longest sequence a sample holds")
    p.add_argument("--mask_prob", type=float, default=0.15)
    p.add_argument(
        "--dataset_path",
        type=str,
        default=None,
        help="a folder holding MovieLens' ratings.dat (UserID::MovieID::Rating::Timestamp, "
        "as ml-1m has it); default: the built-in synthetic histories",
    )
    p.add_argument("--min_rating", type=int, default=0, help="MovieLens: ratings kept")
    p.add_argument("--min_user_count", type=int, default=5, help="MovieLens: users kept")
    p.add_argument("--seed", type=int, default=0)
    # As in this project's DLRM example.
    p.add_argument("--limit_train_batches", type=int, default=None)
    p.add_argument("--limit_test_batches", type=int, default=None)
    p.add_argument("--adagrad", action="store_true", help="row-wise Adagrad / Adagrad, not SGD")
    p.add_argument("--print_sharding_plan", action="store_true")
    # Synthetic data (when no --dataset_path).
    p.add_argument("--num_users", type=int, default=8192)
    p.add_argument("--num_items", type=int, default=10000)
    p.add_argument("--zipf", type=float, default=1.1, help="the item popularity's exponent")
    p.add_argument(
        "--drift",
        type=float,
        default=20.0,
        help="popularity ranks the items' ranking slides by from the first user to the last "
        "(users are in time order): the hot items change",
    )
    p.add_argument("--min_history", type=int, default=4)
    p.add_argument("--max_history", type=int, default=40)
    # Lookahead caching.
    p.add_argument("--lookahead", type=int, default=16)
    p.add_argument("--prefetch_distance", type=int, default=1)
    p.add_argument("--cache_load_factor", type=float, default=0.1)
    p.add_argument("--baseline", action="store_true", help="also train plain TorchRec and compare")
    p.add_argument("--out", type=str, default="results/bert4rec", help="summary JSON and PNG")
    args = p.parse_args(argv)

    for name in (
        "num_epochs",
        "train_batch_size",
        "test_batch_size",
        "emb_dim",
        "nhead",
        "num_layers",
        "num_users",
        "num_items",
        "limit_train_batches",
        "limit_test_batches",
        "lookahead",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be a positive integer, got {value}")
    for name in ("lr", "zipf"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            p.error(f"--{name} must be a positive number, got {getattr(args, name)}")
    if args.emb_dim % 4:
        p.error(
            f"--emb_dim must be a multiple of 4 (FBGEMM's kernels need row widths in "
            f"multiples of 4), got {args.emb_dim}"
        )
    if args.emb_dim % args.nhead:
        p.error(f"--emb_dim ({args.emb_dim}) must be a multiple of --nhead ({args.nhead})")
    if args.max_len < 2:
        p.error(
            f"--max_len must be at least 2 (history and the item to predict), got {args.max_len}"
        )
    if not 0 < args.mask_prob < 1:
        p.error(f"--mask_prob must be in (0, 1), got {args.mask_prob}")
    if not 0 <= args.dropout < 1:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    if not (math.isfinite(args.drift) and args.drift >= 0):
        p.error(f"--drift must be a non-negative number, got {args.drift}")
    if not 2 <= args.min_history <= args.max_history:
        p.error(
            "the histories need 2 <= --min_history <= --max_history (an item to train on "
            f"and one to hold out), got {args.min_history} and {args.max_history}"
        )
    if not 0 <= args.seed < 2**63:  # numpy's seeds are non-negative, torch's 64-bit
        p.error(f"--seed must be an integer in [0, 2**63), got {args.seed}")
    # Flags of the data not read: given (not at their defaults), they would be ignored.
    synthetic = ("num_users", "num_items", "zipf", "drift", "min_history", "max_history")
    unused, why = (
        (synthetic, "shape the synthetic histories: not with --dataset_path")
        if args.dataset_path is not None
        else (
            ("min_rating", "min_user_count"),
            "filter MovieLens' ratings: they need --dataset_path",
        )
    )
    if given := [f"--{n}" for n in unused if getattr(args, n) != p.get_default(n)]:
        p.error(f"{', '.join(given)} {why}")
    if args.prefetch_distance < 0:
        p.error(f"--prefetch_distance must be >= 0, got {args.prefetch_distance}")
    if not 0 < args.cache_load_factor <= 1:
        p.error(f"--cache_load_factor must be in (0, 1], got {args.cache_load_factor}")
    if args.dataset_path is not None:
        ratings = Path(args.dataset_path, "ratings.dat")
        if problem := shared.folder_problem(args.dataset_path, must_exist=True, written=False):
            p.error(f"--dataset_path {args.dataset_path}: {problem}")
        if not ratings.is_file():
            p.error(
                f"--dataset_path {args.dataset_path}: holds no ratings.dat (MovieLens' "
                "UserID::MovieID::Rating::Timestamp lines)"
            )
    if problem := shared.folder_problem(args.out, must_exist=False):
        p.error(f"--out {args.out}: {problem}")
    return args
