"""Graph-capturable MoE communication: :class:`~ascend_dualpath.moe.Buffer`'s cached dispatch/combine and the
low-latency pair as ops.

A ``Buffer`` and a dispatch handle are stateful Python objects, so the ops take them by an integer id from this
module's registries (:func:`register_buffer`, :func:`register_handle`), the way vLLM hands DeepEP buffers to
its compiled MoE layers through a module-level manager. An id is a constant of the traced graph, so a fake
kernel looks its object up and gives exact output shapes: the handle's received-token count for the cached pair,
DeepEP's worst-case ``[L, R·M, H]`` for the low-latency pair. The real kernels call the ``Buffer`` methods, which
keep every check and error of the eager API.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ascend_dualpath.errors import NotRegistered

_buffers: dict[int, Any] = {}
_handles: dict[int, Any] = {}
_next_id = itertools.count(1)


def register_buffer(buffer: Any) -> int:
    """Id under which the ``moe_*`` ops reach ``buffer`` (a :class:`~ascend_dualpath.moe.Buffer`)."""
    buffer_id = next(_next_id)
    _buffers[buffer_id] = buffer
    return buffer_id


def register_handle(handle: Any) -> int:
    """Id under which the cached ``moe_*`` ops reach ``handle`` (a normal dispatch's ``DispatchHandle``)."""
    handle_id = next(_next_id)
    _handles[handle_id] = handle
    return handle_id


def release(object_id: int) -> None:
    """Forget a buffer or handle id (the object itself is not destroyed)."""
    if _buffers.pop(object_id, None) is None and _handles.pop(object_id, None) is None:
        raise NotRegistered(f"no MoE buffer or handle registered under id {object_id}")


def buffer_of(buffer_id: int) -> Any:
    try:
        return _buffers[buffer_id]
    except KeyError:
        raise NotRegistered(f"no MoE buffer registered under id {buffer_id} (ops.register_buffer)") from None


def handle_of(handle_id: int) -> Any:
    try:
        return _handles[handle_id]
    except KeyError:
        raise NotRegistered(f"no dispatch handle registered under id {handle_id} (ops.register_handle)") from None


# ---------------------------------------------------------------------------------------------- real kernels
def cached_dispatch(x: list[torch.Tensor], buffer_id: int, handle_id: int) -> list[torch.Tensor]:
    """``Buffer.dispatch(x, handle=...)``: ``x`` is ``[x]`` or a quantised ``[values, scales]`` pair."""
    payload = x[0] if len(x) == 1 else tuple(x)
    recv_x = buffer_of(buffer_id).dispatch(payload, handle=handle_of(handle_id))[0]
    return list(recv_x) if isinstance(recv_x, tuple) else [recv_x]


def combine(x, topk_weights, bias_0, bias_1, buffer_id: int, handle_id: int, weighted: bool):
    """``Buffer.combine``; the second output is ``[T, 0]`` without ``topk_weights``."""
    handle = handle_of(handle_id)
    combined, weights, _ = buffer_of(buffer_id).combine(
        x, handle, topk_weights, bias=(bias_0, bias_1), weighted=weighted
    )
    if weights is None:
        weights = torch.zeros(combined.shape[0], 0, dtype=torch.float32, device=combined.device)
    return combined, weights


def low_latency_dispatch(
    x,
    topk_idx,
    buffer_id: int,
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int,
    use_fp8: bool,
    round_scale: bool,
    use_ue8m0: bool,
):
    """``Buffer.low_latency_dispatch`` received in full; ``recv_scales`` is ``[0]`` float32 without FP8."""
    recv_x, recv_count, handle, _, _ = buffer_of(buffer_id).low_latency_dispatch(
        x,
        topk_idx,
        num_max_dispatch_tokens_per_rank,
        num_experts,
        use_fp8=use_fp8,
        round_scale=round_scale,
        use_ue8m0=use_ue8m0,
    )
    values, scales = recv_x if use_fp8 else (recv_x, torch.zeros(0, dtype=torch.float32, device=x.device))
    src_info, layout_range = handle[0], handle[1]
    return values, scales, recv_count, src_info, layout_range


def low_latency_combine(
    x,
    topk_idx,
    topk_weights,
    src_info,
    layout_range,
    buffer_id: int,
    num_max_dispatch_tokens_per_rank: int,
    num_experts: int,
):
    """``Buffer.low_latency_combine`` with the handle rebuilt from its tensors."""
    handle = (src_info, layout_range, num_max_dispatch_tokens_per_rank, x.shape[2], num_experts)
    return buffer_of(buffer_id).low_latency_combine(x, topk_idx, topk_weights, handle)[0]


# ---------------------------------------------------------------------------------------------- fake kernels
def cached_dispatch_fake(x, buffer_id, handle_id):
    rows = handle_of(handle_id).plan.num_recv_tokens
    return [part.new_empty((rows, *part.shape[1:])) for part in x]


def combine_fake(x, topk_weights, bias_0, bias_1, buffer_id, handle_id, weighted):
    tokens = handle_of(handle_id).plan.is_token_in_rank.shape[0]
    width = 0 if topk_weights is None else topk_weights.shape[1]
    return x.new_empty((tokens, x.shape[1])), x.new_empty((tokens, width), dtype=torch.float32)


def low_latency_dispatch_fake(
    x, topk_idx, buffer_id, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0
):
    num_ranks = buffer_of(buffer_id).group_size
    local, slots, hidden = num_experts // num_ranks, num_ranks * num_max_dispatch_tokens_per_rank, x.shape[1]
    if not use_fp8:
        values, scales = x.new_empty((local, slots, hidden)), x.new_empty((0,), dtype=torch.float32)
    else:
        values = x.new_empty((local, slots, hidden), dtype=torch.float8_e4m3fn)
        columns = hidden // (512 if use_ue8m0 else 128)
        # column-major in the last two dims, as DeepEP (and Buffer.low_latency_dispatch) lay the scales out
        scales = x.new_empty_strided(
            (local, slots, columns), (slots * columns, 1, slots), dtype=torch.int32 if use_ue8m0 else torch.float32
        )
    recv_count = x.new_empty((local,), dtype=torch.int32)
    src_info = x.new_empty((local, slots), dtype=torch.int32)
    layout_range = x.new_empty((local, num_ranks), dtype=torch.int64)
    return values, scales, recv_count, src_info, layout_range


def low_latency_combine_fake(
    x, topk_idx, topk_weights, src_info, layout_range, buffer_id, num_max_dispatch_tokens_per_rank, num_experts
):
    return x.new_empty((topk_idx.shape[0], x.shape[2]))
