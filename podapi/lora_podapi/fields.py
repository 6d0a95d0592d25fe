"""Reading a pod's JSON field by field, leniently (pure): a field of the wrong type reads as
absent, so a pod of another version, or vLLM, is read as far as it says what we know."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def version_of(payload: Mapping[str, Any]) -> int:
    """A payload's `api_version`; 1 for one without (the servers before the field)."""
    return count(payload.get("api_version")) or 1


def count(value: Any) -> int | None:
    """A whole number of at least 0, else None (a bool is no number here)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def flag(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def texts(value: Any) -> tuple[str, ...]:
    """The strings of a list (others left out); () for anything but a list."""
    return tuple(v for v in value if isinstance(v, str)) if isinstance(value, list) else ()
