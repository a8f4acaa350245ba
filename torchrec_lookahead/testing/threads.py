"""Set up every thread started from now on: for test doubles that live in thread-local state.

torch keeps its dispatch modes per thread, and the pipeline runs its stage and
its executor on threads of their own, started when it is built. The doubles of
:mod:`~torchrec_lookahead.testing.fake_cuda` and
:mod:`~torchrec_lookahead.testing.stream_check` enter their modes in those
threads too, through :func:`in_new_threads` (``threading.setprofile``: a hook
that runs in each new thread before its ``run``, and removes itself there).
:func:`on_start` runs a hook in the starting thread instead, as ``start`` is called:
what the new thread may know of its starter (``start`` happens before ``run``).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["in_new_threads", "on_start"]

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


@contextmanager
def on_start(hook: Callable[[threading.Thread], None]) -> Iterator[None]:
    """Call ``hook(thread)`` in the starting thread as each ``thread.start()`` inside this
    block is called, before the new thread runs."""
    start = threading.Thread.start

    def hooked_start(thread: threading.Thread) -> None:
        hook(thread)
        start(thread)

    threading.Thread.start = hooked_start  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        threading.Thread.start = start  # type: ignore[method-assign]
