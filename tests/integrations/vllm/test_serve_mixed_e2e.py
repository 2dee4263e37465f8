"""End to end on a real vLLM (CPU): ``serve --policy dual`` holds nothing after any mix of requests.

200 requests of every kind a client sends (short prompts, long ones sharing stored prefixes, requests only the DE
refuses, streams the client abandons after the first chunk, prompt lists, ``n = 2`` sampled), then every instance's
side-channel ``status`` must come back to zero (no unfinished request or token, no host lease, nothing
quarantined) within the plans' expiry bound, and the proxy's log must hold no traceback. Then ``vllm bench serve``
(random dataset, concurrency 32, 200 requests; through ``tools/vllm_cli.py`` as docs/vllm.md says) must see no
failed request. Slow: the deployment takes 30-90 s to start here.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
aiohttp = pytest.importorskip("aiohttp")
pytestmark = pytest.mark.slow

from ascend_dualpath.dualpath.side_channel import TOKEN_ENV, query_status  # noqa: E402
from ascend_dualpath.integrations.vllm.cluster import SIDE_PORT_OFFSET  # noqa: E402
from tests.integrations.vllm import test_serve_e2e as e2e  # noqa: E402
from tests.integrations.vllm.test_serve_e2e import ENV, ROOT, _get, _serve, _stop, _vocab  # noqa: E402

model = e2e.model  # the same tiny model fixture
TOKEN = b"mixed-e2e-deployment-token-0123"  # serve's token (ADP_SIDE_TOKEN), so the test may ask the side channels
TIMEOUT_S = 15  # serve's --timeout: the connectors' bound, and so how long a plan no request took lives
MIX = {"short": 50, "long": 40, "refused": 30, "aborted": 30, "batched": 25, "n2": 25}
# What an instance holds now; each must be 0 once every request ended (counters since start are not here).
HELD = ("unfinished_requests", "unfinished_tokens", "host_leases", "quarantined_bytes")


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    """``serve --policy dual``: ``(url, side channel by instance name, log directory)``."""
    tmp = tmp_path_factory.mktemp("mixed")
    proc, url, log = _serve(model, tmp, "--policy", "dual", "--timeout", str(TIMEOUT_S),
                            env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", TOKEN_ENV: TOKEN.decode()})  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (ready := [x for x in log.read_text().splitlines() if x.startswith("serve: ready at")]):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        ports = re.findall(r"(\w+) :(\d+)", ready[0])
        yield url, {name: f"tcp://127.0.0.1:{int(p) + SIDE_PORT_OFFSET}" for name, p in ports}, tmp / "logs"
        assert proc.poll() is None, f"serve died:\n{log.read_text()[-3000:]}"
    finally:
        _stop(proc)


def _requests(model: str) -> list[tuple[str, dict]]:
    """The mix, shuffled (fixed seed): ``(kind, body)``. Long prompts share four prefixes, so later ones read
    their hits from the store over either path."""
    rng, words = random.Random(26), _vocab(model)[:300]

    def prompt(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    prefixes = [prompt(rng.randint(96, 300)) for _ in range(4)]
    base = {"model": model, "max_tokens": 4, "temperature": 0}
    make = {
        "short": lambda: {**base, "prompt": prompt(rng.randint(1, 40))},
        "long": lambda: {**base, "prompt": f"{rng.choice(prefixes)} {prompt(rng.randint(1, 60))}"},
        "refused": lambda: {**base, "prompt": prompt(rng.randint(40, 200)), "max_tokens": -1},
        "aborted": lambda: {**base, "prompt": prompt(rng.randint(20, 200)), "max_tokens": 64, "stream": True},
        "batched": lambda: {**base, "prompt": [prompt(rng.randint(5, 200)) for _ in range(rng.randint(2, 3))]},
        "n2": lambda: {**base, "prompt": prompt(rng.randint(5, 200)), "n": 2, "temperature": 1.0, "seed": 7},
    }
    mix = [(kind, make[kind]()) for kind, count in MIX.items() for _ in range(count)]
    rng.shuffle(mix)
    return mix


async def _one(session, url: str, kind: str, body: dict) -> str | None:
    """One request; returns what was wrong with its answer, or None."""
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if kind == "aborted":
            async for _ in resp.content:  # the first chunk, then the client goes away
                break
            resp.close()
            return None if resp.status == 200 else f"{kind}: {resp.status}"
        text = await resp.text()
    if kind == "refused":
        return None if resp.status == 400 and json.loads(text)["error"]["type"] else f"{kind}: {resp.status} {text}"
    if resp.status != 200:
        return f"{kind}: {resp.status} {text[:300]}"
    want = len(body["prompt"]) if kind == "batched" else body.get("n", 1)
    got = sorted(c["index"] for c in json.loads(text)["choices"])
    return None if got == list(range(want)) else f"{kind}: choices {got}, expected {want}"


async def _run_mix(url: str, mix: list[tuple[str, dict]], concurrency: int = 8) -> list[str]:
    limit = asyncio.Semaphore(concurrency)

    async def bounded(session, kind, body):
        async with limit:
            return await _one(session, url, kind, body)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        results = await asyncio.gather(*(bounded(session, k, b) for k, b in mix))
    return [r for r in results if r is not None]


def _held(sides: dict[str, str]) -> dict:
    """``{instance: {field: value}}`` of every non-zero held-now figure."""
    found = {}
    for name, side in sides.items():
        status = query_status(side, 10, token=TOKEN)
        nonzero = {key: getattr(status, key) for key in HELD if getattr(status, key)}
        if nonzero:
            found[name] = nonzero
    return found


def _assert_drained(sides: dict[str, str]) -> None:
    """Every plan ends within its expiry bound (``TIMEOUT_S``) and a quarantine sweep or two after it."""
    deadline = time.monotonic() + 3 * TIMEOUT_S
    while (held := _held(sides)) and time.monotonic() < deadline:
        time.sleep(1)
    assert not held, f"still held {3 * TIMEOUT_S} s after the last request: {held}"


def _tracebacks(log_dir: Path) -> list[str]:
    """The exception line of each traceback in the proxy's log."""
    lines = (log_dir / "proxy.log").read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        if "Traceback" in line:
            after = [x for x in lines[i + 1 :] if x and not x.startswith(" ")]
            found.append(after[0] if after else line)
    return found


def test_every_request_of_a_mixed_run_leaves_nothing_held(model, served):
    url, sides, log_dir = served
    mix = _requests(model)
    assert len(mix) == 200 and set(sides) == {"prefill0", "decode0"}
    problems = asyncio.run(_run_mix(url, mix))
    assert problems == [], f"{len(problems)} wrong answers, first: {problems[:5]}"
    _assert_drained(sides)
    assert _tracebacks(log_dir) == []
    assert json.loads(_get(url + "/health"))  # serve is still up


def test_vllm_bench_serve_through_serve_has_no_failure(model, served, tmp_path):
    url, sides, log_dir = served
    argv = [sys.executable, str(ROOT / "tools" / "vllm_cli.py"), "bench", "serve", "--backend", "vllm",
            "--base-url", url, "--model", model, "--tokenizer", model, "--dataset-name", "random",
            "--random-input-len", "64", "--random-output-len", "8", "--num-prompts", "200", "--max-concurrency", "32",
            "--seed", "26", "--save-result", "--result-dir", str(tmp_path), "--result-filename", "bench.json"]  # fmt: skip
    proc = subprocess.run(argv, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert (result["completed"], result["failed"]) == (200, 0), {k: result.get(k) for k in ("completed", "failed")}
    _assert_drained(sides)
    assert _tracebacks(log_dir) == []
