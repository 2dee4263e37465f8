"""FP8 (per-128 e4m3, round_scale, UE8M0) and INT8 per-token quantisation against float64 bounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dualpath.errors import AlignmentError, ConfigError
from ascend_dualpath.moe import quant

# e4m3 keeps 3 mantissa bits: rounding error <= 2^-4 relative to the value, plus the block's subnormal step.
FP8_REL_ERROR = 2 ** -4
INT8_ABS_ERROR_IN_SCALES = 0.5


def _rows(seed: int, tokens: int, blocks: int, spread: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, blocks * 128, generator=g, dtype=torch.float64) * spread).float()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), tokens=st.integers(0, 6), blocks=st.integers(1, 8),
       spread=st.sampled_from([1e-3, 1.0, 300.0]), round_scale=st.booleans())
def test_fp8_round_trip_within_e4m3_precision(seed, tokens, blocks, spread, round_scale):
    x = _rows(seed, tokens, blocks, spread)
    q, scales = quant.per_token_cast_to_fp8(x, round_scale=round_scale)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (tokens, blocks)
    back = quant.per_token_cast_back(q, scales).double()
    step = scales.double().repeat_interleave(128, dim=1) * 2 ** -9  # smallest e4m3 subnormal, scaled
    assert bool(((back - x.double()).abs() <= FP8_REL_ERROR * x.double().abs() + step).all())
    if round_scale:
        assert bool((torch.log2(scales) == torch.log2(scales).round()).all())


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31), tokens=st.integers(1, 5), words=st.integers(1, 3))
def test_ue8m0_packs_the_power_of_two_scales(seed, tokens, words):
    x = _rows(seed, tokens, 4 * words, 10.0)
    q, packed = quant.per_token_cast_to_fp8(x, round_scale=True, use_ue8m0=True)
    q_ref, scales = quant.per_token_cast_to_fp8(x, round_scale=True)
    assert packed.dtype == torch.int32 and packed.shape == (tokens, words)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(quant.unpack_ue8m0(packed), scales)
    exponents = (scales.view(torch.int32) >> 23) & 0xFF
    assert int(packed[0, 0]) & 0xFF == int(exponents[0, 0])  # byte 0 holds block 0


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), tokens=st.integers(0, 6), hidden=st.sampled_from([16, 128, 7168 // 4]))
def test_int8_per_token_round_trip(seed, tokens, hidden):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g) * 5
    q, scales = quant.per_token_cast_to_int8(x)
    assert q.dtype == torch.int8 and scales.shape == (tokens,)
    assert bool((q.abs() <= 127).all())
    back = quant.per_token_cast_back_int8(q, scales).double()
    # half a quantisation step, plus float32 rounding of x / scale and of q * scale (relative 2^-23 each)
    float32_slack = 2.0**-22 * x.double().abs()
    bound = INT8_ABS_ERROR_IN_SCALES * scales.double().unsqueeze(1) + float32_slack
    assert bool(((back - x.double()).abs() <= bound).all())


def test_bad_quantisation_input_names_the_value():
    with pytest.raises(AlignmentError, match="hidden=200"):
        quant.per_token_cast_to_fp8(torch.ones(2, 200))
    with pytest.raises(ConfigError, match="round_scale"):
        quant.per_token_cast_to_fp8(torch.ones(2, 512), use_ue8m0=True)
    with pytest.raises(AlignmentError, match="hidden=384"):
        quant.per_token_cast_to_fp8(torch.ones(2, 384), round_scale=True, use_ue8m0=True)
    with pytest.raises(ConfigError, match="power-of-two"):
        quant.pack_ue8m0(torch.full((1, 4), 3.0))
    with pytest.raises(ConfigError, match="int64"):
        quant.per_token_cast_to_int8(torch.ones(2, 4, dtype=torch.int64))
