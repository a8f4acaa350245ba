"""Set up every thread started from now on: for test doubles that live in thread-local state.

torch keeps its dispatch modes per thread, and the pipeline runs its stage and
its executor on threads of their own, started when it is built. The doubles of
:mod:`~torchrec_lookahead.testing.fake_cuda`, :mod:`~torchrec_lookahead.testing.host_waits`
and :mod:`~torchrec_lookahead.testing.stream_check` enter their modes in those
threads too, through :func:`in_new_threads`, and leave them as each thread's ``run``
ends: a mode left on a finished thread is released only when the thread itself goes,
and releasing it takes the GIL, which at interpreter exit ends the process with
"terminate called without an active exception".
:func:`on_start` runs a hook in the starting thread instead, as ``start`` is called:
what the new thread may know of its starter (``start`` happens before ``run``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["Teardown", "in_new_threads", "on_start"]

Teardown = Callable[[], None]  # undoes a setup, in the thread that ran it


@contextmanager
def in_new_threads(setup: Callable[[], Teardown]) -> Iterator[None]:
    """Call ``setup`` in every thread started inside this block before its ``run``, and
    the teardown it returns once ``run`` ends (setups in the order the blocks were
    entered, teardowns in reverse)."""

    def wrap(thread: threading.Thread) -> None:
        run = thread.run

        def run_set_up() -> None:
            teardown = setup()
            try:
                run()
            finally:
                teardown()

        thread.run = run_set_up  # type: ignore[method-assign]

    with on_start(wrap):
        yield


@contextmanager
def on_start(hook: Callable[[threading.Thread], None]) -> Iterator[None]:
    """Call ``hook(thread)`` in the starting thread as each ``thread.start()`` inside this
    block is called, before the new thread runs (the latest block's hook first)."""
    start = threading.Thread.start

    def hooked_start(thread: threading.Thread) -> None:
        hook(thread)
        start(thread)

    threading.Thread.start = hooked_start  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        threading.Thread.start = start  # type: ignore[method-assign]
