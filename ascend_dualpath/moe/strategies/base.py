"""What a strategy provides: count exchange, row exchange, and (optionally faster) normal dispatch/combine.

:class:`~ascend_dualpath.moe.buffer.Buffer` validates every input, computes layouts and plans, and builds the
low-latency ops on :meth:`Strategy.exchange_counts` and :meth:`Strategy.exchange_rows`; a strategy overrides
:meth:`dispatch_rows` / :meth:`combine_rows` when it has a faster path for normal mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch


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
    """Rows in flight; :meth:`wait` (bounded) returns them as the list of parts that was sent."""

    def __init__(self, finish: Callable[[], list[torch.Tensor]]) -> None:
        self._finish = finish
        self._result: list[torch.Tensor] | None = None

    def wait(self) -> list[torch.Tensor]:
        if self._result is None:
            self._result = self._finish()
        return self._result


class Strategy:
    """Base class; subclasses set :attr:`name` and implement the two exchanges."""

    name = "base"

    def __init__(self, group: Any, timeout_s: float) -> None:
        self.group = group
        self.timeout_s = timeout_s

    def exchange_counts(self, counts: torch.Tensor, what: str) -> torch.Tensor:
        """All-gather one int64 ``[R]`` vector per rank into a CPU int64 ``[R, R]`` matrix (row = sender)."""
        raise NotImplementedError

    def exchange_rows(self, parts: list[torch.Tensor], send_counts: list[int], recv_counts: list[int],
                      what: str) -> PendingRows:
        """Send ``parts`` (each ``[S, ...]``, rows grouped by destination rank) and receive ``[N, ...]`` rows."""
        raise NotImplementedError

    def exchange_dispatch_counts(self, num_tokens_per_rank: torch.Tensor, num_tokens_per_expert: torch.Tensor,
                                 topk_idx: torch.Tensor | None, is_token_in_rank: torch.Tensor,
                                 what: str) -> torch.Tensor:
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
        return self.exchange_counts(torch.cat([num_tokens_per_rank.to(torch.int64),
                                               num_tokens_per_expert.to(torch.int64), stats]), what)

    def prepare_plan(self, plan: NormalPlan) -> None:
        """Hook to attach strategy-private state to a new plan (default: nothing)."""

    def dispatch_rows(self, plan: NormalPlan, parts: list[torch.Tensor], what: str) -> list[torch.Tensor]:
        """Normal dispatch of ``parts`` (each ``[T, ...]``) along ``plan``; returns ``[N, ...]`` rows."""
        send = [part.index_select(0, plan.send_order) for part in parts]
        return self.exchange_rows(send, plan.send_counts, plan.recv_counts, what).wait()

    def combine_rows(self, plan: NormalPlan, x: torch.Tensor, weights: torch.Tensor | None,
                     biases: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        acc_w = None if weights is None else torch.zeros(tokens, weights.shape[1], dtype=torch.float32,
                                                          device=x.device)
        for dst in range(len(offsets) - 1):
            # Each token appears at most once per destination, so this indexed add has no collisions and the
            # per-token order of additions is exactly destination rank 0, 1, ...
            rows = plan.send_order[offsets[dst]:offsets[dst + 1]]
            acc[rows] += back[0][offsets[dst]:offsets[dst + 1]].float()
            if acc_w is not None:
                acc_w[rows] += back[1][offsets[dst]:offsets[dst + 1]].float()
        for bias in biases:
            if bias is not None:
                acc += bias.float()
        return acc.to(x.dtype), acc_w
