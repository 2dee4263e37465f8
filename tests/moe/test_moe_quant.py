"""FP8 (per-128 e4m3, round_scale, UE8M0) and INT8 per-token quantisation against float64 bounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dualpath.errors import AlignmentError, ConfigError
from ascend_dualpath.moe import quant

# e4m3 keeps 3 mantissa bits: rounding error <= 2^-4 relative to the value, plus the block's subnormal step.
FP8_REL_ERROR = 2**-4
INT8_ABS_ERROR_IN_SCALES = 0.5
# float32 rounding of x / scale and of q * scale: one float32 ulp (2^-24 relative) each.
FLOAT32_ROUNDINGS = 2 * 2**-24


def _rows(seed: int, tokens: int, blocks: int, spread: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, blocks * 128, generator=g, dtype=torch.float64) * spread).float()


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    tokens=st.integers(0, 6),
    blocks=st.integers(1, 8),
    spread=st.sampled_from([1e-3, 1.0, 300.0]),
    round_scale=st.booleans(),
)
def test_fp8_round_trip_within_e4m3_precision(seed, tokens, blocks, spread, round_scale):
    x = _rows(seed, tokens, blocks, spread)
    q, scales = quant.per_token_cast_to_fp8(x, round_scale=round_scale)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (tokens, blocks)
    back = quant.per_token_cast_back(q, scales).double()
    step = scales.double().repeat_interleave(128, dim=1) * 2**-9  # smallest e4m3 subnormal, scaled
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
    bound = INT8_ABS_ERROR_IN_SCALES * scales.double().unsqueeze(1) + FLOAT32_ROUNDINGS * x.double().abs()
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


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    tokens=st.integers(1, 5),
    blocks=st.integers(1, 4),
    spread=st.sampled_from([1e-3, 1.0, 300.0]),
)
def test_scales_follow_the_documented_rounding_rule(seed, tokens, blocks, spread):
    """Scales equal the float64 quotient rounded once to float32 (exact for one division), and round_scale
    equals the float64 power of two at or above it: the rule a GPU kernel reproduces bit for bit."""
    x = _rows(seed, tokens, blocks, spread)
    amax = x.double().view(tokens, blocks, 128).abs().amax(dim=2).clamp(min=quant.AMAX_FLOOR)
    _, scales = quant.per_token_cast_to_fp8(x)
    assert torch.equal(scales, (amax / quant.FP8_E4M3_MAX).float())
    _, rounded = quant.per_token_cast_to_fp8(x, round_scale=True)
    exact = (amax / quant.FP8_E4M3_MAX).float().double()
    assert torch.equal(rounded.double(), torch.exp2(torch.ceil(torch.log2(exact))))
    _, int8_scales = quant.per_token_cast_to_int8(x)
    assert torch.equal(int8_scales, (x.double().abs().amax(dim=1).clamp(min=quant.AMAX_FLOOR) / quant.INT8_MAX).float())


def test_power_of_two_rounding_at_the_boundaries():
    exact = torch.tensor([1.0, 2.0**-20, 3.0, 2.0**10 * (1 + 2**-23), 0.75], dtype=torch.float32)
    want = torch.tensor([1.0, 2.0**-20, 4.0, 2.0**11, 1.0], dtype=torch.float32)
    assert torch.equal(quant.round_up_to_power_of_two(exact), want)
