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

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NoReturn

import numpy as np
from numba import njit
from tqdm import tqdm

from torchrec_lookahead.data.days import (
    CAT_FEATURE_COUNT,
    INT_FEATURE_COUNT,
    DayFiles,
    file_fingerprint,
    find_days,
)
from torchrec_lookahead.data.npy import DataError, MappedRows, RowWriter

__all__ = ["DONE", "convert_tsv_day", "convert_tsv_days"]

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
    """Convert ``tsvs`` (day 0, 1, ...) into ``out``; days already done from the same files
    are kept (a day's marker records its file: ``file_fingerprint``), others converted."""
    out.mkdir(parents=True, exist_ok=True)
    sources = [file_fingerprint(tsv) for tsv in tsvs]
    markers = [out / f"day_{day}.{DONE}" for day in range(len(tsvs))]
    for day, marker in enumerate(markers):  # the earlier code's marker: the day's path
        if marker.exists() and marker.read_text() == f"{tsvs[day]}\n":
            marker.write_text(sources[day])  # taken as done, as that code took it
    todo = [d for d, m in enumerate(markers) if not m.exists() or m.read_text() != sources[d]]
    if todo:
        (out / DONE).unlink(missing_ok=True)  # the folder is not whole until they are
    for day in tqdm(todo, desc="convert TSV days", unit="day", disable=not progress):
        markers[day].unlink(missing_ok=True)
        convert_tsv_day(Path(tsvs[day]), out, day, block_bytes)
        markers[day].write_text(sources[day])
    (out / DONE).write_text("".join(f"{t}\n" for t in tsvs))
    return find_days(out)


def convert_tsv_day(
    tsv: Path,
    out: Path,
    day: int,
    block_bytes: int = 32 * 2**20,
    on_ids: Callable[[np.ndarray], None] | None = None,
) -> None:
    """Convert one TSV day into ``out/day_<day>_{dense,sparse,labels}.npy``, each file
    appearing only complete. ``on_ids`` sees every block of ids ([n, 26] int64) as it
    is written, so a caller can count them without reading the file again."""
    raw_dense = out / f".day_{day}_dense_raw.npy"
    low = _INT32.max
    with (
        RowWriter(out / f"day_{day}_labels.npy", np.int32, 1) as labels,
        RowWriter(out / f"day_{day}_sparse.npy", np.int64, CAT_FEATURE_COUNT) as sparse,
        RowWriter(raw_dense, np.int32, INT_FEATURE_COUNT) as dense,
    ):
        for first_line, text in _text_blocks(tsv, block_bytes):
            label, integers, ids = _parse_text(text, tsv, first_line)
            labels.append(label)
            dense.append(integers)
            sparse.append(ids)
            if on_ids is not None:
                on_ids(ids)
            low = min(low, int(integers.min()))
        if labels.count == 0:
            raise DataError(f"{tsv}: no samples")
    raw = MappedRows(raw_dense)
    try:
        with RowWriter(out / f"day_{day}_dense.npy", np.float32, INT_FEATURE_COUNT) as dense:
            # As TorchRec: x -= min - 2 in int32 (wrapping, as numpy does), then log in float32.
            shift = np.int32((low - 2 + 2**31) % 2**32 - 2**31)
            for start in range(0, raw.shape[0], 2**20):
                block = raw.rows[start : start + 2**20] - shift
                dense.append(np.log(block, dtype=np.float32))
    finally:
        raw.close()
        raw_dense.unlink()


def _text_blocks(path: Path, block_bytes: int) -> Iterator[tuple[int, bytes]]:
    """``(number of the first line, whole lines)`` of ``path`` in blocks of about
    ``block_bytes``; a block's lines are joined by newlines, without the last one's."""
    line = 1
    carry = b""
    with open(path, "rb") as file:
        while block := file.read(block_bytes):
            text = carry + block
            end = text.rfind(b"\n")
            carry = text[end + 1 :]  # the unfinished last line
            if end >= 0:
                yield line, text[:end]
                line += text.count(b"\n", 0, end) + 1
    if carry:
        yield line, carry


def _parse_text(text: bytes, path: Path, first_line: int) -> tuple[np.ndarray, ...]:
    """Labels [n, 1] int32, integers [n, 13] int32 and ids [n, 26] int64 of the lines of
    ``text``. Lines in the canonical form (40 tab-separated fields; decimals an optional
    ``-`` and at most 10 digits, within 32 bits; hex ids at most 16 digits, below 2**63;
    empty fields) are parsed by a compiled pass; a block with any other line goes the
    general way (:func:`_parse`), which parses what it can and names what it cannot, so
    both give the same arrays and the same errors."""
    lines = text.count(b"\n") + 1
    labels = np.empty((lines, 1), np.int32)
    integers = np.empty((lines, INT_FEATURE_COUNT), np.int32)
    ids = np.empty((lines, CAT_FEATURE_COUNT), np.int64)
    if _parse_canonical(np.frombuffer(text, np.uint8), labels, integers, ids) < 0:
        return labels, integers, ids
    return _parse(text.split(b"\n"), path, first_line)


@njit(cache=True, nogil=True)
def _parse_canonical(text, labels, integers, ids):
    """Fill the arrays from ``text``'s lines (:func:`_parse_text`); returns -1, or the
    first line not in the canonical form (the arrays then hold garbage)."""
    size = text.size
    pos = 0
    for row in range(labels.shape[0]):
        for field in range(FIELDS):
            if field <= INT_FEATURE_COUNT:  # the label and the integers: decimal
                negative = pos < size and text[pos] == 45  # "-"
                pos += 1 if negative else 0
                value = 0
                digits = 0
                while pos < size and 48 <= text[pos] <= 57 and digits <= 10:
                    value = value * 10 + (text[pos] - 48)
                    digits += 1
                    pos += 1
                if (negative and digits == 0) or digits > 10:
                    return row
                value = -value if negative else value
                if value < -(2**31) or value >= 2**31:
                    return row
                if field == 0:
                    labels[row, 0] = value
                else:
                    integers[row, field - 1] = value
            else:  # the ids: hexadecimal
                number = np.uint64(0)
                digits = 0
                while pos < size and _HEX[text[pos]] < 16 and digits <= 16:
                    number = number * np.uint64(16) + np.uint64(_HEX[text[pos]])
                    digits += 1
                    pos += 1
                if digits > 16 or number >= np.uint64(2**63):
                    return row
                ids[row, field - 1 - INT_FEATURE_COUNT] = np.int64(number)
            end = 9 if field < FIELDS - 1 else 10  # a tab, or the newline after the last field
            if pos < size:
                if text[pos] != end:
                    return row
                pos += 1
            elif field < FIELDS - 1:
                return row
    return -1 if pos == size else labels.shape[0]


def _parse(lines: list[bytes], path: Path, first_line: int) -> tuple[np.ndarray, ...]:
    """Labels [n, 1] int32, integers [n, 13] int32 and ids [n, 26] int64 of ``lines``."""
    rows = [line.rstrip(b"\r").split(b"\t") for line in lines]
    widths = np.fromiter(map(len, rows), np.int64, len(rows))
    wrong = np.flatnonzero(widths != FIELDS)
    if wrong.size:
        at = int(wrong[0])
        raise DataError(
            f"{path}:{first_line + at}: {widths[at]} tab-separated fields; a Criteo "
            f"line has {FIELDS} (a label, 13 integers, 26 hex ids)"
        )
    for at, row in enumerate(rows):  # numpy's bytes arrays take NUL for their padding
        for field, text in enumerate(row):
            if b"\0" in text:
                kind = "a decimal integer" if field <= INT_FEATURE_COUNT else "a hexadecimal id"
                _bad(path, first_line + at, field, text, f"{kind} (a NUL byte: a damaged file?)")
    table = np.array(rows, dtype=bytes)
    numbers = _decimal(table[:, : 1 + INT_FEATURE_COUNT], path, first_line)
    return (
        numbers[:, :1],
        numbers[:, 1:],
        _hexadecimal(table[:, 1 + INT_FEATURE_COUNT :], path, first_line),
    )


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
        _bad(
            path,
            first_line + row,
            1 + INT_FEATURE_COUNT + column,
            fields[row, column],
            "a hexadecimal id below 2**63",
        )
    return value.astype(np.int64)


def _bad(path: Path, line: int, field: int, text: object, expected: str) -> NoReturn:
    shown = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
    raise DataError(f"{path}:{line}: field {field + 1} is {shown!r}, not {expected}")
