"""Pure-torch kernels of the stateless ``ascend_dualpath`` ops: the CPU implementation, and the fallback of the
other dispatch keys where no device kernel exists.

Every function here computes on its inputs' device, takes already-validated arguments (the typed wrappers in
:mod:`ascend_dualpath.ops` and the library functions that call them validate) and returns fresh tensors, never a
view of an input (an op's outputs may not alias its inputs). The quantisation rounding rule is the one stated in
:mod:`ascend_dualpath.moe.quant`, which re-exports the constants below.
"""

from __future__ import annotations

import math

import torch

from ascend_dualpath.errors import ConfigError

FP8_BLOCK = 128
FP8_E4M3_MAX = 448.0
INT8_MAX = 127.0
# Smallest amax used when computing a scale, so an all-zero block gets a finite, non-zero scale.
AMAX_FLOOR = 1e-4
UE8M0_BIAS = 127


# ---------------------------------------------------------------------------------------------- MoE layout
def num_nodes_of(num_ranks: int, ranks_per_node: int) -> int:
    """Nodes of ``num_ranks`` ranks, ``ranks_per_node`` to a node (1 when they fit in one)."""
    return num_ranks // ranks_per_node if num_ranks > ranks_per_node else 1


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int):
    """Tokens per rank, node and expert of ``topk_idx`` int64 [T, K] (ids in ``[-1, E)``).

    Returns ``(num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank int32 [R / ranks_per_node] (``[0]`` on
    one node), num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R])``. A token counts once per rank and
    once per node, however many of its experts live there.
    """
    tokens = topk_idx.shape[0]
    valid = topk_idx >= 0
    experts = topk_idx.clamp(min=0)
    num_tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64, device=topk_idx.device)
    num_tokens_per_expert.scatter_add_(0, experts.reshape(-1), valid.reshape(-1).to(torch.int64))
    ranks = experts // (num_experts // num_ranks)
    # uint8, not bool: CUDA has no bool scatter_reduce.
    is_token_in_rank = torch.zeros(tokens, num_ranks, dtype=torch.uint8, device=topk_idx.device)
    # "amax" makes the scatter an "or": an invalid slot (clamped to expert 0) scatters False and cannot
    # clear a True set by a valid slot of the same token.
    is_token_in_rank = is_token_in_rank.scatter_reduce_(1, ranks, valid.to(torch.uint8), reduce="amax").bool()
    num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
    num_nodes = num_nodes_of(num_ranks, ranks_per_node)
    num_tokens_per_rdma_rank = torch.zeros(0, dtype=torch.int32, device=topk_idx.device)
    if num_nodes > 1:
        in_node = is_token_in_rank.view(tokens, num_nodes, ranks_per_node).any(dim=2)
        num_tokens_per_rdma_rank = in_node.sum(dim=0, dtype=torch.int32)
    return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert.to(torch.int32), is_token_in_rank


# ---------------------------------------------------------------------------------------------- quantisation
def divide(numerator: torch.Tensor, denominator: float) -> torch.Tensor:
    """``numerator / denominator`` correctly rounded on every device (tensor by tensor: CUDA torch turns a
    division by a Python scalar into a multiplication by its reciprocal, which rounds differently)."""
    return numerator / torch.full((), denominator, dtype=numerator.dtype, device=numerator.device)


def round_up_to_power_of_two(scales: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ``>=`` each positive, normal float32 scale, exactly (from the float32 bits)."""
    bits = scales.contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def fp8_quantize(x: torch.Tensor, round_scale: bool, use_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, H] (H % 128 == 0) → ``(e4m3 [T, H], float32 [T, H/128] or UE8M0 int32 [T, H/512])``."""
    tokens, hidden = x.shape
    blocks = x.float().view(tokens, hidden // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=2).clamp(min=AMAX_FLOOR)
    scales = divide(amax, FP8_E4M3_MAX)
    if round_scale:
        scales = round_up_to_power_of_two(scales)
    x_e4m3 = (blocks / scales.unsqueeze(2)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    x_e4m3 = x_e4m3.view(tokens, hidden)
    if use_ue8m0:
        return x_e4m3, _pack_exponents(scales)
    return x_e4m3, scales


def ue8m0_pack(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 ``[..., B]`` → int32 ``[..., B/4]``, byte ``j`` of word ``i`` = exponent of ``4i+j``.

    The power-of-two check reads the data, so it lives here, in the kernel: callers stay traceable.
    """
    if bool(((scales.contiguous().view(torch.int32) & 0x7FFFFF) != 0).any()):
        raise ConfigError("UE8M0 packing needs power-of-two scales (round_scale=True)")
    return _pack_exponents(scales)


def _pack_exponents(scales: torch.Tensor) -> torch.Tensor:
    exponent = (scales.contiguous().view(torch.int32) >> 23) & 0xFF
    exponent = exponent.view(*scales.shape[:-1], scales.shape[-1] // 4, 4)
    packed = exponent[..., 0] | (exponent[..., 1] << 8) | (exponent[..., 2] << 16) | (exponent[..., 3] << 24)
    return packed.to(torch.int32)


def ue8m0_unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`ue8m0_pack`: int32 ``[..., B/4]`` → float32 ``[..., B]`` powers of two."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    exponent = torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], dim=-1)
    exponent = exponent.reshape(*packed.shape[:-1], packed.shape[-1] * 4).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def fp8_dequantize(x_e4m3: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """e4m3 ``[T, H]`` and float32 ``[T, H/128]`` (or UE8M0 int32 ``[T, H/512]``) → float32 ``[T, H]``."""
    if scales.dtype == torch.int32:
        scales = ue8m0_unpack(scales)
    tokens, hidden = x_e4m3.shape
    blocks = x_e4m3.float().view(tokens, hidden // FP8_BLOCK, FP8_BLOCK)
    return (blocks * scales.unsqueeze(2)).view(tokens, hidden)


def int8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, H] → ``(int8 [T, H], float32 [T])``, one scale ``amax / 127`` per token."""
    values = x.float()
    scales = divide(values.abs().amax(dim=1).clamp(min=AMAX_FLOOR), INT8_MAX)
    quantised = torch.round(values / scales.unsqueeze(1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return quantised, scales


def int8_dequantize(x_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 ``[T, H]`` and float32 ``[T]`` → float32 ``[T, H]``."""
    return x_int8.float() * scales.reshape(-1, 1)


# ---------------------------------------------------------------------------------------------- KV rows
def kv_row_bytes(fields: list[torch.Tensor], field_ndims: list[int]) -> int:
    """C: bytes of one token row made of ``fields``, field ``i`` ending in ``field_ndims[i]`` row dims."""
    return sum(math.prod(f.shape[f.dim() - n :]) * f.element_size() for f, n in zip(fields, field_ndims, strict=True))


def kv_encode_rows(fields: list[torch.Tensor], field_ndims: list[int]) -> torch.Tensor:
    """Typed fields ``[..., *shape_i]`` (one leading shape) → fresh ``uint8 [..., C]`` rows, fields in order."""
    leading = tuple(fields[0].shape[: fields[0].dim() - field_ndims[0]])
    count = math.prod(leading)
    parts = [
        f.contiguous().reshape(count, math.prod(f.shape[f.dim() - n :])).view(torch.uint8)
        for f, n in zip(fields, field_ndims, strict=True)
    ]
    return torch.cat(parts, dim=1).reshape(*leading, kv_row_bytes(fields, field_ndims))


def kv_decode_field(rows: torch.Tensor, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """Field at byte ``offset`` of ``uint8 [..., C]`` rows → a fresh ``dtype [..., *shape]`` tensor."""
    nbytes = math.prod(shape) * dtype.itemsize
    window = rows.narrow(-1, offset, nbytes).clone(memory_format=torch.contiguous_format)
    return window.view(dtype).unflatten(-1, tuple(shape))


def kv_gather_tokens(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``cache [num_blocks, block_size, *row]`` (any strides) → ``[n, *row]`` = ``cache[blocks, offsets]``."""
    return cache[blocks, offsets].contiguous()


def kv_scatter_tokens(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache[blocks[i], offsets[i]] = rows[i]`` in place; no other byte of ``cache`` changes."""
    cache.index_put_((blocks, offsets), rows)
