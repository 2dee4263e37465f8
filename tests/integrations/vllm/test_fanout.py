"""Prompt lists and ``n > 1`` through the proxy: one engine request (and transfer) each, answers merged as vLLM
merges them. Pure functions with hypothesis, then the proxy against fake instances (no model)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")
pytest.importorskip("aiohttp")

from ascend_dualpath.integrations.vllm import fanout  # noqa: E402
from tests.integrations.vllm.fakes import run  # noqa: E402
from tests.integrations.vllm.test_proxy import Harness  # noqa: E402

prompts = st.one_of(
    st.text(min_size=1, max_size=8),
    st.lists(st.integers(0, 999), min_size=1, max_size=5),
)


def _fake_answer(body: dict, choice_tokens: int = 2):
    """A fake engine's answer to one sub-request: text names its prompt and seed; usage counts words."""
    prompt = body.get("prompt", "chat")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):  # a one-prompt list is not split
        (prompt,) = prompt
    words = len(prompt) if isinstance(prompt, list) else len(str(prompt).split()) + 1
    text = f"{prompt}/{body.get('seed')}"
    usage = {"prompt_tokens": words, "total_tokens": words + choice_tokens, "completion_tokens": choice_tokens}
    answer = {"id": f"cmpl-{text}", "object": "text_completion", "choices": [{"index": 0, "text": text}]}
    base = {"id": f"cmpl-{text}", "object": "text_completion", "created": 1, "model": "tiny"}
    chunks = [
        f"data: {json.dumps({**base, 'choices': [{'index': 0, 'text': text[:1]}]})}\n\n".encode(),
        f"data: {json.dumps({**base, 'choices': [{'index': 0, 'text': text[1:], 'finish_reason': 'length'}]})}\n\n",
    ]
    chunks[1] = chunks[1].encode()
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append(f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n".encode())
    chunks.append(b"data: [DONE]\n\n")
    return {**answer, "usage": usage}, chunks


@settings(max_examples=60)
@given(ps=st.lists(prompts, min_size=1, max_size=5), n=st.integers(1, 4), seed=st.none() | st.integers(0, 1000))
def test_split_orders_choices_as_vllm_and_gives_children_vllms_seeds(ps, n, seed):
    body = {"prompt": ps if len(ps) > 1 or isinstance(ps[0], str) else ps[0], "n": n, "max_tokens": 3}
    if seed is not None:
        body["seed"] = seed
    subs = fanout.split(body, chat=False)
    assert [s.index for s in subs] == list(range(len(ps) * n))
    for s in subs:
        assert s.body["n"] == 1 and s.body["max_tokens"] == 3
        assert s.body["prompt"] == ps[s.prompt_index] or (len(ps) == 1 and s.body["prompt"] == body["prompt"])
        child = s.index % n
        expected_seed = seed if seed is None or n == 1 else seed + child  # vLLM: child i samples with seed + i
        assert s.body.get("seed") == expected_seed


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "a", "n": 0},
        {"prompt": "a", "n": -1},
        {"prompt": "a", "n": "2"},
        {"prompt": [], "n": 2},
        {"prompt": ["a", 3]},
        {"prompt": "a", "n": 2, "best_of": 3},
        {"prompt": [[1, 2], []]},
    ],
)
def test_a_form_vllm_refuses_is_not_split(body):
    assert fanout.split(body, chat=False) == [fanout.SubRequest(body, 0, 0)]


def test_too_many_sub_requests_are_refused_before_anything_is_sent():
    with pytest.raises(fanout.FanOutLimit, match=str(fanout.MAX_SUB_REQUESTS)):
        fanout.split({"prompt": ["a"] * 100, "n": 11}, chat=False)


@settings(max_examples=40)
@given(num_prompts=st.integers(1, 4), n=st.integers(1, 3), cut=st.integers(1, 40), usage=st.booleans())
def test_stream_merge_rewrites_indices_and_ends_once(num_prompts, n, cut, usage):
    """Sub-streams cut anywhere and interleaved: every choice's text arrives whole under its global index, one
    usage chunk sums as vLLM sums (each prompt once), one [DONE]."""
    body = {"prompt": [f"p{i}" for i in range(num_prompts)], "n": n, "stream": True, "seed": 5}
    if usage:
        body["stream_options"] = {"include_usage": True}
    subs = fanout.split(body, chat=False)
    merger = fanout.StreamMerger(subs, usage)
    streams = [b"".join(_fake_answer(s.body)[1]) for s in subs]
    out = b""
    for offset in range(0, max(map(len, streams)), cut):  # round robin over the sub-streams, cut every `cut` bytes
        for i, stream in enumerate(streams):
            out += merger.feed(i, stream[offset : offset + cut])
    out += merger.end()
    events = [e for e in out.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and out.count(b"[DONE]") == 1
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {s.index: f"p{s.prompt_index}/{s.body['seed']}" for s in subs}
    usage_chunks = [c for c in chunks if not c["choices"]]
    if usage:
        (last,) = usage_chunks
        assert last is chunks[-1]
        assert last["usage"] == {"prompt_tokens": 2 * num_prompts, "completion_tokens": 2 * num_prompts * n,
                                 "total_tokens": 2 * num_prompts + 2 * num_prompts * n}  # fmt: skip
    else:
        assert usage_chunks == []


def test_the_proxy_sends_each_prompt_and_choice_as_its_own_request_and_merges_the_answer():
    async def body():
        async with Harness() as h:
            h.pe.answer = h.de.answer = _fake_answer
            request = {"model": "tiny", "prompt": ["a b", "c"], "n": 2, "seed": 10, "max_tokens": 2}
            status, answer = await h.post("/v1/completions", request)
            assert status == 200
            assert [(c["index"], c["text"]) for c in answer["choices"]] == [
                (0, "a b/10"), (1, "a b/11"), (2, "c/10"), (3, "c/11")
            ]  # fmt: skip
            assert answer["usage"] == {"prompt_tokens": 3 + 2, "total_tokens": 5 + 8, "completion_tokens": 8}
            assert len(h.de.bodies) == len(h.pe.bodies) == 4
            xfers = {b["kv_transfer_params"]["dualpath"]["xfer_id"] for b in h.de.bodies}
            assert len(xfers) == 4  # one transfer per engine request
            assert {b["kv_transfer_params"]["dualpath"]["xfer_id"] for b in h.pe.bodies} == xfers
            assert all(b["n"] == 1 for b in h.de.bodies) and all("n" not in b for b in h.pe.bodies)

    run(body())


def test_a_streamed_fan_out_is_one_stream():
    async def body():
        async with Harness() as h:
            h.pe.answer = h.de.answer = _fake_answer
            request = {"prompt": "x", "n": 3, "stream": True, "stream_options": {"include_usage": True}}
            async with h.client.post("/v1/completions", json=request) as resp:
                assert resp.status == 200 and resp.content_type == "text/event-stream"
                text = (await resp.read()).decode()
            events = [e for e in text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]" and text.count("[DONE]") == 1
            chunks = [json.loads(e[6:]) for e in events[:-1]]
            assert {c["index"] for chunk in chunks for c in chunk["choices"]} == {0, 1, 2}
            assert chunks[-1]["usage"]["completion_tokens"] == 6 and chunks[-1]["usage"]["prompt_tokens"] == 2

    run(body())


def test_a_client_leaving_mid_stream_logs_no_traceback_and_keeps_the_latency(caplog):
    async def body():
        async with Harness() as h:
            h.de.gate = asyncio.Event()  # the DE's stream stops after its first chunk
            async with h.client.post("/v1/completions", json={"prompt": "x", "stream": True}) as resp:
                await resp.content.readany()
            await asyncio.sleep(0.3)
            h.de.gate.set()
            await asyncio.sleep(0.3)
            metrics = await h.metrics()
            counts = [v for (name, labels), v in metrics.items() if name == "adp_proxy_request_seconds_count"]
            assert sum(counts) == 1

    with caplog.at_level(logging.DEBUG):
        run(body())
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]


def test_routes_of_plain_vllm_are_answered_and_metrics_carry_the_instances():
    async def body():
        async with Harness() as h:
            h.pe.tokens_per_word = 1
            h.pe.kv = h.de.kv = (100, 0.25)
            status, answer = await h.post("/tokenize", {"prompt": "a b"})
            assert status == 200 and answer["count"] == 3
            async with h.client.get("/version") as resp:
                assert resp.status == 200 and (await resp.json()) == {"version": "fake-decode"}
            metrics = await h.metrics()
            usage = {dict(labels).get("instance"): v for (name, labels), v in metrics.items()
                     if name == "vllm:kv_cache_usage_perc"}  # fmt: skip
            assert usage == {"prefill0": 0.25, "decode0": 0.25}
            assert metrics[("adp_proxy_alpha_tokens", frozenset())] == float("inf")

    run(body())
