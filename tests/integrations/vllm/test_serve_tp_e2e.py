"""End to end on a real vLLM (CPU) with tensor parallelism inside vLLM: ``serve`` with a PE and a DE of
tensor-parallel sizes 2 and 2, 2 and 1, 1 and 2, against a plain vLLM server of the DE's size; at 2 and 2 also a model
of one KV head, which vLLM replicates on both ranks of each instance (the replicas' copies, dualpath/replicas.py).

Multi-turn conversations whose prompts extend the previous turn: every turn's greedy text equals the plain
server's, and after the first turn the prefix comes from storage (each rank reads its heads of the blocks the DE's
ranks persisted as parts, published whole). Slow: three servers of two workers each on this machine's cores.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from ascend_dualpath.dualpath.settings import rank_address  # noqa: E402
from ascend_dualpath.dualpath.side_channel import TOKEN_ENV, query_status  # noqa: E402
from ascend_dualpath.integrations.vllm import proxy as proxy_mod  # noqa: E402
from ascend_dualpath.integrations.vllm.cluster import SIDE_PORT_OFFSET  # noqa: E402
from tests.integrations.vllm import test_serve_e2e as e2e  # noqa: E402
from tests.integrations.vllm.fakes import run  # noqa: E402
from tests.integrations.vllm.test_serve_e2e import model  # noqa: E402, F401 (the fixture, by name)

PERSIST_WAIT_S = 30.0  # the last turn's persist runs behind its answer; a rank waits up to PARENT_WAIT_S (10 s)
STARTUP_S = 900  # three vLLM processes and two workers per instance start in minutes on two shared cores
# a fresh instance's first forward builds torch's CPU-ISA probe (a C++ compile of tens of seconds on this VM), past
# the proxy's default request timeout
REQUEST_TIMEOUT_S = 120


def _bind(size: int) -> str:
    """One core list per rank (vLLM's CPU worker); the automatic binding wants a NUMA node per rank."""
    cores = sorted(os.sched_getaffinity(0))
    return "|".join(str(cores[r % len(cores)]) for r in range(size))


TOKEN = b"tp-e2e-deployment-token-01234567"  # serve's token (ADP_SIDE_TOKEN), so the test may ask the side channels


def _check_instance_status(log, sizes: dict[str, int], reader: str) -> None:
    """The proxy's view of each instance (its ranks' statuses merged, ``proxy.query_status``) against each rank's
    own reply: the instance's size, its storage reads the sum of its ranks' (the reading instance's nonzero), and
    nothing unfinished or held once the requests ended."""
    import zmq.asyncio

    ready = next(line for line in log.read_text().splitlines() if line.startswith("serve: ready at"))
    ports = dict(re.findall(r"(\w+) :(\d+)", ready))

    async def merged(side: str) -> dict:
        ctx = zmq.asyncio.Context()
        try:
            return await proxy_mod.query_status(ctx, side, 10.0, TOKEN)
        finally:
            ctx.term()

    for name, size in sizes.items():
        side = f"tcp://127.0.0.1:{int(ports[name]) + SIDE_PORT_OFFSET}"
        ranks = [query_status(rank_address(side, rank), 10.0, token=TOKEN) for rank in range(size)]
        status = run(merged(side))
        assert status["tp_size"] == size and [r.tp_rank for r in ranks] == list(range(size)), (name, status)
        assert status["snic_read_bytes"] == sum(r.snic_read_bytes for r in ranks), (name, status, ranks)
        assert status["snic_read_bytes"] > 0 or name != reader, (name, status)
        held = {key: status[key] for key in ("unfinished_requests", "host_leases", "quarantined_bytes")}
        assert held == dict.fromkeys(held, 0), (name, status)


def _wait_persisted(store) -> None:
    """Wait (bounded) until every persist ended: no announcement left and every part set published."""
    deadline = time.monotonic() + PERSIST_WAIT_S
    while True:
        pending = [*(store / "persisting").glob("*"), *(store / "parts").glob("*")]
        if not pending:
            return
        assert time.monotonic() < deadline, f"after {PERSIST_WAIT_S} s still persisting: {pending}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def one_kv_head_model(tmp_path_factory) -> str:
    """The tiny model with one KV head: at tensor-parallel size 2 vLLM replicates it on both ranks."""
    from ascend_dualpath.models.tiny_hf import TinyHFConfig, make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-model-kv1"), TinyHFConfig(num_kv_heads=1)))


@pytest.mark.parametrize(
    ("pe_tp", "de_tp", "policy", "kv_heads"),
    [
        (2, 2, "de", 2),
        (2, 2, "pe", 2),
        (2, 1, "de", 2),
        (2, 1, "pe", 2),
        (1, 2, "de", 2),
        (2, 2, "de", 1),
        (2, 2, "pe", 1),
    ],  # fmt: skip
    ids=["pe2-de2-de", "pe2-de2-pe", "pe2-de1-de", "pe2-de1-pe", "pe1-de2-de", "pe2-de2-de-kv1", "pe2-de2-pe-kv1"],
)
def test_serve_at_tensor_parallel_sizes_matches_plain_vllm_and_loads_from_storage(
    request,
    tmp_path,
    pe_tp,
    de_tp,
    policy,
    kv_heads,
    monkeypatch,
):
    """serve first, the plain server after it (not both at once: six vLLM workers on this machine's cores start too
    slowly), each turn's text compared with a plain server of the DE's size (the DE decodes every answer).

    ``kv_heads`` 1: both ranks of each instance hold the one head (vLLM replicates it); each request's lead rank reads
    and moves it, and the other rank takes its rows through vLLM's tensor-parallel group (dualpath/replicas.py) on
    the PE before each layer's attention and on the DE before the request decodes: a rank without them would attend
    over garbage and the text would differ."""
    served = request.getfixturevalue("model" if kv_heads == 2 else "one_kv_head_model")
    monkeypatch.setattr(e2e, "STARTUP_S", STARTUP_S)
    sizes = [f"prefill0=--tensor-parallel-size {pe_tp}", f"decode0=--tensor-parallel-size {de_tp}"]
    # different sizes sum a layer's partial products in another order, so a bf16 prompt's KV computed at the PE's
    # size can differ in its last bits from the plain server's at the DE's size; float32 keeps the greedy text equal
    dtype = ("--dtype", "float32") if pe_tp != de_tp else ()
    vllm_shm = {name for name in os.listdir("/dev/shm") if name.startswith("vllm_dist_")}
    proc, url, log = e2e._serve(served, tmp_path, "--policy", policy, "--startup-timeout", str(STARTUP_S),
                                "--timeout", str(REQUEST_TIMEOUT_S),
                                *(arg for size in sizes for arg in ("--instance-args", size)),
                                *(("--", *dtype) if dtype else ()), env={TOKEN_ENV: TOKEN.decode()})  # fmt: skip
    try:
        turns = e2e.conversation_turns(url, served)
        metrics = e2e._get(f"{url}/metrics")
        loads = sum(e2e._metric(metrics, "vllm:dualpath_loads_total", path=p) for p in ("pe", "de", "split"))
        # one load per request with storage hits, counted once per instance whatever the sizes (each conversation's
        # turns after its first find their prefix stored)
        assert len(turns) - len(turns) // e2e.TURNS <= loads <= len(turns), metrics
        assert e2e._metric(metrics, "vllm:dualpath_failures_total") == 0, metrics
        _wait_persisted(tmp_path / "store")
        assert list((tmp_path / "store" / "blocks").rglob("*.kvb"))
        _check_instance_status(log, {"prefill0": pe_tp, "decode0": de_tp}, "prefill0" if policy == "pe" else "decode0")
    finally:
        code = e2e._stop(proc)
    assert code == 128 + signal.SIGTERM, log.read_text()[-3000:]
    e2e._assert_nothing_left()
    left = {name for name in os.listdir("/dev/shm") if name.startswith("vllm_dist_")} - vllm_shm
    assert not left, f"serve left its vLLM workers' shared memory: {sorted(left)}"
    env = {"VLLM_CPU_OMP_THREADS_BIND": _bind(de_tp)}
    for plain in e2e.plain_server(
        served, tmp_path / "plain.log", "--tensor-parallel-size", str(de_tp), *dtype, env=env
    ):
        for turn, (prompt, ours) in enumerate(turns):
            reference = e2e._complete(plain, served, prompt)
            assert ours == reference, f"turn {turn}: {ours!r} != plain vLLM's {reference!r}"
