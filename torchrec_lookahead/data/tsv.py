"""Raw Criteo TSV days converted to the ``.npy`` day layout as a stream, in bounded memory.

A line is a label, 13 decimal integers and 26 hexadecimal ids, tab-separated;
an empty field is 0. The result equals TorchRec's ``BinaryCriteoUtils.tsv_to_npys``
(which holds a whole day in memory) bit for bit: dense features become
``log(x - min + 2)`` in float32 with the day's minimum, so they take a second
pass over a temporary file of the raw integers.

A day is converted into files that appear under their names only complete
(:class:`~torchrec_lookahead.data.npy.RowWriter`) and marked done after all
three; the folder is marked done after every day. An interrupted conversion
starts again at the first day not marked done. A malformed line stops the
conversion with the file, line and field.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn

import numpy as np
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT
from tqdm import tqdm

from torchrec_lookahead.data.criteo import DayFiles, find_days
from torchrec_lookahead.data.npy import DataError, MappedRows, RowWriter

__all__ = ["DONE", "convert_tsv_days"]

DONE = "done"  # the folder's marker: every day converted
FIELDS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
_HEX = np.full(256, 255, np.uint8)  # byte -> hex digit; 16 marks numpy's NUL padding
_HEX[0] = 16
for _digit, _chars in enumerate(zip("0123456789abcdef", "0123456789ABCDEF")):
    _HEX[[ord(c) for c in _chars]] = _digit
_INT32 = np.iinfo(np.int32)


def convert_tsv_days(
    tsvs: Sequence[Path], out: Path, block_bytes: int = 32 * 2**20, progress: bool = True
) -> list[DayFiles]:
    """Convert ``tsvs`` (day 0, 1, ...) into ``out``; days already done are kept."""
    out.mkdir(parents=True, exist_ok=True)
    for day, tsv in enumerate(
        tqdm(tsvs, desc="convert TSV days", unit="day", disable=not progress)
    ):
        marker = out / f"day_{day}.{DONE}"
        if not marker.exists():
            _convert_day(Path(tsv), out, day, block_bytes)
            marker.write_text(f"{tsv}\n")
    (out / DONE).write_text("".join(f"{t}\n" for t in tsvs))
    return find_days(out)


def _convert_day(tsv: Path, out: Path, day: int, block_bytes: int) -> None:
    raw_dense = out / f".day_{day}_dense_raw.npy"
    low = _INT32.max
    with RowWriter(out / f"day_{day}_labels.npy", np.int32, 1) as labels, \
         RowWriter(out / f"day_{day}_sparse.npy", np.int64, CAT_FEATURE_COUNT) as sparse, \
         RowWriter(raw_dense, np.int32, INT_FEATURE_COUNT) as dense:  # fmt: skip
        for first_line, lines in _line_blocks(tsv, block_bytes):
            label, integers, ids = _parse(lines, tsv, first_line)
            labels.append(label)
            dense.append(integers)
            sparse.append(ids)
            low = min(low, int(integers.min()))
        if labels.count == 0:
            raise DataError(f"{tsv}: no samples")
    raw = MappedRows(raw_dense)
    try:
        with RowWriter(out / f"day_{day}_dense.npy", np.float32, INT_FEATURE_COUNT) as dense:
            shift = np.int32(low - 2)  # as TorchRec: x -= min - 2 in int32, then log in float32
            for start in range(0, raw.shape[0], 2**20):
                block = raw.rows[start : start + 2**20] - shift
                dense.append(np.log(block, dtype=np.float32))
    finally:
        raw.close()
        raw_dense.unlink()


def _line_blocks(path: Path, block_bytes: int) -> Iterator[tuple[int, list[bytes]]]:
    """``(number of the first line, lines)`` of ``path`` in blocks of about ``block_bytes``."""
    line = 1
    carry = b""
    with open(path, "rb") as file:
        while block := file.read(block_bytes):
            lines = (carry + block).split(b"\n")
            carry = lines.pop()  # the unfinished last line
            if lines:
                yield line, lines
                line += len(lines)
    if carry:
        yield line, [carry]


def _parse(lines: list[bytes], path: Path, first_line: int) -> tuple[np.ndarray, ...]:
    """Labels [n, 1] int32, integers [n, 13] int32 and ids [n, 26] int64 of ``lines``."""
    rows = [line.rstrip(b"\r").split(b"\t") for line in lines]
    widths = np.fromiter(map(len, rows), np.int64, len(rows))
    wrong = np.flatnonzero(widths != FIELDS)
    if wrong.size:
        at = int(wrong[0])
        raise DataError(f"{path}:{first_line + at}: {widths[at]} tab-separated fields; a Criteo "
                        f"line has {FIELDS} (a label, 13 integers, 26 hex ids)")  # fmt: skip
    table = np.array(rows, dtype=bytes)
    numbers = _decimal(table[:, : 1 + INT_FEATURE_COUNT], path, first_line)
    return numbers[:, :1], numbers[:, 1:], _hexadecimal(table[:, 1 + INT_FEATURE_COUNT :], path,
                                                        first_line)  # fmt: skip


def _decimal(fields: np.ndarray, path: Path, first_line: int) -> np.ndarray:
    """Decimal fields (empty: 0) as int32."""
    try:
        values = np.where(fields == b"", b"0", fields).astype(np.int64)
    except ValueError:
        for (row, column), text in np.ndenumerate(fields):
            try:
                int(text or b"0")
            except ValueError:
                _bad(path, first_line + row, column, text, "a decimal integer")
        raise
    outside = np.argwhere((values < _INT32.min) | (values > _INT32.max))
    if outside.size:
        row, column = outside[0]
        _bad(path, first_line + row, column, fields[row, column], "an integer of 32 bits")
    return values.astype(np.int32)


def _hexadecimal(fields: np.ndarray, path: Path, first_line: int) -> np.ndarray:
    """Hexadecimal fields (empty: 0) of at most 63 bits as int64."""
    width = fields.dtype.itemsize
    digits = _HEX[np.ascontiguousarray(fields).view(np.uint8).reshape(*fields.shape, width)]
    value = np.zeros(fields.shape, np.uint64)
    for position in range(width):  # NUL padding follows the digits
        digit = digits[..., position]
        value = np.where(digit < 16, value * np.uint64(16) + digit, value)
    bad = (digits == 255).any(axis=-1) | (value >= np.uint64(2**63))
    if width > 16:
        bad |= np.char.str_len(fields) > 16
    bad = np.argwhere(bad)
    if bad.size:
        row, column = bad[0]
        _bad(path, first_line + row, 1 + INT_FEATURE_COUNT + column, fields[row, column],
             "a hexadecimal id below 2**63")  # fmt: skip
    return value.astype(np.int64)


def _bad(path: Path, line: int, field: int, text: object, expected: str) -> NoReturn:
    shown = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
    raise DataError(f"{path}:{line}: field {field + 1} is {shown!r}, not {expected}")
