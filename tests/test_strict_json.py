"""JSON the library writes is strict: no NaN or Infinity, which strict parsers (and JSON itself) reject."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ascend_dualpath import _json

ROOT = Path(__file__).resolve().parents[1]


def _strict(text: str):
    def refuse(constant: str):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("path", sorted((ROOT / "docs" / "figures").glob("*.json")), ids=lambda p: p.name)
def test_every_published_figure_is_strict_json(path):
    _strict(path.read_text())


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)


@given(values)
def test_dumps_writes_non_finite_floats_as_null_and_keeps_the_rest(value):
    parsed = _strict(_json.dumps(value))

    def same(a, b):
        if isinstance(a, float) and not math.isfinite(a):
            return b is None
        if isinstance(a, list | tuple):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        return a == b

    assert same(value, parsed)
