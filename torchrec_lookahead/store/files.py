"""Store files: tables and optimizer state in files under one directory, mapped into memory.

Each tensor of a disk store is one file of rows, preallocated with
``posix_fallocate`` (so a full disk fails at creation, naming the file, and
never later as a SIGBUS on a page written through the mapping) and mapped
``MAP_SHARED`` with ``torch.from_file``. Pages of a shared file mapping are
page cache, not the process's private (anonymous) memory: the kernel reads
them in on demand, writes dirty ones back behind the process, and drops clean
ones under memory pressure, so a table larger than RAM costs no RAM of its
own. A write through the mapping is seen by every later read at once (one
page cache), and reaches the file even if the process dies.

``layout.json`` records each file's shape. Opening a directory checks every
file it records (a file of another size is a damaged store: refused, naming
it), and a tensor asked for under a recorded name with another shape is
refused too, so a store is never silently reused for another model.
A lock file keeps a second process out of the directory.

Reads ahead: :meth:`StoreFiles.read_ahead` hands rows to a reader thread,
which asks the kernel to start reading their pages (``POSIX_FADV_WILLNEED``,
one call per run of pages, in a compiled loop). The call returns once the
reads are queued, so one thread keeps the disk's queue deep; the rows' later
gather then finds them in the page cache.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import queue
import re
import threading
import weakref
from pathlib import Path

import numpy as np
import torch
from numba import njit, types

__all__ = ["StoreFiles", "anonymous_rss_bytes", "will_need"]

PAGE = os.sysconf("SC_PAGE_SIZE")
_LAYOUT = "layout.json"
_libc = ctypes.CDLL(None, use_errno=True)
_MADV_RANDOM, _MADV_WILLNEED, _MADV_DONTNEED = 1, 3, 4  # <sys/mman.h>
_WILLNEED_STEP = 2 << 20
_SUFFIX = {torch.float32: "f32", torch.int64: "i64"}  # file name suffix of each dtype
_WILLNEED = os.POSIX_FADV_WILLNEED
_posix_fadvise = types.ExternalFunction(
    "posix_fadvise", types.int32(types.int32, types.int64, types.int64, types.int32)
)


@njit(nogil=True, cache=True)
def advise_rows(
    fd: int, base: int, rows: np.ndarray, row_bytes: int, page: int, advice: int
) -> int:
    """``posix_fadvise`` the pages of ``rows`` (sorted) of a table at byte ``base`` of a file,
    one call per run of adjacent pages; returns the number of calls."""
    calls = 0
    run_start = -1
    run_end = -2  # last page of the current run
    for row in rows:
        first = (base + row * row_bytes) // page
        last = (base + row * row_bytes + row_bytes - 1) // page
        if first <= run_end + 1:
            run_end = max(run_end, last)
            continue
        if run_start >= 0:
            _posix_fadvise(fd, run_start * page, (run_end - run_start + 1) * page, advice)
            calls += 1
        run_start, run_end = first, last
    if run_start >= 0:
        _posix_fadvise(fd, run_start * page, (run_end - run_start + 1) * page, advice)
        calls += 1
    return calls


def anonymous_rss_bytes() -> int:
    """This process's private resident memory (``RssAnon``), or -1 where not on Linux."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


class StoreFiles:
    """The files of one disk store: tensors (float32 rows, int64 oracle tables) mapped
    from files in ``directory``.

    Args:
        directory: an existing, writable directory (``create_subdir`` makes
            one below it, e.g. a rank's own).
        read_ahead_jobs: read-ahead requests (one per batch entering the
            window) that may wait for the reader thread; more are dropped
            (reading ahead is advice, never needed for correctness).
    """

    def __init__(self, directory: str | os.PathLike, read_ahead_jobs: int = 256) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise ValueError(f"store_dir {str(self.directory)!r} is not an existing directory")
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise ValueError(f"store_dir {str(self.directory)!r} is not writable")
        try:
            self._lock = open(self.directory / ".lock", "w")  # noqa: SIM115 (held while open)
        except OSError as error:
            raise ValueError(
                f"store lock {str(self.directory / '.lock')!r} cannot be opened: {error.strerror}"
            ) from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise ValueError(
                f"store_dir {str(self.directory)!r} is in use by another store (a module "
                "of this or another process); give each module a directory of its own"
            ) from None
        try:
            self._layout: dict[str, dict] = self._read_layout()  # name -> {"shape", "dtype"}
        except ValueError:
            self._lock.close()
            raise
        self._tensors: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (tensor, fd)
        self._jobs: queue.Queue = queue.Queue(read_ahead_jobs)
        self.read_ahead_dropped = 0
        self._reader: threading.Thread | None = None

    @staticmethod
    def create_subdir(directory: str | os.PathLike, name: str) -> StoreFiles:
        """The store in ``directory/name`` (``name`` may have several levels), made if
        missing (``directory`` must exist)."""
        parent = Path(directory)
        if not parent.is_dir():
            raise ValueError(f"store_dir {str(parent)!r} is not an existing directory")
        (parent / name).mkdir(parents=True, exist_ok=True)
        return StoreFiles(parent / name)

    # ------------------------------------------------------------ files

    def check_space(self, nbytes: int, what: str) -> None:
        """Raise ``ValueError`` unless ``nbytes`` more fit on the store's disk (for files
        to be made later, checked before the first of them is written)."""
        free = _free_bytes(self.directory)
        if nbytes > free:
            raise ValueError(
                f"no space in store_dir {str(self.directory)!r} for {what}: "
                f"{_size(nbytes)} needed, {_size(free)} free"
            )

    def tensor(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The zero-filled tensor ``name`` of ``shape``, in a new file. An old file of
        that name is replaced (a store holds training state, not a checkpoint); a
        mapping of it made earlier keeps the old contents."""
        path = self.directory / f"{name}.{_SUFFIX[dtype]}"
        recorded = self._layout.get(name)
        wanted = {"shape": list(shape), "dtype": _SUFFIX[dtype]}
        if recorded is not None and recorded != wanted:
            raise ValueError(
                f"store file {str(path)!r} holds a tensor of {recorded}, not {wanted}: "
                "the directory belongs to another model; use an empty directory"
            )
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        old = path.stat().st_size if path.exists() else 0
        if nbytes > _free_bytes(self.directory) + old:
            raise _no_space(path, nbytes)
        self._remove(name, path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError as error:
            os.close(fd)
            path.unlink(missing_ok=True)
            if error.errno == errno.ENOSPC:
                raise _no_space(path, nbytes) from error
            raise
        self._layout[name] = wanted
        self._write_layout()
        mapped = torch.from_file(str(path), shared=True, size=nbytes // dtype.itemsize, dtype=dtype)
        if nbytes:  # no read-around on faults: read_ahead asks for exactly the pages needed
            _madvise(mapped, _MADV_RANDOM)
        mapped = mapped.view(shape)
        self._tensors[name] = (mapped, fd)
        return mapped

    def remove_series(self, name: str) -> None:
        """Removes the tensors ``name.0``, ``name.1``, ...: scratch made in a series
        (an oracle's row tables, one per partition), which a later series may make in
        other shapes and numbers. Mappings made earlier keep their contents."""
        series = re.compile(re.escape(name) + r"\.\d+")
        for recorded, fields in list(self._layout.items()):
            if series.fullmatch(recorded):
                self._remove(recorded, self.directory / f"{recorded}.{fields['dtype']}")

    def _remove(self, name: str, path: Path) -> None:
        if self._layout.pop(name, None) is not None:
            self._write_layout()  # a crash while the file is removed leaves no stale record
        path.unlink(missing_ok=True)  # a new file gets a new inode: mappings keep theirs
        if name in self._tensors:
            os.close(self._tensors.pop(name)[1])

    def region(self, view: torch.Tensor) -> tuple[int, int]:
        """``(fd, byte offset)`` of the first element of ``view``, a view of a store tensor."""
        address = view.data_ptr()
        for tensor, fd in self._tensors.values():
            start = tensor.data_ptr()
            if start <= address < start + tensor.nbytes:
                return fd, address - start
        raise ValueError("the tensor is not a view of this store's files")

    def drop_page_cache(self) -> None:
        """Write the files out and drop their pages from the page cache (a cold start)."""
        for tensor, fd in self._tensors.values():
            # Unmap the pages from this process first (their dirty bits go to the page
            # cache): the kernel keeps pages that are mapped.
            _madvise(tensor, _MADV_DONTNEED)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, tensor.nbytes, os.POSIX_FADV_DONTNEED)

    # ------------------------------------------------------------ reading ahead

    def read_ahead(self, regions: list[tuple[int, int, np.ndarray, int]]) -> None:
        """Ask for rows to be read in soon, on the reader thread; returns at once.

        ``regions``: ``(fd, base, rows, row_bytes)`` for each table tensor, its
        rows (sorted) of ``row_bytes`` each starting at byte ``base`` of file ``fd``.
        """
        if not regions:
            return
        if self._reader is None:
            self._reader = threading.Thread(
                target=_read, args=(self._jobs,), name="store-reader", daemon=True
            )
            self._reader.start()
            weakref.finalize(self, self._jobs.put, None)  # the thread ends with the store
        try:
            self._jobs.put_nowait(regions)
        except queue.Full:
            self.read_ahead_dropped += 1

    def close(self) -> None:
        """Stop the reader and release the directory (mapped tensors stay valid)."""
        if self._reader is not None:
            self._jobs.put(None)
            self._reader.join()
            self._reader = None
        for _, fd in self._tensors.values():
            os.close(fd)
        self._tensors.clear()
        self._lock.close()

    # ------------------------------------------------------------ layout

    def _read_layout(self) -> dict[str, dict]:
        path = self.directory / _LAYOUT
        if not path.exists():
            return {}
        try:
            layout = json.loads(path.read_text())
            if not all(
                set(e) == {"shape", "dtype"}
                and e["dtype"] in _SUFFIX.values()
                and isinstance(e["shape"], list)
                and all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in e["shape"]
                )
                for e in layout.values()
            ):
                raise ValueError("entries must be {'shape': [rows, ...], 'dtype': 'f32' or 'i64'}")
        except (OSError, ValueError, TypeError, AttributeError) as error:
            reason = error.strerror if isinstance(error, OSError) else error
            raise ValueError(f"store layout {str(path)!r} is not a store's: {reason}") from None
        dtypes = {suffix: dtype for dtype, suffix in _SUFFIX.items()}
        for name, entry in layout.items():
            file = self.directory / f"{name}.{entry['dtype']}"
            want = int(np.prod(entry["shape"], dtype=np.int64)) * dtypes[entry["dtype"]].itemsize
            have = file.stat().st_size if file.exists() else None
            if have != want:
                raise ValueError(
                    f"store file {str(file)!r} is {'missing' if have is None else f'{have} bytes'}"
                    f", its layout says {want} bytes: the store is damaged; use an empty directory"
                )
        return layout

    def _write_layout(self) -> None:
        path = self.directory / _LAYOUT
        partial = path.with_suffix(".json.tmp")
        try:
            partial.write_text(json.dumps(self._layout, indent=1))
            os.replace(partial, path)
        except OSError as error:
            partial.unlink(missing_ok=True)
            raise ValueError(
                f"store layout {str(path)!r} cannot be written: {error.strerror}"
            ) from None


def will_need(tensor: torch.Tensor) -> None:
    """Start reading the pages under ``tensor`` now, in large requests. Store mappings are
    ``MADV_RANDOM`` (the window reads rows ahead), so a sequential pass over one (a
    checkpoint) would otherwise read one page per fault, many times slower (see
    ``docs/guides/disk-store.md``). Advice only: on memory that is no file's it
    does nothing."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return
    span = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) + 1
    first = tensor.data_ptr() // PAGE * PAGE
    end = tensor.data_ptr() + span * tensor.element_size()
    # The kernel reads at most its read-ahead window (8 MiB here) per call.
    for start in range(first, end, _WILLNEED_STEP):
        length = ctypes.c_size_t(min(_WILLNEED_STEP, end - start))
        _libc.madvise(ctypes.c_void_p(start), length, _MADV_WILLNEED)


def _madvise(mapped: torch.Tensor, advice: int) -> None:
    """``madvise`` the whole mapping behind ``mapped`` (a store tensor, page-aligned)."""
    start, length = ctypes.c_void_p(mapped.data_ptr()), ctypes.c_size_t(mapped.nbytes)
    if _libc.madvise(start, length, advice) != 0:
        raise OSError(ctypes.get_errno(), f"madvise({advice}) failed on a store mapping")


def _read(jobs: queue.Queue) -> None:
    """The reader thread: queue the reads of each job's pages, until ``None``."""
    while (regions := jobs.get()) is not None:
        for fd, base, rows, row_bytes in regions:
            advise_rows(fd, base, rows, row_bytes, PAGE, _WILLNEED)


def _no_space(path: Path, nbytes: int) -> ValueError:
    free = _free_bytes(path.parent)
    return ValueError(
        f"no space for store file {str(path)!r}: it needs {_size(nbytes)}, {_size(free)} are free"
    )


def _size(nbytes: int) -> str:
    """``nbytes`` for a person: in the largest unit that keeps a figure before the point."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} bytes"


def _free_bytes(directory: Path) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize
