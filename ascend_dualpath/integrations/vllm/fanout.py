"""One engine request per DualPath transfer: a client request's prompts and choices as single requests, and back.

vLLM turns a completions ``prompt`` list into one engine request per prompt and ``n > 1`` into ``n`` child
requests, all carrying the client's ``kv_transfer_params``; two engine requests on one transfer would share one
lease. So the proxy sends every (prompt, choice) as its own request (``n = 1``, its own transfer) and merges the
answers into the response vLLM itself gives:

- choice ``index`` = ``prompt_index * n + choice_index`` (vLLM's completion order; chat has one prompt);
- ``usage``: each prompt's tokens counted once, every choice's completion tokens summed;
- a seeded ``n > 1`` request gives child ``i`` the seed ``seed + i``, as vLLM's parallel sampling does, so a seeded
  request samples what plain vLLM samples;
- streamed: every sub-stream's chunks pass on as they come, with their ``index`` and ``id`` rewritten; each
  sub-stream's usage chunk and ``[DONE]`` are held back, and one usage chunk (when ``stream_options.include_usage``)
  and one ``data: [DONE]`` end the stream.

A request whose ``prompt`` or ``n`` is not of a form vLLM accepts is not split: it goes on whole, so the client
gets vLLM's own validation error.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

MAX_SUB_REQUESTS = 1024  # prompts x n of one client request; vLLM's own limit is memory


class FanOutLimit(ValueError):
    """A request asks for more than :data:`MAX_SUB_REQUESTS` engine requests."""


@dataclasses.dataclass(frozen=True)
class SubRequest:
    """One engine request of a client request: its body (one prompt, ``n`` 1), the prompt's index and the
    choice's global index."""

    body: dict
    prompt_index: int
    index: int


def _prompts(body: dict, chat: bool) -> list[Any] | None:
    """The request's prompts, or None when it is not a list vLLM would split (then it is not split here either)."""
    if chat:
        return [None]  # chat has one conversation
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (_is_ids(prompt) and prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or (_is_ids(p) and p) for p in prompt):
        return list(prompt)
    return None


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


def _choices(body: dict) -> int | None:
    n = body.get("n", 1)
    if n is None:
        return 1
    if type(n) is not int or n < 1 or body.get("best_of") not in (None, 1):
        return None
    return n


def split(body: dict, chat: bool) -> list[SubRequest]:
    """``body`` as single-prompt, ``n = 1`` sub-requests in vLLM's choice order (one, unchanged, when there is
    nothing to split or its form is invalid). Raises :class:`FanOutLimit` above :data:`MAX_SUB_REQUESTS`."""
    prompts, n = _prompts(body, chat), _choices(body)
    if prompts is None or n is None or (len(prompts) == 1 and n == 1):
        return [SubRequest(body, 0, 0)]
    if len(prompts) * n > MAX_SUB_REQUESTS:
        raise FanOutLimit(
            f"{len(prompts)} prompts x n={n} is {len(prompts) * n} requests; this server takes at most "
            f"{MAX_SUB_REQUESTS} in one request"
        )
    seed = body.get("seed")
    subs = []
    for p, prompt in enumerate(prompts):
        for c in range(n):
            sub = {**body, "n": 1}
            if not chat:
                sub["prompt"] = prompt
            if type(seed) is int and n > 1:
                sub["seed"] = seed + c
            subs.append(SubRequest(sub, p, p * n + c))
    return subs


def merge(subs: list[SubRequest], answers: list[dict]) -> dict:
    """The non-streamed response of the whole request from its sub-requests' answers (same order)."""
    merged = dict(answers[0])
    merged["choices"] = []
    prompt_tokens: dict[int, int] = {}
    completion_tokens = 0
    for sub, answer in zip(subs, answers, strict=True):
        for choice in answer.get("choices", []):
            merged["choices"].append({**choice, "index": sub.index})
        usage = answer.get("usage") or {}
        prompt_tokens[sub.prompt_index] = int(usage.get("prompt_tokens", 0))
        completion_tokens += int(usage.get("completion_tokens") or 0)
    if answers[0].get("usage") is not None:
        total_prompt = sum(prompt_tokens.values())
        merged["usage"] = {
            **answers[0]["usage"],
            "prompt_tokens": total_prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": total_prompt + completion_tokens,
        }
    return merged


class StreamMerger:
    """Rewrites the SSE events of a fanned-out request's sub-streams into one stream.

    Feed each sub-stream's bytes to :meth:`feed` as they arrive (events may be cut anywhere); it returns the bytes to
    send on. :meth:`end` returns the closing usage chunk (if asked for) and ``data: [DONE]``.
    """

    def __init__(self, subs: list[SubRequest], include_usage: bool) -> None:
        self.subs, self.include_usage = subs, include_usage
        self._pending = [b""] * len(subs)
        self._id: str | None = None
        self._usage_chunk: dict | None = None  # a sub-stream's closing usage chunk: the envelope of the merged one
        self._prompt_tokens: dict[int, int] = {}
        self._completion_tokens = 0

    def feed(self, sub: int, data: bytes) -> bytes:
        """Bytes of sub-stream ``sub`` in; the complete events among them, rewritten, out."""
        buffered = self._pending[sub] + data
        *events, self._pending[sub] = buffered.split(b"\n\n")
        return b"".join(self._event(sub, event) for event in events if event.strip())

    def _event(self, sub: int, event: bytes) -> bytes:
        text = event.decode("utf-8").strip()
        if not text.startswith("data:"):
            return event + b"\n\n"
        payload = text[len("data:") :].strip()
        if payload == "[DONE]":
            return b""
        chunk = json.loads(payload)
        if not isinstance(chunk, dict) or "choices" not in chunk:
            return event + b"\n\n"  # an error event: passed on as it is
        self._id = self._id or chunk.get("id")
        chunk["id"] = self._id
        if not chunk["choices"] and chunk.get("usage") is not None:  # the sub-stream's closing usage chunk
            self._usage_chunk = chunk
            self._count(sub, chunk["usage"])
            return b""
        for choice in chunk["choices"]:
            choice["index"] = self.subs[sub].index
        return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode()

    def _count(self, sub: int, usage: dict) -> None:
        self._prompt_tokens[self.subs[sub].prompt_index] = int(usage.get("prompt_tokens", 0))
        self._completion_tokens += int(usage.get("completion_tokens") or 0)

    def end(self) -> bytes:
        """The closing usage chunk (with ``include_usage``) and the one ``[DONE]``."""
        out = b""
        if self.include_usage and self._usage_chunk is not None:
            prompt = sum(self._prompt_tokens.values())
            usage = {
                **self._usage_chunk["usage"],
                "prompt_tokens": prompt,
                "total_tokens": prompt + self._completion_tokens,
                "completion_tokens": self._completion_tokens,
            }
            chunk = {**self._usage_chunk, "usage": usage}
            out = f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode()
        return out + b"data: [DONE]\n\n"
