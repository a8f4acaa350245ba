"""Races on one block of device memory: an access of one stream not ordered after another's.

CUDA's sanitizer reports a kernel that reads memory another stream wrote, or
writes memory another stream read or wrote, with no event wait between them.
:class:`TrackedStorage` keeps, for one storage, the last write and the reads
since, of the whole storage and of each row followed on its own, and reports
an access that an earlier one of another stream is not ordered before: the
accessing stream's vector clock (``known``: the step of each stream it has
waited for) must have reached that stream's step of the earlier access.
:class:`~torchrec_lookahead.testing.stream_check.StreamChecker` keeps the
clocks and one of these per storage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Access", "TrackedStorage", "Use"]


@dataclass
class Access:
    """Who touched a block of memory (or one row of it) since it was last written."""

    write: tuple[int, int, str] | None = None  # (stream, seq, operator)
    reads: dict[int, tuple[int, str]] = field(default_factory=dict)  # stream -> (seq, operator)


@dataclass(frozen=True)
class Use:
    """An operator's accesses: ``op``, step ``seq`` of ``stream``, which had then waited for
    step ``known[s]`` of each stream ``s`` (its vector clock)."""

    stream: int
    seq: int
    known: dict[int, int]
    op: str


@dataclass
class TrackedStorage:
    """One storage: its allocation, its accesses (whole and by row) and its users."""

    what: str
    alloc: tuple[int, int, str] | None  # (stream, seq, operator); None: made before
    whole: Access = field(default_factory=Access)
    rows: dict[int, Access] = field(default_factory=dict)
    users: dict[int, tuple[int, str]] = field(default_factory=dict)  # stream -> last use
    recorded: set[int] = field(default_factory=set)  # streams given by record_stream
    # Per stream, its latest step that wrote (read) one of ``rows``: a bound on every row's
    # own, so that an access ordered after it needs no pass over the rows.
    rows_written: dict[int, int] = field(default_factory=dict)
    rows_read: dict[int, int] = field(default_factory=dict)

    def use_whole(self, use: Use, write: bool, names: Sequence[str], found: list[str]) -> None:
        """``use`` reads or writes the whole storage; races go to ``found`` (streams named
        by ``names``)."""
        self._against(self.whole, use, write, names, found, "")
        if self._rows_may_race(use, write):
            for key, access in self.rows.items():
                self._against(access, use, write, names, found, f" (row at {key})", reads=write)
        if write:
            self.whole, self.rows = Access((use.stream, use.seq, use.op)), {}
            self.rows_written, self.rows_read = {}, {}
        else:
            self.whole.reads[use.stream] = (use.seq, use.op)
        self.users[use.stream] = (use.seq, use.op)

    def use_rows(
        self, keys: np.ndarray, use: Use, write: bool, names: Sequence[str], found: list[str]
    ) -> None:
        """``use`` reads or writes the rows starting at ``keys`` (as :meth:`use_whole`)."""
        self._against(self.whole, use, write, names, found, "", reads=write)
        check = self._rows_may_race(use, write)
        for key in np.unique(keys).tolist():
            access = self.rows.get(key)
            if access is None:
                access = self.rows[key] = Access()
            elif check and len(found) < 3:
                self._against(access, use, write, names, found, f" (row at {key})")
            if write:
                access.write, access.reads = (use.stream, use.seq, use.op), {}
            else:
                access.reads[use.stream] = (use.seq, use.op)
        (self.rows_written if write else self.rows_read)[use.stream] = use.seq
        self.users[use.stream] = (use.seq, use.op)

    def _rows_may_race(self, use: Use, write: bool) -> bool:
        """Whether some row's access of another stream may be unordered before ``use``: a
        write not yet waited for, or (for a write) a read. Steps only grow, so the streams'
        latest steps on any row bound each row's; false means no row needs a look."""
        latest = (self.rows_written, self.rows_read) if write else (self.rows_written,)
        known, stream = use.known, use.stream
        return any(
            other != stream and known.get(other, 0) < seq
            for steps in latest
            for other, seq in steps.items()
        )

    def _against(
        self,
        access: Access,
        use: Use,
        write: bool,
        names: Sequence[str],
        found: list[str],
        where: str,
        reads: bool = True,
    ) -> None:
        """Report ``use`` if an earlier access of another stream is not ordered before it
        (writes against everything, reads against writes)."""
        stream, known, op = use.stream, use.known, use.op
        doing = "written" if write else "read"
        last = access.write
        if last is not None and last[0] != stream and known.get(last[0], 0) < last[1]:
            found.append(
                f"{self.what}{where} is {doing} on {names[stream]} by {op}, but it was "
                f"written on {names[last[0]]} by {last[2]} with no event wait between them"
            )
        if write and reads:
            for other, (seq, other_op) in access.reads.items():
                if other != stream and known.get(other, 0) < seq:
                    found.append(
                        f"{self.what}{where} is written on {names[stream]} by {op} "
                        f"while {names[other]} may still read it ({other_op}): no event "
                        "wait between them"
                    )
