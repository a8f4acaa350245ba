"""Criteo days, raw TSV, into the ``.npy`` days the example trains on, as TorchRec prepares them.

    python examples/dlrm/preprocess.py --input_dir RAW --output_dir OUT \\
        --frequency_threshold T [--workers N]

``RAW`` holds ``day_0`` ... ``day_N`` (decompressed TSV). ``OUT`` gets, per
day, ``day_<n>_dense.npy``, ``day_<n>_labels.npy`` and
``day_<n>_sparse_contig_freq.npy``: array for array what TorchRec's
``tsv_to_npys`` per day and then ``sparse_to_contiguous`` over all days with
threshold ``T`` write (ids seen fewer than ``T`` times become 1, the others
2, 3, ... per column in order of first occurrence; 0 and 1 mean no threshold;
MLPerf's DLRM uses 15). It also gets ``num_embeddings_per_feature.txt``: the
26 table sizes (2 + the ids kept, per column), comma-separated, which
``dlrm_main.py`` reads from ``--dataset_path OUT`` by itself or takes as
``--num_embeddings_per_feature OUT/num_embeddings_per_feature.txt``.

Memory is bounded by the distinct ids, not the lines; it runs ``--workers``
days (and columns) at once, and an interrupted run, started again with the
same flags, goes on where it stopped (:mod:`torchrec_lookahead.data.contiguous`
says how, and what memory it takes). Run it before training: training refuses
raw days. Bad input ends with one ``error:`` line and exit status 1.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time

from folders import folder_problem

from torchrec_lookahead.data.contiguous import CARDINALITY_FILE, preprocess_days
from torchrec_lookahead.data.npy import DataError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Criteo TSV days -> TorchRec's .npy days with contiguous ids"
    )
    p.add_argument("--input_dir", required=True, help="raw days day_0 ... day_N (TSV)")
    p.add_argument("--output_dir", required=True, help="where the .npy days go")
    p.add_argument(
        "--frequency_threshold",
        type=int,
        default=0,
        help="ids seen fewer times than this (over all days) become 1 (0: no threshold; "
        "MLPerf: 15)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="days (and columns) processed at once; memory grows with it (default: the CPUs)",
    )
    p.add_argument("--block_mb", type=float, default=32.0, help="TSV read per block, per worker")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.frequency_threshold < 0:
        p.error(f"--frequency_threshold must be 0 or more, got {args.frequency_threshold}")
    if args.workers < 1:
        p.error(f"--workers must be at least 1, got {args.workers}")
    if not (math.isfinite(args.block_mb) and args.block_mb > 0):
        p.error(f"--block_mb must be a positive number, got {args.block_mb}")
    for name, must_exist, written in (("input_dir", True, False), ("output_dir", False, True)):
        if problem := folder_problem(getattr(args, name), must_exist, written):
            p.error(f"--{name} {getattr(args, name)}: {problem}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        sizes = preprocess_days(
            args.input_dir,
            args.output_dir,
            args.frequency_threshold,
            workers=args.workers,
            block_bytes=max(1, int(args.block_mb * 2**20)),
            progress=not args.quiet,
        )
    except (DataError, ValueError) as error:  # bad data or settings: one line
        print(f"error: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # a full disk, say: its writes' errors name no file
        print(f"error: {disk_problem(error, args.output_dir)}", file=sys.stderr)
        return 1
    print(
        f"preprocessed {args.input_dir} into {args.output_dir} in "
        f"{time.perf_counter() - start:.1f} s; table sizes "
        f"({os.path.join(args.output_dir, CARDINALITY_FILE)}): {','.join(map(str, sizes))}"
    )
    return 0


def disk_problem(error: OSError, output_dir: str) -> str:
    """An OS error of the preprocessing: an input file's as the OS says it; a write's with
    the space left in the output folder (a short write names no file)."""
    what = f"{error.filename}: {error.strerror}" if error.filename else str(error)
    output = os.path.abspath(output_dir)
    named = error.filename if isinstance(error.filename, str) else None
    if named and os.path.commonpath([os.path.abspath(named), output]) != output:
        return what  # reading an input file: no disk space to speak of
    try:
        free = f"{shutil.disk_usage(output_dir).free / 2**30:.2f} GiB free there"
    except OSError:
        free = "its free space unknown"
    return f"preprocessing into {output_dir} failed ({what}); {free}; run again to go on"


if __name__ == "__main__":
    sys.exit(main())
