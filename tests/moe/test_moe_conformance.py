"""DeepEP conformance of ``Buffer`` over the CPU strategies (``alltoall``, ``aiv`` on both dataplanes) on 2, 4 and 8
gloo ranks."""

from __future__ import annotations

import pytest

from tests.moe import _spawn, conformance_worker
from tests.moe.conftest import conformance_results

CHECKS = [
    "layout",
    "dispatch_bf16",
    "expert_alignment",
    "dispatch_quantised",
    "worst_tokens",
    "cached_dispatch",
    "combine",
    "weighted_combine",
    "low_latency_dispatch",
    "low_latency_combine",
    "repeatable",
    "graph_replay",
]


@pytest.mark.slow
@pytest.mark.parametrize("check", CHECKS)
def test_conformance(world: int, strategy: str, check: str) -> None:
    for rank, result in enumerate(conformance_results(world, strategy)):
        assert "__fatal__" not in result, result.get("__fatal__")
        assert result[f"check_{check}"] == "ok", f"rank {rank}/{world}:\n{result[f'check_{check}']}"


@pytest.mark.slow
def test_bad_input_raises_before_communication(strategy: str) -> None:
    for rank, result in enumerate(conformance_results(2, strategy)):
        assert "__fatal__" not in result, result.get("__fatal__")
        assert result["check_bad_input"] == "ok", f"rank {rank}:\n{result['check_bad_input']}"


@pytest.mark.slow
def test_a_failed_expectation_leaves_every_other_check_running():
    results = _spawn.run_ranks(
        2, conformance_worker.run_all, "alltoall", "cpu", conformance_worker.InjectedFailureChecks
    )
    for result in results:
        assert result["check_aaa_injected_failure"].startswith("1 failed expectation(s):"), result
        assert "injected failure" in result["check_aaa_injected_failure"]
        others = {name: value for name, value in result.items() if name != "check_aaa_injected_failure"}
        assert others and all(value == "ok" for value in others.values()), others


@pytest.mark.parametrize("strategy", ["alltoall", "aiv"])
def test_ranks_with_no_tokens_to_send_or_receive(strategy: str) -> None:
    """Every check (normal and low latency, dispatch and combine) where rank 1 sends nothing and receives nothing."""
    results = _spawn.run_ranks(2, conformance_worker.run_all, strategy, "cpu", conformance_worker.EmptyRankChecks)
    assert conformance_worker.make_inputs_one_rank_receives_nothing(2)[0][1].shape[0] == 0
    for rank, result in enumerate(results):
        assert "__fatal__" not in result, result.get("__fatal__")
        failed = {name: value for name, value in result.items() if value != "ok"}
        assert not failed, f"rank {rank}: {failed}"
