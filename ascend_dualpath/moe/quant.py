"""FP8 (per-128-column e4m3, optional power-of-two / UE8M0 scales) and INT8 (per-token) quantisation.

These are the wire formats of DeepEP's FP8 dispatch and of torch_npu MC2's ``quant_mode=2``:

- FP8: every run of 128 columns of a token shares one float32 scale ``amax / 448`` (448 is the largest
  finite e4m3 value); ``round_scale`` rounds each scale up to a power of two, and UE8M0 packs those
  power-of-two scales as their biased exponent byte, four per int32 (byte ``j`` holds column block ``4i+j``).
- INT8: one float32 scale ``amax / 127`` per token, values rounded to nearest and clamped to ±127.

Rounding rule (identical on every device, so a scale computed on the CPU equals one computed by a GPU kernel
bit for bit): ``scale = amax / 448`` (or ``/ 127``) is an IEEE-754 float32 division rounded to nearest-even; with
``round_scale`` it becomes the smallest power of two ``>= scale``, taken from the float32 bits (exponent + 1
when the mantissa is non-zero), never from ``log2``; values are ``x / scale`` (float32, correctly rounded),
clamped, then rounded to nearest-even into e4m3 / int8. Divisions are tensor by tensor on purpose: CUDA torch
turns division by a Python scalar into multiplication by its reciprocal, which rounds differently.
"""

from __future__ import annotations

import torch

from ascend_dualpath.errors import AlignmentError, ConfigError

FP8_BLOCK = 128
FP8_E4M3_MAX = 448.0
INT8_MAX = 127.0
# Smallest amax used when computing a scale, so an all-zero block gets a finite, non-zero scale.
AMAX_FLOOR = 1e-4
UE8M0_BIAS = 127


def _divide(numerator: torch.Tensor, denominator: float) -> torch.Tensor:
    """``numerator / denominator`` correctly rounded on every device (see the module's rounding rule)."""
    return numerator / torch.full((), denominator, dtype=numerator.dtype, device=numerator.device)


def round_up_to_power_of_two(scales: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ``>=`` each positive, normal float32 scale, exactly (from the float32 bits)."""
    bits = scales.contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def _check_2d_float(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ConfigError(f"{name} must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    if not x.is_floating_point() or x.dtype == torch.float8_e4m3fn:
        raise ConfigError(f"{name} must be a bf16/fp16/fp32 tensor, got {x.dtype}")


def per_token_cast_to_fp8(
    x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` to e4m3 with one scale per token and 128-column block.

    Parameters
    ----------
    x : Tensor [T, H], bf16/fp16/fp32, ``H % 128 == 0``
    round_scale : bool
        Round each scale up to a power of two (the block's amax then maps to at most 448).
    use_ue8m0 : bool
        Return the scales UE8M0-packed as int32 ``[T, H/512]``; needs ``round_scale`` and ``H % 512 == 0``.

    Returns
    -------
    (x_e4m3 [T, H] float8_e4m3fn, scales [T, H/128] float32 or [T, H/512] int32)
    """
    _check_2d_float(x, "x")
    tokens, hidden = x.shape
    if hidden % FP8_BLOCK:
        raise AlignmentError(f"FP8 quantisation needs hidden % {FP8_BLOCK} == 0, got hidden={hidden}")
    if use_ue8m0 and not round_scale:
        raise ConfigError("use_ue8m0=True needs round_scale=True (UE8M0 holds powers of two only)")
    if use_ue8m0 and hidden % (4 * FP8_BLOCK):
        raise AlignmentError(f"UE8M0 packing needs hidden % {4 * FP8_BLOCK} == 0, got hidden={hidden}")
    blocks = x.float().view(tokens, hidden // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=2).clamp(min=AMAX_FLOOR)
    scales = _divide(amax, FP8_E4M3_MAX)
    if round_scale:
        scales = round_up_to_power_of_two(scales)
    x_e4m3 = (blocks / scales.unsqueeze(2)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    x_e4m3 = x_e4m3.view(tokens, hidden)
    if use_ue8m0:
        return x_e4m3, pack_ue8m0(scales)
    return x_e4m3, scales


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Pack power-of-two float32 scales ``[..., B]`` (``B % 4 == 0``) into int32 ``[..., B/4]`` UE8M0 words."""
    if scales.dtype != torch.float32 or scales.shape[-1] % 4:
        raise ConfigError(f"UE8M0 packing needs float32 scales with a last dim divisible by 4, got "
                          f"{scales.dtype} {tuple(scales.shape)}")
    exponent = (scales.contiguous().view(torch.int32) >> 23) & 0xFF
    mantissa = scales.contiguous().view(torch.int32) & 0x7FFFFF
    if bool((mantissa != 0).any()):
        raise ConfigError("UE8M0 packing needs power-of-two scales (round_scale=True)")
    exponent = exponent.view(*scales.shape[:-1], scales.shape[-1] // 4, 4)
    packed = exponent[..., 0] | (exponent[..., 1] << 8) | (exponent[..., 2] << 16) | (exponent[..., 3] << 24)
    return packed.to(torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_ue8m0`: int32 ``[..., B/4]`` → float32 ``[..., B]`` powers of two."""
    if packed.dtype != torch.int32:
        raise ConfigError(f"UE8M0 scales must be int32, got {packed.dtype}")
    words = packed.to(torch.int64) & 0xFFFFFFFF
    exponent = torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], dim=-1)
    exponent = exponent.reshape(*packed.shape[:-1], packed.shape[-1] * 4).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def per_token_cast_back(x_e4m3: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantise FP8: ``[T, H]`` e4m3 and float32 ``[T, H/128]`` (or UE8M0 int32 ``[T, H/512]``) → float32
    ``[T, H]``."""
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales)
    tokens, hidden = x_e4m3.shape
    blocks = x_e4m3.float().view(tokens, hidden // FP8_BLOCK, FP8_BLOCK)
    return (blocks * scales.unsqueeze(2)).view(tokens, hidden)


def per_token_cast_to_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token INT8 quantisation (MC2 ``quant_mode=2``).

    Parameters
    ----------
    x : Tensor [T, H], bf16/fp16/fp32

    Returns
    -------
    (x_int8 [T, H] int8, scales [T] float32) with ``x ≈ x_int8 * scales[:, None]``
    """
    _check_2d_float(x, "x")
    values = x.float()
    scales = _divide(values.abs().amax(dim=1).clamp(min=AMAX_FLOOR), INT8_MAX)
    quantised = torch.round(values / scales.unsqueeze(1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return quantised, scales


def per_token_cast_back_int8(x_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantise INT8: ``[T, H]`` int8 and float32 ``[T]`` → float32 ``[T, H]``."""
    return x_int8.float() * scales.reshape(-1, 1)
