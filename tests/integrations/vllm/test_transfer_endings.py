"""Every transfer ends with nothing held: whatever way a request ends, the DE's plan, lease and counters go back.

vLLM gives every engine request of one HTTP request (a prompt list, ``n > 1``) the same ``kv_transfer_params``; a
prompt ending inside the first block takes nothing from its PE; a request the DE refuses never reaches its
connector while the PE's copy was planned. Worker harness, no vLLM.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.side_channel import PeerClient
from ascend_dualpath.errors import BoundsError, ProtocolError
from ascend_dualpath.kv.layout import KVLayout
from tests.integrations.vllm.worker_harness import (
    BLOCK,
    LAYERS,
    LAYOUT,
    Deployment,
    assert_caches_equal,
    expected_de_caches,
)

# a deployment is expensive to start, so the hypothesis examples share one
_SHARED = settings(max_examples=12, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    deployment = Deployment(tmp_path_factory.mktemp("endings"), 1, 1)
    yield deployment
    deployment.close()


def _held(d: Deployment, name: str) -> tuple[int, int, int]:
    """``(unfinished_requests, unfinished_tokens, live host leases)`` of one instance once its quarantine swept."""
    worker = d.instances[name].worker
    worker.quarantine.sweep()
    status = worker.status()
    return status.unfinished_requests, status.unfinished_tokens, status.host_leases


def _until_nothing_held(d: Deployment, name: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (held := _held(d, name)) != (0, 0, 0):
        assert time.monotonic() < deadline, f"{name} still holds (requests, tokens, leases) = {held}"
        time.sleep(0.02)


def test_two_requests_on_one_transfer_id_never_share_rows(deploy):
    """The reported crash: a prompt list's two engine requests carry one transfer id. The second plan is refused
    on the PE before anything moves, the second receive is refused on the DE, the first request is bit-exact and
    the second's DE blocks keep their poison; nothing stays held."""
    d = deploy(1, 1)
    rows_a, rows_b = Deployment.true_rows(1, 3 * BLOCK + 2), Deployment.true_rows(2, 5 * BLOCK + 1)
    pe_a, de_a = d.request("pe0", "de0", rows_a, 2, "pe")
    pe_b, de_b = d.request("pe0", "de0", rows_b, 3, "de")
    pe_b = dataclasses.replace(pe_b, xfer=pe_a.xfer)
    de_b = dataclasses.replace(de_b, xfer=de_a.xfer)
    d.expect_recv("de0", de_a)
    d.expect_recv("de0", de_b)
    assert d.prefill("pe0", pe_a) == set()
    bad_b = d.prefill("pe0", pe_b, check_layers=False)
    assert bad_b == set(pe_b.block_ids[:3])  # its plan was refused: vLLM recomputes its hit blocks
    _, failed = d.finish("de0", {de_a.req_id, de_b.req_id})
    assert failed == {de_b.req_id}
    assert_caches_equal(d.instances["de0"].caches, expected_de_caches([(de_a, rows_a)]))
    d.done("pe0", pe_a)
    d.done("pe0", pe_b)
    _until_nothing_held(d, "de0")
    _until_nothing_held(d, "pe0")


def test_a_second_plan_of_a_transfer_id_is_refused_and_the_first_lease_kept(deploy):
    d = deploy(1, 1)
    de = d.instances["de0"].worker.decode
    de_rows = Deployment.true_rows(3, 2 * BLOCK + 3)
    pe_req, de_req = d.request("pe0", "de0", de_rows, 0, "pe")
    d.expect_recv("de0", de_req)
    d.prefill("pe0", pe_req)
    d.finish("de0", {de_req.req_id})
    plan = m.Plan(pe=d.instances["pe0"].address, xfer_id="dup", path="pe", hit_tokens=0, prompt_tokens=5,
                  load_start=0, store_ids=[])  # fmt: skip
    de._on_plan(plan)
    lease = de._xfers["dup"].lease
    with pytest.raises(Exception, match="'dup'.*already planned"):
        de._on_plan(msgspec.structs.replace(plan, prompt_tokens=9))
    assert de._xfers["dup"].lease is lease and de._xfers["dup"].plan.prompt_tokens == 5


@_SHARED
@given(prompt=st.integers(1, 3 * BLOCK + 1), path=st.sampled_from(["pe", "de"]), hit_blocks=st.integers(0, 2))
def test_every_prompt_length_leaves_nothing_held(pair, prompt, path, hit_blocks):
    """Around the block boundaries: a prompt ending inside the first block takes nothing from the PE (vLLM waits
    for no receive), longer ones a receive; either way the DE's plan, lease and unfinished counts go back."""
    hit_blocks = min(hit_blocks, (prompt - 1) // BLOCK)
    rows = Deployment.true_rows(prompt * 7 + hit_blocks, prompt)
    pe_req, de_req = pair.request("pe0", "de0", rows, hit_blocks, path)
    assert de_req.report == (prompt > BLOCK)
    pair.expect_recv("de0", de_req)
    assert pair.prefill("pe0", pe_req) == set()
    if de_req.report:
        assert pair.finish("de0", {de_req.req_id})[1] == set()
    else:
        pair.drain("de0", de_req)
    pair.done("pe0", pe_req)
    _until_nothing_held(pair, "de0")
    _until_nothing_held(pair, "pe0")


def test_a_plan_no_request_takes_expires_and_gives_its_lease_back(deploy):
    """The DE refused the request (vLLM answered 400, say) while the PE's copy was valid: the PE plans and sends
    its rows, no receive ever comes. The plan expires after the timeout, also on an idle DE (``status`` sweeps)."""
    d = deploy(1, 1)
    de = d.instances["de0"].worker
    de.decode.settings = dataclasses.replace(de.decode.settings, timeout_s=0.3)
    pe_req, _ = d.request("pe0", "de0", Deployment.true_rows(4, 4 * BLOCK + 1), 2, "pe")
    assert d.prefill("pe0", pe_req) == set()
    d.done("pe0", pe_req)
    assert _held(d, "de0")[0] == 1
    _until_nothing_held(d, "de0")
    assert de.counters.expired_plans == 1


def test_a_pe_of_another_protocol_version_is_refused_at_hello_naming_both(deploy):
    d = deploy(1, 1)
    pe, de = d.instances["pe0"].worker, d.instances["de0"]
    compat = pe.dataplane.compat(LAYOUT)
    speaks = m.Speaks(m.PROTOCOL_VERSION + 1, compat, compat.digest)
    hello = m.Hello(pe=pe.side.address, device_id=0, rank_info=b"", host_mem=(0, 0, 0), speaks=speaks)
    client = PeerClient(de.address, 5.0)
    try:
        versions = rf"version {m.PROTOCOL_VERSION} at DE de0, {m.PROTOCOL_VERSION + 1} at PE"
        with pytest.raises(ProtocolError, match=versions):
            client.request(hello)
    finally:
        client.close()
    assert not de.worker.dataplane.links  # refused before any link was made


def test_a_pe_with_another_kv_layout_is_refused_at_hello_naming_both_digests(deploy, monkeypatch):
    d = deploy(1, 1)
    pe, de = d.instances["pe0"].worker, d.instances["de0"]
    mine, theirs = (
        pe.dataplane.compat(LAYOUT),
        m.Compat.of(KVLayout(LAYOUT.kind, LAYERS + 1, LAYOUT.fields, LAYOUT.block_tokens), "emulator"),
    )
    monkeypatch.setattr(pe.dataplane, "compat", lambda layout: theirs)
    facts = rf"digest {mine.digest} at DE de0, {theirs.digest} at PE .*num_layers {LAYERS} here, {LAYERS + 1} there"
    with pytest.raises(ProtocolError, match=facts):
        pe.prefill.connect_peer(de.address)
    assert not pe.prefill._peers and not de.worker.dataplane.links


def test_the_pe_says_its_writes_ended_only_once_the_request_that_planned_them_is_over(deploy):
    """A DE gives a quarantined lease back on the PE's word; while the PE's request lives, a later chunk of its
    prefill would write into the lease again, so the word is no until vLLM reports the request finished."""
    d = deploy(1, 1)
    pe = d.instances["pe0"].worker
    pe_req, de_req = d.request("pe0", "de0", Deployment.true_rows(5, 3 * BLOCK + 1), 0, "pe")
    d.expect_recv("de0", de_req)
    d.prefill("pe0", pe_req)
    asked = m.WritesEnded(xfer_id=pe_req.xfer.xfer_id)
    assert not pe.prefill._writes_pending(pe_req.xfer.xfer_id)  # every write of this step ended ...
    assert pe.prefill.on_writes_ended(asked) == m.Ended(ended=False)  # ... but the request may write again
    d.done("pe0", pe_req)
    assert pe.prefill.on_writes_ended(asked) == m.Ended(ended=True)
    d.finish("de0", {de_req.req_id})


def test_a_receive_vllm_waits_for_nothing_ends_on_status_without_a_step(deploy):
    """A prompt inside the first block: vLLM computes it on the DE and waits for no receive, and may end the request
    (a grammar error, an abort) before the PE's rows arrive; with no request left it runs no step, so ``status``
    (the proxy asks it every few seconds) lets go of the receive, its plan and its lease."""
    d = deploy(1, 1)
    de = d.instances["de0"].worker
    pe_req, de_req = d.request("pe0", "de0", Deployment.true_rows(9, BLOCK - 1), 0, "pe")
    assert not de_req.report
    d.expect_recv("de0", de_req)
    assert d.prefill("pe0", pe_req) == set()
    d.done("pe0", pe_req)
    deadline = time.monotonic() + 10  # no step on the DE from here on: only status
    while (status := de.status()).unfinished_requests or status.host_leases:
        assert time.monotonic() < deadline, f"still held without a step: {status}"
        time.sleep(0.05)
    assert de_req.xfer.xfer_id not in de.decode._recvs
    _, recving, failed = de.get_finished(set())
    assert de_req.req_id not in recving | failed  # vLLM waited for nothing: nothing is reported


def test_steps_and_status_ending_receives_together_never_collide(deploy):
    """The engine's steps and the side channel's ``status`` both end receives vLLM waits for nothing from; run
    together on many of them, neither raises and nothing stays held."""
    d = deploy(1, 1)
    de = d.instances["de0"].worker
    stop, errors = threading.Event(), []

    def poll_status() -> None:
        while not stop.is_set():
            try:
                de.status()
            except Exception as error:  # noqa: BLE001 - collected for the assertion below
                errors.append(error)

    poller = threading.Thread(target=poll_status, daemon=True)
    poller.start()
    try:
        for i in range(12):
            pe_req, de_req = d.request("pe0", "de0", Deployment.true_rows(i, 1 + i % (BLOCK - 1)), 0, "pe")
            d.expect_recv("de0", de_req)
            assert d.prefill("pe0", pe_req) == set()
            d.drain("de0", de_req)  # the engine's steps, while status settles the same receives
            d.done("pe0", pe_req)
    finally:
        stop.set()
        poller.join(10)
    assert errors == []
    _until_nothing_held(d, "de0")


def _connected(d: Deployment):
    """The DE half of a 1P1D deployment whose PE said hello (one request served), and the PE's window."""
    de = d.instances["de0"].worker.decode
    rows = Deployment.true_rows(5, 2 * BLOCK + 3)
    pe_req, de_req = d.request("pe0", "de0", rows, 0, "pe")
    d.expect_recv("de0", de_req)
    d.prefill("pe0", pe_req)
    d.finish("de0", {de_req.req_id})
    d.done("pe0", pe_req)
    link = d.instances["pe0"].worker.prefill._peers[d.instances["de0"].address].link
    return de, link.window.base_addr


def _de_plan(d: Deployment, window: int, **overrides) -> m.Plan:
    """A DE-path plan of 2 hit blocks and 3 new tokens (its start names slots in the PE's ``window``)."""
    fields = dict(pe=d.instances["pe0"].address, xfer_id="bad", path="de", hit_tokens=2 * BLOCK,
                  prompt_tokens=2 * BLOCK + 3, load_start=0, store_ids=[bytes(16)] * 2,
                  notify_base=0, magics=[7] * LAYERS, abort_magic=9, ready_magic=11)  # fmt: skip
    return m.Plan(**{**fields, **overrides})


BAD_PLANS = {
    "path": (dict(path="xx"), "path must be"),
    "no prompt": (dict(prompt_tokens=0, hit_tokens=0, store_ids=[]), "prompt_tokens 0"),
    "hit past prompt": (dict(prompt_tokens=BLOCK), "hit_tokens"),
    "hit off blocks": (dict(hit_tokens=BLOCK + 1), "multiples"),
    "load after hit": (dict(load_start=3 * BLOCK), "load_start"),
    "store ids": (dict(store_ids=[bytes(16)]), "store ids"),
    "store id bytes": (dict(store_ids=[bytes(16), bytes(3)]), "store ids"),
    "pe share": (dict(pe_blocks=3), "pe_blocks 3"),
    "notify group": (dict(notify_base=1 << 20), "notify_base"),
    "magics": (dict(magics=[7]), "notify value"),
    "zero magic": (dict(abort_magic=0), "notify value"),
    "zero ready magic": (dict(ready_magic=0), "notify value"),
}
BAD_STARTS = {
    "one slot": ([0], "two slots"),
    "slot outside the window": ([1 << 40, 1 << 40], "inside the PE's window"),
}


@pytest.mark.parametrize("case", list(BAD_PLANS))
def test_a_plan_that_does_not_describe_one_request_is_refused_before_anything_is_leased(deploy, case):
    """Whatever a plan says, the DE leases and reads nothing for numbers outside one request of its layout, and
    pushes only into two slots inside the PE's window; the error names the field and the limit."""
    d = deploy(1, 1)
    de, window = _connected(d)
    overrides, match = BAD_PLANS[case]
    leases = de.dataplane.host.stats().live_leases
    with pytest.raises(BoundsError, match=match):
        de._on_plan(_de_plan(d, window, **overrides))
    assert "bad" not in de._xfers and de.dataplane.host.stats().live_leases == leases
    de._on_plan(_de_plan(d, window, xfer_id="good"))  # the same plan with sound numbers is taken
    assert "good" in de._xfers


@pytest.mark.parametrize("case", list(BAD_STARTS))
def test_a_start_naming_slots_outside_the_pes_window_is_refused_and_nothing_is_pushed(deploy, case):
    """The DE pushes only into two slots inside the PE's window, whatever a start names; a refused start leaves the
    plan waiting for a sound one, and a second start is refused."""
    d = deploy(1, 1)
    de, window = _connected(d)
    de._on_plan(_de_plan(d, window, xfer_id="s"))
    slots, match = BAD_STARTS[case]
    with pytest.raises(BoundsError, match=match):
        de._on_start(m.Start(xfer_id="s", slots=slots))
    xfer = de._xfers["s"]
    assert not xfer.started.is_set() and xfer.slots == [] and xfer.pushes == []
    de._on_start(m.Start(xfer_id="s", slots=[window, window + 4096]))
    assert xfer.started.is_set() and xfer.slots == [window, window + 4096]
    with pytest.raises(ProtocolError, match="started already"):
        de._on_start(m.Start(xfer_id="s", slots=[window, window + 4096]))
    with pytest.raises(ProtocolError, match="no plan here"):
        de._on_start(m.Start(xfer_id="nobody", slots=[]))


def test_rows_and_consumed_layers_outside_the_request_are_refused(deploy):
    d = deploy(1, 1)
    de, window = _connected(d)
    de._on_plan(_de_plan(d, window, xfer_id="x"))
    with pytest.raises(BoundsError, match=rf"rows \[0, 99\).*has {2 * BLOCK + 3} tokens"):
        de._on_rows(m.Rows(xfer_id="x", start=0, end=99))
    with pytest.raises(BoundsError, match=rf"consumed layer {LAYERS} .*layers are \[0, {LAYERS}\)"):
        de._on_consumed(m.Consumed(xfer_id="x", layer=LAYERS))
    assert de._xfers["x"].received_end == 2 * BLOCK and de._xfers["x"].error is None


def test_a_lease_outside_the_des_host_region_is_refused_before_the_pe_writes(deploy, monkeypatch):
    """The PE writes only into the DE's registered host region: a plan reply naming memory outside it fails the load
    (vLLM recomputes its blocks) before a byte moves."""
    d = deploy(1, 1)
    de, _ = _connected(d)
    on_plan = de._on_plan
    monkeypatch.setattr(de, "_on_plan", lambda plan: m.Planned(lease_addr=on_plan(plan).lease_addr + (1 << 40)))
    rows = Deployment.true_rows(6, 3 * BLOCK + 2)
    pe_req, de_req = d.request("pe0", "de0", rows, 2, "pe")
    d.expect_recv("de0", de_req)
    link = d.instances["pe0"].worker.prefill._peers[d.instances["de0"].address].link
    with pytest.raises(BoundsError, match="outside its host region"):
        link.check_peer_lease(link.peer_host[0] + link.peer_host[1] - 10, 11, "probe")
    assert link.check_peer_lease(link.peer_host[0], 11, "probe") == link.peer_host[0]
    assert d.prefill("pe0", pe_req, check_layers=False) == set(pe_req.block_ids[:2])  # recomputed instead
