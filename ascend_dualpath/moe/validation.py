"""Input checks of :class:`~ascend_dualpath.moe.Buffer`, run before any communication.

A check that needs only this rank's arguments raises here, before the first exchange, so that nothing is
half-sent; what every rank must pass alike travels as an *agreement vector* (:func:`agreement_vector`) with the
first count exchange and is compared by :func:`check_agreement`, so that every rank raises the same error.
Shapes: ``R`` ranks, ``E`` experts, ``L = E / R`` local experts, ``T`` tokens, ``K`` top-k slots, ``H`` hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ascend_dualpath.errors import AlignmentError, BoundsError, CapacityError, ConfigError, PayloadTooLarge
from ascend_dualpath.moe import quant
from ascend_dualpath.moe.config import Config
from ascend_dualpath.moe.event import EventOverlap

MAX_LOCAL_EXPERTS = 1024
LL_MAX_TOPK = 11
TOPK_IDX_DTYPE = torch.int64
SUPPORTED_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Bytes a dispatched row carries besides x: int32 source token index; per top-k slot int64 id + float32 weight.
SOURCE_INDEX_BYTES = 4
TOPK_SLOT_BYTES = 8 + 4


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row (all dims but the first) of ``t``."""
    return math.prod(t.shape[1:]) * t.element_size()


def check_tensor(t: Any, name: str, dtype: torch.dtype | tuple, shape: tuple) -> None:
    """ConfigError unless ``t`` is a tensor of (one of) ``dtype`` and ``shape``; None entries match any size."""
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise ConfigError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape, strict=True)):
        expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ConfigError(f"{name} must have shape {expected}, got {list(t.shape)}")


def check_id_range(low: Any, high: Any, num_experts: int, where: str = "") -> None:
    """BoundsError unless every expert id in ``[low, high]`` is -1 (unused) or in ``[0, num_experts)``."""
    low, high = int(low), int(high)
    if high >= num_experts:
        raise BoundsError(f"topk_idx{where} holds expert id {high}, but num_experts={num_experts} (ids must be < it)")
    if low < -1:
        raise BoundsError(f"topk_idx{where} holds expert id {low}; ids must be -1 (unused) or in [0, {num_experts})")


def check_topk_idx(topk_idx: torch.Tensor, tokens: int, num_experts: int) -> None:
    """``topk_idx`` int64 [tokens, K] with ids in range (one host sync for the range)."""
    check_tensor(topk_idx, "topk_idx", TOPK_IDX_DTYPE, (tokens, None))
    if topk_idx.numel():
        check_id_range(*torch.aminmax(topk_idx), num_experts)


def check_topk_2d(topk_idx: Any) -> None:
    """ConfigError unless ``topk_idx`` is a 2-D tensor (its dtype and ids are checked later)."""
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
        got = getattr(topk_idx, "shape", topk_idx)
        raise ConfigError(f"topk_idx must be a 2-D tensor [tokens, topk], got {got}")


def _check_quantised_x(x: tuple) -> list[torch.Tensor]:
    if len(x) != 2:
        raise ConfigError(f"quantised x must be a (values, scales) pair, got a tuple of {len(x)}")
    values, scales = x
    check_tensor(values, "x[0]", (torch.float8_e4m3fn, torch.int8), (None, None))
    tokens, hidden = values.shape
    if values.dtype == torch.int8:
        check_tensor(scales, "x[1] (INT8 per-token scales)", torch.float32, (tokens,))
        return [values, scales]
    if hidden % quant.FP8_BLOCK:
        raise AlignmentError(f"FP8 x needs hidden % {quant.FP8_BLOCK} == 0, got hidden={hidden}")
    if isinstance(scales, torch.Tensor) and scales.dtype == torch.int32:
        check_tensor(scales, "x[1] (UE8M0 scales)", torch.int32, (tokens, hidden // (4 * quant.FP8_BLOCK)))
    else:
        check_tensor(scales, "x[1] (FP8 scales)", torch.float32, (tokens, hidden // quant.FP8_BLOCK))
    return [values, scales]


def x_parts(x: Any) -> list[torch.Tensor]:
    """Validate ``x`` (bf16/fp16/fp32 [T, H], or an FP8 / INT8 ``(values, scales)`` pair) and return its
    row-aligned tensors."""
    if isinstance(x, tuple):
        return _check_quantised_x(x)
    check_tensor(x, "x", SUPPORTED_X_DTYPES, (None, None))
    if x.shape[1] * x.element_size() % 16:
        raise AlignmentError(f"x rows must be a multiple of 16 bytes, got hidden={x.shape[1]} of {x.dtype}")
    return [x]


def check_num_experts(num_experts: int, group_size: int) -> int:
    """``num_experts`` a positive multiple of ``group_size`` with at most :data:`MAX_LOCAL_EXPERTS` per rank;
    returns the local expert count ``L``."""
    if num_experts <= 0 or num_experts % group_size:
        raise ConfigError(f"num_experts={num_experts} must be a positive multiple of the group size {group_size}")
    local = num_experts // group_size
    if local > MAX_LOCAL_EXPERTS:
        raise ConfigError(f"{local} local experts per rank exceed the limit {MAX_LOCAL_EXPERTS}")
    return local


def check_stream_args(previous_event: Any, async_finish: bool, allocate_on_comm_stream: bool) -> None:
    """DeepEP's stream arguments: an EventOverlap or None; allocating on the comm stream needs both others."""
    if previous_event is not None and not isinstance(previous_event, EventOverlap):
        raise ConfigError(f"previous_event must be an EventOverlap, got {type(previous_event).__name__}")
    if allocate_on_comm_stream and not (previous_event is not None and async_finish):
        raise ConfigError("allocate_on_comm_stream=True needs previous_event and async_finish=True")


def check_config(config: Any) -> None:
    if config is not None and not isinstance(config, Config):
        raise ConfigError(f"config must be a moe.Config, got {type(config).__name__}")


# ----------------------------------------------------------------------------- normal dispatch
@dataclass(frozen=True)
class DispatchArgs:
    """What :func:`check_dispatch` derived from a fresh dispatch's arguments."""

    num_experts: int
    local_experts: int
    num_topk: int  # 0 without topk_idx
    row_bytes: int  # wire bytes of one dispatched row (x parts, top-k, source index)


def _check_rdma_layout(num_tokens_per_rdma_rank: Any, num_nodes: int) -> None:
    if num_nodes > 1:
        if num_tokens_per_rdma_rank is None:
            raise ConfigError(f"internode dispatch ({num_nodes} nodes) needs num_tokens_per_rdma_rank")
        check_tensor(num_tokens_per_rdma_rank, "num_tokens_per_rdma_rank", torch.int32, (num_nodes,))
    elif num_tokens_per_rdma_rank is not None:
        raise ConfigError("num_tokens_per_rdma_rank must be None for intranode dispatch (one node)")


def _check_dispatch_topk(topk_idx: Any, topk_weights: Any, tokens: int) -> None:
    if (topk_idx is None) != (topk_weights is None):
        raise ConfigError("topk_idx and topk_weights must be given together or both omitted")
    if topk_idx is not None:
        check_tensor(topk_idx, "topk_idx", TOPK_IDX_DTYPE, (tokens, None))
        check_tensor(topk_weights, "topk_weights", torch.float32, tuple(topk_idx.shape))


def _check_worst_tokens(num_worst_tokens: Any, topk_idx: Any) -> None:
    if not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
        raise ConfigError(f"num_worst_tokens={num_worst_tokens!r} must be an int >= 0")
    if num_worst_tokens and topk_idx is None:
        raise ConfigError("num_worst_tokens > 0 needs topk_idx and topk_weights")


def check_dispatch(
    parts: list[torch.Tensor],
    *,
    group_size: int,
    num_nodes: int,
    num_tokens_per_rank: Any,
    num_tokens_per_rdma_rank: Any,
    is_token_in_rank: Any,
    num_tokens_per_expert: Any,
    topk_idx: Any,
    topk_weights: Any,
    expert_alignment: Any,
    num_worst_tokens: Any,
) -> DispatchArgs:
    """Every rank-local check of a fresh (non-cached) dispatch; ``parts`` from :func:`x_parts`."""
    tokens = parts[0].shape[0]
    if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
        raise ConfigError(
            "non-cached dispatch needs num_tokens_per_rank, is_token_in_rank and "
            "num_tokens_per_expert (from get_dispatch_layout)"
        )
    check_tensor(num_tokens_per_rank, "num_tokens_per_rank", torch.int32, (group_size,))
    check_tensor(is_token_in_rank, "is_token_in_rank", torch.bool, (tokens, group_size))
    check_tensor(num_tokens_per_expert, "num_tokens_per_expert", torch.int32, (None,))
    num_experts = num_tokens_per_expert.shape[0]
    local_experts = check_num_experts(num_experts, group_size)
    _check_rdma_layout(num_tokens_per_rdma_rank, num_nodes)
    _check_dispatch_topk(topk_idx, topk_weights, tokens)
    if not isinstance(expert_alignment, int) or expert_alignment < 1:
        raise ConfigError(f"expert_alignment={expert_alignment!r} must be an int >= 1")
    _check_worst_tokens(num_worst_tokens, topk_idx)
    num_topk = 0 if topk_idx is None else topk_idx.shape[1]
    wire = sum(row_bytes(p) for p in parts) + num_topk * TOPK_SLOT_BYTES + SOURCE_INDEX_BYTES
    return DispatchArgs(num_experts, local_experts, num_topk, wire)


def check_capacity(needed: int, capacity: int, what: str) -> None:
    """CapacityError when ``needed`` bytes exceed the buffer's ``num_nvl_bytes + num_rdma_bytes``."""
    if needed > capacity:
        raise CapacityError(f"{what} needs {needed} bytes of buffer, but num_nvl_bytes + num_rdma_bytes = {capacity}")


def check_dispatch_table(
    table: torch.Tensor, num_experts: int, capacity: int, wire_row_bytes: int, num_worst_tokens: int
) -> None:
    """Checks of every rank's inputs on the exchanged count table (int64 [R, R + E + 4]: per-rank counts,
    per-expert counts, min id, max id, per-rank sum, set entries of ``is_token_in_rank``); every rank sees the
    whole table, so every rank raises the same error, before any data moves."""
    group_size = table.shape[0]
    for rank, (low, high, per_rank_sum, in_rank_sum) in enumerate(table[:, -4:].tolist()):
        where = f" on rank {rank}"
        # (-1, -1) when the rank had neither top-k ids nor a layout with a device-side id range (cuda)
        check_id_range(low, high, num_experts, where)
        if per_rank_sum != in_rank_sum:
            raise ConfigError(
                f"num_tokens_per_rank{where} sums to {per_rank_sum} but is_token_in_rank marks "
                f"{in_rank_sum} (token, rank) pairs; pass one layout"
            )
    for rank, count in enumerate(table[:, :group_size].sum(dim=0).tolist()):
        check_capacity(count * wire_row_bytes, capacity, f"dispatch on rank {rank} (receive {count} tokens)")
        if num_worst_tokens and count > num_worst_tokens:
            raise CapacityError(f"rank {rank} receives {count} tokens, more than num_worst_tokens={num_worst_tokens}")


def check_handle(handle: Any, handle_type: type) -> None:
    if not isinstance(handle, handle_type):
        raise ConfigError(f"handle must be the DispatchHandle returned by dispatch, got {type(handle).__name__}")


def check_cached_dispatch(plan: Any, parts: list[torch.Tensor], topk_idx: Any, topk_weights: Any) -> None:
    """A cached dispatch along ``plan`` (the handle's): no top-k, the handle's token count."""
    if topk_idx is not None or topk_weights is not None:
        raise ConfigError("cached dispatch (handle given) takes no topk_idx/topk_weights")
    expected = plan.is_token_in_rank.shape[0]
    if parts[0].shape[0] != expected:
        raise ConfigError(f"cached dispatch: x has {parts[0].shape[0]} tokens but the handle was made for {expected}")


# ----------------------------------------------------------------------------- normal combine
def _trim_rows(t: torch.Tensor, num_recv: int, name: str) -> torch.Tensor:
    if t.shape[0] < num_recv:
        raise ConfigError(f"combine: {name} has {t.shape[0]} rows but this rank received {num_recv} tokens")
    return t[:num_recv] if t.shape[0] > num_recv else t


def check_combine(
    x: Any, plan: Any, topk_weights: Any, bias: Any, weighted: bool
) -> tuple[torch.Tensor, torch.Tensor | None, tuple]:
    """A combine's checks along ``plan`` (the handle's); returns ``(x, topk_weights, biases)`` with worst-token
    padding rows cut off and the bias as a tuple of at most two tensors or None."""
    num_recv, tokens = plan.num_recv_tokens, plan.is_token_in_rank.shape[0]
    check_tensor(x, "x", SUPPORTED_X_DTYPES, (None, None))
    x = _trim_rows(x, num_recv, "x")
    if topk_weights is not None:
        check_tensor(topk_weights, "topk_weights", torch.float32, (None, None))
        topk_weights = _trim_rows(topk_weights, num_recv, "topk_weights")
    if weighted and topk_weights is None:
        raise ConfigError("weighted combine needs topk_weights (the dispatch's recv_topk_weights)")
    biases = bias if isinstance(bias, tuple) else (bias,)
    if len(biases) > 2:
        raise ConfigError(f"bias takes at most two tensors, got {len(biases)}")
    for i, b in enumerate(biases):
        if b is not None:
            check_tensor(b, f"bias[{i}]", x.dtype, (tokens, x.shape[1]))
    return x, topk_weights, biases


# ----------------------------------------------------------------------------- low latency
def check_ll_common(
    topk_idx: Any,
    max_tokens: Any,
    num_experts: int,
    group_size: int,
    low_latency_mode: bool,
    async_finish: bool,
    return_recv_hook: bool,
) -> int:
    """Checks shared by the low-latency ops; returns the local expert count."""
    if not low_latency_mode:
        raise ConfigError("low-latency ops need Buffer(..., low_latency_mode=True)")
    if async_finish and return_recv_hook:
        raise ConfigError("async_finish and return_recv_hook are mutually exclusive")
    local_experts = check_num_experts(num_experts, group_size)
    if not isinstance(max_tokens, int) or max_tokens <= 0:
        raise ConfigError(f"num_max_dispatch_tokens_per_rank={max_tokens!r} must be a positive int")
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
        raise ConfigError("topk_idx must be a 2-D int64 tensor [tokens, topk]")
    if topk_idx.shape[0] > max_tokens:
        raise PayloadTooLarge(f"{topk_idx.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank={max_tokens}")
    if topk_idx.shape[1] > LL_MAX_TOPK:
        raise ConfigError(f"low-latency top-k {topk_idx.shape[1]} exceeds {LL_MAX_TOPK}")
    check_topk_idx(topk_idx, topk_idx.shape[0], num_experts)
    return local_experts


def check_ll_hidden(
    hidden: int, needed_rdma_bytes: int, num_rdma_bytes: int, max_tokens: int, num_experts: int
) -> None:
    """``hidden`` a multiple of the FP8 block and the low-latency buffer large enough."""
    if hidden % quant.FP8_BLOCK:
        raise AlignmentError(f"low-latency ops need hidden % {quant.FP8_BLOCK} == 0, got hidden={hidden}")
    if needed_rdma_bytes > num_rdma_bytes:
        raise CapacityError(
            f"low-latency ops with M={max_tokens}, hidden={hidden}, {num_experts} experts need "
            f"num_rdma_bytes >= {needed_rdma_bytes} (get_low_latency_rdma_size_hint), got "
            f"{num_rdma_bytes}"
        )


def check_ll_dispatch_options(
    hidden: int, use_fp8: bool, round_scale: bool, use_ue8m0: bool, stats: Any, wait_stats: Any, local_experts: int
) -> None:
    if use_ue8m0 and not round_scale:
        raise ConfigError("use_ue8m0=True needs round_scale=True")
    if use_ue8m0 and not use_fp8:
        raise ConfigError("use_ue8m0=True needs use_fp8=True")
    if use_ue8m0 and hidden % (4 * quant.FP8_BLOCK):
        raise AlignmentError(f"UE8M0 scales need hidden % {4 * quant.FP8_BLOCK} == 0, got hidden={hidden}")
    if stats is not None:
        check_tensor(stats, "cumulative_local_expert_recv_stats", torch.int32, (local_experts,))
    if wait_stats is not None:
        raise ConfigError("dispatch_wait_recv_cost_stats is not supported (no device-side wait to time)")


def check_ll_combine_options(
    x: Any,
    topk_idx: torch.Tensor,
    topk_weights: Any,
    out: Any,
    hidden: int,
    local_experts: int,
    slots: int,
    use_logfmt: bool,
    zero_copy: bool,
    wait_stats: Any,
) -> None:
    check_tensor(x, "x", torch.bfloat16, (local_experts, slots, hidden))
    check_tensor(topk_weights, "topk_weights", torch.float32, tuple(topk_idx.shape))
    if out is not None:
        check_tensor(out, "out", torch.bfloat16, (topk_idx.shape[0], hidden))
    if use_logfmt or zero_copy:
        raise ConfigError("use_logfmt and zero_copy are not supported (no device-side LL buffer to write into)")
    if wait_stats is not None:
        raise ConfigError("combine_wait_recv_cost_stats is not supported (no device-side wait to time)")


# ----------------------------------------------------------------------------- rank agreement
# What every rank must pass alike to an op that exchanges counts, as a fixed-size int64 vector gathered before any
# exchange whose size depends on it: gloo aborts the process (EnforceNotMet) when the ranks' sizes differ.
AGREEMENT_OPS = ("dispatch", "low-latency dispatch")
AGREEMENT_FIELDS = (
    "op",
    "num_experts",
    "hidden",
    "x_dtype",
    "scales_dtype",
    "scales_width",
    "num_topk",
    "num_worst_tokens",
    "num_max_dispatch_tokens_per_rank",
    "use_fp8",
    "round_scale",
    "use_ue8m0",
)
# dtypes travel as their index here + 1 (0: no such tensor), so a disagreement message can name them
AGREEMENT_DTYPES = (*SUPPORTED_X_DTYPES, torch.float8_e4m3fn, torch.int8, torch.int32)


def agreement_vector(op: str, **fields: Any) -> torch.Tensor:
    """int64 [len(AGREEMENT_FIELDS)] for ``op`` (one of AGREEMENT_OPS) and ``fields`` (AGREEMENT_FIELDS names;
    absent ones are 0, dtypes by code)."""
    codes = {"op": AGREEMENT_OPS.index(op)}
    for name, value in fields.items():
        codes[name] = AGREEMENT_DTYPES.index(value) + 1 if isinstance(value, torch.dtype) else int(value)
    return torch.tensor([codes.get(name, 0) for name in AGREEMENT_FIELDS], dtype=torch.int64)


def check_agreement(table: torch.Tensor, what: str) -> None:
    """Raise the same ConfigError on every rank if the gathered rows (int64 [R, len(AGREEMENT_FIELDS)]) differ,
    naming the first field that differs and each rank's value."""
    for column, name in enumerate(AGREEMENT_FIELDS):
        values = table[:, column].tolist()
        if len(set(values)) == 1:
            continue
        if name == "op":
            values = [AGREEMENT_OPS[v] for v in values]
        elif name.endswith("dtype"):
            values = [str(AGREEMENT_DTYPES[v - 1]) if v else "none" for v in values]
        shown = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(values))
        raise ConfigError(f"{what}: ranks disagree on {name} ({shown}); every rank must pass the same")
