"""Placement over N PEs x M DEs through the proxy, against fake instances and fake side channels: every rule of
the paper's scheduler on live state (beta, alpha, DE groups, HBM fit, waiting, the read path), round robin, the
compute quota, and the cluster description."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")
aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("zmq")

from aiohttp.test_utils import TestServer  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from ascend_dualpath.errors import ConfigError  # noqa: E402
from ascend_dualpath.integrations.vllm import cluster as cluster_mod  # noqa: E402
from ascend_dualpath.integrations.vllm.placement import (  # noqa: E402
    KvBlocks,
    Ledger,
    Placer,
    Snapshot,
    node_queues,
    parse_kv_blocks,
)
from ascend_dualpath.integrations.vllm.proxy import DualPathProxy, ProxyConfig  # noqa: E402
from ascend_dualpath.integrations.vllm.thresholds import alpha_from_status, beta_from_warmup  # noqa: E402
from tests.integrations.vllm.fakes import FakeInstance, FakeSideChannel, ProxyClient, run, status_reply  # noqa: E402
from tests.integrations.vllm.worker_harness import free_ports  # noqa: E402

FREE = (1000, 0.0)  # a DE's KV cache: 1000 blocks, none used
FULL = (1000, 1.0)


class Cluster(ProxyClient):
    """``pes`` / ``des``: one ``(node, status kwargs)`` per PE and one ``(node, group, status kwargs, kv)`` per DE;
    fake instances and side channels for each, and the proxy over them."""

    def __init__(self, pes, des, **cfg) -> None:
        self.pe_specs, self.de_specs, self.cfg_kwargs = pes, des, {"timeout_s": 5.0, **cfg}
        self.pes = [FakeInstance(f"prefill{i}") for i in range(len(pes))]
        self.des = [FakeInstance(f"decode{i}") for i in range(len(des))]
        self.pe_sides = [FakeSideChannel(status_reply(n, "prefill", **kw)) for n, kw in pes]
        self.de_sides = [FakeSideChannel(status_reply(n, "decode", **kw)) for n, _, kw, _ in des]
        for de, (_, _, _, kv) in zip(self.des, des, strict=True):
            de.kv = kv

    async def __aenter__(self) -> Cluster:
        self.servers = [TestServer(i.app()) for i in self.pes + self.des]
        for server in self.servers:
            await server.start_server()
        urls = [str(s.make_url("")) for s in self.servers]
        spec = {
            "prefill": [
                {"url": urls[i], "kv": side.address, "node": node}
                for i, (side, (node, _)) in enumerate(zip(self.pe_sides, self.pe_specs, strict=True))
            ],
            "decode": [
                {"url": urls[len(self.pes) + i], "kv": side.address, "node": node, "group": group}
                for i, (side, (node, group, _, _)) in enumerate(zip(self.de_sides, self.de_specs, strict=True))
            ],
        }
        self.cfg = ProxyConfig(cluster=cluster_mod.cluster_from_dict(spec), status_timeout_s=0.3, **self.cfg_kwargs)
        self.proxy = DualPathProxy(self.cfg)
        self.proxy_server = TestServer(self.proxy.make_app())
        await self.proxy_server.start_server()
        self.client = aiohttp.ClientSession(base_url=str(self.proxy_server.make_url("")))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        for server in [self.proxy_server, *self.servers]:
            await server.close()
        for side in self.pe_sides + self.de_sides:
            side.close()

    async def post(self, words: int = 3, max_tokens: int = 4) -> tuple[int, dict]:
        body = {"model": "tiny", "prompt": " ".join(["w"] * words), "max_tokens": max_tokens}
        async with self.client.post("/v1/completions", json=body) as resp:
            return resp.status, await resp.json(content_type=None)


def rules(decision: dict, name: str) -> list[str]:
    return [r for r in decision["rules"] if r.split(" ", 1)[0] == name]


def test_a_pe_over_beta_is_never_chosen():
    async def body():
        # prefill0 is in the better category (its node's read queue is under alpha) but over beta: without the beta
        # rule it would win; prefill1 (category 3) must take everything
        pes = [("n0", {"unfinished_tokens": 500}), ("n1", {"unfinished_tokens": 90, "queue_tokens": 1000})]
        async with Cluster(pes, [("n0", 0, {}, FREE)], alpha_tokens=100, beta_tokens=100) as c:
            for _ in range(3):
                assert (await c.post())[0] == 200
            decisions = await c.decisions()
            assert {d["prefill"] for d in decisions} == {"prefill1"}
            assert c.pes[0].bodies == [] and len(c.pes[1].bodies) == 3
            assert rules(decisions[0], "pe-over-beta") == [
                "pe-over-beta excluded ['prefill0']: unfinished tokens > beta 100"
            ]
            m = await c.metrics()
            assert m[("adp_proxy_placements_total", frozenset({("rule", "pe-over-beta")}))] == 3
            assert m[("adp_proxy_beta_tokens", frozenset())] == 100

    run(body())


def test_a_node_over_alpha_is_avoided_while_another_qualifies_then_category_3():
    async def body():
        # prefill0 has the fewest tokens but its node's read queue (both its instances) is over alpha
        pes = [("n0", {"unfinished_tokens": 0, "queue_tokens": 150}), ("n1", {"unfinished_tokens": 30})]
        des = [("n0", 0, {"queue_tokens": 100}, FREE)]
        async with Cluster(pes, des, alpha_tokens=200, policy="pe") as c:
            assert (await c.post())[0] == 200
            (decision,) = await c.decisions()
            assert decision["prefill"] == "prefill1"
            assert rules(decision, "pe-category-2") == [
                "pe-category-2 prefill1: node read queue 0 <= alpha 200, fewest tokens"
            ]
            assert rules(decision, "pe-alpha-avoided") == ["pe-alpha-avoided ['prefill0']: node read queue > alpha 200"]
            c.pe_sides[1].reply = status_reply("n1", "prefill", queue_tokens=900, unfinished_tokens=30)
            assert (await c.post())[0] == 200  # now no node qualifies: category 3, fewest tokens
            decision = (await c.decisions())[-1]
            assert decision["prefill"] == "prefill0" and rules(decision, "pe-category-3")

    run(body())


def test_a_de_without_free_blocks_is_never_chosen():
    async def body():
        des = [("n0", 0, {"unfinished_tokens": 0}, FULL), ("n1", 0, {"unfinished_tokens": 400}, FREE)]
        async with Cluster([("n0", {})], des) as c:
            for _ in range(3):
                assert (await c.post())[0] == 200
            decisions = await c.decisions()
            assert {d["decode"] for d in decisions} == {"decode1"}
            assert rules(decisions[0], "hbm-fit") == ["hbm-fit excluded ['decode0']: fewer than 1 free KV blocks"]
            assert rules(decisions[0], "z-high") or rules(decisions[0], "z-low")

    run(body())


def test_de_group_of_fewest_total_tokens_then_fewest_sequences_under_z():
    async def body():
        des = [
            ("n0", 0, {"unfinished_tokens": 300}, FREE),
            ("n1", 1, {"unfinished_tokens": 20}, FREE),
            ("n1", 1, {"unfinished_tokens": 10}, FREE),
        ]
        async with Cluster([("n0", {})], des) as c:
            assert (await c.post())[0] == 200
            (decision,) = await c.decisions()
            assert decision["decode"] in ("decode1", "decode2")
            assert rules(decision, "de-group")[0].startswith("de-group 1 of fewest total tokens")

    run(body())


def test_a_request_that_fits_nowhere_waits_then_proceeds_when_blocks_free():
    async def body():
        # one group: phase 1 commits a request to a group, phase 2 waits for a DE of it with room
        des = [("n0", 0, {}, FULL), ("n1", 0, {}, FULL)]
        async with Cluster([("n0", {})], des, timeout_s=10.0) as c:
            task = asyncio.create_task(c.post())
            await asyncio.sleep(0.8)
            assert not task.done() and c.pes[0].bodies == []
            assert (await c.metrics())[("adp_proxy_waiting_requests", frozenset())] == 1
            c.des[1].kv = (1000, 0.5)  # decode1 frees half its cache
            status, _ = await asyncio.wait_for(task, 5)
            assert status == 200
            (decision,) = await c.decisions()
            assert decision["decode"] == "decode1" and decision["waited_s"] >= 0.7

    run(body())


def test_a_request_that_fits_nowhere_fails_clearly_at_its_timeout():
    async def body():
        async with Cluster([("n0", {})], [("n0", 0, {}, FULL)], timeout_s=1.0) as c:
            start = time.monotonic()
            status, answer = await c.post(words=5, max_tokens=27)
            assert 1.0 <= time.monotonic() - start < 3.0
            assert status == 503 and answer["error"]["type"] == "ServiceUnavailableError"
            message = answer["error"]["message"]
            assert "waited 1.0 s for a DE with 2 free KV blocks" in message and "'decode0': 0" in message
            assert c.pes[0].bodies == [] and c.des[0].bodies == []
            # withdrawn: it no longer holds up a request that fits once the DE has room
            c.des[0].kv = FREE
            assert (await c.post())[0] == 200

    run(body())


def test_all_pes_over_beta_wait_and_fail_naming_beta():
    async def body():
        pes = [("n0", {"unfinished_tokens": 500}), ("n1", {"unfinished_tokens": 600})]
        async with Cluster(pes, [("n0", 0, {}, FREE)], beta_tokens=100, timeout_s=1.0) as c:
            status, answer = await c.post()
            assert status == 503
            assert "a PE with unfinished tokens <= beta 100" in answer["error"]["message"]
            assert "'prefill0': 500" in answer["error"]["message"]
            # the DE's blocks it held while waiting for a PE went back
            assert c.proxy.placer.ledger.blocks.get("decode0", 0) == 0

    run(body())


@pytest.mark.parametrize(("pe_queue", "de_queue", "path"), [(500, 0, "de"), (0, 500, "pe")])
def test_read_path_on_the_shorter_node_queue(pe_queue, de_queue, path):
    async def body():
        # each node's queue is the sum of its instances'
        pes = [("p", {"queue_tokens": pe_queue // 2}), ("p", {"queue_tokens": pe_queue // 2})]
        des = [("d", 0, {"queue_tokens": de_queue}, FREE), ("d", 0, {}, FREE)]
        async with Cluster(pes, des) as c:
            assert (await c.post())[0] == 200
            (decision,) = await c.decisions()
            assert (decision["path"], decision["rule"]) == (path, "shorter-queue")
            assert (decision["pe_queue_tokens"], decision["de_queue_tokens"]) == (pe_queue, de_queue)
            de = c.des[int(decision["decode"][-1])]
            assert de.bodies[0]["kv_transfer_params"]["dualpath"]["path"] == path

    run(body())


def test_round_robin_cycles_and_split_reaches_both_instances():
    async def body():
        pes = [("n0", {}), ("n1", {})]
        des = [("n0", 0, {}, FREE), ("n1", 0, {}, FREE), ("n1", 1, {}, FREE)]
        async with Cluster(pes, des, placement="round-robin", split=True) as c:
            for _ in range(6):
                assert (await c.post())[0] == 200
            pairs = [(d["prefill"], d["decode"]) for d in await c.decisions()]
            assert pairs == [(f"prefill{k % 2}", f"decode{k % 3}") for k in range(6)]
            params = c.des[0].bodies[0]["kv_transfer_params"]["dualpath"]
            assert params["split"] is True and params["peer"] == c.pe_sides[0].address
            assert c.pes[1].bodies[0]["kv_transfer_params"]["dualpath"]["peer"] == c.de_sides[1].address
            assert rules((await c.decisions())[0], "round-robin")

    run(body())


def test_compute_quota_holds_a_request_until_the_pe_prefill_in_flight_finishes():
    async def body():
        # beta 10 fits the attention model through (10 tokens, 5 s): 3 tokens take 0.27 s, two exceed 0.3 s
        async with Cluster([("n0", {"unfinished_tokens": 0})], [("n0", 0, {}, FREE)],
                           beta_tokens=10, compute_quota_s=0.3) as c:  # fmt: skip
            c.pes[0].prefill_delay_s = 0.6
            first = asyncio.create_task(c.post())
            await asyncio.sleep(0.2)
            start = time.monotonic()
            second = asyncio.create_task(c.post())
            await asyncio.sleep(0.1)
            assert len(c.pes[0].bodies) == 1  # held at the proxy
            assert [s for s, _ in await asyncio.gather(first, second)] == [200, 200]
            assert time.monotonic() - start >= 0.35
            held = rules((await c.decisions())[1], "compute-quota")
            assert held and held[0].startswith("compute-quota held")
            assert (await c.metrics())[("adp_proxy_quota_holds_total", frozenset())] == 1

    run(body())


def test_cluster_flags_file_and_errors(tmp_path):
    cluster = cluster_mod.cluster_from_flags(
        ["http://127.0.0.1:8100,node=a", "http://127.0.0.1:8101"],
        ["http://127.0.0.1:8200,node=a,group=2,kv=tcp://127.0.0.1:9999"],
    )
    assert [(i.name, i.node, i.kv, i.group) for i in cluster.instances] == [
        ("prefill0", "a", "tcp://127.0.0.1:8200", 0),
        ("prefill1", "pe1", "tcp://127.0.0.1:8201", 0),
        ("decode0", "a", "tcp://127.0.0.1:9999", 2),
    ]
    assert cluster.nodes == ("a", "pe1") and cluster.groups == (2,)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cluster_mod.cluster_to_dict(cluster)))
    assert cluster_mod.load_cluster(str(path)) == cluster
    with pytest.raises(ConfigError, match="option 'group=1' is not one of"):
        cluster_mod.parse_instance_flag("prefill", 0, "http://h:1,group=1")
    with pytest.raises(ConfigError, match="group='x'"):
        cluster_mod.parse_instance_flag("decode", 0, "http://h:1,group=x")
    with pytest.raises(ConfigError, match="at least one prefill and one decode"):
        cluster_mod.cluster_from_flags(["http://h:1"], [])
    with pytest.raises(ConfigError, match="appear more than once"):
        cluster_mod.cluster_from_flags(["http://h:1"], ["http://h:1"])
    path.write_text(json.dumps({"prefill": [{"url": "http://h:1", "gpu": 0}], "decode": []}))
    with pytest.raises(ConfigError, match=r"prefill\[0\]"):
        cluster_mod.load_cluster(str(path))


def test_kv_blocks_from_vllm_metrics_and_thresholds():
    text = (  # 65 blocks, 64 usable: vLLM keeps a null block
        'vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="65"} 1.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
    )
    blocks = parse_kv_blocks(text)
    assert (blocks.total, blocks.used, blocks.block_size) == (64, 16, 32)
    assert parse_kv_blocks('vllm:num_requests_running{engine="0"} 1\n') is None
    cluster = cluster_mod.cluster_from_flags(["http://h:1,node=a", "http://h:2,node=b"], ["http://h:3,node=b"])
    status = {"prefill0": {"snic_bytes_per_s": 1e6}, "prefill1": {"snic_bytes_per_s": 1e6},
              "decode0": {"snic_bytes_per_s": 3e6}}  # fmt: skip
    assert alpha_from_status(cluster, status, kv_bytes_per_token=1000) == 12000  # node b: 4 MB/s x 3 s / 1000 B
    assert alpha_from_status(cluster, {**status, "decode0": {"snic_bytes_per_s": 1e15}}, 1000) is None
    assert alpha_from_status(cluster, status, None) is None
    assert beta_from_warmup(256, 0.5) == 2560


def test_a_cancelled_wait_leaves_nothing_queued_or_counted():
    async def body():
        cluster = cluster_mod.cluster_from_flags(["http://h:1"], ["http://h:2"])
        kv = {"value": KvBlocks(4, 1.0, 16)}  # full

        async def status(instance):
            return status_reply(instance.node, instance.role, unfinished_tokens=0)

        async def kv_blocks(instance):
            return kv["value"]

        placer = Placer(cluster, status, kv_blocks, CollectorRegistry(), timeout_s=10.0, poll_s=0.05)
        waiting = asyncio.create_task(placer.place({"prompt": "a b c", "max_tokens": 4}))
        await asyncio.sleep(0.3)
        assert placer.scheduler.queued == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert placer.scheduler.queued == 0 and not placer._waiting
        kv["value"] = KvBlocks(4, 0.0, 16)  # room now: a later request is placed, nothing stale ahead of it
        placement = await asyncio.wait_for(placer.place({"prompt": "a", "max_tokens": 4}), 5)
        assert placement.de.name == "decode0" and placer.ledger.blocks["decode0"] == 1
        placer.release(placement)
        assert placer.ledger.blocks["decode0"] == 0 and placer.ledger.tokens["prefill0"] == 0

    run(body())


def test_read_queues_on_unequal_storage_nics_compare_by_time_to_drain():
    cluster = cluster_mod.cluster_from_flags(["http://h:1,node=slow", "http://h:2,node=fast"], ["http://h:3,node=fast"])
    status = {
        "prefill0": {"read_queue_tokens": 300, "snic_bytes_per_s": 1e6},  # 300 tokens at 1 MB/s
        "prefill1": {"read_queue_tokens": 500, "snic_bytes_per_s": 2e6},  # the fast node: 4 MB/s in all
        "decode0": {"read_queue_tokens": 100, "snic_bytes_per_s": 2e6},
    }
    ledger = Ledger(reads={"x": ("slow", 100)})  # sent there, no instance reported it yet
    queues = node_queues(cluster, Snapshot(status, {}), ledger)
    assert queues == {"slow": 1600, "fast": 600}  # (300 + 100) x 4: the slow node drains last
    status["decode0"] = {"read_queue_tokens": 100}  # a cap unknown: no scaling
    assert node_queues(cluster, Snapshot(status, {}), ledger) == {"slow": 400, "fast": 600}


def test_prompt_tokens_come_from_the_pes_tokenizer_else_from_words():
    """A PE's ``/tokenize`` (round robin over the PEs) counts the prompt placement uses, chat template options
    included; token ids are counted as they are; a PE that cannot tokenize leaves words, counted in a metric."""

    async def body():
        pes = [("n0", {}), ("n1", {})]
        async with Cluster(pes, [("n0", 0, {}, FREE)]) as c:
            for pe in c.pes:
                pe.tokens_per_word = 3
            assert (await c.post(words=5))[0] == 200
            assert (await c.post(words=5))[0] == 200
            assert [len(pe.tokenized) for pe in c.pes] == [1, 1]
            assert c.pes[0].tokenized[0] == {"model": "tiny", "prompt": "w w w w w"}
            chat = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "a b"}],
                "chat_template_kwargs": {"enable_thinking": False},
                "max_tokens": 2,
            }
            async with c.client.post("/v1/chat/completions", json=chat) as resp:
                assert resp.status == 200
            assert c.pes[0].tokenized[1] == {k: chat[k] for k in ("model", "messages", "chat_template_kwargs")}
            ids = {"model": "tiny", "prompt": list(range(9)), "max_tokens": 2}
            async with c.client.post("/v1/completions", json=ids) as resp:
                assert resp.status == 200
            for pe in c.pes:
                pe.tokens_per_word = None  # /tokenize answers 404
            assert (await c.post(words=5))[0] == 200
            decisions = await c.decisions()
            counted = [(d["prompt_tokens"], d["tokens_from"]) for d in decisions]
            assert counted == [(16, "tokenizer"), (16, "tokenizer"), (7, "tokenizer"), (9, "token ids"), (5, "words")]
            assert sum(len(pe.tokenized) for pe in c.pes) == 3  # the token ids were not sent
            m = await c.metrics()
            assert m[("adp_proxy_tokenize_fallbacks_total", frozenset())] == 1

    run(body())


def test_hits_are_the_leading_blocks_that_requests_answered_in_full_left_in_the_store():
    """With token ids, a prompt's storage hits (what its read counts) are its leading 16-token blocks that an earlier
    request, answered in full, left in the store; a failed request leaves nothing; without ids every token is a
    hit, as before."""

    async def body():
        async with Cluster([("n0", {})], [("n0", 0, {}, FREE)]) as c:
            c.pes[0].tokens_per_word = 3  # 40 words: 121 tokens, 7 full blocks

            async def post(words: str) -> dict:
                request = {"model": "tiny", "prompt": words, "max_tokens": 2}
                async with c.client.post("/v1/completions", json=request) as resp:
                    assert resp.status == 200
                return (await c.decisions())[-1]

            first = post_words = " ".join(["w"] * 40)
            hits = [(d["cached_tokens"], d["cached_from"]) for d in [await post(first), await post(first)]]
            assert hits == [(0, "prefixes"), (112, "prefixes")]
            longer = await post(post_words + " x" * 10)  # 151 tokens: its first 7 blocks are the stored ones
            assert (longer["prompt_tokens"], longer["cached_tokens"]) == (151, 112)
            assert (await post(" ".join(["v"] * 40)))["cached_tokens"] == 0  # another prompt from its first block
            c.des[0].mode = "error"
            async with c.client.post("/v1/completions", json={"model": "tiny", "prompt": "y " * 40}) as resp:
                assert resp.status == 400
            c.des[0].mode = "ok"
            assert (await post("y " * 40))["cached_tokens"] == 0  # the failed request stored nothing
            c.pes[0].tokens_per_word = None  # no /tokenize: words, every one taken as a hit
            assert [(d := await post(first))["cached_tokens"], d["cached_from"]] == [40, "assumed"]
            assert c.proxy.placer.ledger.reads == {}  # every read went back

    run(body())


def test_a_read_the_instance_reports_is_counted_once():
    """A read the PE's status names in ``reading`` is in its reported queue: the next placement sees it once, not
    once there and once more in the proxy's own estimate; once the read ended (no queue, no longer named) it is
    gone although the PE has not answered yet, while a read no status named yet still counts."""

    async def body():
        async with Cluster([("n0", {"unfinished_tokens": 0})], [("n1", 0, {}, FREE)], policy="pe") as c:
            c.pes[0].prefill_delay_s = 1.0  # every prefill stays unfinished until the three requests are placed

            async def sent(words: int) -> asyncio.Task:  # the request, once the PE has it (its placement is made)
                task = asyncio.create_task(c.post(words=words))  # every word taken as a hit
                deadline, count = time.monotonic() + 5, len(c.pes[0].bodies)
                while len(c.pes[0].bodies) == count:
                    assert time.monotonic() < deadline, "the PE never got the request"
                    await asyncio.sleep(0.01)
                return task

            tasks = [await sent(50)]
            xfer_id = c.pes[0].bodies[0]["kv_transfer_params"]["dualpath"]["xfer_id"]
            c.pe_sides[0].reply = status_reply("n0", "prefill", queue_tokens=50, unfinished_tokens=0, reading=[xfer_id])
            tasks.append(await sent(2))
            c.pe_sides[0].reply = status_reply("n0", "prefill", unfinished_tokens=0, reading=[])  # read, not answered
            tasks.append(await sent(3))
            assert [status for status, _ in await asyncio.gather(*tasks)] == [200] * 3
            queues = [d["pe_queue_tokens"] for d in await c.decisions()]
            assert queues == [0, 50, 2]  # counted twice, it was [0, 100, 52]

    run(body())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 300), st.sampled_from(["unseen", "queued", "read"])), max_size=6))
def test_a_node_queue_counts_each_read_once(reads):
    """Reads placed on node ``a``, each unseen by any status, reported ``reading`` (in the queue the status
    reports), or reported once and read since: the node's queue is the reported queue plus the unseen reads, and
    the proxy's estimate of a read never comes back once an instance reported it."""

    async def body():
        cluster = cluster_mod.cluster_from_flags(["http://h:1,node=a"], ["http://h:2,node=b"])
        live = {"reading": [], "queue": 0}

        async def status(instance):
            if instance.role == "decode":
                return status_reply(instance.node, "decode", unfinished_tokens=0)
            reply = status_reply("a", "prefill", queue_tokens=live["queue"], unfinished_tokens=0)
            return {**reply, "reading": live["reading"]}

        async def kv_blocks(instance):
            return None

        placer = Placer(cluster, status, kv_blocks, CollectorRegistry(), placement="round-robin", read_path="pe")
        placed = [await placer.place({"prompt": "w " * hits, "max_tokens": 1}) for hits, _ in reads]
        seen = [(p, hits, state) for p, (hits, state) in zip(placed, reads, strict=True) if state != "unseen"]
        live["reading"] = [p.xfer_id for p, _, _ in seen]  # every reported read queued at first
        live["queue"] = sum(hits for _, hits, _ in seen)
        await placer.snapshot(with_kv=False)
        live["reading"] = [p.xfer_id for p, _, state in seen if state == "queued"]  # then the "read" ones ended
        live["queue"] = sum(hits for _, hits, state in seen if state == "queued")
        snap = await placer.snapshot(with_kv=False)
        unseen = sum(hits for hits, state in reads if state == "unseen")
        assert node_queues(cluster, snap, placer.ledger)["a"] == live["queue"] + unseen
        for placement in placed:
            placer.prefill_done(placement)
        assert node_queues(cluster, snap, placer.ledger) == {"a": live["queue"], "b": 0}
        assert placer.ledger.reads == {}

    run(body())


def test_data_parallel_engines_of_one_server_are_placed_on_as_instances(tmp_path):
    cluster = cluster_mod.cluster_from_flags(
        ["http://127.0.0.1:8100"], ["http://127.0.0.1:8200,dp=2,tp=2,node=n", "http://127.0.0.1:8300"]
    )
    assert [(i.name, i.kv, i.node, i.dp_rank, i.headers) for i in cluster.decode] == [
        ("decode0.dp0", "tcp://127.0.0.1:8300", "n", 0, {"X-data-parallel-rank": "0"}),
        ("decode0.dp1", "tcp://127.0.0.1:8302", "n", 1, {"X-data-parallel-rank": "1"}),  # base + k x tp
        ("decode1", "tcp://127.0.0.1:8400", "de1", None, {}),
    ]
    assert [i.name for i in cluster.servers] == ["prefill0", "decode0.dp0", "decode1"]
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cluster_mod.cluster_to_dict(cluster)))
    assert cluster_mod.load_cluster(str(path)) == cluster
    for bad, match in (("dp=0", "dp='0' must be an int >= 1"), ("tp=x", "tp='x' must be an int >= 1")):
        with pytest.raises(ConfigError, match=match):
            cluster_mod.parse_instance_flag("decode", 0, f"http://h:1,{bad}")
    with pytest.raises(ConfigError, match=r"side channel\(s\) \['tcp://h:102'\] are given to more than one"):
        cluster_mod.cluster_from_flags(["http://h:1"], ["http://h:2,dp=2", "http://h:3,kv=tcp://h:102"])
    text = "".join(
        f'vllm:cache_config_info{{block_size="16",engine="{k}",num_gpu_blocks="{101 + 100 * k}"}} 1.0\n'
        f'vllm:kv_cache_usage_perc{{engine="{k}",model_name="m"}} {0.5 * k}\n'
        for k in range(2)
    )
    assert parse_kv_blocks(text, 1) == KvBlocks(200, 0.5, 16)
    assert parse_kv_blocks(text, 0) == KvBlocks(100, 0.0, 16)
    assert parse_kv_blocks(text, 2) is None


def test_the_proxy_sends_each_data_parallel_engine_its_rank_and_names_its_side_channel():
    async def body():
        pe, de = FakeInstance("prefill0"), FakeInstance("decode0")
        base = free_ports(2)
        pe_side = FakeSideChannel(status_reply("n0", "prefill"))
        de_sides = [FakeSideChannel(status_reply("n1", "decode"), port=base + k) for k in range(2)]
        servers = [TestServer(pe.app()), TestServer(de.app())]
        for server in servers:
            await server.start_server()
        spec = {
            "prefill": [{"url": str(servers[0].make_url("")), "kv": pe_side.address}],
            "decode": [{"url": str(servers[1].make_url("")), "kv": f"tcp://127.0.0.1:{base}", "dp": 2}],
        }
        cfg = ProxyConfig(cluster=cluster_mod.cluster_from_dict(spec), status_timeout_s=0.3, placement="round-robin")
        proxy = DualPathProxy(cfg)
        proxy_server = TestServer(proxy.make_app())
        await proxy_server.start_server()
        try:
            async with aiohttp.ClientSession(base_url=str(proxy_server.make_url(""))) as client:
                for _ in range(4):
                    request = {"model": "tiny", "prompt": "w w w", "max_tokens": 4}
                    async with client.post("/v1/completions", json=request) as resp:
                        assert resp.status == 200
                async with client.get("/health") as resp:
                    assert resp.status == 200 and set(await resp.json()) == {"prefill0", "decode0.dp0"}
            assert de.dp_ranks == ["0", "1", "0", "1"] and pe.dp_ranks == [None] * 4
            peers = [b["kv_transfer_params"]["dualpath"]["peer"] for b in pe.bodies]
            assert peers == [de_sides[k % 2].address for k in range(4)]
            assert all(side.queries > 0 for side in de_sides)  # each engine's own read queue is asked
        finally:
            await proxy_server.close()
            for server in servers:
                await server.close()
            for side in (pe_side, *de_sides):
                side.close()

    run(body())
