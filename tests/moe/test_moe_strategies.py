"""Strategy registry, the mc2 constraint validators, and bounded waits."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ascend_dualpath.errors import BackendUnavailable, BoundsError, ConfigError, PayloadTooLarge, WaitTimeout
from ascend_dualpath.moe import strategies
from ascend_dualpath.moe.strategies import mc2
from tests.moe import _spawn

NO_TORCH_NPU = importlib.util.find_spec("torch_npu") is None


def test_auto_order_is_documented():
    assert strategies.AUTO_ORDER == ("mc2", "aiv", "cuda", "alltoall")


def test_unknown_strategy_names_the_choices():
    with pytest.raises(ConfigError, match="alltoall"):
        strategies.resolve("nvshmem", None)


def test_aiv_without_a_process_group_is_unavailable_with_reason():
    with pytest.raises(BackendUnavailable, match="aiv strategy needs an initialised process group"):
        strategies.resolve("aiv", None)


@pytest.mark.skipif(not NO_TORCH_NPU, reason="torch_npu is installed here")
def test_mc2_without_torch_npu_raises_with_reason():
    with pytest.raises(BackendUnavailable, match="torch_npu is not installed"):
        strategies.resolve("mc2", None)
    with pytest.raises(BackendUnavailable, match="torch_npu"):
        strategies.create("mc2", None, 1.0)


def _mc2_ok(tokens=8, hidden=7168, topk=8, experts=256, world=16):
    x = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(experts)[:topk] for _ in range(tokens)]).int()
    return x, ids, world, 0, experts


def test_mc2_validator_accepts_documented_shapes():
    mc2.validate_dispatch(*_mc2_ok(), product="A3", version="v1", quant_mode=2)
    mc2.validate_dispatch(*_mc2_ok(hidden=4096, topk=16, experts=1024), product="A3", version="v2")
    x, ids, world, rank, experts = _mc2_ok()
    mc2.validate_combine(torch.zeros(64, 7168, dtype=torch.bfloat16), ids, torch.ones(ids.shape), world, rank,
                         experts)


@pytest.mark.parametrize("change, error, words", [
    (dict(tokens=513), PayloadTooLarge, "512"),
    (dict(topk=9, version="v1"), ConfigError, "top-k <= 8"),
    (dict(experts=2048), ConfigError, "1024"),
    (dict(hidden=4096, version="v1"), ConfigError, "7168"),
    (dict(hidden=9216), ConfigError, "8192"),
    (dict(quant_mode=1), ConfigError, "quant_mode=1"),
    (dict(product="A2", tokens=300), PayloadTooLarge, "256"),
    (dict(product="A2", experts=512, world=16), ConfigError, "24 local experts"),
])
def test_mc2_validator_rejects_documented_limits(change, error, words):
    shape = {k: change.pop(k) for k in ("tokens", "hidden", "topk", "experts", "world") if k in change}
    x, ids, world, rank, experts = _mc2_ok(**shape)
    with pytest.raises(error, match=words):
        mc2.validate_dispatch(x, ids, world, rank, experts, **change)


def test_mc2_validator_rejects_bad_ids_unless_masked():
    x, ids, world, rank, experts = _mc2_ok()
    bad = ids.clone()
    bad[0, 0] = experts
    with pytest.raises(BoundsError, match=str(experts)):
        mc2.validate_dispatch(x, bad, world, rank, experts)
    bad[0, 0] = -1
    with pytest.raises(BoundsError, match="-1"):
        mc2.validate_dispatch(x, bad, world, rank, experts)
    mask = torch.ones(ids.shape, dtype=torch.bool)
    mask[0, 0] = False
    mc2.validate_dispatch(x, bad, world, rank, experts, x_active_mask=mask)
    dup = ids.clone()
    dup[1, 1] = dup[1, 0]
    with pytest.raises(ConfigError, match="repeat"):
        mc2.validate_dispatch(x, dup, world, rank, experts)
    with pytest.raises(ConfigError, match="prefix"):
        mc2.validate_dispatch(x, ids, world, rank, experts, x_active_mask=torch.tensor([1, 0, 1, 1, 1, 1, 1, 1]).bool())


def _silent_peer(rank: int, world: int) -> dict:
    """Rank 0 dispatches; rank 1 never joins: rank 0's wait must end in WaitTimeout within the bound."""
    import time

    from ascend_dualpath.moe import Buffer

    buffer = Buffer(None, num_nvl_bytes=1 << 20, strategy="alltoall", timeout_s=2)
    if rank == 1:
        time.sleep(6)
        return {"peer": "ok"}
    idx = torch.tensor([[0, 1]])
    layout = buffer.get_dispatch_layout(idx, 4)
    start = time.monotonic()
    try:
        buffer.dispatch(torch.ones(1, 8, dtype=torch.bfloat16), num_tokens_per_rank=layout[0],
                        is_token_in_rank=layout[3], num_tokens_per_expert=layout[2])
    except WaitTimeout as exc:
        # the first exchange of a fresh dispatch: the ranks' shapes and options, before the token counts
        return {"timeout": "ok" if "dispatch shapes" in str(exc) else str(exc),
                "elapsed": "ok" if time.monotonic() - start < 5 else f"took {time.monotonic() - start:.1f} s"}
    return {"timeout": "dispatch returned although the peer never joined"}


@pytest.mark.slow
def test_wait_is_bounded_and_names_what_it_waited_for():
    results = _spawn.run_ranks(2, _silent_peer, timeout_s=60)
    assert results[0] == {"timeout": "ok", "elapsed": "ok"}, results
