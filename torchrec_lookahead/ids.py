"""Checking a batch's ids against the tables its features look up, in one pass."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["check_feature_ids"]


def check_feature_ids(
    values: np.ndarray,
    lengths_per_key: Sequence[int],
    keys: Sequence[str],
    rows_per_key: Sequence[int],
    where: str,
) -> None:
    """Raise ``ValueError`` naming ``where``, the feature and the id if any id of
    a feature is negative or not below its table's row count.

    ``values`` holds the features' ids one feature after another (a
    ``KeyedJaggedTensor``'s values), ``lengths_per_key`` how many each has.
    """
    limits = np.repeat(np.asarray(rows_per_key, dtype=np.int64), lengths_per_key)
    bad = (values < 0) | (values >= limits)
    if not bad.any():
        return
    position = int(np.argmax(bad))
    key = int(np.searchsorted(np.cumsum(lengths_per_key), position, side="right"))
    value = int(values[position])
    if value < 0:
        raise ValueError(f"{where}: feature {keys[key]!r}: negative id {value}")
    raise ValueError(
        f"{where}: feature {keys[key]!r}: id {value} is out of range for a table of "
        f"{rows_per_key[key]} rows"
    )
