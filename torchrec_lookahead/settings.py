"""Checking settings where they are given: counts are integers, fractions finite and in range.

A setting of the wrong type raises :class:`SettingTypeError`, both a ``TypeError``
(what it is) and a ``ValueError`` (what callers that check settings catch), so one
``except ValueError`` handles every bad setting, as with bad batches."""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["SettingTypeError", "check_count", "check_fraction"]


class SettingTypeError(TypeError, ValueError):
    """A setting of the wrong type (a float or bool for a count, a string for a fraction)."""


def check_count(name: str, value: Any, minimum: int) -> int:
    """``value`` if it is an integer (not a bool) of at least ``minimum``; else
    ``SettingTypeError`` / ``ValueError`` naming the setting."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SettingTypeError(f"{name} must be an integer, got {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def check_fraction(name: str, value: Any) -> float:
    """``value`` if it is a real number in (0, 1]; else ``SettingTypeError`` / ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SettingTypeError(f"{name} must be a number, got {value!r}")
    if not (math.isfinite(value) and 0 < float(value) <= 1):
        raise ValueError(f"{name} must be in (0, 1], got {value}")
    return float(value)
