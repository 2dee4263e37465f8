"""Vectorised dispatch layout against the loop-based reference, over random routings with -1 slots."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dualpath.moe.layout import compute_dispatch_layout
from ascend_dualpath.reference import moe as ref


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    tokens=st.integers(0, 20),
    topk=st.integers(1, 6),
    world=st.sampled_from([1, 2, 4, 8, 16]),
    per_rank=st.integers(1, 4),
    ranks_per_node=st.sampled_from([2, 8]),
)
def test_layout_matches_reference(seed, tokens, topk, world, per_rank, ranks_per_node):
    experts = world * per_rank
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, experts, (tokens, topk), generator=g)
    got = compute_dispatch_layout(idx, experts, world, ranks_per_node)
    want = ref.dispatch_layout(idx, experts, world, ranks_per_node)
    for g_, w_ in zip(got, want, strict=True):
        assert (g_ is None and w_ is None) or torch.equal(g_, w_)
