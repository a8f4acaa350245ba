"""Processes for the tests, started from a warm process instead of a fresh interpreter.

Every test that trains at several ranks, and every run of the example, starts new
processes; a fresh interpreter spends about 7 s of CPU importing torch and TorchRec
before it does anything (measured on the 2-core machine: ``import torchrec``), which
was most of the suite's time. Here they are forked from multiprocessing's fork server,
which imports torch, FBGEMM, TorchRec and this package once per test session and forks
each process from that state. The processes are as real as before: separate address
spaces, gloo over TCP, their own stdout and exit code.

* :func:`spawn` is ``torch.multiprocessing.spawn`` on the fork server.
* :func:`run_script` runs a script (a benchmark, say) at one or more ranks as ``python
  script`` or ``torchrun --standalone`` would (each rank gets torchrun's environment), its
  output and exit code as from ``subprocess.run``.
* :func:`run_example` runs ``examples/dlrm/dlrm_main.py`` so. Runs that need torchrun
  itself (its restarts) go through torchrun (``launcher="torchrun"``).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "dlrm" / "dlrm_main.py"
# Imported once by the fork server: the costly part of every process's start.
_PRELOAD = [
    "torch",
    "fbgemm_gpu",
    "torchrec",
    "torchrec.distributed",
    "torchrec.distributed.planner",
    "torch.distributed.checkpoint",
    "torchmetrics",
    "torchrec_lookahead",
    "torchrec_lookahead._compat",
    "torchrec_lookahead.pipeline",
    "tests.distributed_cases",
    "tests.hot_cases",
]
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(_PRELOAD)


def free_port() -> int:
    """A TCP port free on this machine now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn: Callable[..., None], args: tuple = (), nprocs: int = 1) -> None:
    """``fn(i, *args)`` in ``nprocs`` processes forked from the warm server; raises as
    ``torch.multiprocessing.spawn`` does when one of them fails."""
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def run_example(
    *argv: str, ranks: int = 1, restarts: int = 0, launcher: str = "forkserver", timeout: int = 600
) -> subprocess.CompletedProcess:
    """The example with ``argv`` at ``ranks`` ranks: its stdout, stderr and exit code (the
    first rank's that failed, else 0). ``launcher="torchrun"`` (needed for ``restarts``)
    runs it under ``python -m torch.distributed.run --standalone`` instead."""
    if launcher == "torchrun" or restarts:
        cmd = [sys.executable, str(EXAMPLE), *argv]
        if ranks > 1 or restarts:
            cmd[1:1] = [
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={ranks}",
                f"--max-restarts={restarts}",
            ]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return run_script(EXAMPLE, *argv, ranks=ranks, timeout=timeout)


def run_script(
    script: Path, *argv: str, ranks: int = 1, timeout: int = 600
) -> subprocess.CompletedProcess:
    """``script`` with ``argv`` at ``ranks`` ranks, each rank a process forked from the warm
    server and run as ``__main__`` with the script's folder first on its path: its stdout,
    stderr and exit code (the first rank's that failed, else 0; 124 past ``timeout``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        port = free_port()
        processes = [
            _CONTEXT.Process(
                target=_script_rank,
                args=(str(script), list(argv), _env(ranks, r, port), os.getcwd(), out, err),
            )
            for r in range(ranks)
        ]
        for process in processes:
            process.start()
        code = _wait(processes, timeout)
        return subprocess.CompletedProcess([str(script), *argv], code, _read(out), _read(err))


def _env(ranks: int, rank: int, port: int) -> dict[str, str]:
    """This process's environment, and at several ranks what ``torchrun --standalone
    --nproc_per_node=ranks`` adds for rank ``rank`` (one rank runs as a plain script)."""
    if ranks == 1:
        return dict(os.environ)
    return {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks),
        "GROUP_RANK": "0",
        "ROLE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


def _script_rank(
    script: str, argv: list[str], env: dict[str, str], cwd: str, out: Path, err: Path
) -> None:
    """One rank, in the forked process: the parent's environment and working directory,
    output appended to the shared files (ranks interleave, as under torchrun)."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).parent))
    runpy.run_path(script, run_name="__main__")


def _wait(processes: Sequence[Any], timeout: int) -> int:
    """Wait for every rank, ``timeout`` seconds in all; the first that fails ends the
    others, as torchrun's agent does. Returns the failed rank's exit code (1 for a
    signal, 124 for the timeout), else 0."""
    sentinels = {p.sentinel: p for p in processes}
    failed = 0
    deadline = time.monotonic() + timeout
    while sentinels:
        left = deadline - time.monotonic()
        ready = multiprocessing.connection.wait(list(sentinels), left) if left > 0 else []
        if not ready:
            failed = failed or 124
            break
        for sentinel in ready:
            process = sentinels.pop(sentinel)
            process.join()
            if process.exitcode and not failed:
                failed = process.exitcode if process.exitcode > 0 else 1
        if failed:
            break
    for process in sentinels.values():
        process.kill()
        process.join()
    return failed


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
