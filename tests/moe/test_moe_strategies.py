"""Strategy registry and bounded waits (the mc2 constraint tables: test_moe_mc2.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ascend_dualpath.errors import BackendUnavailable, ConfigError, WaitTimeout
from ascend_dualpath.moe import strategies
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
        buffer.dispatch(
            torch.ones(1, 8, dtype=torch.bfloat16),
            num_tokens_per_rank=layout[0],
            is_token_in_rank=layout[3],
            num_tokens_per_expert=layout[2],
        )
    except WaitTimeout as exc:
        # the first exchange of a fresh dispatch: the ranks' shapes and options, before the token counts
        return {
            "timeout": "ok" if "dispatch shapes" in str(exc) else str(exc),
            "elapsed": "ok" if time.monotonic() - start < 5 else f"took {time.monotonic() - start:.1f} s",
        }
    return {"timeout": "dispatch returned although the peer never joined"}


@pytest.mark.slow
def test_wait_is_bounded_and_names_what_it_waited_for():
    results = _spawn.run_ranks(2, _silent_peer, timeout_s=60)
    assert results[0] == {"timeout": "ok", "elapsed": "ok"}, results


class _NeverCompletes:
    """A collective's work object whose peers never join."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        raise AssertionError("waited on work that never completed")


def test_alltoall_rows_wait_is_bounded_by_its_argument(monkeypatch):
    """A row exchange whose collective never completes: ``wait(0.05)`` raises WaitTimeout naming the exchange and
    the given bound, long before the strategy's own 60 s; ``wait(0)`` only looks; a negative bound is refused."""
    import time

    import torch.distributed as dist

    from ascend_dualpath.moe.strategies.alltoall import AllToAllStrategy

    monkeypatch.setattr(dist, "all_to_all_single", lambda *args, **kwargs: _NeverCompletes())
    pending = AllToAllStrategy(None, 60.0).exchange_rows([torch.ones(2, 4)], [2], [2], "dispatch rows")
    start = time.monotonic()
    with pytest.raises(WaitTimeout, match=r"waited 0.05 s for dispatch rows \(alltoall strategy\)"):
        pending.wait(timeout_s=0.05)
    assert time.monotonic() - start < 5
    with pytest.raises(WaitTimeout, match="waited 0 s for dispatch rows"):
        pending.wait(0)
    with pytest.raises(ConfigError, match="PendingRows.wait: timeout_s must be >= 0, got -1"):
        pending.wait(-1)
