"""OpenAI-compatible proxy in front of N vLLM prefill (PE) and M decode (DE) instances.

A client request becomes one engine request per prompt and choice (:mod:`.fanout`: vLLM would give them all one
transfer); per engine request the proxy places it (:mod:`ascend_dualpath.integrations.vllm.placement`: the library's
scheduler on the instances' live state, or round robin; the cluster is :mod:`.cluster`'s), and sends,
concurrently:

- to its DE: the client's body unchanged plus ``kv_transfer_params.dualpath = {xfer_id, role: "decode",
  path, peer: <PE side channel>, split}``;
- to its PE: the same body less :data:`ANSWER_FIELDS` (what shapes only the answer) with ``max_tokens: 1`` (chat:
  also ``max_completion_tokens: 1``), ``stream: false``, and ``kv_transfer_params.dualpath`` with
  ``role: "prefill"`` and ``peer: <DE side channel>``. Its answer is discarded; only its status matters.

The read path (``policy="dual"``: :func:`ascend_dualpath.dualpath.scheduler.choose_read_path` on the two
nodes' storage read-queue lengths; ``"pe"`` / ``"de"`` force one); ``split`` (true with ``--split``) asks the
connectors to read the request's hit blocks through both storage NICs.

Every field the proxy does not use passes through to the DE unchanged (sampling parameters, ``ignore_eos``, ...).
The client's response starts once the PE has answered successfully and the DE's response head is in:
the DE cannot produce its first token before the PE's prefill anyway, and this way a PE failure still
reaches the client as an error status. From then on the DE's body (an SSE stream when ``stream`` is
true) passes through chunk by chunk.

Failures: a PE or DE error (an HTTP status >= 400, a refused connection, a timeout) ends the client's
request: an instance's error as vLLM wrote it (:mod:`.upstream`), else an error in vLLM's shape naming the instance
by name (502 for a connection failure, 504 for a timeout), and cancels the other upstream request by closing its connection (vLLM aborts a
request whose client went away). A request no engine could take within ``timeout_s`` gets a 503 naming
what it waited for. A side channel that does not answer within ``status_timeout_s`` is counted
(``adp_proxy_side_channel_failures_total``) and a request placed on that instance takes the ``pe`` path
(rule ``"fallback:side-channel"``): the PE read path needs nothing from the DE's storage NIC. Every upstream
wait is bounded by ``timeout_s``: the PE's whole answer, the DE's response head and each DE chunk.

A request's prompt token ids (what placement counts) come from a PE's ``/tokenize`` (the model's tokenizer and chat
template, round robin over the PEs, bounded by ``status_timeout_s``), or from the prompt when it is ids; where
``/tokenize`` does not answer, the proxy counts words (``adp_proxy_tokenize_fallbacks_total``) and takes every token
as a hit. With ids, the hits are the prompt's leading blocks that requests answered in full before have left in the
store (:class:`~.cached_prefixes.CachedPrefixes`, at most ``cached_capacity_blocks``).

Endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and ``/version`` (the first DE's),
``/tokenize`` and ``/detokenize`` (a PE's), ``/v1/responses`` (a DE computes it, no DualPath plan), ``/health`` (200
only when every instance answers its own), ``/metrics`` (the proxy's private registry, then every instance's
metrics labelled ``instance``) and ``/debug/decisions`` (the last 100 decisions as JSON, each with its deciding
rules).

aiohttp, zmq, msgspec and prometheus_client are imported here only (all are vLLM dependencies).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import json
import time
from collections.abc import Callable

import aiohttp
import msgspec
import zmq
import zmq.asyncio
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ascend_dualpath import _env
from ascend_dualpath._checks import check_bound
from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath import side_channel as side
from ascend_dualpath.dualpath.settings import rank_address
from ascend_dualpath.errors import ConfigError, ProtocolError, WaitTimeout
from ascend_dualpath.integrations.vllm import fanout
from ascend_dualpath.integrations.vllm.cached_prefixes import DEFAULT_CAPACITY_BLOCKS
from ascend_dualpath.integrations.vllm.cluster import Cluster, Instance, default_side_channel, make_instance
from ascend_dualpath.integrations.vllm.placement import (
    PLACEMENTS,
    UNBOUNDED,
    KvBlocks,
    Placement,
    PlacementTimeout,
    Placer,
    decide,
    parse_kv_blocks,
    tokenize_request,
)
from ascend_dualpath.integrations.vllm.upstream import (
    DecodeStream,
    UpstreamError,
    answered_error,
    error_json,
    federated_metrics,
    instance_metrics,
    pass_through,
    transport_error,
)
from ascend_dualpath.kv.layout import TP_SIZE_MAX

POLICIES = ("dual", "pe", "de")
__all__ = ["DualPathProxy", "ProxyConfig", "decide", "default_side_channel", "run_proxy"]
DECISIONS_KEPT = 100
# Status fields mirrored as gauges labelled by node and instance (counters on the connector's side, hence no
# _total); a node's figure is the sum over its instances.
STATUS_GAUGES = {
    "read_queue_tokens": "tokens waiting in or being read through the node's storage read queue",
    "read_queue_bytes": "bytes waiting in or being read through the node's storage read queue",
    "snic_read_bytes": "bytes read through the node's storage NIC since the instance started",
    "snic_read_blocks": "blocks read through the node's storage NIC since the instance started",
    "unfinished_requests": "requests the instance has not finished",
    "unfinished_tokens": "tokens of the requests the instance has not finished",
    "host_leases": "host-buffer leases the instance holds (plans, receives, quarantine)",
    "quarantined_bytes": "host-buffer bytes kept out of use until late writes into them are ruled out",
}
# Fields of vLLM's completion and chat requests that shape the sampled answer, not the prompt's KV: the PE's one-token
# copy drops them (vLLM's defaults apply). What shapes the prompt (model, prompt / messages, chat template fields,
# tools, add_special_tokens, truncate_prompt_tokens, cache_salt, ...) and anything unknown stays.
ANSWER_FIELDS = frozenset(
    {
        "n", "best_of", "min_tokens", "max_completion_tokens", "stop", "stop_token_ids", "include_stop_str_in_output",
        "ignore_eos", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "suffix", "stream_options",
        "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "length_penalty", "use_beam_search", "logit_bias", "allowed_token_ids", "bad_words",
        "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "guided_decoding_backend", "guided_whitespace_pattern", "return_tokens_as_token_ids", "return_token_ids",
        "skip_special_tokens", "spaces_between_special_tokens", "logits_processors", "vllm_xargs",
        "thinking_token_budget", "reasoning_effort",
    }
)  # fmt: skip
TOKENIZER_ROUTES = ("/tokenize", "/detokenize")  # answered by a PE, round robin (every instance has the tokenizer)
STANDALONE_ROUTES = ("/v1/responses",)  # no DualPath plan: one DE computes it, round robin


@dataclasses.dataclass(frozen=True)
class ProxyConfig:
    """Where the instances are and how the proxy decides.

    ``cluster`` lists every instance; without it, ``prefill_url`` / ``decode_url`` (and their side channels
    ``prefill_kv`` / ``decode_kv``, empty: the URL's host and port + 100, what ``serve`` configures) make a
    one-PE, one-DE cluster, and with it they name its first PE and DE. ``placement`` is "scheduler" or
    "round-robin", ``policy`` the read path ("dual", "pe", "de"), ``split`` asks the connectors to split a
    request's reads over both storage NICs. ``alpha_tokens`` / ``beta_tokens``: the scheduler's thresholds (None:
    never binding; the CLI measures them at start-up instead, see :func:`measure_thresholds`).
    ``compute_quota_s`` > 0 holds requests to a PE (docs/vllm.md). ``status_timeout_s`` bounds one status or
    ``/metrics`` query; ``timeout_s`` every upstream wait and a request's wait for an engine.
    ``cached_capacity_blocks`` bounds the blocks the estimate of storage hits remembers. ``side_token``: the
    deployment token the instances' side channels require (None: theirs have none).
    """

    prefill_url: str = ""
    decode_url: str = ""
    prefill_kv: str = ""
    decode_kv: str = ""
    policy: str = "dual"
    timeout_s: float = dataclasses.field(default_factory=_env.timeout_s)
    status_timeout_s: float = 1.0
    cluster: Cluster | None = None
    placement: str = "scheduler"
    split: bool = False
    alpha_tokens: int | None = None
    beta_tokens: int | None = None
    compute_quota_s: float = 0.0
    cached_capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS
    side_token: bytes | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy={self.policy!r} is not one of {POLICIES}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"placement={self.placement!r} is not one of {PLACEMENTS}")
        for name in ("timeout_s", "status_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be > 0 seconds")
        for name in ("alpha_tokens", "beta_tokens"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 0):
                raise ConfigError(f"{name}={value!r} must be an int >= 0 tokens")
        check_bound("cached_capacity_blocks", self.cached_capacity_blocks, integer=True, where="ProxyConfig")
        cluster = self.cluster
        if cluster is None:
            if not (self.prefill_url and self.decode_url):
                raise ConfigError("give a cluster, or both prefill_url and decode_url")
            pe = make_instance("prefill", 0, self.prefill_url, kv=self.prefill_kv)
            de = make_instance("decode", 0, self.decode_url, kv=self.decode_kv)
            cluster = Cluster((pe,), (de,))
        object.__setattr__(self, "cluster", cluster)
        first_pe, first_de = cluster.prefill[0], cluster.decode[0]
        for field, value in (("prefill_url", first_pe.url), ("decode_url", first_de.url)):
            object.__setattr__(self, field, value)
        object.__setattr__(self, "prefill_kv", first_pe.kv)
        object.__setattr__(self, "decode_kv", first_de.kv)


@dataclasses.dataclass(frozen=True)
class Decision:
    """One request's placement: PE and DE (instance names), read path and its ``rule``, the two nodes' read queues
    it was chosen on (None when that side channel failed), ``split``, ``rules``: every deciding rule as
    ``"<rule> <detail>"`` (the PE category against alpha, PEs over beta, the DE group, HBM fit, Z, the path), and
    the ``prompt_tokens`` placement counted, ``tokens_from`` ``"tokenizer"`` (a PE's ``/tokenize``), ``"token ids"``
    (the prompt is ids) or ``"words"``, and the ``cached_tokens`` taken as storage hits, ``cached_from``
    ``"prefixes"`` (the prompt's leading blocks that earlier requests left in the store) or ``"assumed"`` (every
    prompt token, without token ids)."""

    xfer_id: str
    endpoint: str
    path: str
    pe_queue_tokens: int | None
    de_queue_tokens: int | None
    rule: str
    prefill: str = ""
    decode: str = ""
    placement: str = "scheduler"
    split: bool = False
    rules: tuple[str, ...] = ()
    waited_s: float = 0.0
    prompt_tokens: int = 0
    tokens_from: str = "words"
    cached_tokens: int = 0
    cached_from: str = "assumed"


def _with_dualpath(body: dict, params: dict) -> dict:
    """``body`` with ``kv_transfer_params.dualpath = params``; other kv_transfer_params keys are kept."""
    kv_params = dict(body.get("kv_transfer_params") or {})
    kv_params["dualpath"] = params
    return {**body, "kv_transfer_params": kv_params}


def _params(decision: Decision, role: str, peer: str) -> dict:
    return {"xfer_id": decision.xfer_id, "role": role, "path": decision.path, "peer": peer, "split": decision.split}


def decode_body(body: dict, decision: Decision, pe_side_channel: str) -> dict:
    """The DE's request: the client's body unchanged plus its ``kv_transfer_params``."""
    return _with_dualpath(body, _params(decision, "decode", pe_side_channel))


def prefill_body(body: dict, decision: Decision, de_side_channel: str, chat: bool) -> dict:
    """The PE's request: the fields that shape the prompt, one token, not streamed, plus its ``kv_transfer_params``.

    Every field of :data:`ANSWER_FIELDS` is dropped: they shape only the answer, which is discarded, and some
    conflict with ``max_tokens: 1`` (``min_tokens``) or cost the PE work (structured output, prompt logprobs).
    """
    out = {key: value for key, value in body.items() if key not in ANSWER_FIELDS}
    out.update(max_tokens=1, stream=False)
    if chat:
        out["max_completion_tokens"] = 1
    return _with_dualpath(out, _params(decision, "prefill", de_side_channel))


async def query_status(ctx: zmq.asyncio.Context, address: str, timeout_s: float, token: bytes | None = None) -> dict:
    """The live state of the instance whose rank 0's side channel is ``address``, as a dict: rank 0's
    :class:`~ascend_dualpath.dualpath.messages.Status` names the tensor-parallel size, then every other rank is asked
    at once (at :func:`~ascend_dualpath.dualpath.settings.rank_address`) and the shares are merged
    (:func:`~ascend_dualpath.dualpath.messages.instance_status`). Waits at most ``2 * timeout_s``; any rank's
    silence or malformed reply fails the whole query (:class:`WaitTimeout`, :class:`ProtocolError`)."""
    first = await _query_rank(ctx, address, timeout_s, token)
    if not 0 < first.tp_size <= TP_SIZE_MAX:  # bounds the sockets opened for the other ranks
        raise ProtocolError(
            f"side channel {address} reports tensor-parallel size {first.tp_size}, not in [1, {TP_SIZE_MAX}]"
        )
    rest = [_query_rank(ctx, rank_address(address, rank), timeout_s, token) for rank in range(1, first.tp_size)]
    return msgspec.to_builtins(m.instance_status([first, *await asyncio.gather(*rest)]))


async def _query_rank(ctx: zmq.asyncio.Context, address: str, timeout_s: float, token: bytes | None) -> m.Status:
    """One :class:`~ascend_dualpath.dualpath.messages.StatusQuery` on one rank's side channel through a fresh
    DEALER, sealed with the deployment ``token`` (:func:`~ascend_dualpath.dualpath.side_channel.seal`).

    A fresh socket per query keeps a late reply to an earlier, timed-out query from being read as this
    one's. Raises :class:`WaitTimeout` when no reply comes within ``timeout_s`` (ZMQ connects lazily, so a
    dead peer shows only as silence) and :class:`ProtocolError` for a malformed reply.
    """
    stamp = side.Sender().stamp()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 2 * side.DEFAULT_MAX_FRAME_BYTES)
    try:
        sock.connect(address)
        frame = side.seal(token, side.REQUEST, stamp, m.encode(m.StatusQuery()))
        await asyncio.wait_for(sock.send_multipart([b"", frame]), timeout_s)
        if not await sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise WaitTimeout(f"side channel {address} sent no status reply within {timeout_s} s")
        frames = await sock.recv_multipart()
    finally:
        sock.close()
    reply = side.open_reply(token, frames[-1], stamp, f"side channel {address}", "status", side.DEFAULT_MAX_FRAME_BYTES)
    if not isinstance(reply, m.Status):
        raise ProtocolError(f"side channel {address} answered {type(reply).__name__} to a status query")
    return reply


class _Metrics:
    """The proxy's Prometheus metrics, in a private registry (two proxies in one process do not clash)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            "adp_proxy_requests", "requests by endpoint and read path", ["endpoint", "path"], registry=reg
        )
        self.errors = Counter(
            "adp_proxy_errors",
            "error answers by the instance that failed (or proxy/client) and status",
            ["source", "status"],
            registry=reg,
        )
        self.side_channel_failures = Counter(
            "adp_proxy_side_channel_failures", "status queries without a valid reply", ["instance"], registry=reg
        )
        self.metrics_failures = Counter(
            "adp_proxy_instance_metrics_failures", "instance /metrics queries without an answer", ["instance"],
            registry=reg,
        )  # fmt: skip
        self.tokenize_fallbacks = Counter(
            "adp_proxy_tokenize_fallbacks", "requests whose prompt tokens were counted as words", registry=reg
        )
        self.latency = Histogram(
            "adp_proxy_request_seconds", "request latency at the proxy", ["endpoint"], registry=reg
        )
        self.ttft = Histogram("adp_proxy_ttft_seconds", "time to the DE's first body chunk", ["endpoint"], registry=reg)
        labels = ["node", "instance"]
        self.status = {key: Gauge(f"adp_{key}", text, labels, registry=reg) for key, text in STATUS_GAUGES.items()}

    def observe_status(self, instance: Instance, status: dict) -> None:
        """Mirror one status reply into the gauges (fields it lacks are left as they were); the node label is the
        cluster's (the one the scheduler sums read queues over)."""
        labels = {"node": instance.node, "instance": instance.name}
        for key, gauge in self.status.items():
            if isinstance(status.get(key), int | float):
                gauge.labels(**labels).set(status[key])


class DualPathProxy:
    """The proxy's state (config, placer, HTTP session, ZMQ context, metrics, recent decisions) and handlers."""

    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self.metrics = _Metrics()
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=DECISIONS_KEPT)
        self.placer = Placer(
            cfg.cluster, self._status, self._kv_blocks, self.metrics.registry,
            placement=cfg.placement, read_path=cfg.policy, split=cfg.split,
            alpha=UNBOUNDED if cfg.alpha_tokens is None else cfg.alpha_tokens,
            beta=UNBOUNDED if cfg.beta_tokens is None else cfg.beta_tokens,
            compute_quota_s=cfg.compute_quota_s, timeout_s=cfg.timeout_s,
            cached_capacity_blocks=cfg.cached_capacity_blocks,
        )  # fmt: skip
        self.session: aiohttp.ClientSession | None = None
        self.zmq_ctx: zmq.asyncio.Context | None = None
        self._tokenizers = itertools.cycle(cfg.cluster.prefill)
        self._standalone = itertools.cycle(cfg.cluster.decode)

    def make_app(self) -> web.Application:
        """The aiohttp application; the HTTP session and ZMQ context live as long as it runs."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.cleanup_ctx.append(self._resources)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/version", self.models)
        for route in TOKENIZER_ROUTES:
            app.router.add_post(route, self.tokenizer)
        for route in STANDALONE_ROUTES:
            app.router.add_route("*", route, self.standalone)
            app.router.add_route("*", route + "/{tail:.*}", self.standalone)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        app.router.add_get("/debug/decisions", self.debug_decisions)
        return app

    async def _resources(self, app: web.Application):
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.zmq_ctx = zmq.asyncio.Context()
        yield
        await self.session.close()
        self.zmq_ctx.term()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._forward(request, "/v1/completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._forward(request, "/v1/chat/completions")

    async def _status(self, instance: Instance) -> dict | None:
        try:
            status = await query_status(self.zmq_ctx, instance.kv, self.cfg.status_timeout_s, self.cfg.side_token)
        except (WaitTimeout, ProtocolError, zmq.ZMQError, asyncio.TimeoutError):
            self.metrics.side_channel_failures.labels(instance=instance.name).inc()
            return None
        self.metrics.observe_status(instance, status)
        return status

    async def _kv_blocks(self, instance: Instance) -> KvBlocks | None:
        """The DE's KV blocks from its vLLM ``/metrics`` (None: no answer within ``status_timeout_s``)."""
        timeout = aiohttp.ClientTimeout(total=self.cfg.status_timeout_s)
        try:
            async with self.session.get(instance.url + "/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    return None
                return parse_kv_blocks(await resp.text(), instance.dp_rank)
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None

    async def _prompt_ids(self, body: dict, endpoint: str) -> tuple[list[int] | None, str]:
        """The token ids of ``body``'s prompt and where they came from: ``"token ids"`` (the prompt is ids),
        ``"tokenizer"`` (a PE's ``/tokenize``), or None and ``"words"`` where neither can say (placement counts
        words)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt, "token ids"
        request = tokenize_request(body, chat=endpoint == "/v1/chat/completions")
        if request is None:
            return None, "words"
        url = next(self._tokenizers).url + "/tokenize"
        try:
            timeout = aiohttp.ClientTimeout(total=self.cfg.status_timeout_s)
            async with self.session.post(url, json=request, timeout=timeout) as resp:
                if resp.status == 200:
                    ids = (await resp.json())["tokens"]
                    if isinstance(ids, list) and all(type(t) is int for t in ids):
                        return ids, "tokenizer"
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError, TypeError):
            pass
        self.metrics.tokenize_fallbacks.inc()
        return None, "words"

    def _record(self, endpoint: str, placement: Placement, tokens_from: str, cached_from: str) -> Decision:
        decision = Decision(
            xfer_id=placement.xfer_id, endpoint=endpoint, path=placement.path,
            pe_queue_tokens=placement.pe_queue_tokens, de_queue_tokens=placement.de_queue_tokens,
            rule=placement.path_rule, prefill=placement.pe.name, decode=placement.de.name,
            placement=self.cfg.placement, split=self.cfg.split, rules=tuple(placement.rules),
            waited_s=round(placement.waited_s, 6), prompt_tokens=placement.tokens, tokens_from=tokens_from,
            cached_tokens=placement.cached, cached_from=cached_from,
        )  # fmt: skip
        self.decisions.append(decision)
        self.metrics.requests.labels(endpoint=endpoint, path=placement.path).inc()
        return decision

    async def _prefill(self, pe: Instance, endpoint: str, body: dict) -> None:
        """Send the PE's request and read its whole answer; raises UpstreamError on any failure."""
        timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s)
        name = pe.name
        try:
            async with self.session.post(pe.url + endpoint, json=body, timeout=timeout, headers=pe.headers) as resp:
                if resp.status >= 400:
                    raise await answered_error("prefill", name, resp)
                await resp.read()
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise transport_error("prefill", name, exc, self.cfg.timeout_s) from None

    async def _forward(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        """One client request: split into one engine request per prompt and choice (:mod:`.fanout`), each placed and
        sent to its PE and DE; the answers relayed (one) or merged (several)."""
        start = time.monotonic()
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):  # vLLM's own answer to a malformed request, word for word
            return await self._standalone_answer(request, request.path, raw)
        try:
            subs = fanout.split(body, chat=endpoint == "/v1/chat/completions")
        except fanout.FanOutLimit as exc:
            self.metrics.errors.labels(source="proxy", status="400").inc()
            return web.json_response(error_json(400, str(exc), "n"), status=400)
        legs: list[_Leg] = []
        try:
            for sub in subs:
                legs.append(await self._start_leg(sub, endpoint, legs))
            failure = await _first_failure_of(legs, self.cfg.status_timeout_s)
            if failure is not None:
                self.metrics.errors.labels(source=failure.source, status=str(failure.status)).inc()
                return failure.response()
            if len(legs) == 1:
                return await self._relay(request, legs[0], endpoint, start)
            if body.get("stream"):
                return await self._relay_merged(request, subs, legs, body, endpoint, start)
            return await self._merged_answer(subs, legs, endpoint, start)
        except PlacementTimeout as exc:
            self.metrics.errors.labels(source="proxy", status="503").inc()
            return web.json_response(error_json(503, str(exc)), status=503)
        finally:
            for leg in legs:
                await leg.close(self.placer)

    async def _start_leg(self, sub: fanout.SubRequest, endpoint: str, earlier: list[_Leg]) -> _Leg:
        """Place one engine request and send it to its PE and DE (a prompt's later choices reuse its token ids)."""
        same = next((leg for leg in earlier if leg.sub.prompt_index == sub.prompt_index), None)
        ids, tokens_from = (same.ids, same.tokens_from) if same else await self._prompt_ids(sub.body, endpoint)
        placement = await self.placer.place(sub.body, ids)
        decision = self._record(endpoint, placement, tokens_from, "assumed" if ids is None else "prefixes")
        pe, de = placement.pe, placement.de
        pe_body = prefill_body(sub.body, decision, de.kv, chat=endpoint == "/v1/chat/completions")
        decode = DecodeStream(de.name)
        pe_task = asyncio.create_task(self._prefill(pe, endpoint, pe_body))
        de_body = decode_body(sub.body, decision, pe.kv)
        de_task = asyncio.create_task(
            decode.run(self.session, de.url + endpoint, de_body, self.cfg.timeout_s, de.headers)
        )
        pe_task.add_done_callback(lambda _: self.placer.prefill_done(placement))
        stored = None if ids is None else functools.partial(self.placer.stored, ids)
        return _Leg(sub, placement, decode, pe_task, de_task, ids, tokens_from, stored)

    async def _relay(self, request: web.Request, leg: _Leg, endpoint: str, start: float) -> web.StreamResponse:
        """Pass one DE answer to the client chunk by chunk (each wait bounded by the DE's read timeout); a client
        gone mid-answer ends it quietly, its latency still recorded."""
        status, content_type = leg.decode.head.result()
        resp = web.StreamResponse(status=status, headers={"Content-Type": content_type})
        try:
            await resp.prepare(request)
            first = True
            while (item := await asyncio.wait_for(leg.decode.chunks.get(), self.cfg.timeout_s + 1.0)) is not None:
                if isinstance(item, UpstreamError):
                    self.metrics.errors.labels(source=item.source, status=str(item.status)).inc()
                    await _write_midstream_error(resp, content_type, item)
                    break
                if first:
                    self.metrics.ttft.labels(endpoint=endpoint).observe(time.monotonic() - start)
                    first = False
                await resp.write(item)
            else:
                leg.answered()
            await resp.write_eof()
        except ConnectionResetError:
            self.metrics.errors.labels(source="client", status="499").inc()
        finally:
            self.metrics.latency.labels(endpoint=endpoint).observe(time.monotonic() - start)
        return resp

    async def _merged_answer(self, subs: list, legs: list[_Leg], endpoint: str, start: float) -> web.Response:
        """The non-streamed answer of a fanned-out request: every DE's whole answer, merged as vLLM answers."""
        try:
            answers = [json.loads(await leg.decode.body(self.cfg.timeout_s + 1.0)) for leg in legs]
        except UpstreamError as failure:
            self.metrics.errors.labels(source=failure.source, status=str(failure.status)).inc()
            return failure.response()
        for leg in legs:
            leg.answered()
        self.metrics.latency.labels(endpoint=endpoint).observe(time.monotonic() - start)
        return web.json_response(fanout.merge(subs, answers))

    async def _relay_merged(
        self, request: web.Request, subs: list, legs: list[_Leg], body: dict, endpoint: str, start: float
    ) -> web.StreamResponse:
        """A fanned-out streamed request: every DE's events as they come, rewritten into one stream."""
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        merger = fanout.StreamMerger(subs, include_usage)
        events: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(_pump(i, leg, events, self.cfg.timeout_s + 1.0)) for i, leg in enumerate(legs)]
        resp = web.StreamResponse(status=200, headers={"Content-Type": legs[0].decode.head.result()[1]})
        try:
            await resp.prepare(request)
            open_streams, first = len(legs), True
            while open_streams:
                i, item = await events.get()
                if item is None:
                    open_streams -= 1
                    legs[i].answered()
                    continue
                if isinstance(item, UpstreamError):
                    self.metrics.errors.labels(source=item.source, status=str(item.status)).inc()
                    await _write_midstream_error(resp, "text/event-stream", item)
                    break
                if first:
                    self.metrics.ttft.labels(endpoint=endpoint).observe(time.monotonic() - start)
                    first = False
                await resp.write(merger.feed(i, item))
            else:
                await resp.write(merger.end())
            await resp.write_eof()
        except ConnectionResetError:
            self.metrics.errors.labels(source="client", status="499").inc()
        finally:
            await _cancel(*pumps)
            self.metrics.latency.labels(endpoint=endpoint).observe(time.monotonic() - start)
        return resp

    async def models(self, request: web.Request) -> web.StreamResponse:
        """``/v1/models`` and ``/version``: the first DE's answer, status and body as they are."""
        return await pass_through(
            self.session, request, self.cfg.cluster.decode[0].name, self.cfg.decode_url + request.path, b"",
            self.cfg.timeout_s,
        )  # fmt: skip

    async def tokenizer(self, request: web.Request) -> web.StreamResponse:
        """``/tokenize`` and ``/detokenize``: a PE's answer (round robin)."""
        pe = next(self._tokenizers)
        return await pass_through(
            self.session, request, pe.name, pe.url + request.path, await request.read(), self.cfg.timeout_s
        )

    async def standalone(self, request: web.Request) -> web.StreamResponse:
        """Routes without a DualPath plan (``/v1/responses``): one DE computes them itself (round robin)."""
        return await self._standalone_answer(request, request.path, await request.read())

    async def _standalone_answer(self, request: web.Request, path: str, raw: bytes) -> web.StreamResponse:
        de = next(self._standalone)
        return await pass_through(self.session, request, de.name, de.url + path, raw, self.cfg.timeout_s)

    async def _instance_health(self, url: str) -> str:
        try:
            timeout = aiohttp.ClientTimeout(total=self.cfg.timeout_s)
            async with self.session.get(url + "/health", timeout=timeout) as resp:
                return "ok" if resp.status == 200 else f"answered {resp.status}"
        except (asyncio.TimeoutError, aiohttp.ClientError, OSError) as exc:
            return f"unreachable: {exc!r}"

    async def health(self, request: web.Request) -> web.Response:
        """200 when every instance answers ``/health`` with 200, else 503 naming what each said (by name)."""
        instances = self.cfg.cluster.servers
        answers = await asyncio.gather(*(self._instance_health(i.url) for i in instances))
        healthy = all(a == "ok" for a in answers)
        return web.json_response(dict(zip((i.name for i in instances), answers, strict=True)),
                                 status=200 if healthy else 503)  # fmt: skip

    async def metrics_text(self, request: web.Request) -> web.Response:
        # fresh connector figures: the last request's status predates its own reads
        await self.placer.snapshot(with_kv=False)
        instances = self.cfg.cluster.servers
        texts = await asyncio.gather(
            *(instance_metrics(self.session, i.url, self.cfg.status_timeout_s) for i in instances)
        )
        for instance, text in zip(instances, texts, strict=True):
            if text is None:
                self.metrics.metrics_failures.labels(instance=instance.name).inc()
        answered = {i.name: text for i, text in zip(instances, texts, strict=True) if text is not None}
        body = generate_latest(self.metrics.registry) + federated_metrics(answered)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def debug_decisions(self, request: web.Request) -> web.Response:
        """The last :data:`DECISIONS_KEPT` decisions, oldest first."""
        return web.json_response([dataclasses.asdict(d) for d in self.decisions])


@dataclasses.dataclass
class _Leg:
    """One engine request of a client request on its way: its placement, the PE's and the DE's tasks, and what is
    stored once its answer arrived in full (``stored``: the proxy's record of the prompt's blocks)."""

    sub: fanout.SubRequest
    placement: Placement
    decode: DecodeStream
    pe_task: asyncio.Task
    de_task: asyncio.Task
    ids: list[int] | None
    tokens_from: str
    stored: Callable[[], None] | None = None

    def answered(self) -> None:
        """Its DE answered in full without an error: its connector stores the request's blocks."""
        if self.stored is not None:
            self.stored()
            self.stored = None

    async def close(self, placer: Placer) -> None:
        await _cancel(self.pe_task, self.de_task)
        self.decode.discard()
        placer.decode_done(self.placement)


async def _first_failure(pe_task: asyncio.Task, de_head: asyncio.Future) -> UpstreamError | None:
    """Wait for the PE's answer and the DE's head; the first failure of either, or None when both are fine.

    Bounded: the PE's request has a total timeout, the DE's head a connect and read timeout.
    """
    pending = {pe_task, de_head}
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for future in done:
            exc = future.exception()
            if isinstance(exc, UpstreamError):
                return exc
            if exc is not None:
                raise exc
    return None


async def _leg_failure(leg: _Leg, grace_s: float) -> UpstreamError | None:
    """A leg's first failure; a PE refusing the request (4xx) yields to the DE's own refusal when that comes within
    ``grace_s``: the DE got the client's body unchanged, so its error is vLLM's answer to the client."""
    failure = await _first_failure(leg.pe_task, leg.decode.head)
    if failure is None or failure.source != "prefill" or failure.status >= 500:
        return failure
    try:
        await asyncio.wait_for(asyncio.shield(leg.decode.head), grace_s)
    except UpstreamError as de_failure:
        return de_failure
    except asyncio.TimeoutError:
        pass
    return failure


async def _first_failure_of(legs: list[_Leg], grace_s: float) -> UpstreamError | None:
    """The first failure among the legs (the others are cancelled by the caller), or None when all are fine."""
    waits = [asyncio.ensure_future(_leg_failure(leg, grace_s)) for leg in legs]
    try:
        for next_done in asyncio.as_completed(waits):
            failure = await next_done
            if failure is not None:
                return failure
        return None
    finally:
        await _cancel(*waits)


async def _pump(index: int, leg: _Leg, events: asyncio.Queue, timeout_s: float) -> None:
    """Move one DE's chunks into the shared queue as ``(index, chunk)``; ends with None or an UpstreamError."""
    try:
        while (item := await asyncio.wait_for(leg.decode.chunks.get(), timeout_s)) is not None:
            await events.put((index, item))
            if isinstance(item, UpstreamError):
                return
        await events.put((index, None))
    except asyncio.TimeoutError:
        message = f"the decode instance {leg.decode.name} sent nothing for {timeout_s} s"
        await events.put((index, UpstreamError("decode", 504, message)))


async def _cancel(*tasks: asyncio.Future) -> None:
    """Cancel what still runs (closing its upstream connection) and wait for it to unwind."""
    for task in tasks:
        if not task.done():
            task.cancel()
    # Their failures were already reported (or do not matter once the request ended for another reason).
    await asyncio.gather(*tasks, return_exceptions=True)


async def _write_midstream_error(resp: web.StreamResponse, content_type: str, failure: UpstreamError) -> None:
    """After the head went out the status cannot change: an SSE stream gets an error event."""
    if content_type.startswith("text/event-stream"):
        await resp.write(f"data: {json.dumps(failure.payload())}\n\n".encode())


def run_proxy(cfg: ProxyConfig, host: str, port: int, shutdown_timeout_s: float = 5.0) -> None:
    """Serve the proxy on ``host:port`` until SIGINT / SIGTERM; open client connections then get at most
    ``shutdown_timeout_s`` to finish (aiohttp's default is 60 s)."""
    app = DualPathProxy(cfg).make_app()
    web.run_app(app, host=host, port=port, print=None, access_log=None, shutdown_timeout=shutdown_timeout_s)
