"""What this example shares with the DLRM example (``examples/dlrm``).

Its quiet Ctrl-C while it starts (``started``: see ``startup.py``) and its notices
filter (the library notices it hides, installed first: some come while TorchRec is
imported), the comparison of two runs (``weights_gap``,
``weights_digest``, ``mean_over_ranks``), the verdicts on the final weights
(``agreement``) and on a diverged loss (``diverged``), the training plot
(``plot``) and progress bar's figures (``progress_postfix``), the writing of both
outputs (``write_outputs``) and the check of an output folder
(``folder_problem``), so both examples compare and draw their runs alike. They
are loaded from that folder by path, under names of their own (``dlrm_notices``,
...), so this folder's modules keep their plain names (``data``, ``model``,
``report``) as the DLRM example's keep theirs.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = [
    "INTERRUPTED",
    "agreement",
    "diverged",
    "folder_problem",
    "mean_over_ranks",
    "plot",
    "progress_postfix",
    "started",
    "weights_digest",
    "weights_gap",
    "write_outputs",
]

DLRM = Path(__file__).resolve().parents[1] / "dlrm"


def _load(name: str) -> ModuleType:
    """``examples/dlrm/<name>.py`` as the module ``dlrm_<name>`` (once per process)."""
    known = sys.modules.get(f"dlrm_{name}")
    if known is not None:
        return known
    spec = importlib.util.spec_from_file_location(f"dlrm_{name}", DLRM / f"{name}.py")
    assert spec is not None and spec.loader is not None, DLRM / f"{name}.py"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_startup = _load("startup")  # first: a Ctrl-C while TorchRec is imported, one line
started, INTERRUPTED = _startup.started, _startup.INTERRUPTED
_load("notices")  # before TorchRec is imported
_compare, _report = _load("compare"), _load("report")
folder_problem = _load("folders").folder_problem
weights_gap = _compare.weights_gap
weights_digest = _compare.weights_digest
mean_over_ranks = _compare.mean_over_ranks
agreement = _report.agreement
diverged = _report.diverged
plot = _report.plot
progress_postfix = _report.progress_postfix
write_outputs = _report.write_outputs
