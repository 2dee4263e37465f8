"""Dispatch layout from ``topk_idx``: which ranks, nodes and experts each token goes to (no communication)."""

from __future__ import annotations

import torch

from ascend_dualpath import ops


def compute_dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int):
    """Vectorised layout on ``topk_idx``'s device (the ``ascend_dualpath::dispatch_layout`` op).

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
    per_rank, per_rdma_rank, per_expert, in_rank = ops.dispatch_layout(topk_idx, num_experts, num_ranks, ranks_per_node)
    return per_rank, (per_rdma_rank if num_ranks > ranks_per_node else None), per_expert, in_rank
