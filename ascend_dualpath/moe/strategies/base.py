"""The strategy contract: what :class:`~ascend_dualpath.moe.Buffer` asks of the code that moves the data.

:class:`Strategy` is an abstract base class. A strategy must implement the two exchanges,
:meth:`Strategy.exchange_counts` and :meth:`Strategy.exchange_rows`; every other method has a default built on
them, in plain torch on the host, which a strategy overrides when it has a faster path (the ``cuda`` strategy
overrides all of them with device kernels). The buffer validates every input before it calls a method, and
calls every method of the contract unconditionally: there are no optional hooks to probe for, so a misspelt
override is an unused method, not a silent change of path (``tests/moe/test_moe_strategy_contract.py`` checks
that every public method of a registered strategy belongs to the contract or is documented as its own API).

=========================  ===================================================================================
method                     default
=========================  ===================================================================================
exchange_counts            abstract
exchange_rows              abstract
exchange_dispatch_counts   per-rank + per-expert counts and 4 statistics in one :meth:`exchange_counts`
dispatch_layout            :func:`~ascend_dualpath.moe.layout.compute_dispatch_layout` after a host id check
prepare_plan               nothing
source_index               ``arange(T)`` int32
dispatch_rows              rows grouped by destination, one :meth:`exchange_rows`
localize_topk              global -> local expert ids in torch ops (new tensors)
combine_rows               rows back with :meth:`exchange_rows`, float32 sum per token in rank order
ll_dispatch / ll_combine   host packing around one count exchange and one :meth:`exchange_rows`
close                      nothing
graph_capturable           False (only then may :meth:`Buffer.capture_graph` use the epoch attributes)
=========================  ===================================================================================
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from ascend_dualpath._checks import check_bound
from ascend_dualpath.moe.layout import compute_dispatch_layout
from ascend_dualpath.moe.strategies import _host_ll
from ascend_dualpath.moe.validation import check_id_range


@dataclass
class NormalPlan:
    """Who sends which rows where, for one normal dispatch; kept in the handle for cached dispatch and combine.

    Attributes
    ----------
    is_token_in_rank : bool [T, R]
    count_matrix : int64 [R, R] on the CPU; ``[i, j]`` = tokens rank ``i`` sends to rank ``j``
    send_order : int64 [S]: token indices grouped by destination rank, ascending within a rank (computed on
        first use: strategies that place rows by slot never need it, and it costs a host sync)
    recv_src_idx : int32 [N] or None until received: each received row's token index on its source rank
    private : strategy-specific state (e.g. destination slots), or None
    """

    rank: int
    is_token_in_rank: torch.Tensor
    count_matrix: torch.Tensor
    recv_src_idx: torch.Tensor | None = None
    private: Any = None
    _send_order: torch.Tensor | None = None

    @property
    def send_order(self) -> torch.Tensor:
        if self._send_order is None:
            self._send_order = self.is_token_in_rank.t().nonzero()[:, 1]
        return self._send_order

    # The count matrix is fixed once the plan exists: these are computed once (they run on every cached call).
    @cached_property
    def send_counts(self) -> tuple[int, ...]:
        return tuple(self.count_matrix[self.rank].tolist())

    @cached_property
    def recv_counts(self) -> tuple[int, ...]:
        return tuple(self.count_matrix[:, self.rank].tolist())

    @cached_property
    def num_recv_tokens(self) -> int:
        return sum(self.recv_counts)


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small CPU tensor to ``device`` without a host sync (through pinned memory on CUDA; a pageable
    copy would wait for the stream's earlier work)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class PendingRows:
    """Rows in flight; :meth:`wait` (bounded) returns them as the list of parts that was sent.

    ``finish(timeout_s)`` completes the exchange within ``timeout_s`` seconds or raises
    :class:`~ascend_dualpath.errors.WaitTimeout` naming what it waited for; ``timeout_s`` here is the owner's
    default bound (the strategy's). A wait that timed out may be repeated: ``finish`` runs again until it returns,
    and every later wait returns the same parts.
    """

    def __init__(self, finish: Callable[[float], list[torch.Tensor]], timeout_s: float) -> None:
        self._finish = finish
        self._timeout_s = timeout_s
        self._result: list[torch.Tensor] | None = None

    def wait(self, timeout_s: float | None = None) -> list[torch.Tensor]:
        """The received parts (each ``[N, ...]``, dtypes as sent) once the exchange completed, waiting at most
        ``timeout_s`` seconds (None: the strategy's bound; 0: only what already completed). WaitTimeout after the
        bound; ConfigError for a NaN, infinite or negative bound (the transport's wait protocol)."""
        bound = (
            self._timeout_s
            if timeout_s is None
            else check_bound("timeout_s", timeout_s, zero_ok=True, where="PendingRows.wait")
        )
        if self._result is None:
            self._result = self._finish(bound)
        return self._result


class Strategy(ABC):
    """The contract of a MoE strategy; subclasses set :attr:`name` and implement the two exchanges.

    Shapes: ``R`` ranks, ``E`` experts, ``L = E / R`` local experts, ``T`` tokens on this rank, ``K`` top-k
    slots, ``H`` hidden, ``N`` received rows, ``M`` = ``num_max_dispatch_tokens_per_rank``. Inputs reach a method
    validated (:mod:`ascend_dualpath.moe.validation`).
    """

    name = "base"
    # Whether Buffer.capture_graph may record this strategy's cached ops; a capturable strategy also provides
    # ``data_epoch`` (settable), ``count_epoch`` and ``generation`` (see the cuda strategy).
    graph_capturable = False

    def __init__(self, group: Any, timeout_s: float) -> None:
        self.group = group
        self.timeout_s = timeout_s

    # ------------------------------------------------------------------ the two exchanges (required)
    @abstractmethod
    def exchange_counts(self, counts: torch.Tensor, what: str) -> torch.Tensor:
        """All-gather one int64 ``[W]`` vector per rank into a CPU int64 ``[R, W]`` matrix (row = sender)."""

    @abstractmethod
    def exchange_rows(
        self, parts: list[torch.Tensor], send_counts: list[int], recv_counts: list[int], what: str
    ) -> PendingRows:
        """Send ``parts`` (each ``[S, ...]``, rows grouped by destination rank) and receive ``[N, ...]`` rows."""

    # ------------------------------------------------------------------ layout and counts
    def dispatch_layout(
        self, topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int
    ) -> tuple[tuple, tuple[int, int] | None]:
        """``(layout, id_range)``: the layout 4-tuple of :meth:`Buffer.get_dispatch_layout` and a host-side
        ``(min id, max id)`` for the caller to check, or None when there is none to check now (the default
        checks the ids itself, before the layout indexes with them; the cuda strategy defers the check to the
        count exchange of the fresh dispatch given this layout)."""
        if topk_idx.numel():
            check_id_range(*torch.aminmax(topk_idx), num_experts)
        return compute_dispatch_layout(topk_idx, num_experts, num_ranks, ranks_per_node), None

    def exchange_dispatch_counts(
        self,
        num_tokens_per_rank: torch.Tensor,
        num_tokens_per_expert: torch.Tensor,
        topk_idx: torch.Tensor | None,
        is_token_in_rank: torch.Tensor,
        what: str,
    ) -> torch.Tensor:
        """A fresh dispatch's count exchange: every rank's row of per-rank counts [R], per-expert counts [E] and
        the statistics its inputs are checked with (min id, max id of ``topk_idx`` ((-1, -1) when absent or
        empty), the sum of ``num_tokens_per_rank``, the set entries of ``is_token_in_rank``), as a CPU int64
        ``[R, R + E + 4]`` matrix (row = sender)."""
        device = num_tokens_per_rank.device
        if topk_idx is not None and topk_idx.numel():
            low_high = torch.stack(torch.aminmax(topk_idx))
        else:
            low_high = torch.full((2,), -1, dtype=torch.int64, device=device)
        sums = torch.stack([num_tokens_per_rank.sum(dtype=torch.int64), is_token_in_rank.sum(dtype=torch.int64)])
        stats = torch.cat([low_high.to(device), sums])
        return self.exchange_counts(
            torch.cat([num_tokens_per_rank.to(torch.int64), num_tokens_per_expert.to(torch.int64), stats]), what
        )

    # ------------------------------------------------------------------ normal dispatch and combine
    def prepare_plan(self, plan: NormalPlan) -> None:
        """Attach strategy-private state to a new plan (default: nothing)."""
        return None

    def source_index(self, tokens: int, device: torch.device) -> torch.Tensor:
        """int32 ``[T]`` = ``arange(T)``: the source token index dispatched with each row (only read)."""
        return torch.arange(tokens, dtype=torch.int32, device=device)

    def dispatch_rows(self, plan: NormalPlan, parts: list[torch.Tensor], what: str) -> list[torch.Tensor]:
        """Normal dispatch of ``parts`` (each ``[T, ...]``) along ``plan``; returns ``[N, ...]`` rows."""
        send = [part.index_select(0, plan.send_order) for part in parts]
        return self.exchange_rows(send, plan.send_counts, plan.recv_counts, what).wait()

    def localize_topk(
        self, topk_idx: torch.Tensor, topk_weights: torch.Tensor, rank: int, local_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Received global top-k (int64 [N, K], float32 [N, K]) as local expert ids of ``rank`` (-1 for other
        ranks' experts and unused slots) and weights zeroed where the id is -1. The default returns new
        tensors; an override may work in place on these (fresh) received tensors and return them."""
        local = topk_idx - rank * local_experts
        here = (topk_idx >= 0) & (local >= 0) & (local < local_experts)
        return torch.where(here, local, torch.full_like(local, -1)), torch.where(
            here, topk_weights, torch.zeros_like(topk_weights)
        )

    def combine_rows(
        self, plan: NormalPlan, x: torch.Tensor, weights: torch.Tensor | None, biases: tuple
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Unweighted combine: send rows back, then sum per token in float32 over destination ranks in order.

        Returns ``(combined [T, H] in x.dtype, combined_weights float32 [T, K] or None)``.
        """
        parts = [x] if weights is None else [x, weights]
        back = self.exchange_rows(parts, plan.recv_counts, plan.send_counts, "combine rows").wait()
        tokens = plan.is_token_in_rank.shape[0]
        offsets = [0]
        for count in plan.send_counts:
            offsets.append(offsets[-1] + count)
        acc = torch.zeros(tokens, x.shape[1], dtype=torch.float32, device=x.device)
        acc_w = None if weights is None else torch.zeros(tokens, weights.shape[1], dtype=torch.float32, device=x.device)
        for dst in range(len(offsets) - 1):
            # Each token appears at most once per destination, so this indexed add has no collisions and the
            # per-token order of additions is exactly destination rank 0, 1, ...
            rows = plan.send_order[offsets[dst] : offsets[dst + 1]]
            acc[rows] += back[0][offsets[dst] : offsets[dst + 1]].float()
            if acc_w is not None:
                acc_w[rows] += back[1][offsets[dst] : offsets[dst + 1]].float()
        for bias in biases:
            if bias is not None:
                acc += bias.float()
        return acc.to(x.dtype), acc_w

    # ------------------------------------------------------------------ low latency
    def ll_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        max_tokens: int,
        num_experts: int,
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        stats: torch.Tensor | None,
        deferred: bool,
    ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, Callable[[], None] | None]:
        """Low-latency dispatch: ``(recv_x, recv_count, src_info, layout_range, receive)`` as
        :meth:`Buffer.low_latency_dispatch` documents; ``receive`` (or None) completes the op and is called by
        the buffer at once unless ``deferred`` (``return_recv_hook``).

        The default packs on the host: one count exchange that also carries the agreement vector (the ranks'
        shapes and options must match), one :meth:`exchange_rows` of the (token, expert) messages, and a receive
        that places the rows in (expert, source rank, token) order.
        """
        return _host_ll.dispatch(self, x, topk_idx, max_tokens, num_experts, use_fp8, round_scale, use_ue8m0, stats)

    def ll_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        layout_range: torch.Tensor,
        max_tokens: int,
        num_experts: int,
        out: torch.Tensor,
        deferred: bool,
    ) -> Callable[[], None] | None:
        """Weighted low-latency combine into ``out`` (bf16 [T, H], contiguous); returns the function that
        completes it (or None when done), called by the buffer at once unless ``deferred``.

        The default sends each (expert, source) run of rows back with one :meth:`exchange_rows` and sums every
        token's valid slots in float32 in slot order.
        """
        return _host_ll.combine(self, x, topk_idx, topk_weights, layout_range, max_tokens, num_experts, out)

    def close(self) -> None:
        """Release the strategy's resources (default: nothing to release)."""
        return None
