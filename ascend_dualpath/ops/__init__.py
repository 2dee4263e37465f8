"""The library's stateless tensor functions as torch ops, ``torch.ops.ascend_dualpath.<name>``.

Importing this module registers every op (schemas and kernels in :mod:`ascend_dualpath.ops._library`; listed
with their schemas in docs/ops.md) and gives the typed wrappers below. ``import ascend_dualpath`` alone does
not import it: the library functions that call an op (``moe.quant``, ``moe.layout``, ``kv.layout``, the vLLM
layout adapters) import it on first use of their module. The ops trace under ``torch.compile(fullgraph=True)``
and pass ``torch.library.opcheck``; the stateful runtimes (transfer engines, the emulated NIC, the MoE
``Buffer`` itself) stay pybind11 / Python objects, reached from the ``moe_*`` ops by registry id.
"""

from __future__ import annotations

import torch

from ascend_dualpath.ops import _library
from ascend_dualpath.ops._library import NAMESPACE, OPS
from ascend_dualpath.ops.aiv import aiv_post_tiling, aiv_queues, aiv_segments
from ascend_dualpath.ops.moe_buffer import register_buffer, register_handle, release

_library.register()
_ops = getattr(torch.ops, NAMESPACE)

__all__ = [
    "NAMESPACE",
    "OPS",
    "aiv_post_tiling",
    "aiv_post_wqe",
    "aiv_queues",
    "aiv_segments",
    "dispatch_layout",
    "fp8_dequantize",
    "fp8_quantize",
    "hccl_stage",
    "int8_dequantize",
    "int8_quantize",
    "kv_decode_field",
    "kv_encode_rows",
    "kv_gather_tokens",
    "kv_scatter_tokens",
    "moe_cached_dispatch",
    "moe_combine",
    "moe_low_latency_combine",
    "moe_low_latency_dispatch",
    "register_buffer",
    "register_handle",
    "release",
    "ue8m0_pack",
    "ue8m0_unpack",
]

Tensors = tuple[torch.Tensor, ...]


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int) -> Tensors:
    """MoE dispatch layout; see ``torch.ops.ascend_dualpath.dispatch_layout`` (``[0]`` rdma counts on one node)."""
    return _ops.dispatch_layout(topk_idx, num_experts, num_ranks, ranks_per_node)


def fp8_quantize(x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False) -> Tensors:
    """e4m3 values [T, H] and float32 [T, H/128] (or UE8M0 int32 [T, H/512]) scales of x [T, H]."""
    return _ops.fp8_quantize(x, round_scale, use_ue8m0)


def fp8_dequantize(x_e4m3: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [T, H] from e4m3 [T, H] and float32 [T, H/128] or UE8M0 int32 [T, H/512] scales."""
    return _ops.fp8_dequantize(x_e4m3, scales)


def int8_quantize(x: torch.Tensor) -> Tensors:
    """int8 [T, H] values and float32 [T] per-token scales of x [T, H]."""
    return _ops.int8_quantize(x)


def int8_dequantize(x_int8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [T, H] from int8 [T, H] and float32 [T] scales."""
    return _ops.int8_dequantize(x_int8, scales)


def ue8m0_pack(scales: torch.Tensor) -> torch.Tensor:
    """UE8M0 int32 [..., B/4] of power-of-two float32 scales [..., B]."""
    return _ops.ue8m0_pack(scales)


def ue8m0_unpack(packed: torch.Tensor) -> torch.Tensor:
    """float32 [..., B] powers of two of UE8M0 int32 [..., B/4]."""
    return _ops.ue8m0_unpack(packed)


def kv_encode_rows(fields: list[torch.Tensor], field_ndims: list[int]) -> torch.Tensor:
    """uint8 [..., C] token rows of typed fields ``[..., *shape_i]`` (``field_ndims[i] = len(shape_i)``)."""
    return _ops.kv_encode_rows(fields, field_ndims)


def kv_decode_field(rows: torch.Tensor, offset: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A fresh ``dtype [..., *shape]`` copy of the field at byte ``offset`` of uint8 rows [..., C]."""
    return _ops.kv_decode_field(rows, offset, dtype, shape)


def kv_gather_tokens(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``cache[blocks, offsets]``: [n, *row] rows of a paged cache [num_blocks, block_size, *row]."""
    return _ops.kv_gather_tokens(cache, blocks, offsets)


def kv_scatter_tokens(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache[blocks, offsets] = rows`` in place."""
    _ops.kv_scatter_tokens(cache, blocks, offsets, rows)


def hccl_stage(src_addr: int, window: torch.Tensor, tiling: torch.Tensor, block_dim: int) -> None:
    """Launch ``hccl_stage``: ``StageTiling.total_bytes`` from ``src_addr`` into ``window`` (in place)."""
    _ops.hccl_stage(src_addr, window, tiling, block_dim)


def aiv_post_wqe(
    segments: torch.Tensor, queues: torch.Tensor, status: torch.Tensor, tiling: torch.Tensor, block_dim: int
) -> None:
    """Launch ``aiv_post_wqe`` on ``block_dim`` vector cores (NPU, or the emulator's queue pairs on CPU); writes
    ``status`` in place. Build the inputs with ``aiv_segments``, ``aiv_queues`` and ``aiv_post_tiling``."""
    _ops.aiv_post_wqe(segments, queues, status, tiling, block_dim)


def moe_cached_dispatch(x: torch.Tensor | Tensors, buffer_id: int, handle_id: int) -> torch.Tensor | Tensors:
    """Cached ``Buffer.dispatch`` of ``x`` (a tensor or a quantised pair); returns the same form, [N, ...]."""
    parts = _ops.moe_cached_dispatch(list(x) if isinstance(x, tuple) else [x], buffer_id, handle_id)
    return tuple(parts) if isinstance(x, tuple) else parts[0]


def moe_combine(
    x: torch.Tensor,
    buffer_id: int,
    handle_id: int,
    topk_weights: torch.Tensor | None = None,
    bias: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    weighted: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``Buffer.combine``: (combined_x [T, H], combined_topk_weights float32 [T, K] or None)."""
    combined, weights = _ops.moe_combine(x, topk_weights, bias[0], bias[1], buffer_id, handle_id, weighted)
    return combined, (weights if topk_weights is not None else None)


def moe_low_latency_dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    buffer_id: int,
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int,
    use_fp8: bool = True,
    round_scale: bool = False,
    use_ue8m0: bool = False,
) -> Tensors:
    """(recv_x or (e4m3, scales), recv_count, src_info, layout_range) of ``Buffer.low_latency_dispatch``."""
    values, scales, recv_count, src_info, layout_range = _ops.moe_low_latency_dispatch(
        x, topk_idx, buffer_id, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0
    )
    recv_x = (values, scales) if use_fp8 else values
    return recv_x, recv_count, src_info, layout_range


def moe_low_latency_combine(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    src_info: torch.Tensor,
    layout_range: torch.Tensor,
    buffer_id: int,
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int,
) -> torch.Tensor:
    """bf16 [T, H] weighted sum of the expert outputs x [L, R*M, H] (``Buffer.low_latency_combine``)."""
    return _ops.moe_low_latency_combine(
        x, topk_idx, topk_weights, src_info, layout_range, buffer_id, num_max_dispatch_tokens_per_rank, num_experts
    )
