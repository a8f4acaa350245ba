"""A real multi-node launch: two emulated hosts (network namespaces on a shaped link),
torchrun on each with ``--nnodes 2``, the DLRM example with hot rows against plain
TorchRec. Skipped, with the reason, where namespaces cannot be made (not root)."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from tests.test_dlrm_example import MAIN, TINY
from torchrec_lookahead.testing.cluster import EmulatedCluster, namespaces_available

UNAVAILABLE = namespaces_available()


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no emulated cluster: {UNAVAILABLE}")
def test_two_hosts_on_a_shaped_link_train_exactly_like_plain_torchrec(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    flags = [
        *TINY,
        "--limit_train_batches",
        "20",
        "--baseline",
        "--hot_rows",
        "--adagrad",
        "--data_cache",
        str(tmp_path / "data"),
        "--out",
        str(out),
    ]
    with EmulatedCluster(2, rate_gbps=1.0) as cluster:
        launch = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc_per_node",
            "1",
            "--master_addr",
            cluster.address(0),
            "--master_port",
            str(port),
        ]
        hosts = [
            cluster.run(
                i,
                [*launch, "--node_rank", str(i), MAIN, *flags],
                env={"GLOO_SOCKET_IFNAME": cluster.interface(i)},
                stdout=open(tmp_path / f"host{i}.log", "w"),
                stderr=-2,
            )
            for i in range(2)
        ]
        codes = [host.wait(timeout=600) for host in hosts]
    logs = [(tmp_path / f"host{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["weights_agreement"] == "bitwise equal", summary["weights_max_difference"]
    look, base = summary["runs"]
    assert look["hot_share"] > 0.5 and look["bytes_per_step"]["hot_sync"] > 0
    assert look["auroc"] == base["auroc"]
