"""``Buffer``: DeepEP V1's MoE dispatch/combine API over pluggable strategies.

Names, arguments and return tuples follow DeepEP V1 (``deep_ep.Buffer``); docs/moe.md lists every deviation.
The buffer is a thin shell: it validates all inputs *before* any communication
(:mod:`ascend_dualpath.moe.validation`: bad input raises the same error on every rank and nothing is
half-sent), takes the kernel settings from a :class:`~ascend_dualpath.moe.config.Config`, and hands the data
movement to a strategy (:class:`~ascend_dualpath.moe.strategies.base.Strategy`, see
:mod:`ascend_dualpath.moe.strategies`). Shapes: ``R`` ranks, ``E`` experts, ``L = E / R`` local experts,
``T`` tokens on this rank, ``K`` top-k slots, ``H`` hidden, ``N`` received tokens, ``M`` =
``num_max_dispatch_tokens_per_rank``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ascend_dualpath import _env
from ascend_dualpath._checks import check_bound, check_type
from ascend_dualpath.errors import AlignmentError, CapacityError, ConfigError
from ascend_dualpath.moe import config as configs
from ascend_dualpath.moe import quant
from ascend_dualpath.moe import validation as v
from ascend_dualpath.moe.config import Config
from ascend_dualpath.moe.event import EventOverlap
from ascend_dualpath.moe.handle import DispatchHandle
from ascend_dualpath.moe.strategies.base import NormalPlan, to_device_async

BUFFER_ALIGNMENT_BYTES = 128
LL_MESSAGE_HEADER_BYTES = 16
# re-exported: the limits Buffer's docstrings name
MAX_LOCAL_EXPERTS, LL_MAX_TOPK, TOPK_IDX_DTYPE = v.MAX_LOCAL_EXPERTS, v.LL_MAX_TOPK, v.TOPK_IDX_DTYPE
SUPPORTED_X_DTYPES = v.SUPPORTED_X_DTYPES


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


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

    Raises
    ------
    ArgumentTypeError, ConfigError
        Arguments are checked by name before any communication: a wrong type raises
        :class:`~ascend_dualpath.errors.ArgumentTypeError`, a NaN, infinite or non-positive bound
        :class:`ConfigError`.

    Examples
    --------
    One rank over gloo (every rank of a real group runs the same code):

    >>> import tempfile, torch, torch.distributed as dist
    >>> from ascend_dualpath import moe
    >>> dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    >>> buffer = moe.Buffer(None, num_nvl_bytes=1 << 20, strategy="alltoall")
    >>> x = torch.randn(4, 128, dtype=torch.bfloat16)
    >>> topk_idx = torch.tensor([[0, 1], [1, -1], [0, 1], [1, 0]])
    >>> topk_weights = torch.full((4, 2), 0.5)
    >>> per_rank, per_node, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts=2)
    >>> recv_x, recv_idx, recv_w, per_expert_list, handle, _ = buffer.dispatch(
    ...     x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
    ...     topk_idx=topk_idx, topk_weights=topk_weights)
    >>> per_expert_list
    [3, 4]
    >>> combined, _, _ = buffer.combine(recv_x, handle)
    >>> torch.equal(combined, x)
    True
    >>> buffer.destroy(); dist.destroy_process_group()
    """

    num_sms = 0

    def __init__(
        self,
        group: Any = None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        *,
        strategy: str = "auto",
        ranks_per_node: int = 8,
        timeout_s: float | None = None,
    ) -> None:
        import torch.distributed as dist

        from ascend_dualpath.moe import strategies

        _check_init_types(
            num_nvl_bytes=num_nvl_bytes,
            num_rdma_bytes=num_rdma_bytes,
            num_qps_per_rank=num_qps_per_rank,
            ranks_per_node=ranks_per_node,
            low_latency_mode=low_latency_mode,
            explicitly_destroy=explicitly_destroy,
            allow_nvlink_for_low_latency_mode=allow_nvlink_for_low_latency_mode,
            allow_mnnvl=allow_mnnvl,
            strategy=strategy,
        )
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

    def _check_capacity(self, needed: int, what: str) -> None:
        v.check_capacity(needed, self.capacity_bytes, what)

    def _finish_event(self, x_device: torch.device, async_finish: bool) -> EventOverlap:
        return EventOverlap.capture(x_device) if async_finish else EventOverlap(None)

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
        """The tuned dispatch :class:`Config` for ``num_ranks`` (:data:`ascend_dualpath.moe.config.DISPATCH_CONFIGS`),
        with :meth:`set_num_sms`'s SM count."""
        return configs.dispatch_config(num_ranks).with_num_sms(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """The tuned combine :class:`Config` for ``num_ranks`` (:data:`ascend_dualpath.moe.config.COMBINE_CONFIGS`),
        with :meth:`set_num_sms`'s SM count."""
        return configs.combine_config(num_ranks).with_num_sms(Buffer.num_sms)

    @staticmethod
    def get_normal_buffer_size_hint(
        num_max_tokens_per_rank: int, hidden_bytes: int, num_ranks: int, num_topk: int = 0
    ) -> int:
        """Bytes a normal dispatch/combine may need at worst: every rank sends all its tokens here."""
        row = hidden_bytes + v.SOURCE_INDEX_BYTES + num_topk * v.TOPK_SLOT_BYTES
        return _align_up(num_ranks * num_max_tokens_per_rank * row, BUFFER_ALIGNMENT_BYTES)

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
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
        needed = self.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank, hidden, self.group_size, num_experts
        )
        if needed > self.num_rdma_bytes:
            raise CapacityError(f"low-latency mode needs num_rdma_bytes >= {needed}, got {self.num_rdma_bytes}")

    def destroy(self) -> None:
        self._check_alive()
        self._destroyed = True
        self.strategy.close()

    # ----------------------------------------------------------------- layout
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
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
        v.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        v.check_num_experts(num_experts, self.group_size)
        v.check_topk_2d(topk_idx)
        v.check_tensor(topk_idx, "topk_idx", v.TOPK_IDX_DTYPE, (topk_idx.shape[0], None))
        if previous_event is not None:
            previous_event.current_stream_wait()
        # The default strategy checks the ids before it counts; the cuda one computes layout and id range in one
        # kernel and leaves the range for the count exchange of the fresh dispatch given this layout.
        layout, id_range = self.strategy.dispatch_layout(topk_idx, num_experts, self.group_size, self.ranks_per_node)
        if id_range is not None:
            v.check_id_range(*id_range, num_experts)
        return (*layout, self._finish_event(topk_idx.device, async_finish))

    # ----------------------------------------------------------------- normal dispatch
    def dispatch(
        self,
        x: Any,
        handle: DispatchHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
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
        config : Config or None
            Kernel settings of the plan this fresh dispatch makes (default :meth:`get_dispatch_config`); its
            cached dispatches and its combine run with them.

        Returns
        -------
        (recv_x [N, H] (or tuple like x), recv_topk_idx int64 [N, K] (local ids, -1 elsewhere) or None,
        recv_topk_weights float32 [N, K] (0 where recv_topk_idx == -1) or None,
        num_recv_tokens_per_expert_list list[int] of length L, handle, EventOverlap).
        Rows arrive grouped by source rank 0..R-1, ascending source token index within a source.
        Cached mode returns ``(recv_x, None, None, None, None, event)``.
        """
        self._check_alive()
        v.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        v.check_config(config)
        parts = v.x_parts(x)
        if handle is not None:
            return self._cached_dispatch(x, parts, handle, topk_idx, topk_weights, previous_event, async_finish)
        args = v.check_dispatch(
            parts,
            group_size=self.group_size,
            num_nodes=self.num_nodes,
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            expert_alignment=expert_alignment,
            num_worst_tokens=num_worst_tokens,
        )
        if parts[0].shape[0] * self.group_size * args.row_bytes > self.capacity_bytes:
            # Only a budget this small can be exceeded by the send side: then the exact count is worth a host
            # sync, and the error comes before any communication.
            self._check_capacity(
                int(num_tokens_per_rank.sum()) * args.row_bytes, f"dispatch on rank {self.rank} (send)"
            )
        if previous_event is not None:
            previous_event.current_stream_wait()
        table = self._exchange_dispatch_counts(
            parts, args, num_tokens_per_rank, num_tokens_per_expert, topk_idx, is_token_in_rank, num_worst_tokens
        )
        count_matrix = table[:, : self.group_size]
        plan = NormalPlan(
            self.rank,
            is_token_in_rank,
            count_matrix,
            private={
                "config": config if config is not None else self.get_dispatch_config(self.group_size),
                "num_experts": args.num_experts,
                "num_topk": args.num_topk,
            },
        )
        self.strategy.prepare_plan(plan)
        payload = [
            *parts,
            *(() if topk_idx is None else (topk_idx, topk_weights)),
            self.strategy.source_index(parts[0].shape[0], parts[0].device),
        ]
        recv = self.strategy.dispatch_rows(plan, payload, "dispatch rows")
        plan.recv_src_idx = recv[-1]
        recv_parts = recv[: len(parts)]
        recv_topk_idx = recv_topk_weights = None
        counts_list: list[int] = []
        if topk_idx is not None:
            recv_topk_idx, recv_topk_weights = self.strategy.localize_topk(
                recv[len(parts)], recv[len(parts) + 1], self.rank, args.local_experts
            )
            counts_list = self._recv_counts_per_expert(table, args, expert_alignment)
        if num_worst_tokens:
            recv_parts, recv_topk_idx, recv_topk_weights = _pad_to_worst(
                num_worst_tokens - plan.num_recv_tokens, recv_parts, recv_topk_idx, recv_topk_weights
            )
            counts_list = []
        rank_prefix_matrix = (plan.private or {}).get("rank_prefix_matrix")  # made on the device by the strategy
        if rank_prefix_matrix is None:
            rank_prefix_matrix = to_device_async(count_matrix.cumsum(dim=0).to(torch.int32), parts[0].device)
        new_handle = DispatchHandle(rank_prefix_matrix, plan.recv_src_idx, is_token_in_rank, plan)
        recv_x = tuple(recv_parts) if isinstance(x, tuple) else recv_parts[0]
        return (
            recv_x,
            recv_topk_idx,
            recv_topk_weights,
            counts_list,
            new_handle,
            self._finish_event(parts[0].device, async_finish),
        )

    def _exchange_dispatch_counts(
        self,
        parts: list[torch.Tensor],
        args: v.DispatchArgs,
        num_tokens_per_rank: torch.Tensor,
        num_tokens_per_expert: torch.Tensor,
        topk_idx: torch.Tensor | None,
        is_token_in_rank: torch.Tensor,
        num_worst_tokens: int,
    ) -> torch.Tensor:
        """The ranks first agree on the shapes and options (the count table's width depends on num_experts),
        then one exchange carries every rank's counts per rank and per expert and the statistics its inputs are
        checked with (id range, layout sums), so all ranks raise the same error before any data moves.
        Returns the CPU int64 table ``[R, R + E + 4]``."""
        scales = parts[1] if len(parts) > 1 else None
        agreement = v.agreement_vector(
            "dispatch",
            num_experts=args.num_experts,
            hidden=parts[0].shape[1],
            x_dtype=parts[0].dtype,
            scales_dtype=scales.dtype if scales is not None else 0,
            scales_width=math.prod(scales.shape[1:]) if scales is not None else 0,
            num_topk=args.num_topk,
            num_worst_tokens=num_worst_tokens,
        )
        v.check_agreement(self.strategy.exchange_counts(agreement.to(parts[0].device), "dispatch shapes"), "dispatch")
        table = self.strategy.exchange_dispatch_counts(
            num_tokens_per_rank, num_tokens_per_expert, topk_idx, is_token_in_rank, "dispatch token counts"
        )
        v.check_dispatch_table(table, args.num_experts, self.capacity_bytes, args.row_bytes, num_worst_tokens)
        return table

    def _recv_counts_per_expert(self, table: torch.Tensor, args: v.DispatchArgs, expert_alignment: int) -> list[int]:
        """Tokens this rank receives per local expert, each rounded up to ``expert_alignment``."""
        first = self.group_size + self.rank * args.local_experts
        mine = table[:, first : first + args.local_experts].sum(dim=0)
        return ((mine + expert_alignment - 1) // expert_alignment * expert_alignment).tolist()

    def _cached_dispatch(self, x, parts, handle, topk_idx, topk_weights, previous_event, async_finish):
        v.check_handle(handle, DispatchHandle)
        plan = handle.plan
        v.check_cached_dispatch(plan, parts, topk_idx, topk_weights)
        row_bytes = sum(v.row_bytes(p) for p in parts)
        self._check_capacity(max(sum(plan.send_counts), plan.num_recv_tokens) * row_bytes, "cached dispatch")
        if previous_event is not None:
            previous_event.current_stream_wait()
        recv = self.strategy.dispatch_rows(plan, parts, "cached dispatch rows")
        recv_x = tuple(recv) if isinstance(x, tuple) else recv[0]
        return recv_x, None, None, None, None, self._finish_event(parts[0].device, async_finish)

    # ----------------------------------------------------------------- normal combine
    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None = None,
        bias: Any = None,
        config: Config | None = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        *,
        weighted: bool = False,
    ):
        """Return every received row to its source and sum per token (the reverse of :meth:`dispatch`).

        Parameters
        ----------
        x : Tensor [N (or more, worst-token mode), H] bf16/fp16/fp32: one row per received token
        handle : the handle of the dispatch that produced the rows
        topk_weights : float32 [N, K] or None: the dispatch's ``recv_topk_weights``
        bias : Tensor [T, H] or a pair of them (either may be None), added after the sum
        config : Config or None: validated; the kernels run with the config of the dispatch that made ``handle``
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
        v.check_stream_args(previous_event, async_finish, allocate_on_comm_stream)
        v.check_handle(handle, DispatchHandle)
        v.check_config(config)
        plan = handle.plan
        x, topk_weights, biases = v.check_combine(x, plan, topk_weights, bias, weighted)
        row_bytes = x.shape[1] * x.element_size() + (0 if topk_weights is None else topk_weights.shape[1] * 4)
        self._check_capacity(max(plan.num_recv_tokens, sum(plan.send_counts)) * row_bytes, "combine")
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
            raise ConfigError(
                f"capture_graph needs the cuda strategy on a GPU; this buffer uses {self.strategy_name!r}"
            )
        for _ in range(2):
            first, counts_before = strategy.data_epoch, strategy.count_epoch
            fn()
            num_ops = strategy.data_epoch - first
            if strategy.count_epoch != counts_before:
                raise ConfigError(
                    "capture_graph: fn exchanged counts (a dispatch without handle); only cached "
                    "dispatch and combine can be captured"
                )
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
                raise ConfigError(
                    f"capture_graph: capturing fn failed ({exc}); fn may only issue cached dispatches and combines"
                ) from exc
            finally:
                strategy.data_epoch = resume
            if strategy.generation != generation:
                raise ConfigError("capture_graph: the symmetric buffer grew during capture; run fn eagerly first")
            graphs.append(graph)
        return CapturedGraph(self, graphs, outputs, num_ops, generation)

    # ----------------------------------------------------------------- low latency
    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ):
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
        max_tokens = num_max_dispatch_tokens_per_rank
        local_experts = v.check_ll_common(
            topk_idx, max_tokens, num_experts, self.group_size, self.low_latency_mode, async_finish, return_recv_hook
        )
        v.check_tensor(x, "x", torch.bfloat16, (topk_idx.shape[0], None))
        hidden = x.shape[1]
        self._check_ll_hidden(hidden, max_tokens, num_experts)
        v.check_ll_dispatch_options(
            hidden,
            use_fp8,
            round_scale,
            use_ue8m0,
            cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats,
            local_experts,
        )
        recv_x, recv_count, src_info, layout_range, receive = self.strategy.ll_dispatch(
            x.contiguous(),
            topk_idx.contiguous(),
            max_tokens,
            num_experts,
            use_fp8,
            round_scale,
            use_ue8m0,
            cumulative_local_expert_recv_stats,
            return_recv_hook,
        )
        hook = _OnceHook(receive if receive is not None else _nothing, "low-latency dispatch receive")
        if not return_recv_hook:
            hook()
        handle = (src_info, layout_range, max_tokens, hidden, num_experts)
        return recv_x, recv_count, handle, self._finish_event(x.device, async_finish), hook

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: tuple,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ):
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
        _, layout_range, max_tokens, hidden, num_experts = handle
        local_experts = v.check_ll_common(
            topk_idx, max_tokens, num_experts, self.group_size, self.low_latency_mode, async_finish, return_recv_hook
        )
        v.check_ll_combine_options(
            x,
            topk_idx,
            topk_weights,
            out,
            hidden,
            local_experts,
            self.group_size * max_tokens,
            use_logfmt,
            zero_copy,
            combine_wait_recv_cost_stats,
        )
        self._check_ll_hidden(hidden, max_tokens, num_experts)
        v.check_tensor(layout_range, "handle layout_range", torch.int64, (local_experts, self.group_size))
        tokens, device = topk_idx.shape[0], x.device
        result = out if out is not None else torch.empty(tokens, hidden, dtype=torch.bfloat16, device=device)
        # the strategies write a contiguous [T, H]; a strided ``out`` gets the result copied in
        target = result if result.is_contiguous() else torch.empty_like(result, memory_format=torch.contiguous_format)
        receive = self.strategy.ll_combine(
            x,
            topk_idx.contiguous(),
            topk_weights.contiguous(),
            layout_range,
            max_tokens,
            num_experts,
            target,
            return_recv_hook,
        )

        def finish() -> None:
            if receive is not None:
                receive()
            if target is not result:
                result.copy_(target)

        hook = _OnceHook(finish, "low-latency combine receive")
        if not return_recv_hook:
            hook()
        return result, self._finish_event(device, async_finish), hook

    def _check_ll_hidden(self, hidden: int, max_tokens: int, num_experts: int) -> None:
        needed = self.get_low_latency_rdma_size_hint(max_tokens, hidden, self.group_size, num_experts)
        v.check_ll_hidden(hidden, needed, self.num_rdma_bytes, max_tokens, num_experts)


def _check_init_types(*, strategy: str, **values: Any) -> None:
    """Buffer's argument types, by name: the byte counts and counts int, the switches bool."""
    for name, value in values.items():
        check_type(name, value, bool if name in _BOOL_ARGS else int, where="Buffer")
    check_type("strategy", strategy, str, where="Buffer")


_BOOL_ARGS = ("low_latency_mode", "explicitly_destroy", "allow_nvlink_for_low_latency_mode", "allow_mnnvl")


def _pad_to_worst(
    pad: int, parts: list[torch.Tensor], topk_idx: torch.Tensor, topk_weights: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Worst-token mode: ``pad`` zero rows after the received ones, top-k ids -1 and weights 0 there."""
    parts = [torch.cat([p, p.new_zeros((pad, *p.shape[1:]))]) for p in parts]
    num_topk = topk_idx.shape[1]
    return (
        parts,
        torch.cat([topk_idx, topk_idx.new_full((pad, num_topk), -1)]),
        torch.cat([topk_weights, topk_weights.new_zeros((pad, num_topk))]),
    )


def _nothing() -> None:
    """The receive half of an op that completed at its call."""


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
            raise ConfigError(
                "the buffer's symmetric memory was replaced after capture (an op needed more room); capture again"
            )
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
