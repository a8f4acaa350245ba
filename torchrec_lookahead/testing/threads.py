"""Set up every thread started from now on: for test doubles that live in thread-local state.

torch keeps its dispatch modes per thread, and the pipeline runs its stage and
its executor on threads of their own, started when it is built. The doubles of
:mod:`~torchrec_lookahead.testing.fake_cuda` and
:mod:`~torchrec_lookahead.testing.stream_check` enter their modes in those
threads too, through :func:`in_new_threads` (``threading.setprofile``: a hook
that runs in each new thread before its ``run``, and removes itself there).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["in_new_threads"]

_SETUPS: list[Callable[[], None]] = []
_PREVIOUS: list[Any] = [None]  # the profile function threads got before the first setup


def _start(frame: Any, event: str, arg: Any) -> None:
    """The first profile event of a new thread: run the setups, then hand the thread
    the profile function it would have had."""
    sys.setprofile(_PREVIOUS[0])
    for setup in list(_SETUPS):
        setup()


@contextmanager
def in_new_threads(setup: Callable[[], None]) -> Iterator[None]:
    """Call ``setup`` at the start of every thread started inside this block (in the order
    the blocks were entered)."""
    if not _SETUPS:
        _PREVIOUS[0] = threading.getprofile()
        threading.setprofile(_start)
    _SETUPS.append(setup)
    try:
        yield
    finally:
        _SETUPS.remove(setup)
        if not _SETUPS:
            threading.setprofile(_PREVIOUS[0])
