"""The Python paths the ops replaced, frozen as they were before the ops existed (``moe/layout.py``,
``moe/quant.py``, ``KVLayout.encode_rows``, the vLLM adapters' index copies), so the bit-exact tests compare each
op with the code it took over rather than with itself."""

from __future__ import annotations

import torch

FP8_BLOCK, FP8_E4M3_MAX, INT8_MAX, AMAX_FLOOR = 128, 448.0, 127.0, 1e-4


def compute_dispatch_layout(topk_idx, num_experts, num_ranks, ranks_per_node):
    tokens = topk_idx.shape[0]
    valid = topk_idx >= 0
    experts = topk_idx.clamp(min=0)
    num_tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64, device=topk_idx.device)
    num_tokens_per_expert.scatter_add_(0, experts.reshape(-1), valid.reshape(-1).to(torch.int64))
    ranks = experts // (num_experts // num_ranks)
    is_token_in_rank = torch.zeros(tokens, num_ranks, dtype=torch.uint8, device=topk_idx.device)
    is_token_in_rank = is_token_in_rank.scatter_reduce_(1, ranks, valid.to(torch.uint8), reduce="amax").bool()
    num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
    num_nodes = num_ranks // ranks_per_node if num_ranks > ranks_per_node else 1
    num_tokens_per_rdma_rank = None
    if num_nodes > 1:
        in_node = is_token_in_rank.view(tokens, num_nodes, ranks_per_node).any(dim=2)
        num_tokens_per_rdma_rank = in_node.sum(dim=0, dtype=torch.int32)
    return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert.to(torch.int32), is_token_in_rank


def _divide(numerator, denominator):
    return numerator / torch.full((), denominator, dtype=numerator.dtype, device=numerator.device)


def round_up_to_power_of_two(scales):
    bits = scales.contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def per_token_cast_to_fp8(x, round_scale=False, use_ue8m0=False):
    tokens, hidden = x.shape
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


def pack_ue8m0(scales):
    exponent = (scales.contiguous().view(torch.int32) >> 23) & 0xFF
    exponent = exponent.view(*scales.shape[:-1], scales.shape[-1] // 4, 4)
    packed = exponent[..., 0] | (exponent[..., 1] << 8) | (exponent[..., 2] << 16) | (exponent[..., 3] << 24)
    return packed.to(torch.int32)


def unpack_ue8m0(packed):
    words = packed.to(torch.int64) & 0xFFFFFFFF
    exponent = torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], dim=-1)
    exponent = exponent.reshape(*packed.shape[:-1], packed.shape[-1] * 4).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def per_token_cast_back(x_e4m3, scales):
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales)
    tokens, hidden = x_e4m3.shape
    blocks = x_e4m3.float().view(tokens, hidden // FP8_BLOCK, FP8_BLOCK)
    return (blocks * scales.unsqueeze(2)).view(tokens, hidden)


def per_token_cast_to_int8(x):
    values = x.float()
    scales = _divide(values.abs().amax(dim=1).clamp(min=AMAX_FLOOR), INT8_MAX)
    quantised = torch.round(values / scales.unsqueeze(1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return quantised, scales


def per_token_cast_back_int8(x_int8, scales):
    return x_int8.float() * scales.reshape(-1, 1)


def encode_rows(layout, **fields):
    """``KVLayout.encode_rows``'s copy loop: fresh CPU rows, each field copied into its typed view."""
    leading = tuple(fields[layout.fields[0].name].shape[: -len(layout.fields[0].shape)])
    rows = torch.empty((*leading, layout.token_bytes), dtype=torch.uint8)
    for field in layout.fields:
        layout.field_view(rows, field.name).copy_(fields[field.name])
    return rows


def flash_attn_gather(cache, blocks, offsets):
    """``FlashAttnAdapter._gather``: cache [B, H, N, 2D] -> [n, 2, H, D]."""
    picked = cache[blocks, :, offsets, :]
    return picked.unflatten(-1, (2, -1)).transpose(1, 2)


def flash_attn_scatter(cache, blocks, offsets, typed):
    cache[blocks, :, offsets, :] = typed.transpose(1, 2).flatten(-2)
