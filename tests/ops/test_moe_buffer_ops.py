"""The MoE ``Buffer``'s cached dispatch/combine and low-latency pair as ops, on one emulated rank (gloo, world 1):
opcheck, equality with the eager ``Buffer`` calls, and ``torch.compile(fullgraph=True)`` over them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ascend_dualpath import ops
from ascend_dualpath.errors import NotRegistered
from tests.ops.samples import has_float8

NUM_EXPERTS, TOKENS, HIDDEN, MAX_TOKENS = 4, 6, 512, 8


@pytest.fixture(scope="module")
def moe():
    """A one-rank Buffer, a fresh dispatch's handle and inputs, all registered; the group is torn down after."""
    from ascend_dualpath.moe import Buffer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        buffer = Buffer(None, 1 << 24, 1 << 24, low_latency_mode=True)
        g = torch.Generator().manual_seed(7)
        topk_idx = torch.tensor([[0, 1], [2, -1], [-1, -1], [3, 0], [1, 2], [3, -1]])
        topk_weights = torch.rand(TOKENS, 2, generator=g)
        x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
        recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
        )
        ids = {"buffer_id": ops.register_buffer(buffer), "handle_id": ops.register_handle(handle)}
        yield dict(
            buffer=buffer,
            handle=handle,
            x=x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            recv_x=recv_x,
            recv_weights=recv_weights,
            **ids,
        )
        ops.release(ids["buffer_id"])
        ops.release(ids["handle_id"])
    finally:
        dist.destroy_process_group()


def _opcheck(name, args):
    utils = ("test_faketensor", "test_aot_dispatch_dynamic") if has_float8(args) else None
    op = getattr(torch.ops.ascend_dualpath, name).default
    if utils is None:
        torch.library.opcheck(op, args)
    else:
        torch.library.opcheck(op, args, test_utils=utils)


def test_cached_dispatch_opcheck_and_equality(moe):
    b, h = moe["buffer_id"], moe["handle_id"]
    fp8 = ops.fp8_quantize(moe["x"], True, True)
    int8 = ops.int8_quantize(moe["x"])
    for x in (moe["x"], fp8, int8, moe["x"][:, :128].contiguous()):
        parts = list(x) if isinstance(x, tuple) else [x]
        _opcheck("moe_cached_dispatch", (parts, b, h))
        eager = moe["buffer"].dispatch(x, handle=moe["handle"])[0]
        got = ops.moe_cached_dispatch(x, b, h)
        for want, have in zip(
            eager if isinstance(x, tuple) else (eager,), got if isinstance(x, tuple) else (got,), strict=True
        ):
            assert torch.equal(_bits(want), _bits(have))


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_combine_opcheck_and_equality(moe):
    b, h = moe["buffer_id"], moe["handle_id"]
    bias = torch.ones(TOKENS, HIDDEN, dtype=torch.bfloat16)
    for weights, bias_0, weighted in (
        (moe["recv_weights"], None, False),
        (None, None, False),
        (moe["recv_weights"], bias, True),
    ):
        _opcheck("moe_combine", (moe["recv_x"], weights, bias_0, None, b, h, weighted))
        combined, combined_weights = ops.moe_combine(moe["recv_x"], b, h, weights, (bias_0, None), weighted)
        eager, eager_weights, _ = moe["buffer"].combine(
            moe["recv_x"], moe["handle"], weights, bias=bias_0, weighted=weighted
        )
        assert torch.equal(combined, eager)
        assert (combined_weights is None) == (eager_weights is None)
        if eager_weights is not None:
            assert torch.equal(combined_weights, eager_weights)


@pytest.mark.parametrize(
    ("use_fp8", "round_scale", "use_ue8m0"), [(False, False, False), (True, False, False), (True, True, True)]
)
def test_low_latency_pair_opcheck_and_equality(moe, use_fp8, round_scale, use_ue8m0):
    b = moe["buffer_id"]
    args = (moe["x"], moe["topk_idx"], b, MAX_TOKENS, NUM_EXPERTS, use_fp8, round_scale, use_ue8m0)
    _opcheck("moe_low_latency_dispatch", args)
    recv_x, recv_count, src_info, layout_range = ops.moe_low_latency_dispatch(*args)
    eager_x, eager_count, handle, _, _ = moe["buffer"].low_latency_dispatch(
        moe["x"],
        moe["topk_idx"],
        MAX_TOKENS,
        NUM_EXPERTS,
        use_fp8=use_fp8,
        round_scale=round_scale,
        use_ue8m0=use_ue8m0,
    )
    pairs = list(zip(recv_x, eager_x, strict=True)) if use_fp8 else [(recv_x, eager_x)]
    pairs += [(recv_count, eager_count), (src_info, handle[0]), (layout_range, handle[1])]
    for have, want in pairs:
        assert torch.equal(_bits(have), _bits(want)) and have.stride() == want.stride()
    expert_out = torch.randn(recv_x[0].shape if use_fp8 else recv_x.shape).to(torch.bfloat16)
    combine_args = (
        expert_out,
        moe["topk_idx"],
        moe["topk_weights"],
        src_info,
        layout_range,
        b,
        MAX_TOKENS,
        NUM_EXPERTS,
    )
    _opcheck("moe_low_latency_combine", combine_args)
    eager_out = moe["buffer"].low_latency_combine(expert_out, moe["topk_idx"], moe["topk_weights"], handle)[0]
    assert torch.equal(ops.moe_low_latency_combine(*combine_args), eager_out)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_moe_step_equals_eager(moe, backend):
    """A model step calling the cached pair and the low-latency pair traces with no graph break."""
    b, h = moe["buffer_id"], moe["handle_id"]

    def step(x, topk_idx, topk_weights):
        recv = ops.moe_cached_dispatch(x, b, h)
        combined, _ = ops.moe_combine(recv * 2, b, h)
        ll_x, _, src_info, layout_range = ops.moe_low_latency_dispatch(
            x, topk_idx, b, MAX_TOKENS, NUM_EXPERTS, use_fp8=False
        )
        ll_out = ops.moe_low_latency_combine(
            ll_x, topk_idx, topk_weights, src_info, layout_range, b, MAX_TOKENS, NUM_EXPERTS
        )
        return combined, ll_out

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    args = (moe["x"], moe["topk_idx"], moe["topk_weights"])
    for have, want in zip(compiled(*args), step(*args), strict=True):
        assert torch.equal(have, want)


def test_unknown_ids_are_refused():
    with pytest.raises(NotRegistered, match="no MoE buffer registered under id 123456"):
        ops.moe_cached_dispatch(torch.zeros(1, 128), 123456, 123456)
    with pytest.raises(NotRegistered, match="no MoE buffer or handle registered under id 123456"):
        ops.release(123456)
