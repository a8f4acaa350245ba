"""What is wrong with a folder flag, found before anything runs (shared with BERT4Rec's)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["folder_problem"]


def folder_problem(path: str | None, must_exist: bool, written: bool = True) -> str | None:
    """What is wrong with ``path`` as a folder to read (``must_exist``) or to write into,
    if anything: a file where a folder is expected, here or above, a folder to read that
    cannot be listed and read, or one to write that cannot be written or made (found now,
    by making and removing a folder in it or in its nearest existing parent, not when the
    run writes its outputs at the end). A folder only read (``written=False``: data, often
    on a read-only mount) is not probed: nothing is written into it."""
    if path is None:
        return None
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        return "is a file, not a folder"
    if must_exist and not folder.exists():
        return "no such folder"
    if not written:
        return None if os.access(folder, os.R_OK | os.X_OK) else "cannot be read"
    above = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    if not above.is_dir():
        return f"cannot be created: {above} is a file"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=above))
    except OSError as error:
        doing = "written" if above == folder else f"created in {above}"
        return f"cannot be {doing}: {error.strerror or error}"
    return None
