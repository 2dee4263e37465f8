"""Sample inputs of every stateless ``ascend_dualpath`` op, edge shapes included (zero tokens, -1 expert ids,
one row, non-contiguous caches). Shared by the opcheck tests, the bit-exact tests and tools/gpu_check_ops.py."""

from __future__ import annotations

import struct

import torch

# Sources of the hccl_stage samples stay alive for the whole process: the op takes their address.
_KEEP: list[torch.Tensor] = []


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def topk_samples(device: str) -> list[tuple]:
    """``(topk_idx, num_experts, num_ranks, ranks_per_node)``: random with -1 slots, zero tokens, all -1, one row,
    one node and several nodes."""
    g = _gen(0)
    random = torch.randint(-1, 16, (33, 4), generator=g)
    return [
        (random.to(device), 16, 8, 2),
        (random.to(device), 16, 4, 8),
        (torch.empty(0, 4, dtype=torch.int64, device=device), 16, 8, 4),
        (torch.full((5, 2), -1, dtype=torch.int64, device=device), 8, 4, 2),
        (torch.tensor([[3, 3, -1, 0]], device=device), 8, 2, 1),
    ]


def float_samples(device: str) -> list[torch.Tensor]:
    """x [T, H] to quantise: bf16 with a zero row, fp16, fp32, zero tokens, one row (H multiples of 512)."""
    g = _gen(1)
    bf16 = torch.randn(7, 512, generator=g).to(torch.bfloat16)
    bf16[2] = 0
    return [
        t.to(device)
        for t in (
            bf16,
            (torch.randn(3, 1024, generator=g) * 1e3).to(torch.float16),
            torch.randn(4, 512, generator=g) * 1e-6,
            torch.empty(0, 512),
            torch.randn(1, 512, generator=g).to(torch.bfloat16),
        )
    ]


def fp8_quantize_samples(device: str) -> list[tuple]:
    return [
        (x, round_scale, use_ue8m0)
        for x in float_samples(device)
        for round_scale, use_ue8m0 in ((False, False), (True, False), (True, True))
    ]


def fp8_dequantize_samples(device: str) -> list[tuple]:
    from ascend_dualpath.ops import cpu

    return [cpu.fp8_quantize(*args) for args in fp8_quantize_samples(device)]


def int8_dequantize_samples(device: str) -> list[tuple]:
    from ascend_dualpath.ops import cpu

    return [cpu.int8_quantize(x) for x in float_samples(device)]


def ue8m0_pack_samples(device: str) -> list[tuple]:
    g = _gen(2)
    exponents = torch.randint(100, 140, (5, 8), generator=g, dtype=torch.int32)
    scales = (exponents << 23).view(torch.float32)
    return [(scales.to(device),), (scales[:1].to(device),), (scales[:0].to(device),), (scales[:, :4].to(device),)]


def ue8m0_unpack_samples(device: str) -> list[tuple]:
    from ascend_dualpath.ops import cpu

    return [(cpu.ue8m0_pack(s[0].cpu()).to(device),) for s in ue8m0_pack_samples("cpu")]


def kv_field_samples(device: str) -> list[tuple]:
    """``(fields, field_ndims)``: GQA bf16, MLA FP8 (e4m3 + float32 scales + bf16 rope), two leading dims, zero
    tokens, one row."""
    g = _gen(3)
    gqa = torch.randn(9, 2, 2, 8, generator=g).to(torch.bfloat16)
    nope = torch.randn(4, 512, generator=g).to(torch.float8_e4m3fn)
    scale = torch.rand(4, 4, generator=g)
    rope = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    return [
        ([gqa.to(device)], [3]),
        ([nope.to(device), scale.to(device), rope.to(device)], [1, 1, 1]),
        ([gqa.view(3, 3, 2, 2, 8).to(device)], [3]),
        ([gqa[:0].to(device)], [3]),
        ([t[:1].to(device) for t in (nope, scale, rope)], [1, 1, 1]),
    ]


def kv_decode_samples(device: str) -> list[tuple]:
    from ascend_dualpath.ops import cpu

    gqa, fp8, two_lead, empty, one = (cpu.kv_encode_rows(*s) for s in kv_field_samples(device))
    return [
        (gqa, 0, torch.bfloat16, [2, 2, 8]),
        (fp8, 512, torch.float32, [4]),
        (fp8, 528, torch.bfloat16, [64]),
        (two_lead, 32, torch.bfloat16, [16]),
        (empty, 0, torch.bfloat16, [2, 2, 8]),
        (one, 0, torch.float8_e4m3fn, [512]),
    ]


def paged_caches(device: str) -> list[torch.Tensor]:
    """``[num_blocks, block_size, *row]`` caches: contiguous GQA bf16, a FLASH_ATTN-style transposed view, MLA."""
    g = _gen(4)
    return [
        torch.randn(6, 4, 2, 8, generator=g).to(torch.bfloat16).to(device),
        torch.randn(6, 2, 4, 16, generator=g).to(device).transpose(1, 2),  # [B, N, H, 2D] view of [B, H, N, 2D]
        torch.randn(6, 8, 72, generator=g).to(torch.float16).to(device),
    ]


def _slots(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (torch.tensor([3, 3, 0, 5], device=device), torch.tensor([0, 1, 3, 2], device=device)),
        (torch.tensor([2], device=device), torch.tensor([1], device=device)),
        (torch.empty(0, dtype=torch.int64, device=device), torch.empty(0, dtype=torch.int64, device=device)),
    ]


def kv_gather_samples(device: str) -> list[tuple]:
    return [(cache, blocks, offsets) for cache in paged_caches(device) for blocks, offsets in _slots(device)]


def kv_scatter_samples(device: str) -> list[tuple]:
    g = _gen(5)
    out = []
    for cache, blocks, offsets in kv_gather_samples(device):
        rows = torch.randn(blocks.shape[0], *cache.shape[2:], generator=g).to(cache.dtype).to(device)
        out.append((cache, blocks, offsets, rows))
    return out


def stage_tiling(total_bytes: int, chunk_bytes: int = 32, buffer_num: int = 2) -> torch.Tensor:
    """``StageTiling`` (op_kernels/include/adp/transfer_kernels.h) as uint8 [16]."""
    return torch.frombuffer(bytearray(struct.pack("<QII", total_bytes, chunk_bytes, buffer_num)), dtype=torch.uint8)


def hccl_stage_samples(device: str) -> list[tuple]:
    """Host memory only (the CPU kernel): a partial copy, a whole window, zero bytes."""
    source = torch.arange(256, dtype=torch.int32).view(torch.uint8)
    _KEEP.append(source)
    return [
        (source.data_ptr(), torch.zeros(512, dtype=torch.uint8), stage_tiling(100), 4),
        (source.data_ptr() + 8, torch.zeros(128, dtype=torch.uint8), stage_tiling(128), 1),
        (source.data_ptr(), torch.zeros(16, dtype=torch.uint8), stage_tiling(0), 2),
    ]


def samples(device: str) -> dict[str, list[tuple]]:
    """Per stateless op name, its sample argument tuples on ``device``."""
    floats = [(x,) for x in float_samples(device)]
    table = {
        "dispatch_layout": topk_samples(device),
        "fp8_quantize": fp8_quantize_samples(device),
        "fp8_dequantize": fp8_dequantize_samples(device),
        "int8_quantize": floats,
        "int8_dequantize": int8_dequantize_samples(device),
        "ue8m0_pack": ue8m0_pack_samples(device),
        "ue8m0_unpack": ue8m0_unpack_samples(device),
        "kv_encode_rows": kv_field_samples(device),
        "kv_decode_field": kv_decode_samples(device),
        "kv_gather_tokens": kv_gather_samples(device),
        "kv_scatter_tokens": kv_scatter_samples(device),
    }
    if device == "cpu":
        table["hccl_stage"] = hccl_stage_samples(device)
    return table


def has_float8(args) -> bool:
    """Whether any tensor argument is float8 (torch's schema check cannot compare those: no float8 allclose)."""
    flat = [a for arg in args for a in (arg if isinstance(arg, list) else [arg])]
    return any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in flat)
