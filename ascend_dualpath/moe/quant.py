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

from ascend_dualpath import ops
from ascend_dualpath.errors import AlignmentError, ConfigError
from ascend_dualpath.ops.cpu import (  # noqa: F401  (re-exported: the format's constants and exact rounding)
    AMAX_FLOOR,
    FP8_BLOCK,
    FP8_E4M3_MAX,
    INT8_MAX,
    UE8M0_BIAS,
    round_up_to_power_of_two,
)


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
    return ops.fp8_quantize(x, round_scale, use_ue8m0)


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Pack power-of-two float32 scales ``[..., B]`` (``B % 4 == 0``) into int32 ``[..., B/4]`` UE8M0 words."""
    if scales.dtype != torch.float32 or scales.shape[-1] % 4:
        raise ConfigError(
            f"UE8M0 packing needs float32 scales with a last dim divisible by 4, got "
            f"{scales.dtype} {tuple(scales.shape)}"
        )
    return ops.ue8m0_pack(scales)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_ue8m0`: int32 ``[..., B/4]`` → float32 ``[..., B]`` powers of two."""
    if packed.dtype != torch.int32:
        raise ConfigError(f"UE8M0 scales must be int32, got {packed.dtype}")
    return ops.ue8m0_unpack(packed)


def per_token_cast_back(x_e4m3: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantise FP8: ``[T, H]`` e4m3 and float32 ``[T, H/128]`` (or UE8M0 int32 ``[T, H/512]``) → float32
    ``[T, H]``."""
    return ops.fp8_dequantize(x_e4m3, scales)


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
    return ops.int8_quantize(x)


def per_token_cast_back_int8(x_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantise INT8: ``[T, H]`` int8 and float32 ``[T]`` → float32 ``[T, H]``."""
    return ops.int8_dequantize(x_int8, scales)
