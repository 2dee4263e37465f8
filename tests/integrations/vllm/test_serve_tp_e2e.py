"""End to end on a real vLLM (CPU) with tensor parallelism inside vLLM (an expected failure while the connector
refuses it, docs/vllm.md): ``serve`` with a PE and a DE of
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

from tests.integrations.vllm import test_serve_e2e as e2e  # noqa: E402
from tests.integrations.vllm.test_serve_e2e import (  # noqa: E402
    TURNS,
    _assert_nothing_left,
    _complete,
    _conversation,
    _get,
    _metric,
    _serve,
    _stop,
    model,  # noqa: F401 (the fixture)
    plain_server,
)

TP = 2
STARTUP_S = 900  # three vLLM processes and two workers per instance start in minutes on two shared cores
# one core list per rank (vLLM's CPU worker); the automatic binding wants a NUMA node per rank
TP_BIND = "|".join(str(sorted(os.sched_getaffinity(0))[r % len(os.sched_getaffinity(0))]) for r in range(TP))


def _turns(url: str, model_dir: str, agents: int = 2) -> list[tuple[str, str]]:
    """Every turn's ``(prompt, text)`` through ``url``, each turn extending the last one's prompt and answer."""
    done = []
    for agent in range(agents):
        prompt = ""
        for turn, append in enumerate(_conversation(model_dir, agent)):
            prompt = f"{prompt} {append}".strip()
            text = _complete(url, model_dir, prompt, stream=(turn == 1))
            done.append((prompt, text))
            prompt += text  # the next turn at once: it must find this turn's blocks (docs/vllm.md, persisting)
    return done


@pytest.mark.xfail(
    strict=True,
    reason="the connector refuses tensor_parallel_size 2 inside vLLM: with the refusal lifted, the first request "
    "through a PE and a DE of size 2 hung (proxy 504, neither instance finished it); lift both together",
)
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
    proc, url, log = _serve(model, tmp_path, "--policy", policy, "--startup-timeout", str(STARTUP_S),
                            "--", "--tensor-parallel-size", str(TP))  # fmt: skip
    try:
        turns = _turns(url, model)
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
    env = {"VLLM_CPU_OMP_THREADS_BIND": TP_BIND}
    for plain in plain_server(model, tmp_path / "plain.log", "--tensor-parallel-size", str(TP), env=env):
        for turn, (prompt, ours) in enumerate(turns):
            reference = _complete(plain, model, prompt)
            assert ours == reference, f"turn {turn}: {ours!r} != plain vLLM's {reference!r}"
