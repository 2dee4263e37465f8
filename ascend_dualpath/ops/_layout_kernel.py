"""The MoE dispatch layout as one Triton kernel: the CUDA kernel of ``dispatch_layout`` (ops/cuda.py) and the
``cuda`` MoE strategy's layout launch (imported only when one of them runs: it needs Triton). Kept in a file of its
own so that triton-ascend can lower it alone (tools/check_triton_ascend.sh)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dispatch_layout(
    topk_idx,
    counts,
    in_rank,
    num_tokens,
    num_topk,
    experts_per_rank,
    num_experts,
    NUM_RANKS: tl.constexpr,
    RANKS_PAD: tl.constexpr,
    RANKS_PER_NODE: tl.constexpr,
    NUM_NODES: tl.constexpr,
    NODES_PAD: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """One pass over ``topk_idx`` [T, K]: ``in_rank`` [T, R] (uint8) and, by atomic adds into the zeroed
    int32 ``counts``: tokens per rank [R], per node [NODES] (when NUM_NODES > 1), per expert [E], then
    ``max(0, -min id)`` and ``max(0, max id)`` for the caller's bounds check. Out-of-range ids count nowhere."""
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.arange(0, TOPK_PAD)
    present = (tokens < num_tokens)[:, None] & (slots < num_topk)[None, :]
    idx = tl.load(topk_idx + tokens[:, None] * num_topk + slots[None, :], mask=present, other=-1)
    int32_max = 2147483647
    below = tl.minimum(tl.max(tl.maximum(-idx, 0)), int32_max).to(tl.int32)
    above = tl.minimum(tl.max(tl.maximum(idx, 0)), int32_max).to(tl.int32)
    stats = counts + NUM_RANKS + (NUM_NODES if NUM_NODES > 1 else 0) + num_experts
    tl.atomic_max(stats, below)
    tl.atomic_max(stats + 1, above)
    valid = present & (idx >= 0) & (idx < num_experts)
    rank_of = tl.where(valid, idx // experts_per_rank, -1)
    ranks = tl.arange(0, RANKS_PAD)
    hit = tl.max((rank_of[:, :, None] == ranks[None, None, :]).to(tl.int32), axis=1)
    tl.store(
        in_rank + tokens[:, None] * NUM_RANKS + ranks[None, :],
        hit.to(tl.uint8),
        mask=(tokens < num_tokens)[:, None] & (ranks < NUM_RANKS)[None, :],
    )
    tl.atomic_add(counts + ranks, tl.sum(hit, axis=0), mask=ranks < NUM_RANKS)
    if NUM_NODES > 1:
        nodes = tl.arange(0, NODES_PAD)
        node_of = tl.where(valid, rank_of // RANKS_PER_NODE, -1)
        node_hit = tl.max((node_of[:, :, None] == nodes[None, None, :]).to(tl.int32), axis=1)
        tl.atomic_add(counts + NUM_RANKS + nodes, tl.sum(node_hit, axis=0), mask=nodes < NUM_NODES)
    expert_counts = counts + NUM_RANKS + (NUM_NODES if NUM_NODES > 1 else 0)
    tl.atomic_add(expert_counts + tl.where(valid, idx, 0), tl.full(idx.shape, 1, tl.int32), mask=valid)


BLOCK_TOKENS = 64  # tokens per program


def launch_constants(num_ranks: int, ranks_per_node: int, num_nodes: int, topk: int) -> dict:
    """The kernel's constexprs for ``num_ranks`` ranks in ``num_nodes`` nodes and ``topk`` slots per token (the
    ``*_PAD`` values are the next powers of two, as ``tl.arange`` needs); the grid is
    ``ceil(tokens / BLOCK_TOKENS)`` programs."""
    return {
        "NUM_RANKS": num_ranks,
        "RANKS_PAD": triton.next_power_of_2(num_ranks),
        "RANKS_PER_NODE": ranks_per_node,
        "NUM_NODES": num_nodes,
        "NODES_PAD": triton.next_power_of_2(num_nodes),
        "TOPK_PAD": triton.next_power_of_2(topk),
        "BLOCK_T": BLOCK_TOKENS,
    }
