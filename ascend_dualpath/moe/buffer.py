"""``Buffer``: DeepEP V1's MoE dispatch/combine API over pluggable strategies.

Names, arguments and return tuples follow DeepEP V1 (``deep_ep.Buffer``); docs/moe.md lists every deviation.
The buffer validates all inputs *before* any communication (so bad input raises the same error on every rank
and nothing is half-sent), then hands the data movement to a strategy (see
:mod:`ascend_dualpath.moe.strategies`). Shapes: ``R`` ranks, ``E`` experts, ``L = E / R`` local experts,
``T`` tokens on this rank, ``K`` top-k slots, ``H`` hidden, ``N`` received tokens, ``M`` =
``num_max_dispatch_tokens_per_rank``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ascend_dualpath import _env
from ascend_dualpath._checks import check_bound, check_type
from ascend_dualpath.errors import AlignmentError, BoundsError, CapacityError, ConfigError, PayloadTooLarge
from ascend_dualpath.moe import quant
from ascend_dualpath.moe.event import EventOverlap
from ascend_dualpath.moe.layout import compute_dispatch_layout
from ascend_dualpath.moe.strategies.base import NormalPlan, to_device_async

BUFFER_ALIGNMENT_BYTES = 128
MAX_LOCAL_EXPERTS = 1024
LL_MAX_TOPK = 11
LL_MESSAGE_HEADER_BYTES = 16
TOPK_IDX_DTYPE = torch.int64
SUPPORTED_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Config:
    """DeepEP's tuning knobs; only ``num_sms`` is used (by the ``cuda`` strategy, 0 = bandwidth model)."""

    num_sms: int = 0
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256


class DispatchHandle(NamedTuple):
    """Normal-dispatch handle; ``handle[0]`` is DeepEP's ``rank_prefix_matrix``.

    Fields: ``rank_prefix_matrix`` int32 [R, R] (``[i, j]`` = tokens sent to rank j by ranks 0..i),
    ``recv_src_idx`` int32 [N] (token index on the source rank), ``is_token_in_rank`` bool [T, R],
    ``plan`` (:class:`~ascend_dualpath.moe.strategies.base.NormalPlan`, strategy state for reuse).
    """

    rank_prefix_matrix: torch.Tensor
    recv_src_idx: torch.Tensor
    is_token_in_rank: torch.Tensor
    plan: NormalPlan


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def _check_tensor(t: Any, name: str, dtype: torch.dtype | tuple, shape: tuple) -> None:
    """``shape`` entries of None match any size."""
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in dtypes:
        raise ConfigError(f"{name} must have dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape, strict=True)):
        expected = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ConfigError(f"{name} must have shape {expected}, got {list(t.shape)}")


def _check_topk_idx(topk_idx: torch.Tensor, tokens: int, num_experts: int) -> None:
    _check_tensor(topk_idx, "topk_idx", TOPK_IDX_DTYPE, (tokens, None))
    if topk_idx.numel():
        _check_id_range(*torch.aminmax(topk_idx), num_experts)


def _check_id_range(low: Any, high: Any, num_experts: int, where: str = "") -> None:
    low, high = int(low), int(high)
    if high >= num_experts:
        raise BoundsError(f"topk_idx{where} holds expert id {high}, but num_experts={num_experts} (ids must be < it)")
    if low < -1:
        raise BoundsError(f"topk_idx{where} holds expert id {low}; ids must be -1 (unused) or in [0, {num_experts})")


def _x_parts(x: Any) -> list[torch.Tensor]:
    """Validate ``x`` (bf16/fp16/fp32, or an FP8 / INT8 tuple) and return its row-aligned tensors."""
    if isinstance(x, tuple):
        if len(x) != 2:
            raise ConfigError(f"quantised x must be a (values, scales) pair, got a tuple of {len(x)}")
        values, scales = x
        _check_tensor(values, "x[0]", (torch.float8_e4m3fn, torch.int8), (None, None))
        tokens, hidden = values.shape
        if values.dtype == torch.float8_e4m3fn:
            if hidden % quant.FP8_BLOCK:
                raise AlignmentError(f"FP8 x needs hidden % {quant.FP8_BLOCK} == 0, got hidden={hidden}")
            if scales.dtype == torch.int32:
                _check_tensor(scales, "x[1] (UE8M0 scales)", torch.int32, (tokens, hidden // (4 * quant.FP8_BLOCK)))
            else:
                _check_tensor(scales, "x[1] (FP8 scales)", torch.float32, (tokens, hidden // quant.FP8_BLOCK))
        else:
            _check_tensor(scales, "x[1] (INT8 per-token scales)", torch.float32, (tokens,))
        return [values, scales]
    _check_tensor(x, "x", SUPPORTED_X_DTYPES, (None, None))
    if x.shape[1] * x.element_size() % 16:
        raise AlignmentError(f"x rows must be a multiple of 16 bytes, got hidden={x.shape[1]} of {x.dtype}")
    return [x]


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


# What every rank must pass alike to an op that exchanges counts, as a fixed-size int64 vector gathered before any
# exchange whose size depends on it: gloo aborts the process (EnforceNotMet) when the ranks' sizes differ.
AGREEMENT_OPS = ("dispatch", "low-latency dispatch")
AGREEMENT_FIELDS = ("op", "num_experts", "hidden", "x_dtype", "scales_dtype", "scales_width", "num_topk",
                    "num_worst_tokens", "num_max_dispatch_tokens_per_rank", "use_fp8", "round_scale", "use_ue8m0")
# dtypes travel as their index here + 1 (0: no such tensor), so a disagreement message can name them
AGREEMENT_DTYPES = (*SUPPORTED_X_DTYPES, torch.float8_e4m3fn, torch.int8, torch.int32)


def _agreement_vector(op: str, **fields: Any) -> torch.Tensor:
    """int64 [len(AGREEMENT_FIELDS)] for ``op`` (one of AGREEMENT_OPS) and ``fields`` (AGREEMENT_FIELDS names;
    absent ones are 0, dtypes by code)."""
    codes = {"op": AGREEMENT_OPS.index(op)}
    for name, value in fields.items():
        codes[name] = AGREEMENT_DTYPES.index(value) + 1 if isinstance(value, torch.dtype) else int(value)
    return torch.tensor([codes.get(name, 0) for name in AGREEMENT_FIELDS], dtype=torch.int64)


def _check_agreement(table: torch.Tensor, what: str) -> None:
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


class Buffer:
    """DeepEP-compatible MoE communication buffer.

    Parameters
    ----------
    group : ProcessGroup or None (the default group)
    num_nvl_bytes, num_rdma_bytes : int, multiples of 128
        Communication buffer budget. Normal ops need their send and receive payload each within
        ``num_nvl_bytes + num_rdma_bytes``; low-latency ops need ``num_rdma_bytes >=``
        :meth:`get_low_latency_rdma_size_hint`.
    low_latency_mode : bool
        Must be True to call the low-latency ops.
    strategy : str, keyword-only
        ``"auto"`` (default), ``"alltoall"``, ``"mc2"``, ``"cuda"`` or ``"aiv"``; see
        :mod:`ascend_dualpath.moe.strategies`.
    ranks_per_node : int, keyword-only
        Ranks sharing a node (node = rank // ranks_per_node); default 8, DeepEP's NVLink domain.
    timeout_s : float, keyword-only
        Bound of every wait (finite, > 0); default ``ADP_TIMEOUT_S`` (:func:`ascend_dualpath._env.timeout_s`).

    Arguments are checked by name before any communication: a wrong type raises
    :class:`~ascend_dualpath.errors.ArgumentTypeError`, a NaN, infinite or non-positive bound :class:`ConfigError`.
    """

    num_sms = 0

    def __init__(self, group: Any = None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 explicitly_destroy: bool = False, *, strategy: str = "auto", ranks_per_node: int = 8,
                 timeout_s: float | None = None) -> None:
        import torch.distributed as dist

        from ascend_dualpath.moe import strategies

        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes),
                            ("num_qps_per_rank", num_qps_per_rank), ("ranks_per_node", ranks_per_node)):
            check_type(name, value, int, where="Buffer")
        for name, value in (("low_latency_mode", low_latency_mode), ("explicitly_destroy", explicitly_destroy),
                            ("allow_nvlink_for_low_latency_mode", allow_nvlink_for_low_latency_mode),
                            ("allow_mnnvl", allow_mnnvl)):
            check_type(name, value, bool, where="Buffer")
        check_type("strategy", strategy, str, where="Buffer")
        # checked before any wait: a NaN bound would never expire
        timeout_s = check_bound("timeout_s", timeout_s, where="Buffer") if timeout_s is not None else _env.timeout_s()
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if value < 0 or value % BUFFER_ALIGNMENT_BYTES:
                raise AlignmentError(f"{name}={value} must be a non-negative multiple of {BUFFER_ALIGNMENT_BYTES}")
        if not dist.is_initialized():
            raise ConfigError("torch.distributed is not initialised; call init_process_group before Buffer()")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        if ranks_per_node < 1:
            raise ConfigError(f"ranks_per_node={ranks_per_node} must be >= 1")
        if self.group_size > ranks_per_node and self.group_size % ranks_per_node:
            raise ConfigError(f"group size {self.group_size} is not a multiple of ranks_per_node={ranks_per_node}")
        self.ranks_per_node = min(ranks_per_node, self.group_size)
        self.num_nodes = self.group_size // self.ranks_per_node
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.timeout_s = timeout_s
        self.strategy_name = strategies.resolve(strategy, self.group)
        # aiv takes two hops (RDMA to the same-index rank of the target node, then intra-node) across nodes
        options = {"ranks_per_node": self.ranks_per_node} if self.strategy_name == "aiv" else {}
        self.strategy = strategies.create(self.strategy_name, self.group, self.timeout_s, **options)
        self._destroyed = False

    # ----------------------------------------------------------------- helpers
    @property
    def capacity_bytes(self) -> int:
        return self.num_nvl_bytes + self.num_rdma_bytes

    def _check_alive(self) -> None:
        if self._destroyed:
            raise ConfigError("this Buffer was destroyed; create a new one")

    @staticmethod
    def _check_stream_args(previous_event: Any, async_finish: bool, allocate_on_comm_stream: bool) -> None:
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise ConfigError(f"previous_event must be an EventOverlap, got {type(previous_event).__name__}")
        if allocate_on_comm_stream and not (previous_event is not None and async_finish):
            raise ConfigError("allocate_on_comm_stream=True needs previous_event and async_finish=True")

    def _check_capacity(self, needed: int, what: str) -> None:
        if needed > self.capacity_bytes:
            raise CapacityError(f"{what} needs {needed} bytes of buffer, but num_nvl_bytes + num_rdma_bytes = "
                                f"{self.capacity_bytes}")

    def _num_experts_check(self, num_experts: int) -> int:
        if num_experts <= 0 or num_experts % self.group_size:
            raise ConfigError(f"num_experts={num_experts} must be a positive multiple of the group size "
                              f"{self.group_size}")
        local = num_experts // self.group_size
        if local > MAX_LOCAL_EXPERTS:
            raise ConfigError(f"{local} local experts per rank exceed the limit {MAX_LOCAL_EXPERTS}")
        return local

    # ----------------------------------------------------------------- DeepEP static helpers
    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current CUDA stream (no-op event without CUDA)."""
        return EventOverlap.capture("cuda" if torch.cuda.is_available() else None)

    @classmethod
    def set_num_sms(cls, new_num_sms: int) -> None:
        """SMs for the ``cuda`` strategy's normal kernels; 0 = bandwidth model; otherwise even, as in DeepEP."""
        if new_num_sms < 0 or new_num_sms % 2:
            raise ConfigError(f"num_sms={new_num_sms} must be 0 or a positive even number")
        cls.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return Config(num_sms=Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return Config(num_sms=Buffer.num_sms)

    @staticmethod
    def get_normal_buffer_size_hint(num_max_tokens_per_rank: int, hidden_bytes: int, num_ranks: int,
                                    num_topk: int = 0) -> int:
        """Bytes a normal dispatch/combine may need at worst: every rank sends all its tokens here."""
        row = hidden_bytes + 4 + num_topk * (8 + 4)
        return _align_up(num_ranks * num_max_tokens_per_rank * row, BUFFER_ALIGNMENT_BYTES)

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Low-latency buffer bytes: two sets of (send M messages + receive E·M messages + E signals).

        A message is a 16-byte header plus the larger of a BF16 row and an FP8 row with its scales.
        """
        message = LL_MESSAGE_HEADER_BYTES + max(2 * hidden, hidden + hidden // quant.FP8_BLOCK * 4)
        per_set = (num_max_dispatch_tokens_per_rank * (1 + num_experts)) * message + num_experts * 4
        return 2 * _align_up(per_set, BUFFER_ALIGNMENT_BYTES)

    def get_comm_stream(self) -> Any:
        return torch.cuda.current_stream() if torch.cuda.is_available() else None

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Nothing to clean: no strategy keeps state between low-latency calls. Validates the sizes only."""
        self._check_alive()
        needed = self.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, self.group_size,
                                                     num_experts)
        if needed > self.num_rdma_bytes:
            raise CapacityError(f"low-latency mode needs num_rdma_bytes >= {needed}, got {self.num_rdma_bytes}")

    def destroy(self) -> None:
        self._check_alive()
        self._destroyed = True
        close = getattr(self.strategy, "close", None)
        if close is not None:
            close()

    def _finish_event(self, x_device: torch.device, async_finish: bool) -> EventOverlap:
        return EventOverlap.capture(x_device) if async_finish else EventOverlap(None)

    # ----------------------------------------------------------------- layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Any = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Count tokens per rank, node and expert (no communication).

        Parameters
        ----------
        topk_idx : int64 [T, K], ``-1`` = unused slot
        num_experts : int, a multiple of the group size

        Returns
        -------
        (num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank int32 [R / ranks_per_node] or None on one
        node, num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R], EventOverlap)
        """
        self._check_alive()
        self._check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        self._num_experts_check(num_experts)
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
            got = getattr(topk_idx, "shape", topk_idx)
            raise ConfigError(f"topk_idx must be a 2-D tensor [tokens, topk], got {got}")
        fused = getattr(self.strategy, "dispatch_layout", None)
        if fused is None:
            _check_topk_idx(topk_idx, topk_idx.shape[0], num_experts)
        else:
            _check_tensor(topk_idx, "topk_idx", TOPK_IDX_DTYPE, (topk_idx.shape[0], None))
        if previous_event is not None:
            previous_event.current_stream_wait()
        if fused is None:
            layout = compute_dispatch_layout(topk_idx, num_experts, self.group_size, self.ranks_per_node)
        else:
            # One kernel computes the layout and the id range. A strategy that returns no host-side range (cuda:
            # no host sync here) checks it at the count exchange of the fresh dispatch given this layout.
            layout, id_range = fused(topk_idx, num_experts, self.group_size, self.ranks_per_node)
            if id_range is not None:
                _check_id_range(*id_range, num_experts)
        return (*layout, self._finish_event(topk_idx.device, async_finish))

    # ----------------------------------------------------------------- normal dispatch
    def dispatch(self, x: Any, handle: DispatchHandle | None = None, num_tokens_per_rank: torch.Tensor | None = None,
                 num_tokens_per_rdma_rank: torch.Tensor | None = None, is_token_in_rank: torch.Tensor | None = None,
                 num_tokens_per_expert: torch.Tensor | None = None, topk_idx: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                 config: Config | None = None, previous_event: Any = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send each token to every rank holding one of its experts (once per rank).

        Parameters
        ----------
        x : Tensor [T, H] bf16 (fp16/fp32 accepted), or ``(x_e4m3 [T, H], scales float32 [T, H/128])``,
            ``(x_e4m3, ue8m0 int32 [T, H/512])`` or ``(x_int8 [T, H], scales float32 [T])``
        handle : DispatchHandle or None
            Cached mode: reuse a previous dispatch's layout; then no topk/layout arguments are taken.
        num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert :
            From :meth:`get_dispatch_layout` (required unless cached).
        topk_idx : int64 [T, K] or None; topk_weights : float32 [T, K] or None (both or neither)
        expert_alignment : int
            Each entry of the returned per-expert list is rounded up to a multiple of it.
        num_worst_tokens : int
            If > 0, outputs have exactly this many rows (padding: ``recv_topk_idx == -1``, zero rows) and the
            per-expert list is empty.

        Returns
        -------
        (recv_x [N, H] (or tuple like x), recv_topk_idx int64 [N, K] (local ids, -1 elsewhere) or None,
        recv_topk_weights float32 [N, K] (0 where recv_topk_idx == -1) or None,
        num_recv_tokens_per_expert_list list[int] of length L, handle, EventOverlap).
        Rows arrive grouped by source rank 0..R-1, ascending source token index within a source.
        Cached mode returns ``(recv_x, None, None, None, None, event)``.
        """
        self._check_alive()
        self._check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        if config is not None and not isinstance(config, Config):
            raise ConfigError(f"config must be a moe.Config, got {type(config).__name__}")
        parts = _x_parts(x)
        tokens = parts[0].shape[0]
        row_bytes = sum(_row_bytes(p) for p in parts)
        if handle is not None:
            return self._cached_dispatch(x, parts, handle, row_bytes, topk_idx, topk_weights, previous_event,
                                         async_finish)
        if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise ConfigError("non-cached dispatch needs num_tokens_per_rank, is_token_in_rank and "
                              "num_tokens_per_expert (from get_dispatch_layout)")
        _check_tensor(num_tokens_per_rank, "num_tokens_per_rank", torch.int32, (self.group_size,))
        _check_tensor(is_token_in_rank, "is_token_in_rank", torch.bool, (tokens, self.group_size))
        _check_tensor(num_tokens_per_expert, "num_tokens_per_expert", torch.int32, (None,))
        num_experts = num_tokens_per_expert.shape[0]
        local_experts = self._num_experts_check(num_experts)
        if self.num_nodes > 1:
            if num_tokens_per_rdma_rank is None:
                raise ConfigError(f"internode dispatch ({self.num_nodes} nodes) needs num_tokens_per_rdma_rank")
            _check_tensor(num_tokens_per_rdma_rank, "num_tokens_per_rdma_rank", torch.int32, (self.num_nodes,))
        elif num_tokens_per_rdma_rank is not None:
            raise ConfigError("num_tokens_per_rdma_rank must be None for intranode dispatch (one node)")
        if (topk_idx is None) != (topk_weights is None):
            raise ConfigError("topk_idx and topk_weights must be given together or both omitted")
        if topk_idx is not None:
            _check_tensor(topk_idx, "topk_idx", TOPK_IDX_DTYPE, (tokens, None))
            _check_tensor(topk_weights, "topk_weights", torch.float32, tuple(topk_idx.shape))
            row_bytes += topk_idx.shape[1] * (8 + 4)
        row_bytes += 4  # source token index
        if not isinstance(expert_alignment, int) or expert_alignment < 1:
            raise ConfigError(f"expert_alignment={expert_alignment!r} must be an int >= 1")
        if not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
            raise ConfigError(f"num_worst_tokens={num_worst_tokens!r} must be an int >= 0")
        if num_worst_tokens and topk_idx is None:
            raise ConfigError("num_worst_tokens > 0 needs topk_idx and topk_weights")
        if tokens * self.group_size * row_bytes > self.capacity_bytes:
            # Only a budget this small can be exceeded by the send side: then the exact count is worth a host
            # sync, and the error comes before any communication.
            self._check_capacity(int(num_tokens_per_rank.sum()) * row_bytes, f"dispatch on rank {self.rank} (send)")
        if previous_event is not None:
            previous_event.current_stream_wait()
        # The ranks first agree on the shapes and options (the count table's width depends on num_experts), then
        # one exchange carries every rank's counts per rank and per expert and the statistics its inputs are
        # checked with (id range, layout sums), so all ranks raise the same error before any data moves.
        scales = parts[1] if len(parts) > 1 else None
        agreement = _agreement_vector(
            "dispatch", num_experts=num_experts, hidden=parts[0].shape[1], x_dtype=parts[0].dtype,
            scales_dtype=scales.dtype if scales is not None else 0,
            scales_width=math.prod(scales.shape[1:]) if scales is not None else 0,
            num_topk=0 if topk_idx is None else topk_idx.shape[1], num_worst_tokens=num_worst_tokens)
        _check_agreement(self.strategy.exchange_counts(agreement.to(parts[0].device), "dispatch shapes"), "dispatch")
        table = self.strategy.exchange_dispatch_counts(num_tokens_per_rank, num_tokens_per_expert, topk_idx,
                                                       is_token_in_rank, "dispatch token counts")
        count_matrix = table[:, :self.group_size]
        expert_table = table[:, self.group_size:self.group_size + num_experts]
        for rank, (low, high, per_rank_sum, in_rank_sum) in enumerate(table[:, -4:].tolist()):
            where = f" on rank {rank}"
            # (-1, -1) when the rank had neither top-k ids nor a layout with a device-side id range (cuda)
            _check_id_range(low, high, num_experts, where)
            if per_rank_sum != in_rank_sum:
                raise ConfigError(f"num_tokens_per_rank{where} sums to {per_rank_sum} but is_token_in_rank marks "
                                  f"{in_rank_sum} (token, rank) pairs; pass one layout")
        received = count_matrix.sum(dim=0)
        # Every rank sees the whole matrix, so every rank raises the same error here, before any data moves.
        for rank, count in enumerate(received.tolist()):
            self._check_capacity(count * row_bytes, f"dispatch on rank {rank} (receive {count} tokens)")
            if num_worst_tokens and count > num_worst_tokens:
                raise CapacityError(f"rank {rank} receives {count} tokens, more than num_worst_tokens="
                                    f"{num_worst_tokens}")
        plan = NormalPlan(self.rank, is_token_in_rank, count_matrix, private={
            "num_sms": config.num_sms if config is not None else Buffer.num_sms, "num_experts": num_experts,
            "num_topk": 0 if topk_idx is None else topk_idx.shape[1]})
        self.strategy.prepare_plan(plan)
        payload = list(parts)
        if topk_idx is not None:
            payload += [topk_idx, topk_weights]
        source_index = getattr(self.strategy, "source_index", None)
        payload.append(source_index(tokens, parts[0].device) if source_index is not None
                       else torch.arange(tokens, dtype=torch.int32, device=parts[0].device))
        recv = self.strategy.dispatch_rows(plan, payload, "dispatch rows")
        plan.recv_src_idx = recv[-1]
        recv_parts = recv[:len(parts)]
        recv_topk_idx = recv_topk_weights = None
        counts_list: list[int] = []
        if topk_idx is not None:
            global_idx, weights = recv[len(parts)], recv[len(parts) + 1]
            localize = getattr(self.strategy, "localize_topk", None)
            if localize is not None:  # in place: the received tensors are fresh
                localize(global_idx, weights, local_experts)
                recv_topk_idx, recv_topk_weights = global_idx, weights
            else:
                local = global_idx - self.rank * local_experts
                here = (global_idx >= 0) & (local >= 0) & (local < local_experts)
                recv_topk_idx = torch.where(here, local, torch.full_like(local, -1))
                recv_topk_weights = torch.where(here, weights, torch.zeros_like(weights))
            mine = expert_table[:, self.rank * local_experts:(self.rank + 1) * local_experts].sum(dim=0)
            counts_list = ((mine + expert_alignment - 1) // expert_alignment * expert_alignment).tolist()
        num_recv = plan.num_recv_tokens
        if num_worst_tokens:
            pad = num_worst_tokens - num_recv
            recv_parts = [torch.cat([p, p.new_zeros((pad, *p.shape[1:]))]) for p in recv_parts]
            recv_topk_idx = torch.cat([recv_topk_idx, recv_topk_idx.new_full((pad, recv_topk_idx.shape[1]), -1)])
            recv_topk_weights = torch.cat([recv_topk_weights,
                                           recv_topk_weights.new_zeros((pad, recv_topk_idx.shape[1]))])
            counts_list = []
        rank_prefix_matrix = (plan.private or {}).get("rank_prefix_matrix")  # made on the device by the strategy
        if rank_prefix_matrix is None:
            rank_prefix_matrix = to_device_async(count_matrix.cumsum(dim=0).to(torch.int32), parts[0].device)
        new_handle = DispatchHandle(rank_prefix_matrix, plan.recv_src_idx, is_token_in_rank, plan)
        recv_x = tuple(recv_parts) if isinstance(x, tuple) else recv_parts[0]
        return (recv_x, recv_topk_idx, recv_topk_weights, counts_list, new_handle,
                self._finish_event(parts[0].device, async_finish))

    def _cached_dispatch(self, x, parts, handle, row_bytes, topk_idx, topk_weights, previous_event, async_finish):
        if not isinstance(handle, DispatchHandle):
            raise ConfigError(f"handle must be the DispatchHandle returned by dispatch, got {type(handle).__name__}")
        if topk_idx is not None or topk_weights is not None:
            raise ConfigError("cached dispatch (handle given) takes no topk_idx/topk_weights")
        plan = handle.plan
        if parts[0].shape[0] != plan.is_token_in_rank.shape[0]:
            raise ConfigError(f"cached dispatch: x has {parts[0].shape[0]} tokens but the handle was made for "
                              f"{plan.is_token_in_rank.shape[0]}")
        self._check_capacity(max(sum(plan.send_counts), plan.num_recv_tokens) * row_bytes, "cached dispatch")
        if previous_event is not None:
            previous_event.current_stream_wait()
        recv = self.strategy.dispatch_rows(plan, parts, "cached dispatch rows")
        recv_x = tuple(recv) if isinstance(x, tuple) else recv[0]
        return recv_x, None, None, None, None, self._finish_event(parts[0].device, async_finish)

    # ----------------------------------------------------------------- normal combine
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor | None = None,
                bias: Any = None, config: Config | None = None, previous_event: Any = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False, *, weighted: bool = False):
        """Return every received row to its source and sum per token (the reverse of :meth:`dispatch`).

        Parameters
        ----------
        x : Tensor [N (or more, worst-token mode), H] bf16/fp16/fp32: one row per received token
        handle : the handle of the dispatch that produced the rows
        topk_weights : float32 [N, K] or None: the dispatch's ``recv_topk_weights``
        bias : Tensor [T, H] or a pair of them (either may be None), added after the sum
        weighted : bool, keyword-only
            False (DeepEP): ``combined[t] = Σ_r x_r[t]``. True (torch_npu MC2 style): each rank's row is first
            scaled by the sum of that row's ``topk_weights`` (the weights of the token's experts on that rank).

        Returns
        -------
        (combined_x [T, H] in x.dtype, combined_topk_weights float32 [T, K] or None, EventOverlap).
        Sums run in float32 over destination ranks 0..R-1, then bias 0, then bias 1; ``combined_topk_weights``
        equals the original weights with ``-1`` slots zeroed.
        """
        self._check_alive()
        self._check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        if not isinstance(handle, DispatchHandle):
            raise ConfigError(f"handle must be the DispatchHandle returned by dispatch, got {type(handle).__name__}")
        plan = handle.plan
        num_recv, tokens = plan.num_recv_tokens, plan.is_token_in_rank.shape[0]
        _check_tensor(x, "x", SUPPORTED_X_DTYPES, (None, None))
        if x.shape[0] < num_recv:
            raise ConfigError(f"combine: x has {x.shape[0]} rows but this rank received {num_recv} tokens")
        if x.shape[0] > num_recv:
            x = x[:num_recv]
        if topk_weights is not None:
            _check_tensor(topk_weights, "topk_weights", torch.float32, (None, None))
            if topk_weights.shape[0] < num_recv:
                raise ConfigError(f"combine: topk_weights has {topk_weights.shape[0]} rows, fewer than {num_recv}")
            if topk_weights.shape[0] > num_recv:
                topk_weights = topk_weights[:num_recv]
        if weighted and topk_weights is None:
            raise ConfigError("weighted combine needs topk_weights (the dispatch's recv_topk_weights)")
        biases = bias if isinstance(bias, tuple) else (bias,)
        if len(biases) > 2:
            raise ConfigError(f"bias takes at most two tensors, got {len(biases)}")
        for i, b in enumerate(biases):
            if b is not None:
                _check_tensor(b, f"bias[{i}]", x.dtype, (tokens, x.shape[1]))
        row_bytes = x.shape[1] * x.element_size() + (0 if topk_weights is None else topk_weights.shape[1] * 4)
        self._check_capacity(max(num_recv, sum(plan.send_counts)) * row_bytes, "combine")
        if previous_event is not None:
            previous_event.current_stream_wait()
        if weighted:
            x = (x.float() * topk_weights.sum(dim=1, keepdim=True)).to(x.dtype)
        combined, combined_weights = self.strategy.combine_rows(plan, x, topk_weights, biases)
        return combined, combined_weights, self._finish_event(x.device, async_finish)

    # ----------------------------------------------------------------- CUDA graphs
    def capture_graph(self, fn: Callable[[], Any]) -> CapturedGraph:
        """Record ``fn``, a fixed sequence of cached dispatches and combines on this buffer, as CUDA graphs.

        Replaying costs one graph launch of host time instead of the Python and kernel-launch work of every op
        (DeepEP supports CUDA graphs for its low-latency ops; here the normal cached ops can be captured).
        Collective: every rank calls it at the same point with the same sequence of ops, and later replays
        in the same order as its peers (mixed freely with eager ops, as long as every rank does the same).

        ``fn`` first runs twice eagerly (compiles the kernels, sizes the symmetric buffer), then is captured
        once for each parity of the epoch of its first op (the two data halves; the epoch itself lives on the
        device, so the recorded kernels need no per-call argument).

        Parameters
        ----------
        fn : callable, no arguments
            Calls ``dispatch(x, handle=...)`` and/or ``combine(...)`` of this buffer (no layout and no fresh
            dispatch: those synchronise with the host). Inputs are read, at replay, from the tensors ``fn``
            used: write new data into them in place.

        Returns
        -------
        CapturedGraph whose :meth:`CapturedGraph.replay` runs the ops on the current stream and returns what
        ``fn`` returned while that variant was captured: static tensors, overwritten by a later replay.

        Raises
        ------
        ConfigError : the strategy cannot be captured (only ``cuda``), ``fn`` issues no data op, needs a count
            exchange or a host synchronisation, or the capture fails.
        """
        self._check_alive()
        strategy = self.strategy
        if not getattr(strategy, "graph_capturable", False) or not torch.cuda.is_available():
            raise ConfigError(f"capture_graph needs the cuda strategy on a GPU; this buffer uses "
                              f"{self.strategy_name!r}")
        for _ in range(2):
            first, counts_before = strategy.data_epoch, strategy.count_epoch
            fn()
            num_ops = strategy.data_epoch - first
            if strategy.count_epoch != counts_before:
                raise ConfigError("capture_graph: fn exchanged counts (a dispatch without handle); only cached "
                                  "dispatch and combine can be captured")
            if num_ops == 0:
                raise ConfigError("capture_graph: fn issued no cached dispatch or combine on this buffer")
        torch.cuda.synchronize()
        generation, resume = strategy.generation, strategy.data_epoch
        graphs, outputs = [], []
        for parity in (0, 1):
            # No kernel runs during capture, so the device epoch stays put; the host copy is moved only so
            # that the ops pick the data halves of this variant, then restored.
            strategy.data_epoch = resume + (parity - resume - 1) % 2
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    outputs.append(fn())
            except RuntimeError as exc:
                raise ConfigError(f"capture_graph: capturing fn failed ({exc}); fn may only issue cached "
                                  f"dispatches and combines") from exc
            finally:
                strategy.data_epoch = resume
            if strategy.generation != generation:
                raise ConfigError("capture_graph: the symmetric buffer grew during capture; run fn eagerly first")
            graphs.append(graph)
        return CapturedGraph(self, graphs, outputs, num_ops, generation)

    # ----------------------------------------------------------------- low latency
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        """Send one message per valid (token, expert) slot into a per-expert packed layout.

        Parameters
        ----------
        x : bf16 [T, H], ``T <= M``, ``H % 128 == 0``
        topk_idx : int64 [T, K], ``K <= 11``, ``-1`` = unused slot
        num_max_dispatch_tokens_per_rank : int, M (the same on all ranks)
        num_experts : int, E
        cumulative_local_expert_recv_stats : int32 [L] or None, incremented by the received counts
        use_fp8, round_scale, use_ue8m0 : quantise in transit (see :mod:`ascend_dualpath.moe.quant`)
        return_recv_hook : if True, the receive half runs only when the returned ``hook()`` is called

        Returns
        -------
        (recv_x: bf16 [L, R·M, H], or (e4m3 [L, R·M, H], scales float32 [L, R·M, H/128] or UE8M0 int32
        [L, R·M, H/512], both scale layouts column-major in the last two dims),
        recv_count int32 [L], handle (src_info int32 [L, R·M], layout_range int64 [L, R], M, H, E),
        EventOverlap, hook). Only the first ``recv_count[l]`` rows of expert ``l`` are meaningful (the
        rest are zero); ``layout_range[l, r] = begin << 32 | count`` locates source rank r's rows and
        ``src_info`` gives each row's token index on its source rank. Rows come in source-rank order and
        ascending token index (DeepEP's order is arrival order; do not rely on either).
        """
        self._check_alive()
        local_experts = self._check_ll_common(topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                              async_finish, return_recv_hook)
        _check_tensor(x, "x", torch.bfloat16, (topk_idx.shape[0], None))
        tokens, hidden = x.shape
        self._check_ll_hidden(hidden, num_max_dispatch_tokens_per_rank, num_experts)
        if use_ue8m0 and not round_scale:
            raise ConfigError("use_ue8m0=True needs round_scale=True")
        if use_ue8m0 and not use_fp8:
            raise ConfigError("use_ue8m0=True needs use_fp8=True")
        if use_ue8m0 and hidden % (4 * quant.FP8_BLOCK):
            raise AlignmentError(f"UE8M0 scales need hidden % {4 * quant.FP8_BLOCK} == 0, got hidden={hidden}")
        if cumulative_local_expert_recv_stats is not None:
            _check_tensor(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats", torch.int32,
                          (local_experts,))
        if dispatch_wait_recv_cost_stats is not None:
            raise ConfigError("dispatch_wait_recv_cost_stats is not supported (no device-side wait to time)")
        num_ranks, slots = self.group_size, self.group_size * num_max_dispatch_tokens_per_rank
        device = x.device
        ll_dispatch = getattr(self.strategy, "ll_dispatch", None)
        if ll_dispatch is not None:  # a device kernel (cuda): no host work past the checks above
            recv_x, recv_count, src_info, layout_range, receive = ll_dispatch(
                x.contiguous(), topk_idx.contiguous(), num_max_dispatch_tokens_per_rank, num_experts, use_fp8,
                round_scale, use_ue8m0,
                cumulative_local_expert_recv_stats, return_recv_hook)
            hook = _OnceHook(receive if receive is not None else lambda: None, "low-latency dispatch receive")
            if not return_recv_hook:
                hook()  # a strategy that launched the halves apart (no fused launch) receives now
            handle = (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)
            return recv_x, recv_count, handle, self._finish_event(device, async_finish), hook

        token_of, slot_of, dest_key = self._ll_selections(topk_idx, local_experts)
        dest_rank = dest_key // local_experts
        send_counts = torch.bincount(dest_rank, minlength=num_ranks)
        # the shapes and options every rank must share travel with the counts (fixed size: one exchange)
        agreement = _agreement_vector(
            "low-latency dispatch", num_experts=num_experts, hidden=hidden, x_dtype=x.dtype,
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank, use_fp8=use_fp8,
            round_scale=round_scale, use_ue8m0=use_ue8m0)
        table = self.strategy.exchange_counts(torch.cat([send_counts, agreement.to(device)]),
                                              "low-latency dispatch counts")
        _check_agreement(table[:, num_ranks:], "low_latency_dispatch")
        count_matrix = table[:, :num_ranks]
        payload = [x.index_select(0, token_of)]
        if use_fp8:
            payload = list(quant.per_token_cast_to_fp8(payload[0], round_scale=round_scale))
        payload += [(dest_key % local_experts).to(torch.int32), token_of.to(torch.int32)]
        pending = self.strategy.exchange_rows(payload, send_counts.tolist(), count_matrix[:, self.rank].tolist(),
                                              "low-latency dispatch rows")

        values_dtype = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
        recv_values = torch.zeros(local_experts, slots, hidden, dtype=values_dtype, device=device)
        recv_scales = None
        if use_fp8:
            blocks = hidden // quant.FP8_BLOCK // (4 if use_ue8m0 else 1)
            recv_scales = torch.zeros(local_experts, blocks, slots, dtype=torch.int32 if use_ue8m0 else torch.float32,
                                      device=device).transpose(1, 2)
        recv_count = torch.zeros(local_experts, dtype=torch.int32, device=device)
        src_info = torch.full((local_experts, slots), -1, dtype=torch.int32, device=device)
        layout_range = torch.zeros(local_experts, num_ranks, dtype=torch.int64, device=device)
        recv_counts_per_source = count_matrix[:, self.rank]

        def receive() -> None:
            rows = pending.wait()
            local_id, src_token = rows[-2].long(), rows[-1]
            src_rank = torch.repeat_interleave(torch.arange(num_ranks, device=device),
                                               recv_counts_per_source.to(device))
            order = torch.sort(local_id, stable=True).indices  # (expert, source rank, token) order
            per_expert = torch.bincount(local_id, minlength=local_experts)
            starts = per_expert.cumsum(0) - per_expert
            sorted_expert = local_id[order]
            position = torch.arange(order.numel(), device=device) - starts[sorted_expert]
            recv_values[sorted_expert, position] = rows[0][order]
            if recv_scales is not None:
                scales = rows[1][order]
                recv_scales[sorted_expert, position] = quant.pack_ue8m0(scales) if use_ue8m0 else scales
            src_info[sorted_expert, position] = src_token[order]
            recv_count.copy_(per_expert.to(torch.int32))
            per_pair = torch.bincount(local_id * num_ranks + src_rank, minlength=local_experts * num_ranks)
            per_pair = per_pair.view(local_experts, num_ranks)
            begins = per_pair.cumsum(1) - per_pair
            layout_range.copy_((begins << 32) | per_pair)
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(per_expert.to(torch.int32))

        hook = _OnceHook(receive, "low-latency dispatch receive")
        if not return_recv_hook:
            hook()
        recv_x = (recv_values, recv_scales) if use_fp8 else recv_values
        handle = (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)
        return recv_x, recv_count, handle, self._finish_event(device, async_finish), hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None):
        """Return expert outputs to their tokens and take the weighted sum over each token's valid slots.

        Parameters
        ----------
        x : bf16 [L, R·M, H]: expert outputs in the packed layout of the matching low-latency dispatch
        topk_idx : int64 [T, K] and topk_weights float32 [T, K]: the dispatch's inputs on this rank
        handle : the dispatch's handle
        out : bf16 [T, H] or None: written in place and returned

        Returns
        -------
        (combined_x bf16 [T, H], EventOverlap, hook) with ``combined_x[t] = Σ_{k: topk_idx[t,k] != -1}
        topk_weights[t,k] · x[expert, slot]`` accumulated in float32 in slot order.
        """
        self._check_alive()
        if not isinstance(handle, tuple) or len(handle) != 5:
            raise ConfigError("handle must be the 5-tuple returned by low_latency_dispatch")
        src_info, layout_range, max_tokens, hidden, num_experts = handle
        local_experts = self._check_ll_common(topk_idx, max_tokens, num_experts, async_finish, return_recv_hook)
        num_ranks = self.group_size
        _check_tensor(x, "x", torch.bfloat16, (local_experts, num_ranks * max_tokens, hidden))
        _check_tensor(topk_weights, "topk_weights", torch.float32, tuple(topk_idx.shape))
        if out is not None:
            _check_tensor(out, "out", torch.bfloat16, (topk_idx.shape[0], hidden))
        if use_logfmt or zero_copy:
            raise ConfigError("use_logfmt and zero_copy are not supported (no device-side LL buffer to write into)")
        if combine_wait_recv_cost_stats is not None:
            raise ConfigError("combine_wait_recv_cost_stats is not supported (no device-side wait to time)")
        self._check_ll_hidden(hidden, max_tokens, num_experts)
        tokens, device = topk_idx.shape[0], x.device
        ll_combine = getattr(self.strategy, "ll_combine", None)
        if ll_combine is not None:  # a device kernel (cuda)
            _check_tensor(layout_range, "handle layout_range", torch.int64, (local_experts, num_ranks))
            result = out if out is not None else torch.empty(tokens, hidden, dtype=torch.bfloat16, device=device)
            target = result if result.is_contiguous() else torch.empty_like(
                result, memory_format=torch.contiguous_format)
            receive = ll_combine(x, topk_idx.contiguous(), topk_weights.contiguous(), layout_range, max_tokens,
                                 num_experts, target, return_recv_hook)

            def finish() -> None:
                if receive is not None:
                    receive()
                if target is not result:
                    result.copy_(target)

            if not return_recv_hook:
                finish()
            hook = _OnceHook(finish if return_recv_hook else lambda: None, "low-latency combine receive")
            return result, self._finish_event(device, async_finish), hook

        token_of, slot_of, dest_key = self._ll_selections(topk_idx, local_experts)
        recv_counts = torch.bincount(dest_key // local_experts, minlength=num_ranks).tolist()
        ranges = layout_range.cpu()
        # Rows to send back, grouped by source rank, then local expert, then position: (expert, source) pairs
        # in source-major order, each a run of ``count`` rows from ``expert * R * M + begin``.
        begins, counts = (ranges >> 32).t().reshape(-1), (ranges & 0xFFFFFFFF).t().reshape(-1)
        pair_expert = torch.arange(local_experts).repeat(num_ranks)
        total = int(counts.sum())
        pair_of_row = torch.repeat_interleave(torch.arange(counts.numel()), counts, output_size=total)
        within = torch.arange(total) - (torch.cumsum(counts, 0) - counts)[pair_of_row]
        row_index = (pair_expert[pair_of_row] * num_ranks * max_tokens + begins[pair_of_row] + within).to(device)
        send_counts = counts.view(num_ranks, local_experts).sum(dim=1).tolist()
        send = x.reshape(-1, hidden).index_select(0, row_index)
        pending = self.strategy.exchange_rows([send], send_counts, recv_counts, "low-latency combine rows")
        result = out if out is not None else torch.empty(tokens, hidden, dtype=torch.bfloat16, device=device)

        def receive() -> None:
            back = pending.wait()[0]
            per_slot = torch.zeros(tokens, topk_idx.shape[1], hidden, dtype=torch.float32, device=device)
            per_slot[token_of, slot_of] = back.float()
            weights = torch.where(topk_idx >= 0, topk_weights, torch.zeros_like(topk_weights))
            acc = torch.zeros(tokens, hidden, dtype=torch.float32, device=device)
            for slot in range(topk_idx.shape[1]):
                acc += weights[:, slot:slot + 1] * per_slot[:, slot]
            result.copy_(acc.to(torch.bfloat16))

        hook = _OnceHook(receive, "low-latency combine receive")
        if not return_recv_hook:
            hook()
        return result, self._finish_event(device, async_finish), hook

    def _check_ll_common(self, topk_idx, max_tokens, num_experts, async_finish, return_recv_hook) -> int:
        if not self.low_latency_mode:
            raise ConfigError("low-latency ops need Buffer(..., low_latency_mode=True)")
        if async_finish and return_recv_hook:
            raise ConfigError("async_finish and return_recv_hook are mutually exclusive")
        local_experts = self._num_experts_check(num_experts)
        if not isinstance(max_tokens, int) or max_tokens <= 0:
            raise ConfigError(f"num_max_dispatch_tokens_per_rank={max_tokens!r} must be a positive int")
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
            raise ConfigError("topk_idx must be a 2-D int64 tensor [tokens, topk]")
        if topk_idx.shape[0] > max_tokens:
            raise PayloadTooLarge(f"{topk_idx.shape[0]} tokens exceed num_max_dispatch_tokens_per_rank={max_tokens}")
        if topk_idx.shape[1] > LL_MAX_TOPK:
            raise ConfigError(f"low-latency top-k {topk_idx.shape[1]} exceeds {LL_MAX_TOPK}")
        _check_topk_idx(topk_idx, topk_idx.shape[0], num_experts)
        return local_experts

    def _check_ll_hidden(self, hidden: int, max_tokens: int, num_experts: int) -> None:
        if hidden % quant.FP8_BLOCK:
            raise AlignmentError(f"low-latency ops need hidden % {quant.FP8_BLOCK} == 0, got hidden={hidden}")
        needed = self.get_low_latency_rdma_size_hint(max_tokens, hidden, self.group_size, num_experts)
        if needed > self.num_rdma_bytes:
            raise CapacityError(f"low-latency ops with M={max_tokens}, hidden={hidden}, {num_experts} experts need "
                                f"num_rdma_bytes >= {needed} (get_low_latency_rdma_size_hint), got "
                                f"{self.num_rdma_bytes}")

    @staticmethod
    def _ll_selections(topk_idx: torch.Tensor, local_experts: int):
        """Valid (token, slot) pairs sorted by (destination rank, local expert, token, slot), and their expert ids."""
        token_of, slot_of = (topk_idx >= 0).nonzero(as_tuple=True)
        experts = topk_idx[token_of, slot_of]
        order = torch.sort(experts, stable=True).indices
        return token_of[order], slot_of[order], experts[order]


class CapturedGraph:
    """Cached dispatches/combines recorded by :meth:`Buffer.capture_graph`, one CUDA graph per epoch parity."""

    def __init__(self, buffer: Buffer, graphs: list, outputs: list, num_ops: int, generation: int) -> None:
        self._buffer, self._graphs, self._outputs = buffer, graphs, outputs
        self.num_ops, self._generation = num_ops, generation

    def replay(self) -> Any:
        """Run the recorded ops on the current stream; returns the captured outputs of the variant replayed."""
        self._buffer._check_alive()
        strategy = self._buffer.strategy
        if strategy.generation != self._generation:
            raise ConfigError("the buffer's symmetric memory was replaced after capture (an op needed more room); "
                              "capture again")
        parity = (strategy.data_epoch + 1) % 2
        self._graphs[parity].replay()
        strategy.data_epoch += self.num_ops
        return self._outputs[parity]


class _OnceHook:
    """The receive half of a low-latency op; runs at most once (a second call is a no-op)."""

    def __init__(self, receive: Callable[[], None], what: str) -> None:
        self._receive: Callable[[], None] | None = receive
        self.what = what

    def __call__(self) -> None:
        if self._receive is not None:
            receive, self._receive = self._receive, None
            receive()
