"""The proxy's side of talking to vLLM instances: their errors as vLLM wrote them, streamed answers, pass-through
routes and their ``/metrics``.

An instance's error reaches the client unchanged (status and vLLM's ``{"error": {message, type, param, code}}``
body). The proxy's own errors (an instance unreachable or silent, no engine free, too many prompts) use the same
shape and name instances by name, never by address. aiohttp and prometheus_client are vLLM dependencies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from http import HTTPStatus

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

ERROR_BODY_LIMIT = 64 * 1024  # bytes of an instance's error body kept


def error_type(status: int) -> str:
    """vLLM's error ``type`` for an HTTP status: ``BadRequestError``, ``InternalServerError``, ..."""
    phrase = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    return phrase if phrase.endswith("Error") else phrase + "Error"


def error_json(status: int, message: str, param: str | None = None) -> dict:
    """An error body in vLLM's shape."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


class UpstreamError(Exception):
    """A request failed at an instance or on the way to it: ``status`` is what the client gets, ``source`` names
    the instance's role (``prefill`` / ``decode``) for the error counter, ``body`` is the instance's own error body
    (None: the proxy words the error)."""

    def __init__(self, source: str, status: int, message: str, body: bytes | None = None) -> None:
        super().__init__(message)
        self.source, self.status, self.body = source, status, body

    def payload(self) -> dict:
        """The error body the client gets."""
        if self.body is not None:
            with contextlib.suppress(ValueError):
                answer = json.loads(self.body)
                if isinstance(answer, dict):
                    return answer
        return error_json(self.status, str(self))

    def response(self) -> web.Response:
        if self.body is not None:
            return web.Response(body=self.body, status=self.status, content_type="application/json")
        return web.json_response(self.payload(), status=self.status)


async def answered_error(source: str, name: str, resp: aiohttp.ClientResponse) -> UpstreamError:
    """An instance's error answer, kept verbatim (its message also names the instance, for the logs)."""
    body = await resp.content.read(ERROR_BODY_LIMIT)
    message = body.decode("utf-8", "replace")
    with contextlib.suppress(ValueError, KeyError, TypeError):
        message = json.loads(body)["error"]["message"]
    return UpstreamError(source, resp.status, f"{source} instance {name} answered {resp.status}: {message}", body)


def transport_error(source: str, name: str, exc: BaseException, timeout_s: float) -> UpstreamError:
    """A connection failure (502) or a timeout (504), naming the instance by name."""
    if isinstance(exc, asyncio.TimeoutError):
        return UpstreamError(source, 504, f"the {source} instance {name} did not answer within {timeout_s} s")
    return UpstreamError(source, 502, f"the {source} instance {name} is unreachable ({type(exc).__name__})")


class DecodeStream:
    """Reads a DE's answer in a task: ``head`` resolves to ``(status, content type)`` or an UpstreamError;
    ``chunks`` then yields body chunks, ending with None (done) or an UpstreamError (broken mid-body)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.head: asyncio.Future = asyncio.get_running_loop().create_future()
        self.chunks: asyncio.Queue = asyncio.Queue(maxsize=64)

    async def run(
        self, session: aiohttp.ClientSession, url: str, body: dict, timeout_s: float, headers: dict | None = None
    ) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)
        try:
            async with session.post(url, json=body, timeout=timeout, headers=headers) as resp:
                if resp.status >= 400:
                    raise await answered_error("decode", self.name, resp)
                self.head.set_result((resp.status, resp.headers.get("Content-Type", "application/json")))
                async for chunk in resp.content.iter_any():
                    await self.chunks.put(chunk)
            await self.chunks.put(None)
        except UpstreamError as exc:
            await self._fail(exc)
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
            await self._fail(transport_error("decode", self.name, exc, timeout_s))

    async def _fail(self, exc: UpstreamError) -> None:
        if not self.head.done():
            self.head.set_exception(exc)
        else:
            await self.chunks.put(exc)

    async def body(self, timeout_s: float) -> bytes:
        """The whole body (each chunk's wait bounded); raises the UpstreamError that broke it."""
        parts = []
        while (item := await asyncio.wait_for(self.chunks.get(), timeout_s)) is not None:
            if isinstance(item, UpstreamError):
                raise item
            parts.append(item)
        return b"".join(parts)

    def discard(self) -> None:
        """Mark an unread head exception as retrieved (the request ended for another reason)."""
        if self.head.done() and not self.head.cancelled():
            self.head.exception()


async def pass_through(
    session: aiohttp.ClientSession, request: web.Request, name: str, url: str, body: bytes, timeout_s: float
) -> web.StreamResponse:
    """Send ``request`` (method, body, content type, query) to ``url`` and stream the instance's answer back as it
    is (a streamed ``/v1/responses`` too). A client gone mid-answer ends it quietly."""
    timeout = aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    try:
        async with session.request(
            request.method, url, data=body or None, headers=headers, params=request.query, timeout=timeout
        ) as up:
            resp = web.StreamResponse(status=up.status)
            resp.content_type = up.content_type
            await resp.prepare(request)
            with contextlib.suppress(ConnectionResetError):
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
            return resp
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
        return transport_error("decode", name, exc, timeout_s).response()


async def instance_metrics(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str | None:
    """An instance's ``/metrics`` text, or None when it does not answer 200 within ``timeout_s``."""
    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return await resp.text() if resp.status == 200 else None
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError):
        return None


class _Families:
    """A collector that yields metric families parsed from instances' text, each sample labelled ``instance``."""

    def __init__(self, texts: dict[str, str]) -> None:
        self.families: dict[str, Metric] = {}
        for instance, text in texts.items():
            for family in text_string_to_metric_families(text):
                merged = self.families.get(family.name)
                if merged is None:
                    merged = Metric(family.name, family.documentation, family.type, family.unit)
                    self.families[family.name] = merged
                merged.samples.extend(s._replace(labels={**s.labels, "instance": instance}) for s in family.samples)

    def collect(self) -> list[Metric]:
        return list(self.families.values())


def federated_metrics(texts: dict[str, str]) -> bytes:
    """Prometheus text of every instance's metrics (``texts``: instance name -> its ``/metrics``), each sample
    labelled with its ``instance``; a family's HELP and TYPE appear once."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(texts))
    return generate_latest(registry)
