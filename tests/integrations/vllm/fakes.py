"""Fake vLLM instances (aiohttp apps) and fake side channels (ZMQ ROUTER threads) for the proxy's tests.

Each fake instance records the bodies it receives and answers as a test tells it to (and, with ``kv`` set, serves
vLLM 0.32's KV-cache metrics); each fake side channel answers status queries with the reply format of the design
(or stays silent). A test changes ``FakeSideChannel.reply`` and ``FakeInstance.kv`` to change the live state.
"""

from __future__ import annotations

import asyncio
import threading
import time
import zlib

import msgspec
import zmq
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from ascend_dualpath.dualpath import side_channel as sc


def status_reply(
    node: str,
    role: str,
    queue_tokens: int = 0,
    read_blocks: int = 0,
    unfinished_tokens: int = 40,
    reading: list[str] | None = None,
) -> dict:
    """A status reply exactly as the design file specifies it (``reading=None``: a peer without the field)."""
    extra = {} if reading is None else {"reading": reading}
    return {
        "op": "status",
        "role": role,
        "node": node,
        "device_id": 0,
        "read_queue_tokens": queue_tokens,
        "read_queue_bytes": queue_tokens * 1024,
        "snic_read_bytes": read_blocks * 65536,
        "snic_read_blocks": read_blocks,
        "unfinished_requests": 1,
        "unfinished_tokens": unfinished_tokens,
        "host_leases": 2,
        "quarantined_bytes": 4096,
        **extra,
    }


class FakeSideChannel:
    """A ZMQ ROUTER on a random loopback port in a thread; answers ``{"op": "status"}`` with ``reply``
    (``reply=None``: stays silent, like a dead instance), both framed with ``token``
    (:func:`~ascend_dualpath.dualpath.side_channel.seal`); counts in ``refused`` the frames failing its check."""

    def __init__(self, reply: dict | None, token: bytes | None = None, port: int | None = None) -> None:
        self.reply, self.token = reply, token
        self.queries = self.refused = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port is None:
            port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        else:
            self._sock.bind(f"tcp://127.0.0.1:{port}")
        self.address = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            identity, empty, frame = self._sock.recv_multipart()
            try:
                stamp, payload = sc.unseal(self.token, frame, sc.REQUEST, sc.DEFAULT_MAX_FRAME_BYTES)
            except sc.Refused:
                self.refused += 1
                continue
            assert msgspec.msgpack.decode(payload) == {"op": "status"}
            self.queries += 1
            if self.reply is not None:
                reply = sc.seal(self.token, sc.REPLY, stamp, msgspec.msgpack.encode(self.reply))
                self._sock.send_multipart([identity, empty, reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close()
        self._ctx.term()


class FakeInstance:
    """A fake vLLM OpenAI server. ``mode``: "ok" (JSON answer or SSE stream), "error" (``error_status``),
    "hang" (waits until the client disconnects, recording it in ``disconnected``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "ok"
        self.error_status = 400
        self.error_delay_s = 0.0  # > 0: the other instance's request is in flight when the error comes
        self.health_status = 200
        self.bodies: list[dict] = []
        self.dp_ranks: list[str | None] = []  # each request's X-data-parallel-rank header (None: none)
        self.stream_chunks = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]
        self.gate: asyncio.Event | None = None  # when set, the stream waits for it after its first chunk
        self.disconnected = asyncio.Event()
        self.prefill_delay_s = 0.0  # > 0: a non-streamed answer comes this late (a PE busy prefilling)
        self.kv: tuple[int, float] | None = None  # (num_gpu_blocks, usage) for /metrics; None: no /metrics
        self.tokens_per_word: int | None = None  # /tokenize counts this many tokens per word; None: no /tokenize
        self.tokenized: list[dict] = []  # the /tokenize bodies it got
        self.answer = None  # answer(body) -> (JSON answer, SSE chunks): a per-request answer in "ok" mode

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/version", self.version)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        return app

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize`` answer: ``count`` (plus a BOS token) and ``tokens``."""
        if self.tokens_per_word is None:
            return web.Response(status=404)
        body = await request.json()
        self.tokenized.append(body)
        text = body["prompt"] if "prompt" in body else " ".join(m["content"] for m in body["messages"])
        # a BOS token, then tokens_per_word ids that depend on the word: prompts share ids where they share words
        ids = [1] + [
            zlib.crc32(f"{word}/{k}".encode()) % 50_000 for word in text.split() for k in range(self.tokens_per_word)
        ]
        return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": ids})

    async def metrics(self, request: web.Request) -> web.Response:
        """vLLM 0.32's two KV-cache metrics, as its Prometheus logger writes them."""
        if self.kv is None:
            return web.Response(status=404)
        blocks, usage = self.kv
        # vLLM counts its null block in num_gpu_blocks (and not in the usage)
        labels = f'block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="{blocks + 1}"'
        text = (
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f"vllm:cache_config_info{{{labels}}} 1.0\n"
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="tiny"}} {usage}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:  # vLLM's answer to a body that is not JSON (its words differ; the shape is the same)
            error = {"message": "JSON decode error", "type": "BadRequestError", "param": None, "code": 400}
            return web.json_response({"error": error}, status=400)
        self.bodies.append(body)
        self.dp_ranks.append(request.headers.get("X-data-parallel-rank"))
        if self.mode == "error":
            await asyncio.sleep(self.error_delay_s)
            message = {
                "error": {"message": f"{self.name} refuses", "type": "BadRequestError", "code": self.error_status}
            }
            return web.json_response(message, status=self.error_status)
        if self.mode == "hang":
            return await self._hang(request)
        if self.answer is not None:
            answer, chunks = self.answer(body)
            if not body.get("stream"):
                return web.json_response(answer)
            return await self._stream(request, chunks)
        if body.get("stream"):
            return await self._stream(request)
        await asyncio.sleep(self.prefill_delay_s)
        return web.json_response({"id": f"{self.name}-1", "choices": [{"text": f"from {self.name}"}]})

    async def _hang(self, request: web.Request) -> web.Response:
        # aiohttp cancels a handler whose client went away; a closing transport is the other sign of it.
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and request.transport is not None and not request.transport.is_closing():
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.disconnected.set()
            raise
        if request.transport is None or request.transport.is_closing():
            self.disconnected.set()
        return web.json_response({})

    async def _stream(self, request: web.Request, chunks: list[bytes] | None = None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for index, chunk in enumerate(self.stream_chunks if chunks is None else chunks):
            await resp.write(chunk)
            if index == 0 and self.gate is not None:
                await asyncio.wait_for(self.gate.wait(), 10)
        await resp.write_eof()
        return resp

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": f"fake-{self.name}"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": f"model-of-{self.name}"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)


class ProxyClient:
    """What the proxy tests ask the proxy under test (``self.client``: an aiohttp session on its URL)."""

    async def decisions(self) -> list[dict]:
        async with self.client.get("/debug/decisions") as resp:
            return await resp.json()

    async def metrics(self) -> dict:
        """``{(sample name, frozenset(labels)): value}`` parsed from ``/metrics``."""
        async with self.client.get("/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


def run(coro):
    """Run one test coroutine, bounded: a hang fails the test within 60 s."""
    return asyncio.run(asyncio.wait_for(coro, 60))
