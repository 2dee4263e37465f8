"""Argument checks shared by constructors and public calls: one rule for bounds, one for types.

A bound is a timeout, capacity, bandwidth or depth. NaN compares false with everything, so ``value <= 0`` lets it
through and a NaN deadline never expires; infinity is no bound either. :func:`check_bound` therefore rejects NaN,
infinities, negative values and (unless ``zero_ok``) zero, with :class:`~ascend_dualpath.errors.ConfigError`;
:func:`check_type` raises :class:`~ascend_dualpath.errors.ArgumentTypeError`. Both messages name the argument,
the value (or the type received) and the rule.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from ascend_dualpath.errors import ArgumentTypeError, ConfigError


def _names(expected: type | tuple[type, ...]) -> str:
    types = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join("None" if t is type(None) else t.__name__ for t in types)


def _prefix(where: str) -> str:
    return f"{where}: " if where else ""


def check_type(name: str, value: Any, expected: type | tuple[type, ...], *, where: str = "") -> Any:
    """``value`` when it is an instance of ``expected``; else ArgumentTypeError naming ``name`` and the type got.

    ``bool`` is not accepted where ``int`` is expected (``True`` is no byte count).
    """
    types = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, types) and not (isinstance(value, bool) and bool not in types and int in types):
        return value
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise ArgumentTypeError(f"{_prefix(where)}{name} must be {_names(expected)}, got {type(value).__name__} {shown}")


def check_bound(name: str, value: Any, *, integer: bool = False, zero_ok: bool = False, where: str = "") -> Any:
    """``value`` as an ``int`` (``integer=True``) or a ``float``, if it is finite and > 0 (>= 0 with ``zero_ok``).

    Raises
    ------
    ArgumentTypeError
        ``value`` is not a real number (not an integer, with ``integer=True``), or is a bool.
    ConfigError
        ``value`` is NaN, infinite, negative, or zero without ``zero_ok``.
    """
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        check_type(name, value, int if integer else (int, float), where=where)  # raises, naming the type got
    rule = ">= 0" if zero_ok else "> 0"
    if integer:
        number: int | float = int(value)
    else:
        number = float(value)
        if not math.isfinite(number):
            raise ConfigError(f"{_prefix(where)}{name} must be a finite number {rule}, got {number}")
    if number < 0 or (number == 0 and not zero_ok):
        raise ConfigError(f"{_prefix(where)}{name} must be {rule}, got {value!r}")
    return number
