"""End to end on a real vLLM (CPU) with tensor parallelism inside vLLM: ``serve`` with a PE and a DE of
tensor-parallel size 2 against a plain vLLM server of the same size.

Multi-turn conversations whose prompts extend the previous turn: every turn's greedy text equals the plain
server's, and after the first turn the prefix comes from storage (each rank reads its heads of the blocks the DE's
ranks persisted as parts, published whole). Slow: three servers of two workers each on this machine's cores.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from tests.integrations.vllm import test_serve_e2e as e2e  # noqa: E402
from tests.integrations.vllm.test_serve_e2e import model  # noqa: E402, F401 (the fixture)

TP = 2
PERSIST_WAIT_S = 30.0  # the last turn's persist runs behind its answer; a rank waits up to PARENT_WAIT_S (10 s)
STARTUP_S = 900  # three vLLM processes and two workers per instance start in minutes on two shared cores
# a fresh instance's first forward builds torch's CPU-ISA probe (a C++ compile of tens of seconds on this VM), past
# the proxy's default request timeout
REQUEST_TIMEOUT_S = 120
# one core list per rank (vLLM's CPU worker); the automatic binding wants a NUMA node per rank
TP_BIND = "|".join(str(sorted(os.sched_getaffinity(0))[r % len(os.sched_getaffinity(0))]) for r in range(TP))


def _wait_persisted(store) -> None:
    """Wait (bounded) until every persist ended: no announcement left and every part set published."""
    deadline = time.monotonic() + PERSIST_WAIT_S
    while True:
        pending = [*(store / "persisting").glob("*"), *(store / "parts").glob("*")]
        if not pending:
            return
        assert time.monotonic() < deadline, f"after {PERSIST_WAIT_S} s still persisting: {pending}"
        time.sleep(0.1)


@pytest.mark.parametrize("policy", ["de", "pe"])
def test_serve_at_tensor_parallel_size_two_matches_plain_vllm_and_loads_from_storage(
    model,  # noqa: F811 (the fixture)
    tmp_path,
    policy,
    monkeypatch,
):
    """serve first, the plain server after it (not both at once: six vLLM workers on this machine's cores start too
    slowly), each turn's text compared."""
    monkeypatch.setattr(e2e, "STARTUP_S", STARTUP_S)
    proc, url, log = e2e._serve(model, tmp_path, "--policy", policy, "--startup-timeout", str(STARTUP_S),
                            "--timeout", str(REQUEST_TIMEOUT_S), "--", "--tensor-parallel-size", str(TP))  # fmt: skip
    try:
        turns = e2e.conversation_turns(url, model)
        metrics = e2e._get(f"{url}/metrics")
        loads = sum(e2e._metric(metrics, "vllm:dualpath_loads_total", path=p) for p in ("pe", "de", "split"))
        assert loads >= 2 * (e2e.TURNS - 1), metrics
        assert e2e._metric(metrics, "vllm:dualpath_failures_total") == 0, metrics
        _wait_persisted(tmp_path / "store")
        assert list((tmp_path / "store" / "blocks").rglob("*.kvb"))
    finally:
        code = e2e._stop(proc)
    assert code == 128 + signal.SIGTERM, log.read_text()[-3000:]
    e2e._assert_nothing_left()
    env = {"VLLM_CPU_OMP_THREADS_BIND": TP_BIND}
    for plain in e2e.plain_server(model, tmp_path / "plain.log", "--tensor-parallel-size", str(TP), env=env):
        for turn, (prompt, ours) in enumerate(turns):
            reference = e2e._complete(plain, model, prompt)
            assert ours == reference, f"turn {turn}: {ours!r} != plain vLLM's {reference!r}"
