"""End to end on a real vLLM (CPU): a decode instance of data-parallel size 2 behind ``serve``.

vLLM runs two engines behind the DE's one server, each with its own KV cache and its own DualPath connector (side
channel at the base port + its rank); the proxy places on each engine as on an instance of its own and routes with
vLLM's ``X-data-parallel-rank`` header. Multi-turn conversations with storage hits on the DE read path (so each
engine's own storage reads and pushes are exercised): every turn's greedy text equals a plain vLLM server at the same
data-parallel size, both engines take requests, and every turn after the first loads its prefix. Slow.
"""

from __future__ import annotations

import collections
import json
import signal

import pytest

from tests.integrations.vllm.test_serve_e2e import (
    _assert_nothing_left,
    _get,
    _metric,
    _run_conversations,
    _serve,
    _stop,
    model,  # noqa: F401 (the fixture)
    plain_server,
)

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

DP = ("--data-parallel-size", "2")
BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one worker per core: vLLM's automatic binding needs a NUMA node each


@pytest.fixture(scope="module")
def plain_dp(model, tmp_path_factory):  # noqa: F811 (the fixture)
    """A plain vLLM server of the same model at data-parallel size 2: the reference text."""
    yield from plain_server(model, tmp_path_factory.mktemp("plain") / "plain.log", *DP, env=BIND)


def test_a_data_parallel_decode_instance_serves_both_engines_identically(model, plain_dp, tmp_path):  # noqa: F811
    proc, url, log = _serve(
        model, tmp_path, "--policy", "de", "--placement", "round-robin", "--instance-args", f"decode0={' '.join(DP)}"
    )
    try:
        pairs = _run_conversations(url, plain_dp, model, agents=2)
        for turn, (ours, reference) in enumerate(pairs):
            assert ours == reference, f"turn {turn}: {ours!r} != plain vLLM's {reference!r}"
        decisions = json.loads(_get(f"{url}/debug/decisions"))
        engines = collections.Counter(d["decode"] for d in decisions)
        assert set(engines) == {"decode0.dp0", "decode0.dp1"}, engines
        metrics = _get(f"{url}/metrics")
        assert _metric(metrics, "adp_snic_read_bytes", node="de0") > 0, metrics
        # a later turn loads its prefix from storage unless the previous turn's persist, on the other engine, is
        # still running past the lookup's wait (it is then computed: the text above stays identical)
        loads = _metric(metrics, "vllm:dualpath_loads_total", path="de")
        assert loads >= 1 and _metric(metrics, "vllm:dualpath_failures_total") == 0, metrics
        cluster = json.loads((tmp_path / "logs" / "cluster.json").read_text())
        assert cluster["decode"][0]["dp"] == 2, cluster
    finally:
        code = _stop(proc)
    assert code == 128 + signal.SIGTERM, log.read_text()[-3000:]
    _assert_nothing_left()
