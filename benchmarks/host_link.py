"""Bytes over the host link per step: the lookahead oracle, a fully associative LRU and
FBGEMM's UVM cache, simulated on the CPU in a miss-heavy regime.

FBGEMM's UVM cache prefetches one batch ahead and on one GPU hides most misses, so
lookahead's edge there is fewer bytes between host and device. This counts them. The
stream: Criteo Kaggle's 26 tables times --scale (33.8M rows at 1.0), Zipf ids
(--zipf), --batch-size samples of one id per table. The cache: --cache-fraction of
the rows. Policies, all over the same ids (table ``t``'s id ``i`` is ``i`` plus the
rows of the tables before it, FBGEMM's ``linearize_cache_indices``):

* ``lookahead``: the product's plan. Under row-wise Adagrad, tables of equal width
  share one slot pool and one :class:`OracleCacher` (``cache.pools.slot_pools``), so
  here one oracle plans all 26 tables, with ``prefetch_distance`` 1 (the pipeline's
  default) and --lookahead. Its slots: each table's ``CacheSizing.rows`` at
  --cache-fraction (``ceil(fraction * rows)``, at least 1), summed over the pool. The
  product's first-batch raise (a table's slots up to ``2 * ids per batch``) is not
  applied, so that every policy has the same capacity.
* ``lru``: the same cache under batched LRU, fully associative: the project's fast
  LRU (the oracle with an empty window and the recency tie-break, what
  ``oracle.misses.lru_misses`` runs), same slots.
* ``fbgemm-lru``: FBGEMM's LRU cache: ``ceil(slots / 32)`` sets of 32 ways, a row's
  set MurmurHash3's 64-bit finalizer of its linearized id modulo the sets (FBGEMM's
  ``cache_slot``), one ``lru_cache_populate`` per step as under TorchRec's prefetch
  pipeline (``prefetch_pipeline=True``, so ``lock_cache_line``). Modelled from
  FBGEMM's source: the step's distinct ids that are in their set take the step's
  time stamp; the misses, in order of set and then id, go into their set's slots
  oldest first (time stamp, then the id held; empty slots first), where a slot is
  evictable unless the current step used it or the cache line is locked by the
  previous step's batch (still in training while this one is prefetched); a miss
  that finds no evictable slot is not cached. ``fbgemm-lru-no-prefetch``: the same
  without the lock (populate in the step's own forward).

Bytes per step, one crossing each (the unsharded path):

* a row fetched into the cache (host to device) and a row written back (device to
  host). Every evicted row was trained since it came in, so every eviction is a
  write-back (FBGEMM evicts without a dirty bit; the oracle's plan writes back every
  eviction);
* FBGEMM only: a miss left out of the cache stays in UVM, read by the forward once per
  occurrence in the batch and read and written once by the fused optimizer (an
  in-place update);
* a row's bytes: ``4 * dim`` of fp32 weights, plus 4 for row-wise Adagrad's
  accumulator where it moves with the row. The project's store keeps it beside the row
  and the cache moves both (``HostStore.bytes_per_row``): ``4 * (dim + 1)`` for
  ``lookahead`` and ``lru``. FBGEMM places row-wise optimizer state on the device even
  for MANAGED_CACHING tables (``construct_split_state``), so ``4 * dim`` there.

Not modelled: the flush at the end, link protocol overhead, and DMP's path, where a
write-back of the lookahead cache crosses the link three times.

Figures are means over the steady-state steps: the first --warmup steps are skipped,
and more if a cache is not full by then. Writes ``report.json`` and ``host_link.png``
into --out and prints the table.

    python benchmarks/host_link.py --out results/host_link
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from numba import njit
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine  # noqa: E402

from torchrec_lookahead.cache.pools import slot_pools  # noqa: E402
from torchrec_lookahead.data import SyntheticCriteo  # noqa: E402
from torchrec_lookahead.oracle import OracleCacher  # noqa: E402
from torchrec_lookahead.oracle.contract import CachePlan  # noqa: E402
from torchrec_lookahead.settings import CacheSizing  # noqa: E402

POLICIES = ("lookahead", "lru", "fbgemm-lru", "fbgemm-lru-no-prefetch")
BASELINE = "fbgemm-lru"
FBGEMM_WAYS = 32  # FBGEMM's DEFAULT_ASSOC
PREFETCH_DISTANCE = 1  # the pipeline's default
# Per step and policy: distinct ids not in the cache; rows fetched into it; rows written
# back; misses left out of the cache; the forward's reads of those (one per occurrence).
COUNTS = ("misses", "rows_fetched", "rows_written_back", "uncached_rows", "uncached_reads")
_MIX1 = np.uint64(0xFF51AFD7ED558CCD)
_MIX2 = np.uint64(0xC4CEB9FE1A85EC53)
_SHIFT = np.uint64(33)


@njit(cache=True)
def cache_set(linear_id: int, sets: int) -> int:
    """FBGEMM's ``cache_slot``: MurmurHash3's 64-bit finalizer of the id, modulo the sets."""
    h = np.uint64(linear_id)
    h ^= h >> _SHIFT
    h *= _MIX1
    h ^= h >> _SHIFT
    h *= _MIX2
    h ^= h >> _SHIFT
    return np.int64(h % np.uint64(sets))


@njit(cache=True)
def _populate(
    ids: np.ndarray,
    step: int,
    lock: bool,
    tags: np.ndarray,
    stamps: np.ndarray,
    seen: np.ndarray,
    counts: np.ndarray,
) -> None:
    """One step of FBGEMM's LRU cache (see the module docstring); ``counts`` as COUNTS."""
    sets, ways = tags.shape
    rows = len(seen)
    unique = np.empty(len(ids), dtype=np.int64)
    n = 0
    for row in ids:
        if seen[row] != step:
            seen[row] = step
            unique[n] = row
            n += 1
    keys = np.empty(n, dtype=np.int64)  # misses as set * rows + id, to sort by set, then id
    m = 0
    for j in range(n):
        row = unique[j]
        s = cache_set(row, sets)
        hit = False
        for w in range(ways):
            if tags[s, w] == row:
                stamps[s, w] = step
                hit = True
                break
        if not hit:
            keys[m] = s * rows + row
            m += 1
    keys = np.sort(keys[:m])
    oldest = step - 1 if lock else step  # slots stamped at or after this are kept
    free = np.empty(ways, dtype=np.int64)
    fetched = written = uncached = 0
    a = 0
    while a < m:
        s = keys[a] // rows
        b = a
        while b < m and keys[b] // rows == s:
            b += 1
        e = 0  # evictable slots, oldest first (insertion sort on time stamp, then id)
        for w in range(ways):
            if stamps[s, w] < oldest:
                q = e
                while q > 0 and (stamps[s, free[q - 1]], tags[s, free[q - 1]]) > (
                    stamps[s, w],
                    tags[s, w],
                ):
                    free[q] = free[q - 1]
                    q -= 1
                free[q] = w
                e += 1
        k = min(b - a, e)
        for q in range(k):
            w = free[q]
            if tags[s, w] >= 0:
                written += 1
            tags[s, w] = keys[a + q] % rows
            stamps[s, w] = step
        for q in range(a + k, b):
            seen[keys[q] % rows] = -2 - step  # uncached this step
        fetched += k
        uncached += b - a - k
        a = b
    reads = 0
    if uncached:
        for row in ids:
            if seen[row] == -2 - step:
                reads += 1
    counts[0] = m
    counts[1] = fetched
    counts[2] = written
    counts[3] = uncached
    counts[4] = reads


class FbgemmLruCache:
    """FBGEMM's 32-way LRU UVM cache over ``rows`` linearized ids, ``sets`` sets.

    ``lock``: rows of the previous step stay (TorchRec's prefetch pipeline locks the
    lines of the batch in training while the next one is prefetched)."""

    def __init__(self, sets: int, rows: int, lock: bool, ways: int = FBGEMM_WAYS) -> None:
        self.lock = lock
        self.tags = np.full((sets, ways), -1, dtype=np.int64)  # linearized id per slot
        self.stamps = np.full((sets, ways), -2, dtype=np.int64)  # step of last use
        self._seen = np.full(rows, -1, dtype=np.int32)

    @property
    def slots(self) -> int:
        return self.tags.size

    def step(self, ids: np.ndarray, step: int) -> np.ndarray:
        """Populate for batch ``step``; returns its COUNTS."""
        counts = np.zeros(len(COUNTS), dtype=np.int64)
        _populate(ids, step, self.lock, self.tags, self.stamps, self._seen, counts)
        return counts


def plan_counts(plan: CachePlan) -> np.ndarray:
    """COUNTS of an oracle's plan: every miss is fetched, every eviction written back."""
    return np.array([plan.num_misses, len(plan.fetch_ids), len(plan.evict_ids), 0, 0])


def step_bytes(counts: np.ndarray, row_bytes: int) -> np.ndarray:
    """Bytes over the link per step from COUNTS rows: fetches, write-backs, and for a row
    left out of the cache its forward reads plus the optimizer's read and write."""
    _, fetched, written, uncached, reads = counts.T
    return (fetched + written + reads + 2 * uncached) * row_bytes


def simulate(args: argparse.Namespace) -> dict[str, object]:
    """Per policy and step, COUNTS; the caches' sizes and each policy's row bytes."""
    data = SyntheticCriteo(scale=args.scale, zipf_exponent=args.zipf, seed=args.seed)
    sizes = data.num_embeddings
    pools = slot_pools(sizes, [args.dim] * len(sizes), EmbOptimType.EXACT_ROWWISE_ADAGRAD)
    assert len(pools) == 1  # one width under row-wise Adagrad: one pool, one oracle
    offsets, rows = pools[0].offsets, pools[0].num_rows
    sizing = CacheSizing(cache_load_factor=args.cache_fraction)
    slots = sum(sizing.rows(f"t{t}", n, n) for t, n in enumerate(sizes))
    sets = math.ceil(slots / FBGEMM_WAYS)
    oracles = {
        "lookahead": OracleCacher(slots, args.lookahead, PREFETCH_DISTANCE, rows),
        "lru": OracleCacher(slots, 0, 0, rows, tie_break="recency"),
    }
    fbgemm = {
        "fbgemm-lru": FbgemmLruCache(sets, rows, lock=True),
        "fbgemm-lru-no-prefetch": FbgemmLruCache(sets, rows, lock=False),
    }
    counts = {name: np.zeros((args.steps, len(COUNTS)), dtype=np.int64) for name in POLICIES}
    bar = tqdm(range(args.steps + args.lookahead), desc="simulating", unit="step")
    for step in bar:
        values = data.batch(step, args.batch_size).values
        ids = np.concatenate([v + o for v, o in zip(values, offsets)])
        for name, oracle in oracles.items():
            if step >= args.steps and name != "lookahead":
                continue
            plan = oracle.push(ids)
            if plan is not None and plan.step < args.steps:
                counts[name][plan.step] = plan_counts(plan)
        if step < args.steps:
            for name, cache in fbgemm.items():
                counts[name][step] = cache.step(ids, step)
    # fp32 weights, plus row-wise Adagrad's accumulator where it moves with the row
    row_bytes = {name: 4 * args.dim + (0 if name in fbgemm else 4) for name in POLICIES}
    capacity = {name: slots for name in oracles} | {name: c.slots for name, c in fbgemm.items()}
    return {
        "tables": len(sizes),
        "rows": rows,
        "cache_rows": slots,
        "fbgemm_sets": sets,
        "counts": counts,
        "row_bytes": row_bytes,
        "capacity": capacity,
    }


def full_at(counts: np.ndarray, capacity: int) -> int | None:
    """The first step after which the cache is full (None: never)."""
    resident = np.cumsum(counts[:, 1] - counts[:, 2])
    full = np.flatnonzero(resident == capacity)
    return int(full[0]) if len(full) else None


ACCOUNTING = {
    "rows_fetched": "rows copied host to device into the cache, one crossing each",
    "rows_written_back": "evicted rows copied device to host, one crossing each; every "
    "evicted row was trained since it came in, so every eviction is written back",
    "uncached_rows": "FBGEMM only: misses that found no evictable slot in their set; they stay "
    "in UVM and the fused optimizer reads and writes each once (2 row crossings)",
    "uncached_reads": "FBGEMM only: the forward's reads of uncached rows from UVM, one per "
    "occurrence in the batch",
    "row_bytes": "4 * dim fp32 weights, plus 4 for row-wise Adagrad's accumulator where it "
    "moves with the row (lookahead, lru); FBGEMM keeps row-wise state on the device",
    "bytes": "(rows_fetched + rows_written_back + uncached_reads + 2 * uncached_rows) * row_bytes",
}


def summarise(args: argparse.Namespace, sim: dict) -> dict[str, object]:
    """The report: per policy, means over the steady-state steps; every step's figures."""
    counts, capacity, row_bytes = sim["counts"], sim["capacity"], sim["row_bytes"]
    fills = {name: full_at(counts[name], capacity[name]) for name in POLICIES}
    skipped = max([args.warmup] + [f + 1 for f in fills.values() if f is not None])
    if skipped >= args.steps:
        raise SystemExit(f"no steady-state steps: {skipped} skipped of {args.steps}")
    per_step = {}
    policies = []
    for name in POLICIES:
        per_step[name] = {"bytes": step_bytes(counts[name], row_bytes[name]).tolist()}
        per_step[name] |= {key: counts[name][:, k].tolist() for k, key in enumerate(COUNTS)}
        means = counts[name][skipped:].mean(axis=0)
        policies.append(
            {
                "name": name,
                "misses_per_step": float(means[0]),
                "bytes_per_step": float(np.mean(per_step[name]["bytes"][skipped:])),
                **{f"{key}_per_step": float(means[k]) for k, key in enumerate(COUNTS[1:], 1)},
                "row_bytes": row_bytes[name],
                "cache_rows": capacity[name],
                "full_after_step": fills[name],
            }
        )
    baseline = next(p["bytes_per_step"] for p in policies if p["name"] == BASELINE)
    for p in policies:
        p["bytes_ratio_to_fbgemm_lru"] = p["bytes_per_step"] / baseline
    return {
        "settings": vars(args) | {"out": str(args.out)},
        "optimizer": "EXACT_ROWWISE_ADAGRAD",
        "prefetch_distance": PREFETCH_DISTANCE,
        "tables": sim["tables"],
        "rows": sim["rows"],
        "cache_rows": sim["cache_rows"],
        "fbgemm_sets": sim["fbgemm_sets"],
        "fbgemm_ways": FBGEMM_WAYS,
        "statistic": "mean over the steady-state steps",
        "steps_simulated": args.steps,
        "steps_skipped": skipped,
        "steps_measured": args.steps - skipped,
        "accounting": ACCOUNTING,
        "policies": policies,
        "per_step": per_step,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    for name in POLICIES:
        ax.plot(np.array(report["per_step"][name]["bytes"]) / 2**20, label=name, linewidth=1)
    ax.axvspan(0, report["steps_skipped"], color="grey", alpha=0.15, label="warm-up (skipped)")
    ax.set_xlabel("step")
    ax.set_ylabel("MiB over the host link")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    s = report["settings"]
    ax.set_title(
        f"scale {s['scale']:g} ({report['rows']:,} rows), dim {s['dim']}, Zipf {s['zipf']:g}, "
        f"cache {100 * s['cache_fraction']:g}%, batch {s['batch_size']:,}, L={s['lookahead']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(report: dict) -> None:
    print(
        f"\nBytes over the host link per step, means of steps {report['steps_skipped']}.."
        f"{report['steps_simulated'] - 1} ({report['steps_skipped']} of "
        f"{report['steps_simulated']} skipped as warm-up); {report['rows']:,} rows, "
        f"{report['cache_rows']:,} cache rows"
    )
    print(
        f"{'policy':>22} {'misses/step':>12} {'fetched':>9} {'written':>9} {'uncached':>9} "
        f"{'MiB/step':>9} {'x fbgemm-lru':>12}"
    )
    for p in report["policies"]:
        print(
            f"{p['name']:>22} {p['misses_per_step']:>12,.0f} {p['rows_fetched_per_step']:>9,.0f} "
            f"{p['rows_written_back_per_step']:>9,.0f} {p['uncached_rows_per_step']:>9,.0f} "
            f"{p['bytes_per_step'] / 2**20:>9.2f} {p['bytes_ratio_to_fbgemm_lru']:>11.3f}x"
        )
    m = report["machine"]
    print(f"\nMachine: {m['cpu']}, {m['cores']} cores; {report['date']}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("results/host_link"))
    p.add_argument("--scale", type=float, default=1.0, help="Criteo Kaggle table sizes times")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--cache-fraction", type=float, default=0.01)
    p.add_argument("--batch-size", type=int, default=32768)
    p.add_argument("--lookahead", type=int, default=16)
    p.add_argument("--steps", type=int, default=300, help="simulated, warm-up included")
    p.add_argument("--warmup", type=int, default=50, help="skipped at least (more if not full)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    start = time.perf_counter()
    report = summarise(args, simulate(args))
    report |= {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "seconds": time.perf_counter() - start,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "host_link.png")
    print_table(report)
    print(f"Wrote {args.out / 'report.json'} and {args.out / 'host_link.png'}")
    return report


if __name__ == "__main__":
    main()
