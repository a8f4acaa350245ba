"""2-D ``.npy`` files of any size: mapped for reading with page advice, written as a stream.

:class:`MappedRows` maps a file read-only (its pages are the page cache's, not
the process's private memory) and tells the kernel which row ranges are read
next and which will not be read again. :class:`RowWriter` appends blocks of rows
when the row count is known only at the end, and the file appears under its
name only once complete.
"""

from __future__ import annotations

import io
import mmap
import os
from pathlib import Path
from types import TracebackType

import numpy as np

__all__ = ["MappedRows", "DataError", "RowWriter"]

PAGE = mmap.PAGESIZE
_HEADER_BYTES = 128  # a 2-D header with any row count below 10**50 fits here (numpy pads to 64)


class DataError(ValueError):
    """A data file is not what it must be: missing, truncated, wrongly shaped or typed."""


class MappedRows:
    """The rows of a 2-D ``.npy`` file, mapped read-only.

    Checked when opened: a 2-D, C-ordered array whose file holds exactly the
    bytes its header promises (a truncated copy is refused here, not read as
    shifted samples later).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file = open(self.path, "rb")  # noqa: SIM115 -- held for fadvise, closed in close()
        try:
            shape, dtype, offset = _read_header(self._file, self.path)
            expected = offset + int(np.prod(shape)) * dtype.itemsize
            size = os.fstat(self._file.fileno()).st_size
            if size != expected:
                raise DataError(
                    f"{self.path}: {size:,} bytes, but its header says {shape} {dtype} "
                    f"({expected:,} bytes): {'truncated' if size < expected else 'extra bytes'}"
                )
            self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except BaseException:
            self._file.close()
            raise
        self._offset = offset
        self.row_bytes = shape[1] * dtype.itemsize
        self.rows: np.ndarray = (
            np.frombuffer(self._map, dtype, count=shape[0] * shape[1], offset=offset).reshape(shape)
            if self._map is not None
            else np.empty(shape, dtype)
        )

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.shape[0], self.rows.shape[1]

    def will_need(self, first: int, end: int) -> None:
        """Start reading rows ``[first, end)`` into the page cache now (asynchronously)."""
        start, length = self._byte_range(first, end)
        if length:
            os.posix_fadvise(self._file.fileno(), start, length, os.POSIX_FADV_WILLNEED)

    def done_with(self, first: int, end: int) -> None:
        """Rows ``[first, end)`` will not be read again: drop them from this mapping and
        from the page cache (pages another process still maps stay)."""
        start, length = self._byte_range(first, end)
        if length and self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED, start, length)
            os.posix_fadvise(self._file.fileno(), start, length, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        self.rows = np.empty((0, self.shape[1]), self.rows.dtype)  # no view outlives the map
        if self._map is not None:
            self._map.close()
        self._file.close()

    def _byte_range(self, first: int, end: int) -> tuple[int, int]:
        """The whole pages holding rows ``[first, end)``: (file offset, length)."""
        end = min(end, self.shape[0])
        if end <= first:
            return 0, 0
        start = (self._offset + first * self.row_bytes) // PAGE * PAGE
        return start, self._offset + end * self.row_bytes - start


class RowWriter:
    """Writes a 2-D ``.npy`` file block by block; the row count is known at :meth:`close`.

    The rows go to ``<path>.partial``; ``close`` writes the final header, syncs
    and renames, so ``path`` exists only complete. Used as a context manager, an
    exception removes the partial file instead.
    """

    def __init__(self, path: str | os.PathLike[str], dtype: np.dtype | type, columns: int) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.columns = columns
        self.count = 0
        self._partial = self.path.with_name(self.path.name + ".partial")
        self._file = open(self._partial, "wb")  # noqa: SIM115 -- closed in close()/abort()
        self._file.write(b"\0" * _HEADER_BYTES)

    def append(self, rows: np.ndarray) -> None:
        if rows.ndim != 2 or rows.shape[1] != self.columns:
            raise ValueError(
                f"{self.path}: rows of shape {rows.shape}, expected [*, {self.columns}]"
            )
        self._file.write(np.ascontiguousarray(rows, self.dtype).tobytes())
        self.count += rows.shape[0]

    def close(self) -> Path:
        """Finish the file and publish it under its name."""
        header = _header((self.count, self.columns), self.dtype)
        self._file.seek(0)
        self._file.write(header)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._partial, self.path)
        return self.path

    def abort(self) -> None:
        self._file.close()
        self._partial.unlink(missing_ok=True)

    def __enter__(self) -> RowWriter:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def _header(shape: tuple[int, int], dtype: np.dtype) -> bytes:
    """The version 1.0 header for ``shape`` and ``dtype``, ``_HEADER_BYTES`` long."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer,
        {
            "descr": np.lib.format.dtype_to_descr(dtype),
            "fortran_order": False,
            "shape": shape,
        },
    )
    header = buffer.getvalue()
    assert len(header) == _HEADER_BYTES, f"a .npy header of {len(header)} bytes for {shape}"
    return header


def _read_header(file: io.BufferedReader, path: Path) -> tuple[tuple[int, int], np.dtype, int]:
    """Shape, dtype and data offset of an open ``.npy`` file, checked to be 2-D and C-ordered."""
    try:
        version = np.lib.format.read_magic(file)
        read = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0
        )
        shape, fortran_order, dtype = read(file)
    except ValueError as error:
        raise DataError(f"{path}: not a .npy file ({error})") from None
    if len(shape) != 2 or fortran_order or dtype.hasobject:
        raise DataError(
            f"{path}: a {len(shape)}-D{' Fortran-ordered' if fortran_order else ''} {dtype} "
            "array; expected 2-D rows in C order"
        )
    return shape, dtype, file.tell()
