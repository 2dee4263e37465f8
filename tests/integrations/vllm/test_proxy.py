"""The DualPath proxy against fake vLLM instances (aiohttp servers) and fake side channels (ZMQ ROUTER threads).

No model: each fake instance records the bodies it receives and answers as a test tells it to; each fake side
channel answers status queries with the reply format of the design (or stays silent).
"""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("vllm")
aiohttp = pytest.importorskip("aiohttp")
zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from aiohttp.test_utils import TestServer  # noqa: E402

from ascend_dualpath.errors import ConfigError  # noqa: E402
from ascend_dualpath.integrations.vllm import proxy as proxy_mod  # noqa: E402
from ascend_dualpath.integrations.vllm.proxy import DualPathProxy, ProxyConfig, decide  # noqa: E402
from tests.integrations.vllm.fakes import FakeInstance, FakeSideChannel, ProxyClient, run, status_reply  # noqa: E402

DEFAULT = object()  # Harness: an idle status reply; None: a silent side channel


class Harness(ProxyClient):
    """Fake PE and DE, their side channels, and the proxy under test, all on loopback."""

    def __init__(
        self, policy="dual", pe_status=DEFAULT, de_status=DEFAULT, timeout_s=5.0, side_token=None, proxy_token=None
    ) -> None:
        self.pe, self.de = FakeInstance("prefill"), FakeInstance("decode")
        pe_reply = status_reply("pe-node", "prefill") if pe_status is DEFAULT else pe_status
        self.pe_side = FakeSideChannel(pe_reply, side_token)
        self.de_side = FakeSideChannel(
            status_reply("de-node", "decode") if de_status is DEFAULT else de_status, side_token
        )
        self.policy, self.timeout_s, self.proxy_token = policy, timeout_s, proxy_token

    async def __aenter__(self) -> Harness:
        self.pe_server, self.de_server = TestServer(self.pe.app()), TestServer(self.de.app())
        await self.pe_server.start_server()
        await self.de_server.start_server()
        self.cfg = ProxyConfig(
            prefill_url=str(self.pe_server.make_url("")),
            decode_url=str(self.de_server.make_url("")),
            prefill_kv=self.pe_side.address,
            decode_kv=self.de_side.address,
            policy=self.policy,
            timeout_s=self.timeout_s,
            status_timeout_s=0.3,
            side_token=self.proxy_token,
        )
        self.proxy = DualPathProxy(self.cfg)
        self.proxy_server = TestServer(self.proxy.make_app())
        await self.proxy_server.start_server()
        self.client = aiohttp.ClientSession(base_url=str(self.proxy_server.make_url("")))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        for server in (self.proxy_server, self.pe_server, self.de_server):
            await server.close()
        self.pe_side.close()
        self.de_side.close()

    async def post(self, path: str, body) -> tuple[int, dict]:
        async with self.client.post(path, json=body) as resp:
            return resp.status, await resp.json(content_type=None)


COMPLETION = {
    "model": "tiny",
    "prompt": "the cat sat",
    "max_tokens": 20,
    "temperature": 0.0,
    "ignore_eos": True,
    "seed": 7,
    "vendor_field": {"nested": [1, 2]},
    "kv_transfer_params": {"other": "kept"},
}


def test_unknown_fields_pass_through_and_prefill_body_is_rewritten():
    async def body():
        async with Harness() as h:
            status, answer = await h.post("/v1/completions", COMPLETION)
            assert status == 200 and answer == {"id": "decode-1", "choices": [{"text": "from decode"}]}
            (de_body,), (pe_body,) = h.de.bodies, h.pe.bodies
            de_params, pe_params = de_body.pop("kv_transfer_params"), pe_body.pop("kv_transfer_params")
            client = {k: v for k, v in COMPLETION.items() if k != "kv_transfer_params"}
            assert de_body == client
            # what shapes only the answer is dropped (the PE's token is discarded); the rest, unknown fields too, stays
            kept = {k: v for k, v in client.items() if k not in ("temperature", "seed", "ignore_eos")}
            assert pe_body == {**kept, "max_tokens": 1, "stream": False}
            xfer_id = de_params["dualpath"]["xfer_id"]
            assert de_params == {
                "other": "kept",
                "dualpath": {
                    "xfer_id": xfer_id,
                    "role": "decode",
                    "path": "pe",
                    "peer": h.pe_side.address,
                    "split": False,
                },
            }
            assert pe_params == {
                "other": "kept",
                "dualpath": {
                    "xfer_id": xfer_id,
                    "role": "prefill",
                    "path": "pe",
                    "peer": h.de_side.address,
                    "split": False,
                },
            }
            assert (await h.decisions())[0]["xfer_id"] == xfer_id

    run(body())


def test_chat_prefill_gets_one_completion_token_and_no_stream_options():
    async def body():
        async with Harness() as h:
            h.de.gate = None
            request = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hello"}],
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_completion_tokens": 9,
                "top_k": 3,
            }
            async with h.client.post("/v1/chat/completions", json=request) as resp:
                assert resp.status == 200 and resp.content_type == "text/event-stream"
                await resp.read()
            pe_body = h.pe.bodies[0]
            assert pe_body["max_tokens"] == 1 and pe_body["max_completion_tokens"] == 1
            assert pe_body["stream"] is False and "stream_options" not in pe_body and "top_k" not in pe_body
            de_body = h.de.bodies[0]
            assert de_body["stream"] is True and de_body["stream_options"] == {"include_usage": True}
            assert de_body["max_completion_tokens"] == 9 and "max_tokens" not in de_body

    run(body())


def test_stream_passes_through_chunk_by_chunk_in_order():
    async def body():
        async with Harness() as h:
            h.de.gate = asyncio.Event()
            async with h.client.post("/v1/completions", json={**COMPLETION, "stream": True}) as resp:
                assert resp.status == 200
                # The DE holds back everything after its first chunk until the gate opens: the first chunk
                # reaching the client proves the proxy relays without waiting for the end of the stream.
                first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 10)
                assert first == h.de.stream_chunks[0]
                h.de.gate.set()
                rest = await resp.read()
            assert first + rest == b"".join(h.de.stream_chunks)

    run(body())


@pytest.mark.parametrize(
    ("pe_queue", "de_queue", "pe_read", "de_read", "path", "rule"),
    [
        (100, 10, 0, 0, "de", "shorter-queue"),
        (10, 100, 0, 0, "pe", "shorter-queue"),
        (50, 50, 5, 3, "de", "tie:fewer-reads"),
        (50, 50, 3, 5, "pe", "tie:fewer-reads"),
        (0, 0, 0, 0, "pe", "tie:pe"),
    ],
)
def test_decide_follows_the_scheduler_rule(pe_queue, de_queue, pe_read, de_read, path, rule):
    pe = status_reply("pe-node", "prefill", pe_queue, pe_read)
    de = status_reply("de-node", "decode", de_queue, de_read)
    assert decide("dual", pe, de) == (path, rule)


@pytest.mark.parametrize(("pe_queue", "de_queue", "path"), [(300, 20, "de"), (20, 300, "pe")])
def test_proxy_picks_the_path_with_the_shorter_read_queue(pe_queue, de_queue, path):
    async def body():
        pe, de = status_reply("pe-node", "prefill", pe_queue), status_reply("de-node", "decode", de_queue)
        async with Harness(pe_status=pe, de_status=de) as h:
            assert (await h.post("/v1/completions", COMPLETION))[0] == 200
            assert h.de.bodies[0]["kv_transfer_params"]["dualpath"]["path"] == path
            assert h.pe.bodies[0]["kv_transfer_params"]["dualpath"]["path"] == path
            (decision,) = await h.decisions()
            assert {k: decision[k] for k in ("endpoint", "path", "pe_queue_tokens", "de_queue_tokens", "rule")} == {
                "endpoint": "/v1/completions",
                "path": path,
                "pe_queue_tokens": pe_queue,
                "de_queue_tokens": de_queue,
                "rule": "shorter-queue",
            }
            assert (decision["prefill"], decision["decode"], decision["split"]) == ("prefill0", "decode0", False)
            assert f"path-shorter-queue {path}" in decision["rules"]

    run(body())


@pytest.mark.parametrize("policy", ["pe", "de"])
def test_forced_policy_ignores_the_queues(policy):
    async def body():
        # The queues point the other way from the forced path.
        pe_queue, de_queue = (500, 0) if policy == "pe" else (0, 500)
        pe, de = status_reply("pe-node", "prefill", pe_queue), status_reply("de-node", "decode", de_queue)
        async with Harness(policy=policy, pe_status=pe, de_status=de) as h:
            for _ in range(3):
                assert (await h.post("/v1/completions", COMPLETION))[0] == 200
            assert {b["kv_transfer_params"]["dualpath"]["path"] for b in h.de.bodies + h.pe.bodies} == {policy}
            assert {d["rule"] for d in await h.decisions()} == {f"forced:{policy}"}

    run(body())


def test_silent_side_channel_is_counted_and_falls_back_to_pe():
    async def body():
        # The PE's queue is long, so only the fallback can explain the pe path.
        async with Harness(pe_status=status_reply("pe-node", "prefill", 900), de_status=None) as h:
            assert (await h.post("/v1/completions", COMPLETION))[0] == 200
            (decision,) = await h.decisions()
            assert (decision["path"], decision["rule"], decision["de_queue_tokens"]) == (
                "pe",
                "fallback:side-channel",
                None,
            )
            metrics = await h.metrics()
            key = ("adp_proxy_side_channel_failures_total", frozenset({("instance", "decode0")}))
            assert metrics[key] >= 1.0  # /metrics asks again

    run(body())


@pytest.mark.parametrize("proxy_token", [None, b"another-token-of-16-bytes"], ids=["none", "another"])
def test_a_proxy_without_the_deployment_token_learns_nothing_from_the_side_channels(proxy_token):
    async def body():
        token = b"the-deployment-token-0123456789"
        async with Harness(pe_status=status_reply("pe-node", "prefill", 900), side_token=token,
                           proxy_token=proxy_token) as h:  # fmt: skip
            assert (await h.post("/v1/completions", COMPLETION))[0] == 200  # served, on the pe fallback
            (decision,) = await h.decisions()
            assert decision["rule"] == "fallback:side-channel" and h.de_side.queries == 0 < h.de_side.refused
        async with Harness(pe_status=status_reply("pe-node", "prefill", 900), side_token=token,
                           proxy_token=token) as h:  # fmt: skip
            assert (await h.post("/v1/completions", COMPLETION))[0] == 200
            (decision,) = await h.decisions()
            assert decision["rule"] != "fallback:side-channel" and decision["path"] == "de"
            assert h.de_side.refused == 0 < h.de_side.queries

    run(body())


def test_metrics_parse_and_carry_status_and_request_counts():
    async def body():
        pe, de = status_reply("pe-node", "prefill", 7, 11), status_reply("de-node", "decode", 3, 5)
        async with Harness(pe_status=pe, de_status=de) as h:
            assert (await h.post("/v1/completions", COMPLETION))[0] == 200
            h.pe.mode = "error"
            assert (await h.post("/v1/completions", COMPLETION))[0] == 400
            m = await h.metrics()
            assert m[("adp_proxy_requests_total", frozenset({("endpoint", "/v1/completions"), ("path", "de")}))] == 2
            assert m[("adp_snic_read_bytes", frozenset({("node", "pe0"), ("instance", "prefill0")}))] == 11 * 65536
            assert m[("adp_snic_read_bytes", frozenset({("node", "de0"), ("instance", "decode0")}))] == 5 * 65536
            assert m[("adp_read_queue_tokens", frozenset({("node", "pe0"), ("instance", "prefill0")}))] == 7
            assert m[("adp_read_queue_bytes", frozenset({("node", "de0"), ("instance", "decode0")}))] == 3 * 1024
            assert m[("adp_host_leases", frozenset({("node", "pe0"), ("instance", "prefill0")}))] == 2
            assert m[("adp_quarantined_bytes", frozenset({("node", "de0"), ("instance", "decode0")}))] == 4096
            # the connector's counters reach /metrics through vLLM's own metrics (federated), not the status
            assert not any(name in ("adp_loads", "adp_fallbacks", "adp_failures") for name, _ in m), sorted(m)
            assert m[("adp_proxy_errors_total", frozenset({("source", "prefill"), ("status", "400")}))] == 1
            latency = ("adp_proxy_request_seconds_count", frozenset({("endpoint", "/v1/completions")}))
            ttft = ("adp_proxy_ttft_seconds_count", frozenset({("endpoint", "/v1/completions")}))
            assert m[latency] == 1 and m[ttft] == 1

    run(body())


def test_prefill_error_reaches_the_client_and_cancels_the_decode_request():
    async def body():
        async with Harness() as h:
            h.pe.mode, h.pe.error_status, h.pe.error_delay_s, h.de.mode = "error", 422, 0.3, "hang"
            start = time.monotonic()
            status, answer = await h.post("/v1/completions", COMPLETION)
            assert time.monotonic() - start < 2.0  # well before the 5 s timeout: cancelled, not timed out
            # vLLM's error, word for word (no proxy wording, no internal address)
            assert status == 422
            assert answer == {"error": {"message": "prefill refuses", "type": "BadRequestError", "code": 422}}
            await asyncio.wait_for(h.de.disconnected.wait(), 1)

    run(body())


def test_decode_error_reaches_the_client_and_cancels_the_prefill_request():
    async def body():
        async with Harness() as h:
            h.de.mode, h.de.error_status, h.de.error_delay_s, h.pe.mode = "error", 500, 0.3, "hang"
            start = time.monotonic()
            status, answer = await h.post("/v1/chat/completions", {"messages": [], "stream": True})
            assert time.monotonic() - start < 2.0  # well before the 5 s timeout: cancelled, not timed out
            assert (status, answer) == (
                500,
                {"error": {"message": "decode refuses", "type": "BadRequestError", "code": 500}},
            )
            await asyncio.wait_for(h.pe.disconnected.wait(), 1)

    run(body())


def test_unreachable_prefill_is_a_502():
    async def body():
        async with Harness() as h:
            await h.pe_server.close()  # nothing listens on the PE's port any more
            h.de.mode = "hang"
            status, answer = await h.post("/v1/completions", COMPLETION)
            assert status == 502 and "unreachable" in answer["error"]["message"]
            # The refusal is immediate: the DE request was cancelled before or after it arrived.
            if h.de.bodies:
                await asyncio.wait_for(h.de.disconnected.wait(), 5)

    run(body())


@pytest.mark.parametrize("hanging", ["pe", "de"])
def test_a_hanging_instance_times_out_with_504(hanging):
    async def body():
        async with Harness(timeout_s=0.5) as h:
            getattr(h, hanging).mode = "hang"
            start = time.monotonic()
            status, answer = await h.post("/v1/completions", COMPLETION)
            assert status == 504 and "did not answer within 0.5 s" in answer["error"]["message"]
            assert time.monotonic() - start < 3.0
            await asyncio.wait_for(getattr(h, hanging).disconnected.wait(), 5)

    run(body())


def test_health_needs_both_instances_and_models_come_from_the_decode_instance():
    async def body():
        async with Harness() as h:
            async with h.client.get("/health") as resp:
                assert resp.status == 200
            h.pe.health_status = 503
            async with h.client.get("/health") as resp:
                assert resp.status == 503 and (await resp.json())["prefill0"] == "answered 503"
            async with h.client.get("/v1/models") as resp:
                assert resp.status == 200 and (await resp.json())["data"] == [{"id": "model-of-decode"}]

    run(body())


def test_a_body_that_is_not_a_json_object_gets_vllms_own_answer():
    """No DualPath plan for it: one DE answers it (vLLM's validation error), relayed as it is."""

    async def body():
        async with Harness() as h:
            async with h.client.post("/v1/completions", data=b"{not json") as resp:
                assert resp.status == 400 and (await resp.json())["error"]["message"] == "JSON decode error"
            async with h.client.post("/v1/completions", json=[1, 2]) as resp:
                assert resp.status == 500  # the fake DE fails on a list (vLLM answers 400): its answer goes on
            assert h.pe.bodies == [] and h.de.bodies == [[1, 2]]

    run(body())


def test_side_channel_defaults_and_config_errors():
    cfg = ProxyConfig(prefill_url="http://127.0.0.1:8100/", decode_url="http://localhost:8200")
    assert (cfg.prefill_url, cfg.prefill_kv, cfg.decode_kv) == (
        "http://127.0.0.1:8100",
        "tcp://127.0.0.1:8200",
        "tcp://localhost:8300",
    )
    with pytest.raises(ConfigError, match="policy='both'"):
        ProxyConfig(prefill_url="http://a:1", decode_url="http://b:2", policy="both")
    with pytest.raises(ConfigError, match="timeout_s=0"):
        ProxyConfig(prefill_url="http://a:1", decode_url="http://b:2", timeout_s=0)
    with pytest.raises(ConfigError, match="'ftp://x:1'"):
        proxy_mod.default_side_channel("ftp://x:1")


def test_decisions_keep_the_last_hundred():
    async def body():
        async with Harness() as h:
            for _ in range(3):
                await h.post("/v1/completions", COMPLETION)
            h.proxy.decisions.extend(h.proxy.decisions[0] for _ in range(200))
            assert len(await h.decisions()) == proxy_mod.DECISIONS_KEPT

    run(body())


def test_the_proxy_asks_a_real_side_channel_with_the_deployment_token():
    import zmq.asyncio

    from ascend_dualpath.dualpath import messages as m
    from ascend_dualpath.dualpath.counters import Counters
    from ascend_dualpath.dualpath.side_channel import SideChannel
    from ascend_dualpath.errors import ProtocolError

    token, counters = b"the-deployment-token-0123456789", Counters()
    side = SideChannel(0, lambda r: m.Status(role="decode", node="de0", device_id=3), token=token, counters=counters)

    async def body():
        ctx = zmq.asyncio.Context()
        try:
            assert (await proxy_mod.query_status(ctx, side.address, 5.0, token))["device_id"] == 3
            with pytest.raises(ProtocolError, match="refused the frame.*deployment-token check"):
                await proxy_mod.query_status(ctx, side.address, 5.0, None)
        finally:
            ctx.term()

    try:
        run(body())
    finally:
        side.close()
    assert counters.side_refused == 1


def test_an_instances_status_is_merged_from_every_ranks_side_channel():
    """A tensor-parallel instance of 3 ranks: rank 0 names the size, the proxy asks ranks 1 and 2 at the base port
    + 1 and + 2 and sums their shares; a rank that stays silent fails the whole query, naming its address."""
    import zmq.asyncio

    from ascend_dualpath.dualpath import messages as m
    from ascend_dualpath.dualpath.side_channel import SideChannel
    from ascend_dualpath.errors import WaitTimeout
    from tests.integrations.vllm.worker_harness import free_ports

    base, sides = free_ports(3), []

    def share(rank: int) -> m.Status:  # MLA-like: the ranks lead different requests, each reads its own
        return m.Status("decode", f"de0.tp{rank}", rank, 1e9, read_queue_bytes=100 * (rank + 1), tp_size=3,
                        tp_rank=rank, unfinished_requests=rank, reading=[f"x{rank}"])  # fmt: skip

    async def body():
        ctx = zmq.asyncio.Context()
        try:
            status = await proxy_mod.query_status(ctx, sides[0].address, 5.0)
            assert status["read_queue_bytes"] == 600 and status["unfinished_requests"] == 3
            assert status["snic_bytes_per_s"] == 3e9 and status["reading"] == ["x0", "x1", "x2"]
            sides.pop().close()  # rank 2 goes silent
            with pytest.raises(WaitTimeout, match=f"side channel tcp://127.0.0.1:{base + 2} sent no status reply"):
                await proxy_mod.query_status(ctx, sides[0].address, 0.5)
        finally:
            ctx.term()

    try:
        for rank in range(3):
            sides.append(SideChannel(base + rank, lambda r, rank=rank: share(rank)))
        run(body())
    finally:
        for side in sides:
            side.close()


@pytest.mark.parametrize("size", [0, -1, 1025])
def test_a_rank_0_naming_an_impossible_size_is_refused_before_any_other_rank_is_asked(size):
    import zmq.asyncio

    from ascend_dualpath.dualpath import messages as m
    from ascend_dualpath.dualpath.side_channel import SideChannel
    from ascend_dualpath.errors import ProtocolError

    side = SideChannel(0, lambda r: m.Status("decode", "de0.tp0", 0, tp_size=size))

    async def body():
        ctx = zmq.asyncio.Context()
        try:
            with pytest.raises(ProtocolError, match=rf"reports tensor-parallel size {size}, not in \[1, 1024\]"):
                await proxy_mod.query_status(ctx, side.address, 5.0)
        finally:
            ctx.term()

    try:
        run(body())
    finally:
        side.close()
