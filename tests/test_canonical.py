"""The examples the docs show are the files that run: the canonical use (docs/design.md,
examples/canonical.py) and the planner's (its guide and the README, examples/plan_caches.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "canonical.py"


def test_the_design_shows_the_examples_canonical_block_line_for_line() -> None:
    script = SCRIPT.read_text()
    begin, end = "# --- the canonical use, as docs/design.md shows it ---\n", "# --- end of"
    block = script[script.index(begin) + len(begin) : script.index(end)].strip("\n") + "\n"
    design = (ROOT / "docs" / "design.md").read_text()
    section = design[design.index("## The canonical use under") :]
    shown = section[section.index("```python\n") + len("```python\n") : section.index("```\n")]
    assert shown == block  # both formatted by ruff format


@pytest.mark.parametrize("ranks", [1, 2])
def test_the_canonical_use_runs_as_written(ranks: int) -> None:
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    done = subprocess.run([*launcher, str(SCRIPT)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"trained 40 steps on {ranks} rank(s)" in done.stdout
    assert "embedding_bags.t2.weight (101312, 16)" in done.stdout  # the full table, not a cache


PLANNER_SCRIPT = ROOT / "examples" / "plan_caches.py"


def test_the_planner_guide_and_readme_show_the_planner_examples_block() -> None:
    script = PLANNER_SCRIPT.read_text()
    begin = "# --- sizing caches with the planner, as the planner guide shows it ---\n"
    block = script[script.index(begin) + len(begin) : script.index("# --- end of")]
    block = block.strip("\n") + "\n"
    for doc in (ROOT / "docs" / "guides" / "planner.md", ROOT / "README.md"):
        text = doc.read_text()
        start = text.index("```python\nstats = {") + len("```python\n")
        assert text[start : text.index("```\n", start)] == block, doc


def test_the_planner_example_runs_as_written() -> None:
    done = subprocess.run(
        [sys.executable, str(PLANNER_SCRIPT)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cache load miss rate" in done.stdout  # the plan report's header
    assert "trained 20 steps on 1 rank(s) with the planned caches" in done.stdout
