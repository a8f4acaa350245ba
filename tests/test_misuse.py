"""What a user who forgets a step gets: one clear error, and a clean exit.

Each case runs tests/misuse.py in fresh interpreters (an exit code and what happens at
interpreter shutdown are only seen from outside the process).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import free_port

SCRIPT = Path(__file__).with_name("misuse.py")


def run(*argv: str, ranks: int = 1) -> subprocess.CompletedProcess:
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    env = {**__import__("os").environ, "MASTER_PORT": str(free_port())}
    return subprocess.run(
        [*launcher, str(SCRIPT), *argv], capture_output=True, text=True, timeout=600, env=env
    )


def test_a_forgotten_sharder_is_refused_naming_the_sharders() -> None:
    """Before: the meta case said only "must be sharded", the in-backward case failed in
    DDP's hook ("Cannot access accelerator device"), and fused_params trained silently,
    every rank its own copy of every table."""
    done = run("sharder")
    assert done.returncode == 0, done.stderr[-3000:]
    said = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    for way in ("meta", "in-backward", "fused_params"):
        assert said[way].startswith(
            "ValueError: module 'model.sparse_arch.embedding_bag_collection'"
        )
        assert "sharders=[LookaheadEmbeddingBagCollectionSharder()]" in said[way]
        assert "lookahead_sharders()" in said[way]
    # DMP itself looks the module's sharder up, before any code of this project runs.
    assert said["plan"].startswith("KeyError: <class 'torchrec_lookahead.embedding.collection")


@pytest.mark.parametrize("block", [False, True], ids=["uncaught", "with-block"])
def test_an_uncaught_refusal_exits_with_code_1_not_an_abort(block: bool) -> None:
    """Before: without ``with pipeline:`` both ranks ended in SIGABRT ("terminate called
    without an active exception"), 3 runs of 3 on the 2-core machine: the stage and
    executor threads were still running at interpreter shutdown."""
    done = run("refusal", *(["with"] if block else []), ranks=2)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "id 1000000000 is out of range" in done.stderr
    assert "terminate called" not in done.stderr
    assert "SIGABRT" not in done.stderr and "exitcode  : -6" not in done.stderr
