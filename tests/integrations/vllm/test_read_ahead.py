"""The read before the batch: a PE's storage reads (and its DE's) run ahead of the step that takes the request.

Real PE and DE worker halves (:mod:`tests.integrations.vllm.worker_harness`, no vLLM): a step that reads ahead
starts the reads of every path at once without waiting for them; the worker reports each read ahead once it ended
(``build_worker_meta``) with the good prefix; the step that takes the request then loads its layers from host
memory, never waiting on storage; what a read ahead holds goes back when its request ends before a step took it.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from ascend_dualpath.integrations.vllm.metadata import DualPathMetadata
from ascend_dualpath.kv.store import HEADER_BYTES
from tests.integrations.vllm.worker_harness import (
    BLOCK,
    LAYOUT,
    Deployment,
    assert_caches_equal,
    expected_de_caches,
)

SLOW_BLOCK_S = 0.25  # each block read holds its destination this long (slow media behind the storage NIC)
LAYER_WAIT_LIMIT_S = 0.05


def _slow_reads(d: Deployment, seconds: float) -> None:
    for inst in d.instances.values():
        inst.worker.store.faults.delay_reads(seconds)


def _idle(d: Deployment) -> None:
    """Nothing of any request is left: no lease, no quarantine, no read queued, no plan or push on the DE."""
    for name, inst in d.instances.items():
        w = inst.worker
        deadline = time.monotonic() + 10
        while w.read_queue.stats().requests or w.dataplane.host.stats().live_leases:
            assert time.monotonic() < deadline, f"{name} still holds {w.dataplane.host.stats()}"
            w.decode.complete_recvs()
            time.sleep(0.02)
        assert w.quarantine.held_bytes == 0 and w.counters.quarantined_leases == w.counters.quarantined_slots == 0
        assert not w.prefill.pending_prefetches() and not w.decode._xfers and not w.decode._pushing


def _take(d: Deployment, requests: list, hits: dict[str, int] | None = None) -> None:
    """Each request's step on the PE (taking ``hits[req_id]`` tokens of its hit, default all) with no block reported
    bad, every receive on the DE ended well, the DE's caches exact, nothing left anywhere."""
    for pe_req, de_req in requests:
        d.expect_recv("de0", de_req)
        assert d.prefill("pe0", pe_req, hit_tokens=(hits or {}).get(pe_req.req_id)) == set()
        d.done("pe0", pe_req)
    assert d.finish("de0", {de_req.req_id for _, de_req in requests})[1] == set()
    written = [(de_req, pe_req.rows) for pe_req, de_req in requests]
    assert_caches_equal(d.instances["de0"].caches, expected_de_caches(written))
    _idle(d)


@pytest.fixture
def store_faults(monkeypatch):
    """Every store a Deployment opens gets a FaultInjector (``store.faults``)."""
    from ascend_dualpath.kv import store as store_module
    from ascend_dualpath.kv.faults import FaultInjector

    original = store_module.LocalBlockStore.__init__

    def init(self, *args, **kwargs):
        kwargs.setdefault("faults", FaultInjector())
        original(self, *args, **kwargs)

    monkeypatch.setattr(store_module.LocalBlockStore, "__init__", init)


def test_a_step_starts_the_reads_of_every_path_without_waiting_and_the_next_steps_load_from_memory(
    deploy, store_faults
):
    """PE, DE and split reads ahead start in one step that returns at once; both storage NICs read; once the
    worker reports them, their steps load every layer from host memory within 50 ms and the DE's caches are exact."""
    d = deploy(1, 1)
    _slow_reads(d, SLOW_BLOCK_S)
    pe, de = d.instances["pe0"].worker, d.instances["de0"].worker
    requests = [  # the split first: it sizes its shares on both NICs' backlogs, empty then, so both read
        d.request("pe0", "de0", Deployment.true_rows(3, 8 * BLOCK + 2), 8, "de", split=True),
        d.request("pe0", "de0", Deployment.true_rows(1, 6 * BLOCK + 3), 6, "pe"),
        d.request("pe0", "de0", Deployment.true_rows(2, 6 * BLOCK + 1), 6, "de"),
    ]
    took = d.read_ahead("pe0", [pe_req for pe_req, _ in requests])
    assert took < SLOW_BLOCK_S, f"the step waited {took:.3f} s for reads"
    xfers = {pe_req.xfer.xfer_id for pe_req, _ in requests}
    assert {requests[0][0].xfer.xfer_id, requests[1][0].xfer.xfer_id} <= set(pe.status().reading)
    assert {requests[0][0].xfer.xfer_id, requests[2][0].xfer.xfer_id} <= set(de.status().reading)
    assert pe.counters.split_blocks_pe > 0 and pe.counters.split_blocks_de > 0
    assert d.await_ready("pe0", {r.req_id for r, _ in requests}) == {r.req_id: r.hit_tokens for r, _ in requests}
    assert not xfers & set(pe.status().reading) and not xfers & set(de.status().reading)
    _take(d, requests)
    assert max(d.layer_waits) < LAYER_WAIT_LIMIT_S, f"a layer waited {max(d.layer_waits):.3f} s"


@pytest.mark.parametrize(("path", "bad_block"), [("pe", 2), ("de", 1), ("de", 4)])
def test_a_corrupt_block_makes_the_good_prefix_shorter_and_the_rest_is_computed(deploy, path, bad_block):
    """A corrupt block read ahead (by the PE, or by the DE whose half the PE then reads itself) leaves the store; the
    worker reports the prefix before it, the step takes that much, and the DE receives every row exact."""
    d = deploy(1, 1)
    pe = d.instances["pe0"].worker
    rows = Deployment.true_rows(10 + bad_block, 5 * BLOCK + 2)
    pe_req, de_req = d.request("pe0", "de0", rows, 5, path)
    path_of = d.store.path_of(pe_req.store_ids[bad_block])
    with open(path_of, "r+b") as f:
        f.seek(HEADER_BYTES + 3)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    d.read_ahead("pe0", [pe_req])
    ready = d.await_ready("pe0", {pe_req.req_id})
    assert ready == {pe_req.req_id: bad_block * BLOCK}
    assert not path_of.exists()
    _take(d, [(pe_req, de_req)], ready)  # the rest computed, nothing for vLLM to recompute
    assert pe.counters.checksum_errors + d.instances["de0"].worker.counters.checksum_errors == 1


@pytest.mark.parametrize("path", ["pe", "de", "split"])
def test_a_request_ended_while_reading_ahead_releases_everything(deploy, store_faults, path):
    """The request ends (aborted) while its reads are queued: queued reads are cancelled, the DE lets go of its
    plan, every lease goes back once its reads ended; nothing is quarantined, no window slot or notify group kept."""
    d = deploy(1, 1)
    _slow_reads(d, SLOW_BLOCK_S)
    pe = d.instances["pe0"].worker
    link = pe.prefill.connect_peer(d.instances["de0"].address).link
    groups = len(link._notify_free)
    rows = Deployment.true_rows(20, 8 * BLOCK + 1)
    pe_req, _ = d.request("pe0", "de0", rows, 8, "pe" if path == "pe" else "de", split=path == "split")
    d.read_ahead("pe0", [pe_req])
    load = pe.prefill._prefetched[pe_req.req_id]
    plan, base = d.instances["de0"].worker.decode._xfers[pe_req.xfer.xfer_id], load.notify_base
    started = time.monotonic()
    pe.get_finished({pe_req.req_id})  # vLLM's finished_req_ids of the abort
    assert time.monotonic() - started < 8 * SLOW_BLOCK_S, "ending the request waited for its queued reads"
    assert pe.build_worker_meta() is None  # never reported ready
    _idle(d)
    assert len(link._notify_free) == groups and link.window.in_use_bytes == 0
    assert (base < 0) == (path == "pe")  # the DE signals only a half it reads itself
    if base >= 0:  # the freed notify group is the next request's: no signal of this plan may land there
        assert plan.quiet.wait(10), "the DE's pusher of the aborted plan did not end"
        signals = {load.abort_magic, load.ready_magic, *load.magics}
        assert not signals & {link.comm.notify_value(slot) for slot in range(base, base + 3)}


@pytest.mark.parametrize(("full", "path"), [("pe0", "pe"), ("de0", "de")])
def test_a_full_host_buffer_defers_a_read_ahead_without_blocking_the_step(deploy, full, path):
    """No room in the PE's host buffer (PE path), or in the DE's (its answer to a deferrable plan says so at once):
    the step returns at once and the read ahead waits, nothing read and nothing planned; once room is back a later
    step starts it and it completes."""
    d = deploy(1, 1)
    pe, de = d.instances["pe0"].worker, d.instances["de0"].worker
    host = d.instances[full].worker.dataplane.host
    probe = host.allocate("probe", host.capacity_bytes - LAYOUT.full_block_bytes, timeout_s=0)
    pe_req, de_req = d.request("pe0", "de0", Deployment.true_rows(30, 4 * BLOCK + 1), 4, path)
    assert d.read_ahead("pe0", [pe_req]) < 0.5 * pe.settings.timeout_s
    assert pe.build_worker_meta() is None and pe.prefill.pending_prefetches() == 1
    assert pe.read_queue.stats().completed_requests == de.read_queue.stats().completed_requests == 0
    assert not de.decode._xfers
    probe.release()
    assert d.await_ready("pe0", {pe_req.req_id}) == {pe_req.req_id: 4 * BLOCK}
    _take(d, [(pe_req, de_req)])


def test_reads_ahead_beyond_the_cap_wait_for_earlier_ones_to_be_taken(deploy):
    """``prefetch_max_mb`` caps what reads ahead hold at once: a second read ahead waits until the first is taken."""
    d = deploy(1, 1)
    pe = d.instances["pe0"].worker
    blocks = 4  # one read ahead fills the cap
    pe.prefill.settings = dataclasses.replace(
        pe.prefill.settings, prefetch_max_mb=blocks * LAYOUT.full_block_bytes / 2**20
    )
    first = d.request("pe0", "de0", Deployment.true_rows(40, blocks * BLOCK + 1), blocks, "pe")
    second = d.request("pe0", "de0", Deployment.true_rows(41, 2 * BLOCK + 1), 2, "pe")
    d.read_ahead("pe0", [first[0], second[0]])
    assert d.await_ready("pe0", {first[0].req_id}) == {first[0].req_id: blocks * BLOCK}
    assert pe.prefill.pending_prefetches() == 2 and pe.build_worker_meta() is None  # the second still waits
    for pe_req, de_req in (first, second):
        d.expect_recv("de0", de_req)
        assert d.prefill("pe0", pe_req) == set()
        d.done("pe0", pe_req)
        if pe_req is first[0]:
            assert d.await_ready("pe0", {second[0].req_id}) == {second[0].req_id: 2 * BLOCK}
    assert d.finish("de0", {first[1].req_id, second[1].req_id})[1] == set()
    _idle(d)


def test_a_read_ahead_arriving_later_reads_on_the_other_nic_at_once(deploy):
    """An engine loop on its own thread: a request on the PE path arrives, another on the DE path 0.1 s later. The
    second starts reading through the DE's storage NIC within 0.3 s although the first reads for about 1 s, and no
    step's layer waits more than 50 ms."""
    cap = 4 * LAYOUT.full_block_bytes  # bytes/s: 4 blocks' reads take about a second on either storage NIC
    d = deploy(1, 1, snic={"pe0": cap, "de0": cap})
    pe, de = d.instances["pe0"].worker, d.instances["de0"].worker
    first = d.request("pe0", "de0", Deployment.true_rows(50, 5 * BLOCK + 1), 5, "pe")
    second = d.request("pe0", "de0", Deployment.true_rows(51, 4 * BLOCK + 1), 4, "de")
    arrivals = {0.0: first, 0.1: second}
    reading_at: dict[str, float] = {}
    stop = threading.Event()

    def watch() -> None:  # when each transfer's reads show up on their NIC (status, as the proxy sees it)
        while not stop.is_set():
            now = time.monotonic()
            for xfer in [*pe.status().reading, *de.status().reading]:
                reading_at.setdefault(xfer, now)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0, arrived, ready, ready_at, done = time.monotonic(), {}, {}, {}, set()
    try:
        while len(done) < 2:
            now = time.monotonic() - t0
            assert now < 10, "the loop did not finish its requests"
            for at, (pe_req, _) in arrivals.items():
                if now >= at and pe_req.req_id not in arrived:
                    arrived[pe_req.req_id] = time.monotonic()
                    d.read_ahead("pe0", [pe_req])
            for pe_req, de_req in arrivals.values():
                if pe_req.req_id in ready and pe_req.req_id not in done:
                    d.expect_recv("de0", de_req)
                    assert d.prefill("pe0", pe_req, hit_tokens=ready[pe_req.req_id]) == set()
                    d.done("pe0", pe_req)
                    done.add(pe_req.req_id)
            meta = pe.build_worker_meta()
            for req_id in meta.ready if meta is not None else {}:
                ready_at[req_id] = time.monotonic()
            ready |= meta.ready if meta is not None else {}
            time.sleep(0.001)
    finally:
        stop.set()
        watcher.join(5)
    assert ready_at[first[0].req_id] - arrived[first[0].req_id] > 0.7  # the premise: the first reads for ~1 s
    late = reading_at[second[0].xfer.xfer_id] - arrived[second[0].req_id]
    assert late < 0.3, f"the DE path's reads started {late:.3f} s after the request arrived"
    assert max(d.layer_waits) < LAYER_WAIT_LIMIT_S, f"a layer waited {max(d.layer_waits):.3f} s"
    assert d.finish("de0", {first[1].req_id, second[1].req_id})[1] == set()
    rows = [(first[1], first[0].rows), (second[1], second[0].rows)]
    assert_caches_equal(d.instances["de0"].caches, expected_de_caches(rows))
    _idle(d)


def test_a_preempted_prefill_read_ahead_again_reads_its_hit_itself(deploy):
    """vLLM preempts a prefill after its load: the request is read ahead again; its transfer's plan stands, so the
    PE reads the whole hit itself and the DE still receives every row exact."""
    d = deploy(1, 1)
    pe = d.instances["pe0"].worker
    rows = Deployment.true_rows(60, 5 * BLOCK + 3)
    pe_req, de_req = d.request("pe0", "de0", rows, 5, "de")
    d.read_ahead("pe0", [pe_req])
    d.await_ready("pe0", {pe_req.req_id})
    d.expect_recv("de0", de_req)
    assert d.prefill("pe0", pe_req) == set()
    read_before = pe.read_queue.stats().completed_requests
    d.read_ahead("pe0", [pe_req])  # preempted: its blocks freed, looked up and read ahead again
    assert d.await_ready("pe0", {pe_req.req_id}) == {pe_req.req_id: 5 * BLOCK}
    assert pe.read_queue.stats().completed_requests - read_before == 5
    assert d.prefill("pe0", pe_req) == set()
    d.done("pe0", pe_req)
    assert d.finish("de0", {de_req.req_id})[1] == set()
    assert_caches_equal(d.instances["de0"].caches, expected_de_caches([(de_req, rows)]))
    _idle(d)


def _assert_idle_steps_sleep(worker) -> None:
    """Half a second of steps with nothing to compute, back to back as vLLM runs them: each waits about
    ``IDLE_STEP_S``, and together they use less than half a core."""
    from ascend_dualpath.integrations.vllm.worker import IDLE_STEP_S

    steps, cpu, end = 0, time.process_time(), time.monotonic() + 0.5
    while time.monotonic() < end:
        worker.start_step(DualPathMetadata())
        assert worker.build_worker_meta() is None
        steps += 1
    assert steps <= 0.5 / IDLE_STEP_S + 5, f"{steps} idle steps in 0.5 s"
    assert time.process_time() - cpu < 0.25, "idle steps used more than half a core"


def test_steps_with_only_reads_ahead_pending_do_not_spin(deploy, store_faults):
    """While only reads ahead are pending, vLLM runs steps with nothing to compute back to back: each waits
    ``IDLE_STEP_S`` in ``build_worker_meta``, so the engine loop does not spin a core; a step with work does not."""

    d = deploy(1, 1)
    _slow_reads(d, 4 * SLOW_BLOCK_S)
    pe = d.instances["pe0"].worker
    pe_req, _ = d.request("pe0", "de0", Deployment.true_rows(80, 4 * BLOCK + 1), 4, "pe")
    d.read_ahead("pe0", [pe_req])
    _assert_idle_steps_sleep(pe)
    pe.get_finished({pe_req.req_id})
    _idle(d)


def test_steps_with_only_persists_pending_do_not_spin(deploy, monkeypatch):
    """While only a persist is being written, vLLM steps with nothing to compute back to back (it holds the request
    until ``finished_sending``): each step waits up to ``IDLE_STEP_S`` for the write, so the loop does not spin a
    core, and the write's end cuts the wait short."""
    from ascend_dualpath.integrations.vllm.metadata import PersistSpec

    d = deploy(1, 1)
    de = d.instances["de0"].worker
    release = threading.Event()
    monkeypatch.setattr(de.persister.store, "write_blocks", lambda chain: release.wait(10) and [True] * len(chain))
    spec = PersistSpec("r-persist", 0, [bytes(16)], [0])
    de.persister.persist(spec, lambda i: bytes(4))
    _assert_idle_steps_sleep(de)
    threading.Timer(0.001, release.set).start()
    start = time.monotonic()
    while not de.get_finished(set())[0]:
        de.start_step(DualPathMetadata())
        de.build_worker_meta()
        assert time.monotonic() - start < 5, "the persist did not end"
    assert not de.persister.writing()
    _idle(d)
