"""The default low-latency ops of :class:`~ascend_dualpath.moe.strategies.base.Strategy`: host packing around
the strategy's two exchanges (the ``cuda`` strategy replaces both with device kernels).

A message is one valid (token, top-k slot) pair; messages travel sorted by (destination rank, local expert,
token, slot). Shapes as in :meth:`ascend_dualpath.moe.Buffer.low_latency_dispatch`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ascend_dualpath.moe import quant
from ascend_dualpath.moe.validation import agreement_vector, check_agreement


def _rank_and_world(strategy: Any) -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(strategy.group), dist.get_world_size(strategy.group)


def selections(topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Valid (token, slot) pairs sorted by expert id (stable: then token, slot), and their expert ids."""
    token_of, slot_of = (topk_idx >= 0).nonzero(as_tuple=True)
    experts = topk_idx[token_of, slot_of]
    order = torch.sort(experts, stable=True).indices
    return token_of[order], slot_of[order], experts[order]


class _Received:
    """The receive buffers of one low-latency dispatch (zero / -1 where no message lands)."""

    def __init__(
        self,
        local_experts: int,
        num_ranks: int,
        slots: int,
        hidden: int,
        use_fp8: bool,
        use_ue8m0: bool,
        device: torch.device,
    ) -> None:
        values_dtype = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
        self.values = torch.zeros(local_experts, slots, hidden, dtype=values_dtype, device=device)
        self.scales = None
        if use_fp8:
            blocks = hidden // quant.FP8_BLOCK // (4 if use_ue8m0 else 1)
            self.scales = torch.zeros(
                local_experts, blocks, slots, dtype=torch.int32 if use_ue8m0 else torch.float32, device=device
            ).transpose(1, 2)
        self.count = torch.zeros(local_experts, dtype=torch.int32, device=device)
        self.src_info = torch.full((local_experts, slots), -1, dtype=torch.int32, device=device)
        self.layout_range = torch.zeros(local_experts, num_ranks, dtype=torch.int64, device=device)
        self.use_ue8m0 = use_ue8m0

    def place(self, rows: list[torch.Tensor], recv_counts_per_source: torch.Tensor, stats: torch.Tensor | None) -> None:
        """Write the received messages (values[, scales], local expert id, source token) in (expert, source rank,
        token) order and fill counts, ``src_info`` and ``layout_range``."""
        local_experts, num_ranks = self.layout_range.shape
        device = self.values.device
        local_id, src_token = rows[-2].long(), rows[-1]
        src_rank = torch.repeat_interleave(torch.arange(num_ranks, device=device), recv_counts_per_source.to(device))
        order = torch.sort(local_id, stable=True).indices  # (expert, source rank, token) order
        per_expert = torch.bincount(local_id, minlength=local_experts)
        starts = per_expert.cumsum(0) - per_expert
        sorted_expert = local_id[order]
        position = torch.arange(order.numel(), device=device) - starts[sorted_expert]
        self.values[sorted_expert, position] = rows[0][order]
        if self.scales is not None:
            scales = rows[1][order]
            self.scales[sorted_expert, position] = quant.pack_ue8m0(scales) if self.use_ue8m0 else scales
        self.src_info[sorted_expert, position] = src_token[order]
        self.count.copy_(per_expert.to(torch.int32))
        per_pair = torch.bincount(local_id * num_ranks + src_rank, minlength=local_experts * num_ranks)
        per_pair = per_pair.view(local_experts, num_ranks)
        begins = per_pair.cumsum(1) - per_pair
        self.layout_range.copy_((begins << 32) | per_pair)
        if stats is not None:
            stats.add_(per_expert.to(torch.int32))


def dispatch(
    strategy: Any,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    max_tokens: int,
    num_experts: int,
    use_fp8: bool,
    round_scale: bool,
    use_ue8m0: bool,
    stats: torch.Tensor | None,
):
    """:meth:`Strategy.ll_dispatch`'s default; returns ``(recv_x, recv_count, src_info, layout_range, receive)``."""
    rank, num_ranks = _rank_and_world(strategy)
    local_experts = num_experts // num_ranks
    hidden, device = x.shape[1], x.device
    token_of, _, dest_key = selections(topk_idx)
    send_counts = torch.bincount(dest_key // local_experts, minlength=num_ranks)
    # the shapes and options every rank must share travel with the counts (fixed size: one exchange)
    agreement = agreement_vector(
        "low-latency dispatch",
        num_experts=num_experts,
        hidden=hidden,
        x_dtype=x.dtype,
        num_max_dispatch_tokens_per_rank=max_tokens,
        use_fp8=use_fp8,
        round_scale=round_scale,
        use_ue8m0=use_ue8m0,
    )
    table = strategy.exchange_counts(torch.cat([send_counts, agreement.to(device)]), "low-latency dispatch counts")
    check_agreement(table[:, num_ranks:], "low_latency_dispatch")
    recv_counts_per_source = table[:, :num_ranks][:, rank]
    payload = [x.index_select(0, token_of)]
    if use_fp8:
        payload = list(quant.per_token_cast_to_fp8(payload[0], round_scale=round_scale))
    payload += [(dest_key % local_experts).to(torch.int32), token_of.to(torch.int32)]
    pending = strategy.exchange_rows(
        payload, send_counts.tolist(), recv_counts_per_source.tolist(), "low-latency dispatch rows"
    )
    received = _Received(local_experts, num_ranks, num_ranks * max_tokens, hidden, use_fp8, use_ue8m0, device)

    def receive() -> None:
        received.place(pending.wait(), recv_counts_per_source, stats)

    recv_x = (received.values, received.scales) if use_fp8 else received.values
    return recv_x, received.count, received.src_info, received.layout_range, receive


def _return_rows(
    layout_range: torch.Tensor, local_experts: int, num_ranks: int, max_tokens: int
) -> tuple[torch.Tensor, list[int]]:
    """Rows of the packed ``[L, R·M, H]`` layout to send back, grouped by source rank, then local expert, then
    position; and how many go to each source rank."""
    ranges = layout_range.cpu()
    # (expert, source) pairs in source-major order, each a run of ``count`` rows from ``expert * R * M + begin``
    begins, counts = (ranges >> 32).t().reshape(-1), (ranges & 0xFFFFFFFF).t().reshape(-1)
    pair_expert = torch.arange(local_experts).repeat(num_ranks)
    total = int(counts.sum())
    pair_of_row = torch.repeat_interleave(torch.arange(counts.numel()), counts, output_size=total)
    within = torch.arange(total) - (torch.cumsum(counts, 0) - counts)[pair_of_row]
    row_index = pair_expert[pair_of_row] * num_ranks * max_tokens + begins[pair_of_row] + within
    return row_index, counts.view(num_ranks, local_experts).sum(dim=1).tolist()


def combine(
    strategy: Any,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    layout_range: torch.Tensor,
    max_tokens: int,
    num_experts: int,
    out: torch.Tensor,
) -> Callable[[], None]:
    """:meth:`Strategy.ll_combine`'s default; returns the receive half (the weighted sum into ``out``)."""
    _, num_ranks = _rank_and_world(strategy)
    local_experts, _, hidden = x.shape
    tokens, device = topk_idx.shape[0], x.device
    token_of, slot_of, dest_key = selections(topk_idx)
    recv_counts = torch.bincount(dest_key // local_experts, minlength=num_ranks).tolist()
    row_index, send_counts = _return_rows(layout_range, local_experts, num_ranks, max_tokens)
    send = x.reshape(-1, hidden).index_select(0, row_index.to(device))
    pending = strategy.exchange_rows([send], send_counts, recv_counts, "low-latency combine rows")

    def receive() -> None:
        back = pending.wait()[0]
        per_slot = torch.zeros(tokens, topk_idx.shape[1], hidden, dtype=torch.float32, device=device)
        per_slot[token_of, slot_of] = back.float()
        weights = torch.where(topk_idx >= 0, topk_weights, torch.zeros_like(topk_weights))
        acc = torch.zeros(tokens, hidden, dtype=torch.float32, device=device)
        for slot in range(topk_idx.shape[1]):
            acc += weights[:, slot : slot + 1] * per_slot[:, slot]
        out.copy_(acc.to(torch.bfloat16))

    return receive
