"""``torch.compile(fullgraph=True)`` over the library functions that call the ops: a graph break fails the test
(fullgraph raises), and the compiled results equal eager bit for bit, for the eager and inductor backends."""

from __future__ import annotations

import pytest
import torch

from ascend_dualpath import ops
from ascend_dualpath.kv.layout import KVLayout
from ascend_dualpath.moe import quant
from ascend_dualpath.moe.layout import compute_dispatch_layout

GQA = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4)
FP8 = KVLayout.mla_fp8(num_layers=1, block_tokens=4)


def step(topk_idx, x, kv, nope, scale, rope, cache, blocks, offsets):
    """One model step's worth of calls: layout, FP8 / UE8M0 / INT8 quantisation and back, KV encode, a staged
    layer written into a paged cache and read back."""
    per_rank, per_rdma_rank, per_expert, in_rank = compute_dispatch_layout(topk_idx, 16, 8, 4)
    x_e4m3, ue8m0 = quant.per_token_cast_to_fp8(x, round_scale=True, use_ue8m0=True)
    fp8_back = quant.per_token_cast_back(x_e4m3, ue8m0)
    x_int8, int8_scales = quant.per_token_cast_to_int8(x)
    int8_back = quant.per_token_cast_back_int8(x_int8, int8_scales)
    rows = GQA.encode_rows(kv=kv)
    fp8_rows = FP8.encode_rows(nope=nope, scale=scale, rope=rope)
    ops.kv_scatter_tokens(cache, blocks, offsets, kv)
    staged = ops.kv_gather_tokens(cache, blocks, offsets)
    return (
        per_rank,
        per_rdma_rank,
        per_expert,
        in_rank,
        x_e4m3.view(torch.uint8),
        ue8m0,
        fp8_back,
        x_int8,
        int8_scales,
        int8_back,
        rows,
        fp8_rows,
        staged * 2,
    )


def inputs():
    g = torch.Generator().manual_seed(11)
    return (
        torch.randint(-1, 16, (9, 3), generator=g),
        torch.randn(5, 512, generator=g).to(torch.bfloat16),
        torch.randn(6, 2, 2, 8, generator=g).to(torch.bfloat16),
        torch.randn(6, 512, generator=g).to(torch.float8_e4m3fn),
        torch.rand(6, 4, generator=g),
        torch.randn(6, 64, generator=g).to(torch.bfloat16),
        torch.zeros(4, 4, 2, 2, 8, dtype=torch.bfloat16),
        torch.tensor([0, 0, 3, 1, 2, 2]),
        torch.tensor([0, 3, 1, 1, 2, 0]),
    )


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_step_equals_eager(backend):
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    eager_args, compiled_args = inputs(), inputs()
    want, have = step(*eager_args), compiled(*compiled_args)
    assert want[1].shape == have[1].shape == (2,)  # 8 ranks, 4 per node: two nodes
    for index, (w, h) in enumerate(zip(want, have, strict=True)):
        if w is not None:
            assert torch.equal(w, h) and w.dtype == h.dtype, f"output {index} differs"
    assert torch.equal(eager_args[6], compiled_args[6]), "the cache written in place differs"


def test_compiled_step_traces_the_ops_not_their_bodies():
    """The graph holds the ops as single nodes (their kernels are opaque to the tracer)."""
    seen: list[str] = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend=backend)(*inputs())
    called = {name.split(".")[1] for name in seen if name.startswith("ascend_dualpath.")}
    assert {
        "dispatch_layout",
        "fp8_quantize",
        "fp8_dequantize",
        "int8_quantize",
        "int8_dequantize",
        "kv_encode_rows",
        "kv_scatter_tokens",
        "kv_gather_tokens",
    } <= called
