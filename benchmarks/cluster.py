"""Speed-up over plain TorchRec on emulated links: hosts as network namespaces, multi-node torchrun.

Each setting (host count, link rate) is an emulated cluster
(``torchrec_lookahead.testing.cluster``: a namespace per host, a veth into a
bridge, the host's egress shaped by ``tc``'s ``tbf``; ``none`` leaves it
unshaped) running the DLRM example with ``torchrun --nnodes N --node_rank i``
on each host and a static rendezvous on the bridge: a real multi-node launch
on one machine, whose hosts share its cores. Two jobs alternate, ``--runs``
times each:

* ``plain``: plain TorchRec alone, sharded by its own planner
  (``--baseline_only --torchrec_plan``);
* ``lookahead``: lookahead caching with hot rows chosen by the link
  (``auto``: only rows whose bytes cost the link more time than their lookups
  cost the replicas); its first run also trains plain TorchRec on its plan
  (``--baseline``) to check the final weights agree.

``speedup`` is plain's step time over lookahead's (medians of the steps after
the first, then of the runs). ``comm_share`` is the share of plain's step that
the shaped link adds over the unshaped one (``1 - T(unshaped) / T(link)``;
null without an unshaped setting): a lower bound on its time communicating.
Writes ``report.json`` and ``cluster.png`` (speed-up against link rate) into
--out and prints the table. Needs root (network namespaces); where they cannot
be made it says so in one line and exits 1. Every namespace and link it made
is removed, also when it is killed (SIGTERM, Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import EXAMPLE, example_flags, machine
from tqdm import tqdm

from torchrec_lookahead.metrics import EMBEDDING_KINDS
from torchrec_lookahead.testing.cluster import (
    ClusterUnavailable,
    EmulatedCluster,
    namespaces_available,
)

JOBS = {
    "plain": ["--baseline_only", "--torchrec_plan"],
    "lookahead": [],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, nargs="+", default=[2, 4])
    p.add_argument("--ranks-per-host", type=int, default=1)
    p.add_argument(
        "--bandwidths",
        nargs="+",
        default=["1", "3", "10", "25", "none"],
        help="Gbit/s per host link, or none (unshaped)",
    )
    p.add_argument("--runs", type=int, default=3, help="of each job per setting")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2048, help="per rank")
    p.add_argument("--embedding-dim", type=int, default=64)
    p.add_argument("--dense-arch", default="256,64")
    p.add_argument("--over-arch", default="256,64,1")
    p.add_argument("--scale", type=float, default=0.01)
    p.add_argument("--samples-per-day", type=int, default=262144)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        args.rates = [None if b == "none" else float(b) for b in args.bandwidths]
    except ValueError:
        p.error(f"--bandwidths are numbers (Gbit/s) or none, got {args.bandwidths}")
    if any(r is not None and r <= 0 for r in args.rates) or min(args.hosts) < 1:
        p.error("link rates and host counts must be positive")
    return args


def model_flags(args: argparse.Namespace, data: Path) -> list[str]:
    """The example's flags for every job: the model the issue's runs used, on synthetic data."""
    return [
        *example_flags(args.scale, args.batch_size, args.steps, data, args.samples_per_day),
        "--embedding_dim",
        str(args.embedding_dim),
        "--dense_arch_layer_sizes",
        args.dense_arch,
        "--over_arch_layer_sizes",
        args.over_arch,
    ]


def launch(
    cluster: EmulatedCluster, args: argparse.Namespace, flags: list[str], work: Path
) -> dict:
    """One multi-node job: torchrun on every host, node 0 hosting the rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp(dir=work))
    hosts = []
    for i in range(cluster.hosts):
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(cluster.hosts),
            "--node_rank",
            str(i),
            "--nproc_per_node",
            str(args.ranks_per_host),
            "--master_addr",
            cluster.address(0),
            "--master_port",
            str(port),
            EXAMPLE,
            *flags,
            "--out",
            str(out),
        ]
        log = open(out / f"host{i}.log", "w")
        hosts.append(
            cluster.run(
                i, command, env={"GLOO_SOCKET_IFNAME": cluster.interface(i)}, stdout=log, stderr=-2
            )
        )
    codes = [host.wait(timeout=1800) for host in hosts]
    if any(codes):
        tail = (out / f"host{codes.index(next(c for c in codes if c))}.log").read_text()[-3000:]
        raise RuntimeError(f"a host's job failed ({codes}):\n{tail}")
    return json.loads((out / "summary.json").read_text())


def step_ms(run: dict) -> float:
    return 1000 * statistics.median(run["step_s"][1:])


def measure(
    args: argparse.Namespace, hosts: int, rate: float | None, work: Path, data: Path
) -> dict:
    times: dict[str, list[float]] = {"plain": [], "lookahead": []}
    sent: dict[str, dict[str, float]] = {}
    agree, hot_share = None, None
    with EmulatedCluster(hosts, rate) as cluster:
        for r in tqdm(range(args.runs), desc=f"{hosts} hosts, {rate or 'unshaped'} Gbit/s"):
            for job, flags in JOBS.items():
                extra = ["--baseline"] if job == "lookahead" and r == 0 else []
                summary = launch(cluster, args, [*model_flags(args, data), *flags, *extra], work)
                first = summary["runs"][0]
                times[job].append(step_ms(first))
                sent[job] = first["bytes_per_step"]
                if extra:
                    agree = summary["weights_agreement"]
                    hot_share = first["hot_share"]
    batch = args.batch_size * hosts * args.ranks_per_host
    plain, look = statistics.median(times["plain"]), statistics.median(times["lookahead"])
    return {
        "hosts": hosts,
        "ranks_per_host": args.ranks_per_host,
        "bandwidth_gbps": rate,
        "plain_samples_per_s": 1000 * batch / plain,
        "lookahead_samples_per_s": 1000 * batch / look,
        "plain_step_ms": times["plain"],
        "lookahead_step_ms": times["lookahead"],
        "speedup": plain / look,
        "bytes_per_step": sent,
        "embedding_kib_per_step": {
            job: sum(b[k] for k in EMBEDDING_KINDS) / 1024 for job, b in sent.items()
        },
        "hot_share": hot_share,
        "weights_agreement": agree,
        "weights_agree": agree in ("bitwise equal", "within 1e-05"),
    }


def with_comm_share(settings: list[dict]) -> None:
    for s in settings:
        unshaped = next(
            (o for o in settings if o["hosts"] == s["hosts"] and o["bandwidth_gbps"] is None), None
        )
        if unshaped is None:
            s["comm_share"] = None
            continue
        base = statistics.median(unshaped["plain_step_ms"])
        s["comm_share"] = max(0.0, 1 - base / statistics.median(s["plain_step_ms"]))


def table(settings: list[dict]) -> str:
    row = "{:>5} {:>10} {:>10} {:>10} {:>8} {:>10} {:>10} {:>10} {:>8} {:>14}"
    lines = [
        row.format(
            "hosts",
            "link",
            "plain/s",
            "look/s",
            "speedup",
            "comm_share",
            "plain KiB",
            "look KiB",
            "hot",
            "weights",
        )
    ]
    for s in settings:
        kib = s["embedding_kib_per_step"]
        share = s["comm_share"]
        lines.append(
            row.format(
                s["hosts"],
                "unshaped" if s["bandwidth_gbps"] is None else f"{s['bandwidth_gbps']:g}G",
                f"{s['plain_samples_per_s']:,.0f}",
                f"{s['lookahead_samples_per_s']:,.0f}",
                f"{s['speedup']:.2f}x",
                "-" if share is None else f"{share:.2f}",
                f"{kib['plain']:,.0f}",
                f"{kib['lookahead']:,.0f}",
                f"{s['hot_share']:.0%}" if s["hot_share"] else "none",
                s["weights_agreement"] or "-",
            )
        )
    return "\n".join(lines)


def plot(settings: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    rates = sorted({s["bandwidth_gbps"] for s in settings if s["bandwidth_gbps"]})
    unshaped_x = (max(rates) * 3) if rates else 1.0
    for hosts in sorted({s["hosts"] for s in settings}):
        mine = sorted(
            (s for s in settings if s["hosts"] == hosts),
            key=lambda s: s["bandwidth_gbps"] or unshaped_x,
        )
        xs = [s["bandwidth_gbps"] or unshaped_x for s in mine]
        ax.plot(xs, [s["speedup"] for s in mine], marker="o", label=f"{hosts} hosts")
    ax.axhline(1.0, color="grey", linewidth=1, linestyle="--")
    ax.set_xscale("log")
    ticks = [*rates, unshaped_x]
    ax.set_xticks(ticks, [f"{r:g}" for r in rates] + ["unshaped"])
    ax.set_xlabel("link per host (Gbit/s)")
    ax.set_ylabel("speed-up over plain TorchRec")
    ax.set_title("lookahead (hot rows: auto) against plain TorchRec's own plan", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = namespaces_available()
    if why is not None:
        print(f"cluster: cannot emulate hosts here: {why}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    settings = []
    with tempfile.TemporaryDirectory(prefix="cluster-") as tmp:
        work, data = Path(tmp) / "jobs", Path(tmp) / "data"
        work.mkdir()
        try:
            for hosts in args.hosts:
                for rate in args.rates:
                    settings.append(measure(args, hosts, rate, work, data))
        except ClusterUnavailable as error:
            print(f"cluster: cannot emulate hosts here: {error}", file=sys.stderr)
            return 1
    with_comm_share(settings)
    report = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "seconds": time.time() - start,
        "config": vars(args),
        "settings": settings,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    plot(settings, out / "cluster.png")
    print(table(settings))
    print(f"wrote {out / 'report.json'} and {out / 'cluster.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
