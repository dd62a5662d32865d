"""Argument checks for the whole package: a count (an int, never a bool) within a range, a
positive number, a real number within a range. They sit below every other module, so any
layer may use them.

Each raises ValueError (or the `error` class given) with a message that names the argument,
what it may be and the value it got: "k must be an integer >= 0, got -1".
"""

from __future__ import annotations

import numbers
import operator


def is_int(value) -> bool:
    """An int that is not a bool (Python counts True and False as ints; as a count they are a mistake)."""
    return isinstance(value, int) and not isinstance(value, bool)


def as_integer(value) -> int | None:
    """value as a Python int if it is an integer of any kind (an int, a NumPy integer, a 0-d integer
    tensor: whatever operator.index takes) but not a bool; else None (a float is never one, 2.0 neither)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def check_int(
    name: str,
    value,
    minimum: int = 0,
    maximum: int | None = None,
    *,
    allowed: str | None = None,
    error: type[Exception] = ValueError,
) -> int:
    """Return value if it is an integer (not a bool) in minimum..maximum (no upper bound when
    maximum is None); else raise error(f"{name} must be {allowed}, got {value!r}"). allowed
    defaults to "an integer >= minimum" or "an integer in minimum..maximum"."""
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        if allowed is None:
            allowed = f"an integer >= {minimum}" if maximum is None else f"an integer in {minimum}..{maximum}"
        raise error(f"{name} must be {allowed}, got {value!r}")
    return value


def check_positive(name: str, value, *, allow_zero: bool = False, error: type[Exception] = ValueError):
    """Return value if it is a number > 0 (>= 0 with allow_zero) and not a bool; else raise
    error(f"{name} must be > 0, got {value!r}") (">= 0" with allow_zero)."""
    if isinstance(value, bool) or not (value >= 0 if allow_zero else value > 0):
        raise error(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return value


def is_real(value) -> bool:
    """A real number (an int, a float, a NumPy float) that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_real(
    name: str, value, minimum: float, maximum: float, *, allowed: str | None = None, error: type[Exception] = ValueError
):
    """Return value if it is a real number (not a bool) with minimum <= value <= maximum; else raise
    error(f"{name} must be {allowed}, got {value!r}"). NaN is never in range; an infinite bound lets
    infinity in. allowed defaults to "a number in [minimum, maximum]"."""
    if not is_real(value) or not minimum <= value <= maximum:
        raise error(f"{name} must be {allowed or f'a number in [{minimum:g}, {maximum:g}]'}, got {value!r}")
    return value
