"""End to end on a real vLLM (CPU) with tensor parallelism inside vLLM: ``serve`` with a PE and a DE of
tensor-parallel size 2 against a plain vLLM server of the same size.

Multi-turn conversations whose prompts extend the previous turn: every turn's greedy text equals the plain
server's, and after the first turn the prefix comes from storage (each rank reads its heads of the blocks the DE's
ranks persisted as parts, published whole). Slow: three servers of two workers each on this machine's cores.
"""

from __future__ import annotations

import os
import signal

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from tests.integrations.vllm.test_serve_e2e import (  # noqa: E402
    TURNS,
    _assert_nothing_left,
    _get,
    _metric,
    _run_conversations,
    _serve,
    _stop,
    model,  # noqa: F401 (the fixture)
    plain_server,
)

TP = 2
# one core list per rank (vLLM's CPU worker); the automatic binding wants a NUMA node per rank
TP_BIND = "|".join(str(sorted(os.sched_getaffinity(0))[r % len(os.sched_getaffinity(0))]) for r in range(TP))


@pytest.fixture(scope="module")
def plain_tp(model, tmp_path_factory):  # noqa: F811 (model: the fixture)
    """A plain vLLM server of the same model at tensor-parallel size 2: the reference text."""
    log = tmp_path_factory.mktemp("plain-tp") / "plain.log"
    yield from plain_server(model, log, "--tensor-parallel-size", str(TP), env={"VLLM_CPU_OMP_THREADS_BIND": TP_BIND})


@pytest.mark.parametrize("policy", ["de", "pe"])
def test_serve_at_tensor_parallel_size_two_matches_plain_vllm_and_loads_from_storage(model, plain_tp, tmp_path, policy):  # noqa: F811
    proc, url, log = _serve(model, tmp_path, "--policy", policy, "--", "--tensor-parallel-size", str(TP))
    try:
        pairs = _run_conversations(url, plain_tp, model)
        for turn, (ours, reference) in enumerate(pairs):
            assert ours == reference, f"turn {turn}: {ours!r} != plain vLLM's {reference!r}"
        metrics = _get(f"{url}/metrics")
        loads = sum(_metric(metrics, "vllm:dualpath_loads_total", path=p) for p in ("pe", "de", "split"))
        assert loads >= 2 * (TURNS - 1), metrics
        assert _metric(metrics, "vllm:dualpath_failures_total") == 0, metrics
        stored = list((tmp_path / "store" / "blocks").rglob("*.kvb"))
        assert stored and not any((tmp_path / "store" / "parts").iterdir())  # every part set published
    finally:
        code = _stop(proc)
    assert code == 128 + signal.SIGTERM, log.read_text()[-3000:]
    _assert_nothing_left()
