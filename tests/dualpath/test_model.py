from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ascend_dualpath.dualpath import model
from ascend_dualpath.errors import ConfigError


def test_paper_example_is_exact():
    bounds = model.pd_ratio_bounds(8, 1, 500, 50)
    assert bounds.lower == Fraction(1, 7) and isinstance(bounds.lower, Fraction)
    assert bounds.upper == Fraction(7, 2) and isinstance(bounds.upper, Fraction)
    assert bounds.upper_terms == {"de_cnic_read": 6, "de_cnic_write": Fraction(7, 2), "de_dram": Fraction(7, 2)}
    assert bounds.feasible and bounds.contains(Fraction(1, 2)) and not bounds.contains(4)


def test_float_inputs_give_floats():
    bounds = model.pd_ratio_bounds(8, 1.0, 500, 50)
    assert isinstance(bounds.lower, float) and bounds.lower == pytest.approx(1 / 7, rel=1e-15)


def test_dram_can_bind():
    bounds = model.pd_ratio_bounds(8, 1, 200, 50)  # (4 - 3) / 2
    assert bounds.binding == "de_dram" and bounds.upper == Fraction(1, 2)


@given(
    g=st.integers(2, 16), s_num=st.integers(1, 40), s_den=st.integers(1, 8), p=st.integers(1, 64), d=st.integers(1, 64)
)
def test_bounds_are_exactly_where_nic_loads_reach_one(g, s_num, s_den, p, d):
    s = Fraction(s_num, s_den)
    if not 0 < s < g:
        return
    ratio = Fraction(p, d)
    bounds = model.pd_ratio_bounds(g, s, 10**9, 1)  # DRAM never binds here
    nics_ok = (
        model.pe_cnic_write_load(g, s, ratio) <= 1
        and model.de_cnic_read_load(g, s, ratio) <= 1
        and model.de_cnic_write_load(g, s, ratio) <= 1
        and model.pe_cnic_read_load(g, s) <= 1
    )
    assert nics_ok == bounds.contains(ratio)


def test_dram_formula():
    assert model.de_dram_load(50, Fraction(7, 2)) == 500
    assert model.pe_dram_load(50) == 100


@pytest.mark.parametrize(
    "args,match",
    [
        ((8, 0, 500, 50), "s "),
        ((8, 8, 500, 50), "s "),
        ((0, 1, 500, 50), "g "),
        ((8, 1, 500, 0), "Bs"),
        ((8, 1, -1, 50), "M "),
        ((8, "1", 500, 50), "s must"),
    ],
)
def test_bad_inputs_raise(args, match):
    with pytest.raises(ConfigError, match=match):
        model.pd_ratio_bounds(*args)


def test_bad_ratio_raises():
    with pytest.raises(ConfigError, match="P/D"):
        model.de_cnic_read_load(8, 1, 0)
