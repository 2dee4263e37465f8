"""End to end on a real vLLM (CPU): ``serve`` with each read-path policy against a plain vLLM server.

Multi-turn conversations whose prompts extend the previous turn; every turn's greedy text must equal the plain
server's; after the first turn the prefix comes from storage (bytes per storage NIC in the proxy's /metrics); a
corrupted stored block is caught by its checksum and recomputed; killing the PE or the DE mid-request ends the request with
an error and ``serve`` exits cleanly (the PE or the DE), leaving nothing behind. Slow: each deployment takes 30-90 s to start here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

# preexec_fn of the servers a test starts: SIGTERM (serve and vLLM clean up on it) when pytest dies
from ascend_dualpath._process import term_with_parent as _term_with_pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
STARTUP_S = 420
TURNS = 3
GEN_TOKENS = 16
ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def _get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.read().decode()


def _wait_http(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{url} exited with {proc.returncode} during start-up:\n{log.read_text()[-3000:]}")
        try:
            _get(url, timeout=2)
            return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(1)
    pytest.fail(f"{url} did not come up in {STARTUP_S} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(10)


def _free_port() -> int:
    from ascend_dualpath.integrations.vllm.serve import pick_instance_ports

    return pick_instance_ports(1)[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    from ascend_dualpath.models.tiny_hf import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="module")
def plain(model, tmp_path_factory):
    """A plain vLLM server of the same model: the reference text."""
    yield from plain_server(model, tmp_path_factory.mktemp("plain") / "plain.log")


def plain_server(model: str, log: Path, *args: str, env: dict | None = None):
    """Yields the URL of a plain vLLM server of ``model`` (more ``args`` and ``env`` for it), stopped after."""
    port = _free_port()
    from ascend_dualpath.integrations.vllm.serve import remove_vllm_shm, server_argv, vllm_dist_idents

    tmp = tempfile.mkdtemp(prefix="adp-plain-", dir="/tmp")  # vLLM's IPC sockets: a short path, removed after
    proc = subprocess.Popen(
        [*server_argv(model, port), *args],
        env={**os.environ, **ENV, "TMPDIR": tmp, **(env or {})},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_term_with_pytest,  # SIGTERM when pytest dies: a killed run leaves nothing
    )
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        idents = vllm_dist_idents(tmp)  # at tensor-parallel size 2 its CPU workers leave shared memory, as serve's
        _stop(proc)
        remove_vllm_shm(idents)
        shutil.rmtree(tmp, ignore_errors=True)


def _serve(model: str, tmp: Path, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, str, Path]:
    port = _free_port()
    log = tmp / "serve.log"
    argv = [
        sys.executable,
        "-m",
        "ascend_dualpath",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--store",
        str(tmp / "store"),
        "--timeout",
        "20",
        "--log-dir",
        str(tmp / "logs"),
        *args,
    ]
    proc = subprocess.Popen(
        argv,
        env={**os.environ, **ENV, **(env or {})},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_term_with_pytest,  # SIGTERM when pytest dies: a killed run leaves nothing
        cwd=ROOT,
    )
    _wait_http(f"http://127.0.0.1:{port}/health", proc, log)
    return proc, f"http://127.0.0.1:{port}", log


def _vocab(model: str) -> list[str]:
    words = list(json.loads(Path(model, "tokenizer.json").read_text())["model"]["vocab"])
    return [w for w in words if w.isalpha()][:300]


def _conversation(model: str, agent: int) -> list[str]:
    """Turn appendices of one agent: the first is its long opening, then short user messages."""
    words = _vocab(model)
    opening = " ".join(words[(agent * 37 + 7 * i) % len(words)] for i in range(110))
    appends = [
        " ".join(words[(agent * 11 + turn * 13 + i) % len(words)] for i in range(24)) for turn in range(1, TURNS)
    ]
    return [opening, *appends]


def _complete(url: str, model: str, prompt: str, stream: bool = False) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": GEN_TOKENS, "temperature": 0, "ignore_eos": True}
    if not stream:
        return _post(f"{url}/v1/completions", body)["choices"][0]["text"]
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    text = []
    with urllib.request.urlopen(request, timeout=120) as reply:
        for line in reply:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def conversation_turns(url: str, model: str, agents: int = 2) -> list[tuple[str, str]]:
    """Every turn's ``(prompt, text)`` through ``url``, each turn extending the last one's prompt and answer."""
    done = []
    for agent in range(agents):
        prompt = ""
        for turn, append in enumerate(_conversation(model, agent)):
            prompt = f"{prompt} {append}".strip()
            text = _complete(url, model, prompt, stream=(turn == 1))
            done.append((prompt, text))
            prompt += text  # the next turn at once: it must find this turn's blocks (docs/vllm.md, persisting)
    return done


def _run_conversations(url: str, plain: str, model: str, agents: int = 2) -> list[tuple[str, str]]:
    """Every turn through ``url`` and its prompt through the plain server: ``[(ours, plain), ...]``."""
    return [(ours, _complete(plain, model, prompt)) for prompt, ours in conversation_turns(url, model, agents)]


def _metric(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def _assert_nothing_left(fabric_prefix: str = "adp.serve") -> None:
    left = [p for p in os.listdir("/dev/shm") if p.startswith(fabric_prefix)]
    assert not left, f"left in /dev/shm: {left}"


@pytest.mark.parametrize(("policy", "multiprocess"), [("pe", "0"), ("de", "0"), ("dual", "1"), ("split", "0")])
def test_serve_matches_plain_vllm_and_loads_from_storage(model, plain, tmp_path, policy, multiprocess):
    args = ("--policy", "dual", "--split") if policy == "split" else ("--policy", policy)
    proc, url, log = _serve(model, tmp_path, *args, env={"VLLM_ENABLE_V1_MULTIPROCESSING": multiprocess})
    try:
        pairs = _run_conversations(url, plain, model)
        for turn, (ours, reference) in enumerate(pairs):
            assert ours == reference, f"turn {turn}: {ours!r} != plain vLLM's {reference!r}"
        metrics = _get(f"{url}/metrics")
        read = {
            side: _metric(metrics, "adp_snic_read_bytes", node=node) for side, node in (("pe", "pe0"), ("de", "de0"))
        }
        assert sum(read.values()) > 0, metrics
        if policy == "pe":
            assert read["de"] == 0 < read["pe"]
        if policy == "de":
            assert read["pe"] == 0 < read["de"]
        if policy == "split":  # both storage NICs idle and uncapped: each request's hits read half and half
            assert (
                read["pe"] > 0 and read["de"] > 0 and _metric(metrics, "vllm:dualpath_loads_total", path="split") >= 1
            ), metrics
        # every turn after the first loaded its prefix: one load per such turn, on the chosen path
        loads = sum(_metric(metrics, "vllm:dualpath_loads_total", path=p) for p in ("pe", "de", "split"))
        assert loads >= 2 * (TURNS - 1), metrics
        assert _metric(metrics, "vllm:dualpath_failures_total") == 0, metrics
        if policy == "dual":
            _check_corrupted_block_is_recomputed(url, plain, model, tmp_path / "store")
    finally:
        code = _stop(proc)
    assert code == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert "serve: interrupted by SIGTERM; 3 children stopped" in log.read_text()
    _assert_nothing_left()


def _check_corrupted_block_is_recomputed(url: str, plain: str, model: str, store: Path) -> None:
    """Flip one payload byte of every stored block: the next turn is caught by the checksums, recomputed (the
    serve default ``--on-load-failure recompute``), and its text is still the plain server's."""
    blocks = sorted(store.rglob("*.kvb"))
    assert blocks, f"no block files under {store}"
    for path in blocks:
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(raw)
    prompt = " ".join(_conversation(model, 0)[:2])
    assert _complete(url, model, prompt) == _complete(plain, model, prompt)
    metrics = _get(f"{url}/metrics")
    assert _metric(metrics, "vllm:dualpath_checksum_errors_total") >= 1, metrics


def _post_killing(url: str, body: dict, pid: int) -> urllib.error.HTTPError:
    """Send ``body`` and SIGKILL ``pid`` at once (the PE answers its 1-token leg in ~0.2 s); the HTTP error."""
    outcome: dict = {}

    def send() -> None:
        try:
            outcome["reply"] = _post(url, body, timeout=60)
        except urllib.error.HTTPError as exc:
            outcome["error"] = exc

    sender = threading.Thread(target=send)
    sender.start()
    os.kill(pid, signal.SIGKILL)
    sender.join(90)
    assert "error" in outcome, f"the request survived the prefill's death: {outcome}"
    return outcome["error"]


def _stream_killing(url: str, body: dict, pid: int) -> list[str]:
    """Stream ``body`` and SIGKILL ``pid`` once the first token arrived (decoding is under way, whatever the
    machine's speed); the SSE ``data:`` payloads received."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    events: list[str] = []
    with urllib.request.urlopen(request, timeout=60) as reply:
        for line in reply:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
                if len(events) == 1:
                    os.kill(pid, signal.SIGKILL)
    return events


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_killing_an_instance_mid_request_fails_it_and_serve_exits_cleanly(model, tmp_path, victim):
    proc, url, log = _serve(model, tmp_path, "--policy", "pe", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    try:
        deadline = time.monotonic() + 30
        while "serve: ready" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        port = int(log.read_text().split(f"{victim}0 :")[1].split(" ")[0])
        pid = int(subprocess.check_output(["fuser", "-n", "tcp", str(port)], stderr=subprocess.DEVNULL).split()[0])
        words = _vocab(model)
        prompt = " ".join(words[(7 * i) % len(words)] for i in range(1500))  # a prefill long enough to hit
        # the longest answer the model's 4096 positions allow: decoding outlasts the kill on a fast machine
        body = {"model": model, "prompt": prompt, "max_tokens": 2500, "temperature": 0, "ignore_eos": True}
        started = time.monotonic()
        if victim == "prefill":
            error = _post_killing(f"{url}/v1/completions", body, pid)
            assert error.code >= 500, error
        else:
            events = _stream_killing(f"{url}/v1/completions", {**body, "stream": True}, pid)
            assert "[DONE]" not in events, f"the stream survived the decode's death: {events[-3:]}"
            error = json.loads(events[-1])["error"]  # the proxy's own error, in vLLM's shape
            assert (error["code"], error["type"]) == (502, "BadGatewayError") and "decode0" in error["message"], error
            assert len(events) - 1 < body["max_tokens"], len(events)
        assert time.monotonic() - started < 60
        assert proc.wait(60) == 1, log.read_text()[-3000:]  # a child that died stops the whole deployment
    finally:
        _stop(proc)
    text = log.read_text()
    assert f"{victim}0 exited with -9 while serving; last error line: " in text, text[-3000:]
    assert f"(log {tmp_path / 'logs' / victim}0.log)" in text and f"logs kept in {tmp_path / 'logs'}" in text
    assert {"prefill0.log", "decode0.log", "proxy.log", "cluster.json"} <= set(os.listdir(tmp_path / "logs"))
    _assert_nothing_left()
