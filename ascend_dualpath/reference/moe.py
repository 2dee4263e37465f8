"""Reference semantics of DeepEP-style MoE dispatch/combine, computed from a global view of all ranks.

Every function here takes the inputs of *all* ranks (lists indexed by rank) and returns what each rank must
observe, using plain Python loops over tokens so the rules are visible: no process group, no packing, no
vectorised tricks shared with :mod:`ascend_dualpath.moe`. Shapes: ``R`` ranks, ``E`` experts, ``L = E / R``
local experts per rank, ``T_r`` tokens on rank ``r``, ``K`` top-k slots, ``H`` hidden size.

Rules (DeepEP V1):

- a token goes to rank ``r`` once if any of its valid (``!= -1``) expert ids lives on ``r`` (``id // L == r``);
- a rank receives rows grouped by source rank ``0..R-1`` and, inside a source, in ascending token index;
- received expert ids are local (``id - r * L``), ``-1`` where the expert lives elsewhere, with weight 0 there;
- normal combine is an *unweighted* float32 sum over destination ranks in rank order, then bias 0, bias 1;
- low-latency combine is a *weighted* float32 sum over the token's valid top-k slots in slot order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int | None = None):
    """Layout of one rank's routing.

    Parameters
    ----------
    topk_idx : int64 [T, K], ``-1`` = unused slot
    num_experts, num_ranks : int
    ranks_per_node : int or None
        Ranks per node; ``num_tokens_per_rdma_rank`` is returned only when there is more than one node.

    Returns
    -------
    (num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank int32 [R / ranks_per_node] or None,
     num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R])
    """
    local_experts = num_experts // num_ranks
    tokens = topk_idx.shape[0]
    per_rank = [0] * num_ranks
    per_expert = [0] * num_experts
    in_rank = [[False] * num_ranks for _ in range(tokens)]
    nodes = 1 if ranks_per_node is None else max(1, num_ranks // ranks_per_node)
    per_node = [0] * nodes
    for t, row in enumerate(topk_idx.tolist()):
        for expert in row:
            if expert >= 0:
                per_expert[expert] += 1
                in_rank[t][expert // local_experts] = True
        for r in range(num_ranks):
            per_rank[r] += in_rank[t][r]
        if nodes > 1:
            for n in range(nodes):
                per_node[n] += any(in_rank[t][n * ranks_per_node : (n + 1) * ranks_per_node])
    return (
        torch.tensor(per_rank, dtype=torch.int32),
        torch.tensor(per_node, dtype=torch.int32) if nodes > 1 else None,
        torch.tensor(per_expert, dtype=torch.int32),
        torch.tensor(in_rank, dtype=torch.bool).reshape(tokens, num_ranks),
    )


@dataclass
class RankReceive:
    """What one rank receives from a normal dispatch (rows in the reference order)."""

    src_rank: list[int]
    src_idx: list[int]
    x: torch.Tensor
    topk_idx: torch.Tensor | None
    topk_weights: torch.Tensor | None
    num_recv_tokens_per_expert: list[int]
    rank_prefix_matrix: torch.Tensor


def _stack_rows(rows: list, example) -> Any:
    """The received rows stacked like ``example`` (a tensor or a tuple of tensors); empty with its row shape."""
    if isinstance(example, tuple):
        return tuple(
            torch.stack([r[i] for r in rows]) if rows else part.new_empty((0, *part.shape[1:]))
            for i, part in enumerate(example)
        )
    return torch.stack(rows) if rows else example.new_empty((0, *example.shape[1:]))


def _local_weights(weights: list[float], local: list[int]) -> list[float]:
    return [w if e >= 0 else 0.0 for w, e in zip(weights, local, strict=True)]


def _receive_on(
    dst: int, xs, topk_idxs, topk_weights, local_experts: int, expert_alignment: int, sent: torch.Tensor
) -> RankReceive:
    """What rank ``dst`` receives (rows by source rank, then source token); counts into ``sent[src, dst]``."""
    src_rank, src_idx, rows, idx_rows, weight_rows = [], [], [], [], []
    for src in range(len(xs)):
        for t, row in enumerate(topk_idxs[src].tolist()):
            local = [e - dst * local_experts if e >= 0 and e // local_experts == dst else -1 for e in row]
            if all(e < 0 for e in local):
                continue
            sent[src, dst] += 1
            src_rank.append(src)
            src_idx.append(t)
            x = xs[src]
            rows.append(tuple(part[t] for part in x) if isinstance(x, tuple) else x[t])
            idx_rows.append(local)
            if topk_weights is not None:
                weight_rows.append(_local_weights(topk_weights[src][t].tolist(), local))
    k = topk_idxs[0].shape[1]
    recv_idx = torch.tensor(idx_rows, dtype=torch.int64).reshape(-1, k)
    counts = [int((recv_idx == e).sum()) for e in range(local_experts)]
    return RankReceive(
        src_rank=src_rank,
        src_idx=src_idx,
        x=_stack_rows(rows, xs[0]),
        topk_idx=recv_idx,
        topk_weights=torch.tensor(weight_rows, dtype=torch.float32).reshape(-1, k) if topk_weights else None,
        num_recv_tokens_per_expert=[-(-c // expert_alignment) * expert_alignment for c in counts],
        rank_prefix_matrix=None,
    )


def dispatch(xs, topk_idxs, topk_weights, num_experts: int, expert_alignment: int = 1) -> list[RankReceive]:
    """Normal dispatch of every rank's tokens.

    Parameters
    ----------
    xs : list over ranks of Tensor [T_r, H] (any dtype; rows are copied bit-exactly) or of tuples of such
        tensors sharing the first dim (FP8/INT8 payload and scales), each row copied along
    topk_idxs : list over ranks of int64 [T_r, K]
    topk_weights : list over ranks of float32 [T_r, K], or None
    """
    num_ranks = len(xs)
    local_experts = num_experts // num_ranks
    sent = torch.zeros(num_ranks, num_ranks, dtype=torch.int64)
    results = [
        _receive_on(dst, xs, topk_idxs, topk_weights, local_experts, expert_alignment, sent) for dst in range(num_ranks)
    ]
    prefix = sent.cumsum(0).to(torch.int32)
    for result in results:
        result.rank_prefix_matrix = prefix
    return results


def combine(expert_outputs, receives: list[RankReceive], num_tokens: list[int], biases=None) -> list[torch.Tensor]:
    """Unweighted normal combine, float32 accumulation in a fixed order, cast to the input dtype.

    Parameters
    ----------
    expert_outputs : list over destination ranks of Tensor [N_r, H] in the reference receive order
    receives : the :func:`dispatch` result giving each row's (source rank, source index)
    num_tokens : list over ranks of T_r
    biases : list over ranks of tuple (bias0 or None, bias1 or None), each [T_r, H]

    Returns
    -------
    list over ranks of Tensor [T_r, H] in ``expert_outputs``' dtype: ``Σ_r x_r`` over destination ranks
    ``0..R-1``, then ``+ bias0``, then ``+ bias1``, all in float32.
    """
    hidden = expert_outputs[0].shape[1]
    dtype = expert_outputs[0].dtype
    sums = [torch.zeros(n, hidden, dtype=torch.float32) for n in num_tokens]
    for dst, receive in enumerate(receives):
        for row, (src, t) in enumerate(zip(receive.src_rank, receive.src_idx, strict=True)):
            sums[src][t] += expert_outputs[dst][row].float()
    out = []
    for rank, acc in enumerate(sums):
        for bias in biases[rank] if biases else ():
            if bias is not None:
                acc = acc + bias.float()
        out.append(acc.to(dtype))
    return out


@dataclass
class ExpertReceive:
    """What one local expert receives in low-latency dispatch: the set of (source rank, source index) rows."""

    sources: list[tuple[int, int]]


def low_latency_dispatch(topk_idxs, num_experts: int) -> list[list[ExpertReceive]]:
    """Per destination rank and local expert, the (source rank, token) pairs it must receive, one per valid slot."""
    num_ranks = len(topk_idxs)
    local_experts = num_experts // num_ranks
    out = [[ExpertReceive([]) for _ in range(local_experts)] for _ in range(num_ranks)]
    for src, idx in enumerate(topk_idxs):
        for t, row in enumerate(idx.tolist()):
            for expert in row:
                if expert >= 0:
                    out[expert // local_experts][expert % local_experts].sources.append((src, t))
    return out


def low_latency_combine(expert_rows, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Weighted low-latency combine for one source rank, in float64.

    Parameters
    ----------
    expert_rows : callable ``(token, expert) -> Tensor [H]``: the expert's output row for that token
    topk_idx : int64 [T, K]; topk_weights : float32 [T, K]

    Returns
    -------
    float64 [T, H]: ``Σ_{k: topk_idx[t,k] != -1} topk_weights[t,k] · row(t, topk_idx[t,k])``
    """
    tokens, k = topk_idx.shape
    out = None
    for t in range(tokens):
        for slot in range(k):
            expert = int(topk_idx[t, slot])
            row = expert_rows(t, expert) if expert >= 0 else None
            if out is None and row is not None:
                out = torch.zeros(tokens, row.shape[0], dtype=torch.float64)
            if row is not None:
                out[t] += float(topk_weights[t, slot]) * row.double()
    return out


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's similarity score ``1 - 2Σxy / Σ(x²+y²)`` on ``x+1, y+1`` in float64 (0 means identical)."""
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denominator)
