"""The one-line checks of a setting's value, shared by every stage of the harness (and torch-free,
so that reading records never imports torch)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any


def check_choice(kind: str, value: str, valid: Collection[str]) -> str:
    """Return ``value`` if it is one of ``valid``, else raise a ValueError listing them."""
    if value not in valid:
        raise ValueError(f"unknown {kind} {value!r}; expected one of: {', '.join(valid)}")
    return value


def check_fraction(name: str, value: Any, *, allow_zero: bool) -> float:
    """``value`` as a float in [0, 1) (``allow_zero``) or (0, 1); a ValueError naming it otherwise."""
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if not (number and (0 <= value < 1 if allow_zero else 0 < value < 1)):
        raise ValueError(f"{name} must be a number in {'[0, 1)' if allow_zero else '(0, 1)'}, got {value!r}")
    return float(value)
