"""Strict JSON for everything the library writes: no ``NaN`` or ``Infinity``, which strict parsers reject.

A float that is not finite (an undefined ratio, say a max/avg over nothing) is written as ``null``.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(value: Any) -> Any:
    """``value`` with every non-finite float (also inside dicts, lists, tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """:func:`json.dumps` of :func:`finite` ``value``, refusing any non-finite float that is left (``allow_nan``
    False); other keyword arguments as :func:`json.dumps` takes them (``default=str`` is applied first)."""
    default = kwargs.pop("default", None)
    if default is not None:  # objects json cannot write become what ``default`` makes of them, then are checked
        value = json.loads(json.dumps(value, default=default, allow_nan=True))
    return json.dumps(finite(value), allow_nan=False, **kwargs)
