"""Ranks that disagree on a shape or option of a MoE op all raise the same ConfigError, and none aborts (defect D4).

Before the fix, a disagreement reached a gloo collective of mismatched sizes: one rank aborted (``EnforceNotMet``),
the other waited out its timeout. Each case below makes rank 0 and rank 1 pass different values; every rank must
raise a ConfigError with the same message, naming the field and both ranks' values, and the group must stay usable
(an agreeing dispatch after all cases succeeds).
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from tests.moe import _spawn

WORLD = 2
TOKENS = 8
# Bound of every wait inside a rank; a rank that waits for a peer which aborted gives up after this.
WAIT_S = 10.0
RUN_S = 90.0
HIDDEN = 256
EXPERTS = 4
TOPK = 2
LL_MAX_TOKENS = 16
# (field named in the error, what rank 1 passes differently from rank 0, the two values shown)
CASES = {
    "hidden": (dict(hidden=512), ("256", "512")),
    "num_experts": (dict(experts=8), ("4", "8")),
    "x_dtype": (dict(dtype=torch.float32), ("torch.bfloat16", "torch.float32")),
    "num_topk": (dict(topk=3), ("2", "3")),
    "num_max_dispatch_tokens_per_rank": (dict(ll_max_tokens=32), ("16", "32")),
}


def _one_op(buffer, rank: int, field: str) -> None:
    """Run the op of case ``field`` with rank 1's differing value."""
    spec = dict(hidden=HIDDEN, experts=EXPERTS, topk=TOPK, dtype=torch.bfloat16, ll_max_tokens=LL_MAX_TOKENS)
    if rank == 1:
        spec.update(CASES[field][0])
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, spec["hidden"], generator=g).to(spec["dtype"])
    topk_idx = torch.rand(TOKENS, spec["experts"], generator=g).topk(spec["topk"], dim=1).indices
    if field == "num_max_dispatch_tokens_per_rank":
        buffer.low_latency_dispatch(x, topk_idx, spec["ll_max_tokens"], spec["experts"], use_fp8=False)
        return
    weights = torch.rand(TOKENS, spec["topk"], generator=g)
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, spec["experts"])
    buffer.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=topk_idx,
        topk_weights=weights,
    )


def disagreeing_ranks(rank: int, world: int, strategy: str) -> dict:
    """Per case, the error this rank raised (``"ConfigError: ..."``) or what happened instead."""
    from ascend_dualpath.errors import AdpError
    from ascend_dualpath.moe import Buffer

    rdma = max(Buffer.get_low_latency_rdma_size_hint(m, 512, world, 8) for m in (16, 32))
    buffer = Buffer(
        None, num_nvl_bytes=1 << 22, num_rdma_bytes=rdma, low_latency_mode=True, strategy=strategy, timeout_s=WAIT_S
    )
    out = {}
    for field in CASES:
        try:
            _one_op(buffer, rank, field)
            out[field] = "no error"
        except AdpError as exc:
            out[field] = f"{type(exc).__name__}: {exc}"
    # the group is still in step: an op every rank agrees on goes through
    try:
        _one_op(buffer, 0, "hidden")
        out["agreeing dispatch"] = "ok"
    except AdpError as exc:
        out["agreeing dispatch"] = f"{type(exc).__name__}: {exc}"
    buffer.destroy()
    return out


@pytest.mark.parametrize("strategy", ["alltoall", "aiv"])
def test_d04_ranks_that_disagree_on_shapes_all_raise_the_same_error(strategy, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the ranks' rendezvous file goes
    results = _spawn.run_ranks(WORLD, disagreeing_ranks, strategy, timeout_s=RUN_S)
    assert list(tmp_path.iterdir()) == [], "the rendezvous file was left behind"
    for rank, result in enumerate(results):
        assert "__fatal__" not in result, f"rank {rank}: {result['__fatal__']}"
    for field, (_, (value0, value1)) in CASES.items():
        messages = [result[field] for result in results]
        assert messages[0] == messages[1], f"{field}: ranks raised differently: {messages}"
        assert messages[0].startswith("ConfigError: "), f"{field}: {messages[0]}"
        assert f"ranks disagree on {field} (rank 0: {value0}, rank 1: {value1})" in messages[0], messages[0]
    assert [result["agreeing dispatch"] for result in results] == ["ok", "ok"]
