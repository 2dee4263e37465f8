"""End to end on a real vLLM (CPU): ``serve --prefill 2 --decode 2`` and the placement rules against the live
engines' state, with greedy text identical to a plain vLLM server.

One deployment for the module (four in-process vLLM engines on this machine start slowly): nodes ``n0`` (prefill0,
decode0; storage NIC capped at 0.1 MB/s, so a read of a few hundred tokens takes seconds) and ``n1`` (prefill1,
decode1; uncapped), one DE group, alpha 50 tokens, beta 600 tokens, and decode1 with 4 KV blocks of 32 tokens
(``--num-gpu-blocks-override 5``: vLLM keeps one as its null block), too few for any request of more than 128 tokens. Slow.

Needs the connector's N x M dataplane (any PE with any DE on one fabric, ``device_id`` per instance).
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.request

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from tests.integrations.vllm.test_serve_e2e import (  # noqa: E402
    _assert_nothing_left,
    _complete,
    _get,
    _metric,
    _serve,
    _stop,
    _vocab,
    model,  # noqa: F401  (a module fixture of this module too)
    plain_server,
)

ALPHA, BETA = 50, 600
# float32 on both sides: a P/D pair computes a prompt's last token as a one-token step over the received KV, a plain
# server in one prefill, and on a CPU without AMX vLLM's bf16 attention kernels for the two shapes round differently
# (a fresh prompt's greedy text diverged after a few tokens); the bytes the connector moves are exact either way
DTYPE = ("--dtype", "float32")


@pytest.fixture(scope="module")
def plain(model, tmp_path_factory):  # noqa: F811
    """A plain vLLM server of the same model and dtype: the reference text."""
    yield from plain_server(model, tmp_path_factory.mktemp("plain") / "plain.log", *DTYPE)


def _ready_line(log, timeout_s: float = 30.0) -> str:
    """serve's ``serve: ready ...`` line; the proxy answers /health a moment before serve prints it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = [line for line in log.read_text().splitlines() if line.startswith("serve: ready")]
        if lines:
            return lines[0]
        time.sleep(0.2)
    raise AssertionError(f"no 'serve: ready' line within {timeout_s} s: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):  # noqa: F811
    """The 2 PE x 2 DE deployment: ``(proxy URL, {instance name: URL})``."""
    tmp = tmp_path_factory.mktemp("cluster")
    proc, url, log = _serve(
        model, tmp,
        "--prefill", "2", "--decode", "2", "--nodes", "n0,n1,n0,n1", "--decode-groups", "0,0",
        "--node-snic-mbps", "n0=0.1", "--alpha-tokens", str(ALPHA), "--beta-tokens", str(BETA),
        "--instance-args", "decode1=--num-gpu-blocks-override 5 --max-model-len 128",
        "--timeout", "60",  # float32's KV is twice bf16's: a 700-word hit through n0's 0.1 MB/s NIC reads for longer
        "--", *DTYPE,
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )  # fmt: skip
    ready = _ready_line(log)
    urls = {name: f"http://127.0.0.1:{ready.split(f'{name} :')[1].split(' ')[0]}" for name in
            ("prefill0", "prefill1", "decode0", "decode1")}  # fmt: skip
    try:
        yield url, urls
    finally:
        code = _stop(proc)
    assert code == 128 + signal.SIGTERM, log.read_text()[-3000:]
    _assert_nothing_left()


def _words(model_dir: str, count: int, seed: int) -> str:
    words = _vocab(model_dir)
    return " ".join(words[(seed * 31 + 7 * i) % len(words)] for i in range(count))


def _tokens(url: str, model_name: str, prompt: str) -> int:
    """vLLM's own count of ``prompt``'s tokens (its ``/tokenize``)."""
    request = urllib.request.Request(
        f"{url}/tokenize",
        json.dumps({"model": model_name, "prompt": prompt}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())["count"]


def _decisions(url: str) -> list[dict]:
    return json.loads(_get(f"{url}/debug/decisions"))


def _rule(decision: dict, name: str) -> list[str]:
    return [r for r in decision["rules"] if r.split(" ", 1)[0] == name]


def _in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        out["value"] = fn(*args)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_backlogged_node_full_de_and_shorter_queue_with_plain_text(model, plain, cluster):  # noqa: F811
    url, urls = cluster
    blocks = _get(f"{urls['decode1']}/metrics")
    assert 'num_gpu_blocks="5"' in blocks  # vLLM's own view of decode1's exhausted cache
    # X, turn 1 (no hits) then turn 2: ~290 hit tokens read through n0's 0.1 MB/s storage NIC, several seconds
    first = _words(model, 300, seed=1)
    x_prompt = f"{first}{_complete(url, model, first)} {_words(model, 24, seed=2)}"
    turn_1 = _decisions(url)[-1]
    before = len(_decisions(url))
    x_thread, x_out = _in_thread(_complete, url, model, x_prompt)
    deadline = time.monotonic() + 15
    while _metric(_get(f"{url}/metrics"), "adp_read_queue_tokens", node="n0") <= ALPHA:  # the live backlog
        assert time.monotonic() < deadline, "n0's read queue never exceeded alpha"
        time.sleep(0.1)
    y_prompt = _words(model, 150, seed=3)  # 166 tokens with its answer: 6 blocks, more than decode1 has
    y_text = _complete(url, model, y_prompt)
    w_prompt = _words(model, 40, seed=4)  # 2 blocks: decode1 fits it
    w_text = _complete(url, model, w_prompt)
    assert x_thread.is_alive(), "X's read ended before Y and W were placed: the backlog did not last"
    x_thread.join(60)
    x, y, w = _decisions(url)[before:]  # in the order they were placed
    assert {d["tokens_from"] for d in (x, y, w)} == {"tokenizer"}  # the PEs' own /tokenize counted the prompts
    assert y["prompt_tokens"] == _tokens(urls["prefill0"], model, y_prompt)
    # the estimated hits: X's turn 1 blocks (it was answered in full; one block of slack where its last token may
    # have merged with the answer's first), nothing for the first turns of Y and W
    assert turn_1["cached_tokens"] == 0 and x["cached_from"] == "prefixes"
    size = int(re.search(r'block_size="(\d+)"', blocks).group(1))
    assert (turn_1["prompt_tokens"] // size - 1) * size <= x["cached_tokens"] <= turn_1["prompt_tokens"]
    assert y["cached_tokens"] == w["cached_tokens"] == 0
    assert (x["prefill"], x["decode"]) == ("prefill0", "decode0")
    # Y: prefill0's node is over alpha, prefill1's qualifies; decode1 has no room; read on the shorter queue (n1)
    assert y["prefill"] == "prefill1" and _rule(y, "pe-alpha-avoided") == [
        f"pe-alpha-avoided ['prefill0']: node read queue > alpha {ALPHA}"
    ]
    assert y["decode"] == "decode0" and _rule(y, "hbm-fit")[0].startswith("hbm-fit excluded ['decode1']")
    assert (y["path"], y["rule"]) == ("pe", "shorter-queue") and y["pe_queue_tokens"] < y["de_queue_tokens"]
    # W: under Z on decode1 while decode0 holds X
    assert (w["prefill"], w["decode"]) == ("prefill1", "decode1") and _rule(w, "z-low")
    for prompt, ours in ((x_prompt, x_out["value"]), (y_prompt, y_text), (w_prompt, w_text)):
        assert ours == _complete(plain, model, prompt)


def test_pes_over_beta_are_skipped_and_a_request_waits_instead_of_failing(model, plain, cluster):  # noqa: F811
    url, _ = cluster
    before = len(_decisions(url))
    prompts = [_words(model, 700, seed=10 + k) for k in range(4)]  # each over beta on its own
    threads = [_in_thread(_complete, url, model, p) for p in prompts]
    for thread, _ in threads:
        thread.join(120)
    assert all("value" in out for _, out in threads)  # none failed: the ones no PE could take waited
    decisions = _decisions(url)[before:]
    assert len(decisions) == 4
    for decision in decisions:
        over = _rule(decision, "pe-over-beta")
        assert not over or f"'{decision['prefill']}'" not in over[0]
    assert any(_rule(d, "pe-over-beta") or d["waited_s"] > 0.05 for d in decisions), decisions
    metrics = _get(f"{url}/metrics")
    assert _metric(metrics, "adp_proxy_beta_tokens") == BETA and _metric(metrics, "adp_proxy_waiting_requests") == 0
    # one at a time, fresh prompts (the blocks stored by the concurrent ones were computed in a batch, and vLLM's
    # CPU output is batch-variant): the first pass stores the blocks, the second reads them; both are plain's text
    for prompt in (_words(model, 700, seed=20 + k) for k in range(2)):
        reference = _complete(plain, model, prompt)
        assert _complete(url, model, prompt) == reference
        assert _complete(url, model, prompt) == reference


def test_health_lists_every_instance(cluster):
    url, urls = cluster
    with urllib.request.urlopen(f"{url}/health", timeout=10) as reply:
        assert json.loads(reply.read()) == {name: "ok" for name in sorted(urls)}
