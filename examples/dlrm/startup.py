"""A Ctrl-C while an example starts ends it with one line, not an import's traceback.

Importing torch and TorchRec takes seconds; Python's own Ctrl-C there printed the
traceback of whatever module was being imported (one per rank under torchrun).
Imported first by an example's script (``dlrm_main.py``, and ``bert4rec_main.py``
through its ``shared``), this module makes a Ctrl-C until :func:`started` exit at once,
with one line and the shell's status for SIGINT; nothing has been trained or written
then. Only where the process runs one of those scripts: a program that imports their
modules (the tests) keeps its own Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from types import FrameType

__all__ = ["INTERRUPTED", "started"]

INTERRUPTED = 130  # what a shell reports for a process ended by SIGINT
_EXAMPLES = Path(__file__).resolve().parents[1]
_SCRIPTS = {_EXAMPLES / "dlrm" / "dlrm_main.py", _EXAMPLES / "bert4rec" / "bert4rec_main.py"}


def started() -> None:
    """The imports are done: Ctrl-C is Python's again (``KeyboardInterrupt``), which the
    script turns into its own line (what was saved)."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _interrupted_while_starting(signum: int, frame: FrameType | None) -> None:
    """Once: a start that fails before ``started`` leaves Python's Ctrl-C behind. Written
    with ``os.write``: a ``print`` could land inside another write to stderr and fail."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("RANK", "0") == "0":  # one line for the job, not one per rank
        os.write(2, b"interrupted while starting (nothing trained or written)\n")
    raise SystemExit(INTERRUPTED)


def _runs_an_example() -> bool:
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    return script is not None and Path(script).resolve() in _SCRIPTS


if _runs_an_example() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_while_starting)
