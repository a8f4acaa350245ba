"""Atomic checkpoints with ``torch.distributed.checkpoint``, written in the foreground or behind
training; a checkpoint is either complete and published or never read. Tables are written
in row chunks (:class:`~torchrec_lookahead.store.checkpoint.StreamingSavePlanner`), so saving and
loading a disk store's tables never needs a whole table in memory."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from iopath.common.file_io import PathManager
from torch.distributed.checkpoint import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

from torchrec_lookahead._compat import Shard, ShardedTensor, sharded_tensor_from_shards
from torchrec_lookahead.store.checkpoint import StreamingLoadPlanner, StreamingSavePlanner

PATHS = PathManager()
_PUBLISHED = re.compile(r"step_([0-9]+)")
_PRUNING = ".pruning."  # a checkpoint being removed: hidden first, then deleted


def latest(root: str) -> str | None:
    """The newest complete checkpoint under ``root``, if any (``ValueError`` if ``latest``
    names a folder that is gone)."""
    pointer = os.path.join(root, "latest")
    if not PATHS.exists(pointer):
        return None
    if not PATHS.isfile(pointer):
        raise ValueError(f"{pointer} is not a file: it should name the latest checkpoint")
    with PATHS.open(pointer) as f:
        path = os.path.join(root, f.read().strip())
    if not PATHS.isdir(path):
        raise ValueError(f"{pointer} names {path}, which is missing (moved or deleted?)")
    return path


def prune(root: str, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` published checkpoints under ``root`` (0: keep
    them all); returns the names removed.

    Never the one ``latest`` names, and never one being written (those are hidden
    ``.step_<n>.partial`` folders until published). Each goes by an atomic rename to a
    hidden name first and is deleted after, so a checkpoint is whole under its name or
    absent, whenever this is stopped; the leftovers of a prune that was stopped are
    deleted by the next.
    """
    if keep < 0:
        raise ValueError(f"keep must be 0 (keep all) or more, got {keep}")
    if not os.path.isdir(root):
        return []
    named = latest(root)
    published = sorted(
        (int(match[1]), name)
        for name in os.listdir(root)
        if (match := _PUBLISHED.fullmatch(name)) and os.path.isdir(os.path.join(root, name))
    )
    old = [name for _, name in published[:-keep]] if keep else []
    removed = [name for name in old if named is None or os.path.join(root, name) != named]
    for name in removed:
        os.replace(os.path.join(root, name), os.path.join(root, f"{_PRUNING}{name}"))
    for name in os.listdir(root):
        if name.startswith(_PRUNING):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return removed


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the one published before it (if any) stands."""


def _first_cause(error: BaseException) -> str:
    """One line for what failed: DCP's ``CheckpointException`` holds every rank's error
    with its traceback; the first rank's error, without it."""
    failures = error.failures if isinstance(error, dcp.CheckpointException) else {}
    if failures:
        rank, (cause, _) = next(iter(sorted(failures.items(), key=lambda item: item[0])))
        error = cause
        where = f"rank {rank}: "
    else:
        where = ""
    text = str(error).strip().splitlines()
    return f"{where}{type(error).__name__}: {text[0] if text else ''}"


def _interrupted(error: BaseException) -> bool:
    """Whether a rank's save ended by Ctrl-C: DCP wraps a rank's ``KeyboardInterrupt`` into
    its ``CheckpointException`` like any other error."""
    failures = error.failures if isinstance(error, dcp.CheckpointException) else {}
    return any(isinstance(cause, KeyboardInterrupt) for cause, _ in failures.values())


@contextlib.contextmanager
def _ctrl_c_after() -> Iterator[None]:
    """A Ctrl-C (SIGINT) on the main thread waits for the block to end, then interrupts; a
    second one interrupts at once. Inside DCP's writers an interrupt can surface as any
    error (a C++ writer's ``RuntimeError``), and a save cut short publishes nothing: the
    save in flight ends first, published or failed. Off the main thread, no signal comes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def defer(signum: int, frame: object) -> None:
        if caught:  # a second Ctrl-C: the user will not wait
            signal.signal(signal.SIGINT, previous)
            raise KeyboardInterrupt
        caught.append(signum)

    previous = signal.signal(signal.SIGINT, defer)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            raise KeyboardInterrupt


def _write_synced(path: str, text: str) -> None:
    """Write ``text`` into the file ``path`` and sync it to disk."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sync_directory(path: str) -> None:
    """Sync the directory ``path``'s entries (files made or renamed in it) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def snapshot(state: Any, into: Any = None) -> Any:
    """A copy of ``state`` that later training cannot change: every tensor (every local
    shard of a ``ShardedTensor``) copied to CPU memory, containers rebuilt.

    ``into``, an earlier snapshot that nothing reads any more, lends its tensors
    where shapes agree: copying into memory already touched costs half as much
    as into fresh pages, and the copy is what stalls training.
    """
    if isinstance(state, ShardedTensor):
        if isinstance(into, ShardedTensor) and into.metadata() == state.metadata():
            for target, shard in zip(into.local_shards(), state.local_shards()):
                target.tensor.copy_(shard.tensor)
            return into
        moved = state.cpu()  # a copy already when the shards live on an accelerator
        if moved is not state:
            return moved
        shards = [Shard(s.tensor.detach().clone(), s.metadata) for s in state.local_shards()]
        return sharded_tensor_from_shards(shards, state)
    if isinstance(state, torch.Tensor):
        same = isinstance(into, torch.Tensor) and into.shape == state.shape
        if same and into.dtype == state.dtype:
            return into.copy_(state)
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        into = into if isinstance(into, dict) else {}
        return {key: snapshot(value, into.get(key)) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        if not isinstance(into, (list, tuple)) or len(into) != len(state):
            into = [None] * len(state)
        return type(state)(snapshot(value, old) for value, old in zip(state, into))
    return state


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer, calling ``written(step)`` once this rank's files are on disk
    (before the coordinator writes the metadata): where a failure test strikes."""

    def __init__(self, path: str, step: int, written: Callable[[int], None]) -> None:
        super().__init__(path)
        self._step, self._written = step, written

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        results = super().write_data(plan, planner)
        results.wait()
        self._written(self._step)
        return results


class Checkpointer:
    """Saves ``root/step_<n>`` checkpoints and finds and loads the newest.

    Every rank writes its part into a hidden ``.step_<n>.partial`` folder; once
    all have finished, rank 0 renames it to ``step_<n>`` and then points
    ``root/latest`` at it (a file replaced atomically). A save killed at any
    point leaves ``latest`` naming the previous complete checkpoint; its
    leftovers are replaced when that step is saved again.

    With ``asynchronous``, ``save`` stalls training only to take the state and
    copy it (:func:`snapshot`, into the previous copy's memory); a background
    thread writes and publishes the copy over its own gloo process group, so
    the trainer's collectives go on beside it. One save at most is in flight:
    the next ``save`` and ``close`` wait for it (``close`` must run before the
    process exits).

    ``files`` (name -> text) are written into every checkpoint folder by rank 0
    before it is published (the DLRM example describes its model there).

    After publishing a checkpoint, rank 0 keeps the newest ``keep`` of them (0: all) and
    removes the others (:func:`prune`: never the one ``latest`` names, never one being
    written, each removed atomically).

    A step is saved once: the state of a step this process already saved or
    loaded is that checkpoint, so saving it again (the end of the data on a
    checkpoint step, a resumed run ending where it resumed) does nothing. A save
    whose write fails (a full disk) raises a ``RuntimeError`` naming its folder;
    ``latest`` still names the last complete checkpoint, and the step can be
    saved again.
    """

    def __init__(
        self,
        root: str,
        asynchronous: bool = False,
        written: Callable[[int], None] | None = None,
        files: dict[str, str] | None = None,
        keep: int = 0,
    ) -> None:
        if keep < 0:
            raise ValueError(f"keep must be 0 (keep all) or more, got {keep}")
        self.root = root
        self.files = dict(files or {})
        self.keep = keep
        self.step: int | None = None  # the newest step saved or loaded here
        self.stall_s: list[float] = []  # per save: how long the trainer was held
        self._written = written
        self._group = dist.new_group(backend="gloo") if asynchronous else None
        self._thread = ThreadPoolExecutor(1, "checkpoint") if asynchronous else None
        self._pending: Future | None = None
        self._copy: dict[str, Any] | None = None  # the last snapshot, lent to the next

    def load(self, state: dict[str, Any]) -> str | None:
        """Fill ``state`` (shaped like the checkpoint, with a ``step``) in place from the
        newest complete checkpoint; returns its path, or None when there is none."""
        path = latest(self.root)
        if path is not None:
            dcp.load(state, checkpoint_id=path, planner=StreamingLoadPlanner())
            self.step = state["step"]
        return path

    def save(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        """Checkpoint ``state()`` as step ``step`` (on every rank, at the same step)."""
        if step == self.step:
            return
        start = time.perf_counter()
        if self._thread is None:
            with _ctrl_c_after():
                self._write(step, state(), dist.group.WORLD)
                self.step = step
        else:
            self.wait()
            self.step = step  # taken back if the write fails (``wait``)
            self._copy = snapshot(state(), self._copy)
            self._pending = self._thread.submit(self._write, step, self._copy, self._group)
        self.stall_s.append(time.perf_counter() - start)

    def wait(self) -> None:
        """Block until the save in flight (if any) is published; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.exception() is not None:
            self.step = None  # not saved: saving that step again must write it
            raise pending.exception()

    def close(self) -> None:
        """Finish the save in flight and stop the background thread."""
        try:
            self.wait()
        finally:
            if self._thread is not None:
                self._thread.shutdown()

    def _write(self, step: int, state: dict[str, Any], group: dist.ProcessGroup) -> None:
        """Write ``state`` into the hidden folder, then publish it (the class docstring)."""
        final = os.path.join(self.root, f"step_{step:08d}")
        partial = os.path.join(self.root, f".step_{step:08d}.partial")
        rank0 = dist.get_rank() == 0
        if rank0:
            shutil.rmtree(partial, ignore_errors=True)  # left by a save that was killed
            PATHS.mkdirs(self.root)
        dist.barrier(group=group)
        writer = _Writer(partial, step, self._written) if self._written else None
        try:
            dcp.save(
                state,
                checkpoint_id=partial,
                storage_writer=writer,
                process_group=group,
                planner=StreamingSavePlanner(),
            )
        except (Exception, dcp.CheckpointException) as error:  # DCP wraps every rank's error
            if _interrupted(error):  # Ctrl-C mid-save is the user's stop, not a failed write
                raise KeyboardInterrupt from error
            free_gb = shutil.disk_usage(self.root).free / 1e9
            published = latest(self.root)
            kept = (
                f"{os.path.join(self.root, 'latest')} still names {published}"
                if published
                else "no checkpoint was published before it"
            )
            raise CheckpointError(
                f"writing checkpoint step {step} into {partial} failed ({free_gb:.1f} GB free "
                f"there); {kept}. Cause: {_first_cause(error)}"
            ) from error
        dist.barrier(group=group)
        if rank0:
            # Each rename publishes only what is on disk: a power cut after it must not
            # leave ``latest`` naming a folder whose files were still in the page cache.
            for name, text in self.files.items():
                _write_synced(os.path.join(partial, name), text)
            _sync_directory(partial)  # DCP syncs its files' data, not their names
            shutil.rmtree(final, ignore_errors=True)  # an unpublished leftover: not latest
            os.replace(partial, final)
            pointer = os.path.join(self.root, ".latest.partial")
            _write_synced(pointer, os.path.basename(final))
            os.replace(pointer, os.path.join(self.root, "latest"))
            _sync_directory(self.root)
            try:
                prune(self.root, self.keep)
            except OSError as error:  # an old checkpoint left behind is no reason to stop
                print(f"warning: pruning old checkpoints in {self.root}: {error}", file=sys.stderr)
        dist.barrier(group=group)
