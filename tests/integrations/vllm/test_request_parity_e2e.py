"""Every request vLLM serves, ``serve`` serves the same way (real vLLM on the CPU, against a plain vLLM server).

Prompt lists (short, one block, many blocks, mixed), ``n = 2`` with a seed (streamed and not), ``min_tokens``, every
sampling parameter, chat with ``n = 2``, and vLLM's own error bodies; ``serve`` is still up afterwards and its
instances hold nothing. Slow: two deployments start (30-90 s each here).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow

from tests.integrations.vllm import test_serve_e2e as e2e  # noqa: E402
from tests.integrations.vllm.test_serve_e2e import _get, _metric, _serve, _stop, _vocab  # noqa: E402

model, plain = e2e.model, e2e.plain  # the same tiny model and plain vLLM server fixtures

BLOCK = 16  # vLLM's CPU block size for the tiny model


def _call(url: str, path: str, body: dict | bytes, timeout: float = 120) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _stream(url: str, path: str, body: dict) -> list[dict]:
    request = urllib.request.Request(url + path, json.dumps({**body, "stream": True}).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    events = []
    with urllib.request.urlopen(request, timeout=120) as reply:
        for line in reply:
            line = line.decode().strip()
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    return [json.loads(e) for e in events[:-1]]


def _texts(chunks: list[dict]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (choice.get("text") or "")
    return texts


def _choices(answer: dict) -> list[tuple]:
    return [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]]


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    # a longer bound than the other e2e tests: a loaded 2-core machine once took over 20 s for one request
    proc, url, log = _serve(model, tmp_path_factory.mktemp("parity"), "--policy", "dual", "--timeout", "45")
    yield url
    assert proc.poll() is None, f"serve died:\n{log.read_text()[-3000:]}"
    _stop(proc)


def _prompt(model: str, tokens: int, shift: int) -> str:
    words = _vocab(model)
    return " ".join(words[(shift * 31 + 7 * i) % len(words)] for i in range(tokens))


def test_prompt_lists_match_plain_vllm(model, plain, served):
    short, one, many = _prompt(model, 5, 1), _prompt(model, BLOCK + 1, 2), _prompt(model, 6 * BLOCK + 3, 3)
    for prompts in ([short, many], [one, short, many, one], [many, many]):
        body = {"model": model, "prompt": prompts, "max_tokens": 4, "temperature": 0}
        (s1, ours), (s2, theirs) = _call(served, "/v1/completions", body), _call(plain, "/v1/completions", body)
        assert (s1, _choices(ours), ours["usage"]) == (s2, _choices(theirs), theirs["usage"])
        streamed = _stream(served, "/v1/completions", body)
        assert _texts(streamed) == {i: text for i, text, _ in _choices(theirs)}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_n_2_with_a_seed_samples_what_plain_vllm_samples(model, plain, served, path):
    body = {"model": model, "n": 2, "temperature": 1.0, "seed": 1234, "max_tokens": 6}
    if path == "/v1/completions":
        body["prompt"] = _prompt(model, 2 * BLOCK + 5, 4)
    else:
        body["messages"] = [{"role": "user", "content": _prompt(model, 40, 5)}]
    (s1, ours), (s2, theirs) = _call(served, path, body), _call(plain, path, body)
    assert s1 == s2 == 200 and len(ours["choices"]) == 2
    key = "text" if path == "/v1/completions" else "message"
    assert [c[key] for c in ours["choices"]] == [c[key] for c in theirs["choices"]]
    assert ours["usage"] == theirs["usage"]
    chunks = _stream(served, path, body)
    assert sorted({c["index"] for chunk in chunks for c in chunk["choices"]}) == [0, 1]


# every sampling parameter of vLLM's completion request with a value it accepts (greedy, so the text is comparable)
SAMPLING = [
    {"min_tokens": 6}, {"max_tokens": 1}, {"stop": ["the"]}, {"stop_token_ids": [3]}, {"ignore_eos": True},
    {"logprobs": 2}, {"prompt_logprobs": 1}, {"echo": True}, {"top_p": 0.5}, {"top_k": 3}, {"min_p": 0.1},
    {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"repetition_penalty": 1.2}, {"seed": 3},
    {"logit_bias": {"5": 10}}, {"allowed_token_ids": [5, 6, 7]}, {"bad_words": ["x"]},
    {"include_stop_str_in_output": True}, {"skip_special_tokens": False}, {"spaces_between_special_tokens": False},
    {"return_tokens_as_token_ids": True}, {"truncate_prompt_tokens": 20}, {"add_special_tokens": False},
    {"structured_outputs": {"choice": ["yes", "no"]}}, {"response_format": {"type": "json_object"}},
    {"min_tokens": 3, "stream_options": {"include_usage": True}},
]  # fmt: skip


@pytest.mark.parametrize("extra", SAMPLING, ids=lambda e: ",".join(e))
def test_every_sampling_parameter_answers_as_plain_vllm(model, plain, served, extra):
    body = {"model": model, "prompt": _prompt(model, BLOCK + 9, 6), "max_tokens": 8, "temperature": 0, **extra}
    (s1, ours), (s2, theirs) = _call(served, "/v1/completions", body), _call(plain, "/v1/completions", body)
    assert s1 == s2, (ours, theirs)
    if s1 == 200:
        assert _choices(ours) == _choices(theirs) and ours["usage"] == theirs["usage"]
    else:
        assert ours == theirs


INVALID = [
    ("over-long prompt", {"prompt": "x " * 5000, "max_tokens": 4}),
    ("bad n", {"prompt": "hello", "n": 0}),
    ("bad model", {"prompt": "hello", "model": "no-such-model"}),
    ("negative max_tokens", {"prompt": "hello", "max_tokens": -1}),
    ("malformed JSON", b'{"prompt": "hello",'),
    ("n not a number", {"prompt": "hello", "n": "two"}),
]


@pytest.mark.parametrize(("what", "body"), INVALID, ids=[w for w, _ in INVALID])
def test_error_bodies_equal_vllms(model, plain, served, what, body):
    if isinstance(body, dict):
        body = {"model": model, **body}
    (s1, ours), (s2, theirs) = _call(served, "/v1/completions", body), _call(plain, "/v1/completions", body)
    assert (s1, ours) == (s2, theirs), what
    assert "127.0.0.1" not in json.dumps(ours)


def test_serve_is_up_and_its_instances_hold_nothing_afterwards(served):
    assert json.loads(_get(served + "/health"))
    deadline = time.monotonic() + 120  # refused requests' plans expire after serve's --timeout (45 s)
    while True:
        text = _get(served + "/metrics")
        held = _metric(text, "adp_unfinished_requests") + _metric(text, "adp_unfinished_tokens")
        if held == 0:
            break
        lines = [x for x in text.splitlines() if x.startswith(("adp_unfinished", "adp_host_leases"))]
        assert time.monotonic() < deadline, f"unfinished requests/tokens still held: {held}: {lines}"
        time.sleep(1)
    assert "adp_quarantined_bytes" in text and _metric(text, "adp_quarantined_bytes") == 0, text
