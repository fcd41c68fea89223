"""The one-line checks of a value, shared by every subpackage (torch-free: reading records, the
command line's help and the layers' argument checks import nothing heavy through it).

Each check returns the value it accepts and raises a one-line ``ValueError`` naming the parameter,
what it expects and what it got. A ``bool`` is never a number here (``True`` is an ``int`` to
Python, but ``workers=True`` is a mistake, not one worker).
"""

from __future__ import annotations

import numbers
from collections.abc import Collection
from typing import Any


class NonFiniteError(ArithmeticError, ValueError):
    """A NaN or ±inf where a finite number is needed: a fit whose arithmetic overflowed on finite
    data, or a value JSON has no number for. The message names where it arose."""


def is_int(value: Any, minimum: int | None = None) -> bool:
    """Whether ``value`` is an integer (``numbers.Integral``: Python and NumPy ints; not a bool),
    at least ``minimum`` when given."""
    return (not isinstance(value, bool) and isinstance(value, numbers.Integral)
            and (minimum is None or value >= minimum))


def check_int(name: str, value: Any, *, minimum: int = 1, maximum: int | None = None, allow_none: bool = False):
    """``value`` as an ``int`` in [``minimum``, ``maximum``] (no upper end when None; None itself
    passes when ``allow_none``); a ValueError naming ``name`` otherwise."""
    if value is None and allow_none:
        return None
    if not is_int(value, minimum) or (maximum is not None and value > maximum):
        expected = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be {'None or ' if allow_none else ''}an integer {expected}, got {value!r}")
    return int(value)


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
