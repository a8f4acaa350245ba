"""Oracle report: misses of LRU, LFU, the lookahead oracle and Belady's MIN, and planning speed.

On a Criteo-shaped stream (26 tables of Criteo Kaggle's sizes times --scale,
per-table Zipf skew) it counts, at cache sizes of a few percent of each
table, how many rows each policy fetches (the oracle and MIN with the
frequency tie-break), two ways:

* per table: each table has a cache of its own, of a fixed share of the
  slots, and every policy runs on each table alone (plus the oracle at the
  longest lookahead with the previous recency tie-break);
* pooled: one cache over all tables' ids (table t's id i offset by the rows
  of the tables before it) with the same total slots, as a slot pool plans
  and as FBGEMM's UVM cache is shared by a TBE's tables. LRU, LFU, the
  oracle and MIN all run pooled, so pooled MIN is the limit the pooled oracle
  is measured against.

With ``--sequence`` the stream is sequence batches instead (``SequenceData``):
one item table of --items rows, each sample a history of --history-lengths
items (uniform, ends included) of Zipf popularity, as a sequence model such as
BERT4Rec looks them up; one table, so no pooled runs, and no planning-speed
part (it has a trace of its own).

It checks the device oracle (``DeviceOracleCacher``, on CUDA if there is one) against
the numba oracle on the per-table traces, at each lookahead and the
``--device-check-fractions`` cache sizes: their misses must be equal at every step of
every table (``misses.device_check``; a row per size and lookahead).

It then times the oracle, on 1 and 2 partitions (threads), against
``np.unique(batch, return_inverse=True)`` on 65,536-id batches of a 2M-row
table, the floor for any planner that has to deduplicate its input.

Writes ``report.json`` (``misses.results``: per table; ``misses.variants``:
per-table variants; ``misses.pooled``: one cache over all tables, empty for one table;
``misses.device_check``: device oracle against numba oracle) and
``misses.png`` into --out and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from common import SequenceData, machine, pinned_rows_needed
from tqdm import tqdm

from torchrec_lookahead import DeviceOracleCacher
from torchrec_lookahead.data import SyntheticCriteo, ZipfSampler
from torchrec_lookahead.oracle.misses import lfu_misses, lru_misses, min_misses, oracle_misses
from torchrec_lookahead.oracle.partitioned import PartitionedOracle

BAGPIPE_IDS_PER_S = 16384 * 26 / 0.075  # Bagpipe's Python oracle, per its paper


def trace(args: argparse.Namespace) -> tuple[list[list[np.ndarray]], tuple[int, ...]]:
    """Per table, the ids of each batch, and the tables' rows: the Criteo-shaped stream,
    or with --sequence the item table's histories."""
    if args.sequence:
        histories = SequenceData(args.items, args.zipf, tuple(args.history_lengths), args.seed)
        return [histories.stream(args.batch_size, args.steps)], (args.items,)
    data = SyntheticCriteo(scale=args.scale, zipf_exponent=args.zipf, seed=args.seed)
    return data.table_streams(args.batch_size, args.steps), data.num_embeddings


def miss_table(args: argparse.Namespace) -> dict[str, object]:
    streams, num_rows = trace(args)
    floors = [pinned_rows_needed(s, args.prefetch_distance) for s in streams]
    distinct_per_step = sum(len(np.unique(b)) for s in streams for b in s)
    compulsory = sum(len(np.unique(np.concatenate(s))) for s in streams)
    d, longest = args.prefetch_distance, max(args.lookaheads)

    def per_table(simulate) -> object:
        """Total misses of ``simulate(stream, capacity, rows)`` over the tables."""
        return lambda caps: sum(
            int(simulate(stream, cap, n).sum()) for stream, cap, n in zip(streams, caps, num_rows)
        )

    policies: dict[str, object] = {"LRU": per_table(lru_misses), "LFU": per_table(lfu_misses)}
    for lookahead in args.lookaheads:
        policies[f"oracle L={lookahead}"] = per_table(
            lambda b, c, n, L=lookahead: oracle_misses(b, c, L, d, n)
        )
    policies["MIN"] = per_table(min_misses)
    variants: dict[str, object] = {
        f"L={longest} recency": per_table(
            lambda b, c, n: oracle_misses(b, c, longest, d, n, tie_break="recency")
        ),
    }
    # One cache over all tables: table t's id i is sum(rows of tables < t) + i, and the
    # capacity is the sum of the tables' shares (what a slot pool plans, and how FBGEMM's
    # UVM cache is shared by a TBE's tables).
    offsets = np.cumsum([0, *num_rows[:-1]])
    pooled_stream = [
        np.concatenate([stream[step] + offset for stream, offset in zip(streams, offsets)])
        for step in range(args.steps)
    ]
    total_rows = sum(num_rows)

    def one_pool(simulate) -> object:
        """Misses of ``simulate(stream, capacity, rows)`` on the pooled stream."""
        return lambda caps: int(simulate(pooled_stream, sum(caps), total_rows).sum())

    pooled: dict[str, object] = {}
    if len(streams) > 1:  # one table's pool is its own cache
        pooled = {"pooled LRU": one_pool(lru_misses), "pooled LFU": one_pool(lfu_misses)}
        for lookahead in args.lookaheads:
            pooled[f"pooled L={lookahead}"] = one_pool(
                lambda b, c, n, L=lookahead: oracle_misses(b, c, L, d, n)
            )
        pooled["pooled MIN"] = one_pool(min_misses)

    def capacities_at(fraction: float) -> list[int]:
        return [min(n, max(math.ceil(fraction * n), floor)) for n, floor in zip(num_rows, floors)]

    def results(named: dict[str, object]) -> list[dict[str, object]]:
        rows = []
        runs = [(f, name) for f in args.cache_fractions for name in named]
        for fraction, name in tqdm(runs, desc="simulating", unit="run"):
            capacities = capacities_at(fraction)
            misses = named[name](capacities)
            rows.append(
                {
                    "cache_fraction": fraction,
                    "cache_rows": sum(capacities),
                    "policy": name,
                    "misses": misses,
                    "miss_rate": misses / distinct_per_step,
                }
            )
        return rows

    def device_check() -> list[dict[str, object]]:
        """Misses of the device oracle and of the numba oracle, equal at every step?"""
        rows = []
        runs = [(f, L) for f in args.device_check_fractions for L in args.lookaheads]
        for fraction, lookahead in tqdm(runs, desc="device oracle", unit="run"):
            numba = device = 0
            equal = True
            for stream, cap, n in zip(streams, capacities_at(fraction), num_rows):
                want = oracle_misses(stream, cap, lookahead, d, n)
                oracle = DeviceOracleCacher(cap, lookahead, d, n)
                got = np.array([p.num_misses for p in oracle.plan(map(torch.from_numpy, stream))])
                numba, device = numba + int(want.sum()), device + int(got.sum())
                equal = equal and np.array_equal(want, got)
            rows.append(
                {
                    "cache_fraction": fraction,
                    "lookahead": lookahead,
                    "device": str(oracle.device),
                    "numba_misses": numba,
                    "device_misses": device,
                    "equal_every_step": equal,
                }
            )
        return rows

    return {
        "tables": len(streams),
        "rows": sum(num_rows),
        "ids": sum(len(b) for s in streams for b in s),
        "distinct_ids_per_step_total": distinct_per_step,
        "compulsory_misses": compulsory,
        "results": results(policies),
        "variants": results(variants),
        "pooled": results(pooled),
        "device_check": device_check(),
    }


def throughput(args: argparse.Namespace) -> list[dict[str, object]]:
    sampler = ZipfSampler(args.tp_rows, args.zipf, salt=1)
    rng = np.random.default_rng(args.seed)
    batches = [sampler.sample(rng, args.tp_batch) for _ in range(args.tp_batches)]
    ids = args.tp_batch * args.tp_batches
    # At least twice the smallest workable cache, so each partition's share fits its rows.
    capacity = max(
        int(args.tp_cache_fraction * args.tp_rows),
        2 * pinned_rows_needed(batches, args.prefetch_distance),
    )

    def oracle(lookahead: int, partitions: int) -> PartitionedOracle:
        return PartitionedOracle(
            capacity, lookahead, args.prefetch_distance, args.tp_rows, partitions=partitions
        )

    def median_of(fn) -> float:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    for partitions in args.tp_partitions:  # compile (or load the compiled kernels) first
        list(oracle(1, partitions).plan(batches[:2]))
    unique_s = median_of(lambda: [np.unique(b, return_inverse=True) for b in batches])
    runs = [(k, L) for k in args.tp_partitions for L in args.tp_lookaheads]
    out = []
    for partitions, lookahead in tqdm(runs, desc="timing oracle", unit="run"):
        oracle_s = median_of(lambda L=lookahead, k=partitions: list(oracle(L, k).plan(batches)))
        out.append(
            {
                "partitions": partitions,
                "lookahead": lookahead,
                "capacity": capacity,
                "oracle_s": oracle_s,
                "unique_s": unique_s,
                "ratio_to_unique": oracle_s / unique_s,
                "ids_per_s": ids / oracle_s,
                "speedup_vs_bagpipe": ids / oracle_s / BAGPIPE_IDS_PER_S,
            }
        )
    return out


def plot(report: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    misses, cfg = report["misses"], report["config"]
    per_table = (
        "the item table's cache" if cfg["sequence"] else "a cache per table (fixed share each)"
    )
    panels = [(per_table, misses["results"] + misses["variants"])]
    if misses["pooled"]:
        panels.append(("one pooled cache over all tables (same total)", misses["pooled"]))
    variants = {r["policy"] for r in misses["variants"]}
    compulsory = misses["compulsory_misses"] / misses["distinct_ids_per_step_total"]
    fig, axes = plt.subplots(1, len(panels), figsize=(max(9, 6 * len(panels)), 4.8), squeeze=False)
    for ax, (title, results) in zip(axes[0], panels):
        for policy in dict.fromkeys(r["policy"] for r in results):
            pts = [r for r in results if r["policy"] == policy]
            ax.plot(
                [100 * p["cache_fraction"] for p in pts],
                [100 * p["miss_rate"] for p in pts],
                marker="o",
                label=policy,
                linestyle="--" if policy.endswith("MIN") else ":" if policy in variants else "-",
            )
        ax.axhline(100 * compulsory, color="grey", linewidth=1, label="first touches (any cache)")
        ax.set_xscale("log")
        fractions = sorted({100 * r["cache_fraction"] for r in results})
        ax.set_xticks(fractions, [f"{f:g}" for f in fractions])
        ax.minorticks_off()
        ax.set_xlabel("cache size (% of each table's rows)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("misses (% of distinct ids per step)")
    fig.suptitle(f"{stream_title(cfg)}, {cfg['steps']} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def stream_title(cfg: dict[str, object]) -> str:
    """What the misses were counted on, in words."""
    if cfg["sequence"]:
        low, high = cfg["history_lengths"]
        return (
            f"Sequence batches: {cfg['items']:,} items, Zipf {cfg['zipf']}, "
            f"histories of {low}-{high}, batch {cfg['batch_size']}"
        )
    return (
        f"Criteo-shaped stream, scale {cfg['scale']}, Zipf {cfg['zipf']}, batch {cfg['batch_size']}"
    )


def print_misses(
    title: str, results: list[dict[str, object]], ratios: list[tuple[str, str]]
) -> None:
    """One table of miss rates, a column per policy, then ``top / bottom`` (their misses)
    for each pair of ``ratios``."""
    policies = list(dict.fromkeys(r["policy"] for r in results))
    fractions = list(dict.fromkeys(r["cache_fraction"] for r in results))
    labels = [
        "/".join(p.removeprefix("pooled ").removeprefix("oracle ") for p in r) for r in ratios
    ]
    print(f"\n{title}")
    print(
        f"{'cache':>7} {'rows':>10} "
        + " ".join(f"{p:>14}" for p in policies)
        + "".join(f" {label:>12}" for label in labels)
    )
    for f in fractions:
        row = {r["policy"]: r for r in results if r["cache_fraction"] == f}
        cells = " ".join(f"{100 * row[p]['miss_rate']:>13.2f}%" for p in policies)
        quotients = "".join(
            f" {row[top]['misses'] / row[bottom]['misses']:>11.2f}x" for top, bottom in ratios
        )
        print(f"{100 * f:>6.1f}% {row[policies[0]]['cache_rows']:>10,} {cells}{quotients}")


def print_tables(report: dict[str, object]) -> None:
    misses, cfg = report["misses"], report["config"]
    longest = max(cfg["lookaheads"])
    print(
        f"\nMisses (% of distinct ids per step) on {misses['tables']} "
        f"table{'s' if misses['tables'] > 1 else ''}, "
        f"{misses['rows']:,} rows, {misses['ids']:,} ids; compulsory misses "
        f"{100 * misses['compulsory_misses'] / misses['distinct_ids_per_step_total']:.2f}%"
    )
    if cfg["sequence"]:
        print_misses(
            f"{stream_title(cfg)}, {cfg['steps']} steps:",
            misses["results"] + misses["variants"],
            [(f"oracle L={longest}", p) for p in ("LRU", "LFU", "MIN")],
        )
    else:
        print_misses(
            "A cache per table, each a fixed share of the slots:",
            misses["results"] + misses["variants"],
            [(f"oracle L={longest}", "LRU")],
        )
        print_misses(
            "One pooled cache over all tables' ids (offset per table), the same total slots:",
            misses["pooled"],
            [(f"pooled L={longest}", "pooled LRU")],
        )
    if misses["device_check"]:
        print("\nThe device oracle against the numba oracle, per table (their misses):")
        for r in misses["device_check"]:
            verdict = "equal at every step" if r["equal_every_step"] else "DIFFERENT"
            print(
                f"{100 * r['cache_fraction']:>6.1f}% L={r['lookahead']:<4} {r['device']:>6} "
                f"{r['device_misses']:>10,} {r['numba_misses']:>10,}  {verdict}"
            )
    if "throughput" in report:
        print_throughput(report)
    print(
        f"\nMachine: {report['machine']['cpu']}, {report['machine']['cores']} cores; "
        f"{report['date']}"
    )


def print_throughput(report: dict[str, object]) -> None:
    cfg = report["config"]
    print(
        f"\nPlanning speed: {cfg['tp_batches']} batches of {cfg['tp_batch']:,} ids, "
        f"table of {cfg['tp_rows']:,} rows, cache {cfg['tp_cache_fraction']:.0%}, "
        f"median of {cfg['repeats']}"
    )
    print(
        f"{'K':>2} {'L':>4} {'oracle s':>9} {'unique s':>9} {'ratio':>6} {'M ids/s':>8} "
        f"{'x Bagpipe':>9}"
    )
    for t in report["throughput"]:
        print(
            f"{t['partitions']:>2} {t['lookahead']:>4} {t['oracle_s']:>9.3f} "
            f"{t['unique_s']:>9.3f} {t['ratio_to_unique']:>6.2f} {t['ids_per_s'] / 1e6:>8.1f} "
            f"{t['speedup_vs_bagpipe']:>9.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results/oracle"))
    parser.add_argument("--scale", type=float, default=0.1, help="table size factor")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--batch-size", type=int, help="samples (default 4096; --sequence 128)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cache-fractions",
        type=float,
        nargs="+",
        help="default 0.005 0.01 0.02 0.05 0.1 (--sequence: 0.01 0.02 0.05 0.1 0.2)",
    )
    parser.add_argument(
        "--sequence", action="store_true", help="sequence batches: histories of one item table"
    )
    parser.add_argument("--items", type=int, default=1_000_000, help="--sequence: item rows")
    parser.add_argument(
        "--history-lengths",
        type=int,
        nargs=2,
        default=[50, 200],
        metavar=("LOW", "HIGH"),
        help="--sequence: each history's length, uniform in [LOW, HIGH]",
    )
    parser.add_argument("--lookaheads", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--prefetch-distance", type=int, default=1)
    parser.add_argument(
        "--device-check-fractions",
        type=float,
        nargs="*",
        default=[0.01],
        help="cache sizes at which the device oracle's misses are checked (none: skip)",
    )
    parser.add_argument("--tp-rows", type=int, default=2_000_000)
    parser.add_argument("--tp-batch", type=int, default=65_536)
    parser.add_argument("--tp-batches", type=int, default=100)
    parser.add_argument("--tp-cache-fraction", type=float, default=0.05)
    parser.add_argument("--tp-lookaheads", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--tp-partitions", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.batch_size is None:
        args.batch_size = 128 if args.sequence else 4096
    if args.cache_fractions is None:
        args.cache_fractions = (
            [0.01, 0.02, 0.05, 0.1, 0.2] if args.sequence else [0.005, 0.01, 0.02, 0.05, 0.1]
        )

    start = time.perf_counter()
    report = {
        "config": vars(args) | {"out": str(args.out)},
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    report["misses"] = miss_table(args)
    if not args.sequence:
        report["throughput"] = throughput(args)
    report["seconds"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "misses.png")
    print_tables(report)
    print(
        f"Wrote {args.out / 'report.json'} and {args.out / 'misses.png'} "
        f"in {report['seconds']:.0f} s"
    )


if __name__ == "__main__":
    main()
