"""Dispatch layout from ``topk_idx``: which ranks, nodes and experts each token goes to (no communication)."""

from __future__ import annotations

import torch


def compute_dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int):
    """Vectorised layout on ``topk_idx``'s device.

    Parameters
    ----------
    topk_idx : int64 [T, K], entries in ``[-1, num_experts)`` (already validated)
    num_experts, num_ranks : int, ``num_experts % num_ranks == 0``
    ranks_per_node : int; nodes are ``rank // ranks_per_node``

    Returns
    -------
    (num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank int32 [R / ranks_per_node] or None when one node,
     num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R])

    A token counts once per rank and once per node, however many of its experts live there.
    """
    tokens = topk_idx.shape[0]
    valid = topk_idx >= 0
    experts = topk_idx.clamp(min=0)
    num_tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64, device=topk_idx.device)
    num_tokens_per_expert.scatter_add_(0, experts.reshape(-1), valid.reshape(-1).to(torch.int64))
    ranks = experts // (num_experts // num_ranks)
    # uint8, not bool: CUDA has no bool scatter_reduce.
    is_token_in_rank = torch.zeros(tokens, num_ranks, dtype=torch.uint8, device=topk_idx.device)
    # "amax" makes the scatter an "or": an invalid slot (clamped to expert 0) scatters False and cannot
    # clear a True set by a valid slot of the same token.
    is_token_in_rank = is_token_in_rank.scatter_reduce_(1, ranks, valid.to(torch.uint8), reduce="amax").bool()
    num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
    num_nodes = num_ranks // ranks_per_node if num_ranks > ranks_per_node else 1
    num_tokens_per_rdma_rank = None
    if num_nodes > 1:
        in_node = is_token_in_rank.view(tokens, num_nodes, ranks_per_node).any(dim=2)
        num_tokens_per_rdma_rank = in_node.sum(dim=0, dtype=torch.int32)
    return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert.to(torch.int32), is_token_in_rank
