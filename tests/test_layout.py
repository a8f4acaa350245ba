"""The structure the design states (docs/design.md, "Layers"), checked on the source.

* TorchRec's, FBGEMM's and torch's private names are named in
  ``torchrec_lookahead/_compat/`` only (a package, a module per thing it
  adapts; the rest import its names from the package): elsewhere, an attribute starting
  with one underscore is the project's own (assigned or defined somewhere in
  it), and no private module of theirs is imported.
* Imports point down the layers below, never up or across, and no two
  modules import each other (directly or round a cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "torchrec_lookahead"
SOURCES = [
    p
    for folder in ("torchrec_lookahead", "planners", "examples", "benchmarks", "tests")
    for p in (ROOT / folder).rglob("*.py")
]
PUBLIC_UNDERSCORED = {"_replace", "_asdict", "_fields"}  # namedtuple's public API
THEIRS = ("torch", "torchrec", "fbgemm_gpu")

# Low to high: a module imports only from lower layers or its own package.
LAYERS = [
    {"settings", "metrics", "idle"},
    {"_compat"},
    {"checks", "variable_batch", "streams", "traffic", "tbe", "determinism", "data"},
    {"oracle"},
    {"store", "steps", "votes"},
    {"cache", "pipeline"},
    {"embedding"},
    {"testing"},
]
LAYER = {part: level for level, parts in enumerate(LAYERS) for part in parts}


def parsed() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in SOURCES}


def test_private_names_of_torch_torchrec_and_fbgemm_live_in_the_compat_module() -> None:
    trees = parsed()
    ours = set(PUBLIC_UNDERSCORED)
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                ours.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                ours.add(node.id)
    found = []
    for path, tree in trees.items():
        if path.is_relative_to(PACKAGE / "_compat"):
            continue
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute):
                name = node.attr
                if name.startswith("_") and not name.startswith("__") and name not in ours:
                    found.append(f"{where}: .{name}")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                for module in names:
                    parts = module.split(".")
                    if parts[0] in THEIRS and any(p.startswith("_") for p in parts):
                        found.append(f"{where}: import {module}")
    assert found == [], "private names outside torchrec_lookahead/_compat/:\n" + "\n".join(found)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, tree: ast.Module) -> set[str]:
    """The project modules ``path`` imports (a package's ``__init__`` for a package)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    return {name for name in found if name in modules and name != module_name(path)}


def test_imports_point_down_the_layers_and_never_round_a_cycle() -> None:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        graph[module_name(path)] = imports_of(path, ast.parse(path.read_text()))
    upward = []
    for module, imported in graph.items():
        parts = module.split(".")
        if len(parts) == 1:  # the package's own __init__ re-exports from every layer
            continue
        for other in imported:
            mine, theirs = parts[1], other.split(".")[1] if "." in other else None
            if theirs is None or theirs == mine:
                continue
            assert mine in LAYER and theirs in LAYER, f"{module} or {other} has no layer"
            if LAYER[theirs] >= LAYER[mine]:
                upward.append(f"{module} imports {other}")
    assert upward == [], "imports up or across the layers:\n" + "\n".join(upward)

    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for other in sorted(graph.get(module, ())):
            if state.get(other) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path + [module, other])}")
            if other not in state:
                visit(other, path + [module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_planners_and_examples_sit_on_the_library_and_the_library_on_neither() -> None:
    """The library imports neither ``planners`` nor the example; ``planners`` and the
    example use the library but not its test baselines (``torchrec_lookahead.testing``)."""
    wrong = []
    for path in SOURCES:
        folder = path.relative_to(ROOT).parts[0]
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if folder == "torchrec_lookahead" and top in (
                    "planners",
                    "examples",
                    "tests",
                    "benchmarks",
                ):
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
                if folder in ("planners", "examples") and name.startswith(
                    "torchrec_lookahead.testing"
                ):
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
                if folder == "planners" and top in ("examples", "tests", "benchmarks"):
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert wrong == [], "imports against the layers:\n" + "\n".join(wrong)
