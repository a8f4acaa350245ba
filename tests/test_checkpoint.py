"""The example's checkpoints when a write fails part way (a full disk, a file size limit):
a clear error naming the folder, and the last complete checkpoint still published and
loadable; and what a rename publishes is on disk before it."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from checkpoint import Checkpointer, CheckpointError, latest


@contextlib.contextmanager
def _file_size_limit(nbytes: int):
    """Writes past ``nbytes`` fail (EFBIG, as ENOSPC on a full disk does)."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)


@pytest.fixture
def one_rank(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_failed_write_leaves_the_last_checkpoint_published(tmp_path: Path, one_rank) -> None:
    root = tmp_path / "ckpt"
    saver = Checkpointer(str(root))
    # Before any checkpoint: the error says none stands, and names the first rank's cause.
    with pytest.raises(CheckpointError, match=r"no checkpoint was published before it\. Cause"):
        with _file_size_limit(1 << 16):
            saver.save(1, lambda: {"w": torch.ones(1 << 18), "step": 1})
    saver.save(1, lambda: {"w": torch.ones(1 << 18), "step": 1})
    # The kernel refuses writes past 64 KiB (EFBIG, as ENOSPC on a full disk) mid-save.
    with pytest.raises(CheckpointError, match=r"writing checkpoint step 2 into .*step_00000002"):
        with _file_size_limit(1 << 16):
            saver.save(2, lambda: {"w": torch.full((1 << 18,), 2.0), "step": 2})
    assert latest(str(root)) == str(root / "step_00000001")
    state = {"w": torch.zeros(1 << 18), "step": 0}
    assert Checkpointer(str(root)).load(state) == str(root / "step_00000001")
    assert state["step"] == 1 and bool((state["w"] == 1).all())
    saver.save(2, lambda: {"w": torch.full((1 << 18,), 2.0), "step": 2})  # space again: it saves
    assert latest(str(root)) == str(root / "step_00000002")


def test_a_checkpoint_is_on_disk_before_a_rename_publishes_it(
    tmp_path: Path, one_rank, monkeypatch
) -> None:
    """A power cut after a rename must not leave ``latest`` naming files the page cache
    held: every file and folder entry a rename publishes is synced before it, and the
    renames themselves after."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("sync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src: str, dst: str) -> None:
        events.append(("rename", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    root = tmp_path / "ckpt"
    Checkpointer(str(root), files={"model.json": "{}"}).save(3, lambda: {"w": torch.ones(4)})
    renames = [i for i, event in enumerate(events) if event[0] == "rename"]
    assert [events[i][1] for i in renames] == ["step_00000003", "latest"]
    synced_before = {name for kind, name in events[: renames[0]] if kind == "sync"}
    assert {"model.json", ".step_00000003.partial"} <= synced_before
    assert ("sync", ".latest.partial") in events[renames[0] : renames[1]]
    assert events[-1] == ("sync", "ckpt")  # the renames' own entries
    assert latest(str(root)) == str(root / "step_00000003")


class _Interrupting:
    """A state entry whose pickling meets a Ctrl-C, as a SIGINT mid-save does."""

    def __reduce__(self):
        raise KeyboardInterrupt


def test_ctrl_c_mid_save_is_an_interrupt_not_a_failed_write(tmp_path: Path, one_rank) -> None:
    """DCP wraps a rank's KeyboardInterrupt into its CheckpointException; the example then
    reported a Ctrl-C during a save as a failed write (status 1, not 130)."""
    root = tmp_path / "ckpt"
    saver = Checkpointer(str(root))
    saver.save(1, lambda: {"w": torch.ones(4), "step": 1})
    with pytest.raises(KeyboardInterrupt):
        saver.save(2, lambda: {"w": torch.ones(4), "step": 2, "extra": _Interrupting()})
    assert latest(str(root)) == str(root / "step_00000001")


class _SignalledMidSave:
    """A state entry whose pickling sends this process a SIGINT, as a Ctrl-C mid-save."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGINT)
        return (int, (0,))


def test_ctrl_c_during_a_save_lets_it_publish_then_interrupts(tmp_path: Path, one_rank) -> None:
    """A Ctrl-C inside DCP's writers could surface as any error (a C++ writer's
    ``RuntimeError``: the example reported a failed write, status 1). The save in flight
    now ends, published, and the interrupt follows."""
    root = tmp_path / "ckpt"
    saver = Checkpointer(str(root))
    saver.save(1, lambda: {"w": torch.ones(4), "step": 1})
    with pytest.raises(KeyboardInterrupt):
        saver.save(2, lambda: {"w": torch.ones(4), "step": 2, "extra": _SignalledMidSave()})
    assert latest(str(root)) == str(root / "step_00000002")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back
