"""CUDA kernels of the ``ascend_dualpath`` ops that have a Triton kernel: the MoE dispatch layout.

Triton is imported on the first call, not at registration, so registering the CUDA key costs nothing on a
machine without Triton; there the call falls back to the pure-torch kernel of :mod:`ascend_dualpath.ops.cpu`.
"""

from __future__ import annotations

import importlib.util

import torch

from ascend_dualpath.ops import cpu


def has_triton() -> bool:
    """Whether Triton can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int):
    """The layout in one Triton pass (``ops._layout_kernel.dispatch_layout``); same outputs as
    :func:`ascend_dualpath.ops.cpu.dispatch_layout`, bit for bit, for ids in ``[-1, E)``."""
    if not has_triton():
        return cpu.dispatch_layout(topk_idx, num_experts, num_ranks, ranks_per_node)
    from ascend_dualpath.ops import _layout_kernel

    tokens, topk = topk_idx.shape
    num_nodes = cpu.num_nodes_of(num_ranks, ranks_per_node)
    extra = num_nodes if num_nodes > 1 else 0
    # per rank, per node (several nodes only), per expert, then the kernel's two id-range words
    counts = torch.zeros(num_ranks + extra + num_experts + 2, dtype=torch.int32, device=topk_idx.device)
    in_rank = torch.zeros(tokens, num_ranks, dtype=torch.bool, device=topk_idx.device)
    if tokens:
        grid = (-(-tokens // _layout_kernel.BLOCK_TOKENS),)
        _layout_kernel.dispatch_layout[grid](
            topk_idx.contiguous(),
            counts,
            in_rank.view(torch.uint8),
            tokens,
            topk,
            num_experts // num_ranks,
            num_experts,
            **_layout_kernel.launch_constants(num_ranks, ranks_per_node, num_nodes, topk),
        )
    per_rank = counts[:num_ranks].clone()
    per_node = counts[num_ranks : num_ranks + extra].clone()
    per_expert = counts[num_ranks + extra : num_ranks + extra + num_experts].clone()
    return per_rank, per_node, per_expert, in_rank
