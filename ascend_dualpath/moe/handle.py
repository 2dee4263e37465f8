"""The handle a fresh normal dispatch returns (DeepEP's handle tuple, with names)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ascend_dualpath.moe.strategies.base import NormalPlan


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
