"""Several PEs and DEs, and one request read through both storage NICs, on the real connector workers.

In-process workers (:mod:`tests.integrations.vllm.worker_harness`): each with its own emulated device on one
fabric, a per-(PE, DE) pair communicator, real side channels, the real store and read queues, FLASH_ATTN-layout
caches. vLLM's forward is scripted; the DE caches are checked bit for bit (poisoned bytes nobody may write stay).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_dualpath import _ext
from ascend_dualpath.backends import emulator as emu
from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.dataplane import open_dataplane, open_fabric
from ascend_dualpath.dualpath.settings import ConnectorSettings
from ascend_dualpath.dualpath.side_channel import XferParams
from ascend_dualpath.dualpath.transfer_leg import FaultInjectingLeg
from ascend_dualpath.errors import ConfigError
from ascend_dualpath.integrations.vllm.settings import from_kv_transfer_config
from ascend_dualpath.kv.store import HEADER_BYTES
from tests.integrations.vllm.worker_harness import (
    BLOCK,
    LAYERS,
    LAYOUT,
    POISON,
    Deployment,
    assert_caches_equal,
    expected_de_caches,
    remove_fabric_shm,
    run_request,
)

PATHS = [("pe", False), ("de", False), ("de", True)]


def test_every_pe_works_with_every_de_on_every_path(deploy):
    d = deploy(2, 2)
    written: dict[str, list] = {"de0": [], "de1": []}
    errors = []

    def serve(pe: str, seed: int) -> None:
        try:
            for i, (path, split) in enumerate(PATHS * 2):
                de = f"de{i % 2}"
                de_req, rows, bad = run_request(d, pe, de, 29 + i, 6, path, split, seed + i)
                assert bad == set()
                written[de].append((de_req, rows))
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=serve, args=(pe, 100 * k)) for k, pe in enumerate(("pe0", "pe1"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    for de in ("de0", "de1"):
        assert_caches_equal(d.instances[de].caches, expected_de_caches(written[de]))
        assert len(d.instances[de].worker.dataplane.links) == 2  # one pair communicator per PE
    for pe in ("pe0", "pe1"):
        status = d.instances[pe].status()
        assert len(d.instances[pe].worker.dataplane.links) == 2
        loads = (status["loads_pe"], status["loads_de"], status["loads_split"])
        assert sum(loads) == 6 and loads[0] >= 2 and loads[1] >= 2
        assert status["split_blocks_pe"] + status["split_blocks_de"] == 2 * 6
        assert status["fallbacks"] == status["failures"] == 0
        assert {"node", "role", "snic_bytes_per_s", "read_queue_bytes", "unfinished_tokens"} <= status.keys()
        assert status["role"] == "prefill" and status["unfinished_requests"] == 0


@pytest.mark.parametrize(("path", "split", "readers"), [("pe", False, {"pe0"}), ("de", False, {"de0"}),
                                                        ("de", True, {"pe0", "de0"})])  # fmt: skip
def test_the_status_names_the_transfers_whose_reads_are_queued_or_running(deploy, path, split, readers):
    """While a request's hit blocks are read (8 blocks of 768 bytes at 15 kB/s: about 0.4 s), the status of each
    instance reading them names its xfer id in ``reading`` and no other instance does; once read, none does."""
    d = deploy(1, 1, snic={"pe0": 15e3, "de0": 15e3})
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(run_request(d, "pe0", "de0", 37, 8, path, split, 3)))
    thread.start()
    seen: set[str] = set()
    while thread.is_alive():  # the read, then the prefill: the harness bounds each wait
        seen |= {name for name in ("pe0", "de0") if "x0" in d.instances[name].worker.status().reading}
        time.sleep(0.005)
    thread.join()
    assert outcome and outcome[0][2] == set()
    assert seen == readers
    assert [d.instances[name].worker.status().reading for name in ("pe0", "de0")] == [[], []]


def test_the_split_follows_the_storage_nic_caps(deploy):
    """The DE's storage NIC capped 4x lower than the PE's, both read queues idle: the DE reads 1/5 of the blocks."""
    d = deploy(1, 1, snic={"pe0": 40e6, "de0": 10e6})
    written = []
    for seed in range(3):
        de_req, rows, bad = run_request(d, "pe0", "de0", 83, 20, "pe", True, seed)
        assert bad == set()
        written.append((de_req, rows))
    assert_caches_equal(d.instances["de0"].caches, expected_de_caches(written))
    pe, de = d.instances["pe0"].status(), d.instances["de0"].status()
    assert (pe["loads_pe"], pe["loads_de"], pe["loads_split"]) == (0, 0, 3)
    assert (pe["split_blocks_pe"], pe["split_blocks_de"]) == (48, 12)
    assert de["snic_read_blocks"] == 12 and pe["snic_read_blocks"] == 48
    assert de["snic_bytes_per_s"] == 10e6


def _damage(d: Deployment, store_id: bytes, how: str) -> None:
    path = d.store.path_of(store_id)
    if how == "missing":
        path.unlink()
        return
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 10)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 10)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize(
    ("bad_block", "how", "first_reported", "pe_checksum", "de_checksum", "takeovers"),
    [
        (2, "corrupt", 2, 1, 0, 0),  # the PE's half: blocks 0 and 1 are good and stay
        (1, "missing", 0, 0, 0, 0),  # the PE's half, a block gone: nothing of the load can be trusted
        # the DE's half: the DE aborts (and drops the block), the PE's takeover finds it gone: recompute
        (6, "corrupt", 0, 0, 1, 1),
    ],
)
def test_either_half_failing_falls_back_with_correct_kv(
    deploy, bad_block, how, first_reported, pe_checksum, de_checksum, takeovers
):
    d = deploy(1, 1)  # uncapped both: 8 hit blocks split 4 / 4
    rows = Deployment.true_rows(7, 37)
    pe_req, de_req = d.request("pe0", "de0", rows, 8, "de", True)
    _damage(d, pe_req.store_ids[bad_block], how)
    d.expect_recv("de0", de_req)
    bad = d.prefill("pe0", pe_req)
    assert bad == set(pe_req.block_ids[first_reported:8])
    finished, failed = d.finish("de0", {de_req.req_id})
    assert failed == set()
    assert_caches_equal(d.instances["de0"].caches, expected_de_caches([(de_req, rows)]))
    pe, de = d.instances["pe0"].status(), d.instances["de0"].status()
    assert pe["loads_split"] == 1 and (pe["split_blocks_pe"], pe["split_blocks_de"]) == (4, 4)
    assert pe["fallbacks"] == 1 and pe["checksum_errors"] == pe_checksum and de["checksum_errors"] == de_checksum
    assert pe["takeovers"] == takeovers
    assert de["fallbacks"] == 1  # the DE stopped pushing and took complete layers
    assert not d.store.contains(pe_req.store_ids[bad_block]) or how == "missing"

    # the next request on the same pair is unaffected
    de_req2, rows2, bad2 = run_request(d, "pe0", "de0", 21, 4, "de", True, 8)
    assert bad2 == set()
    assert_caches_equal(d.instances["de0"].caches, expected_de_caches([(de_req, rows), (de_req2, rows2)]))


@pytest.mark.parametrize("split", [False, True])
def test_the_pe_takes_over_the_des_half_when_the_des_storage_read_fails(deploy, split):
    """The other path before recompute: the DE's own read of one of its hit blocks fails (the PE's read of it would
    not), the DE aborts, and the PE reads the DE's half through its own storage NIC. Nothing is recomputed: the PE's
    cache holds every layer's hit rows before its attention, and the DE gets complete layers, bit-exact."""
    d = deploy(1, 1)
    rows = Deployment.true_rows(11, 41)
    pe_req, de_req = d.request("pe0", "de0", rows, 8, "de", split)
    bad = pe_req.store_ids[6]  # in the DE's half either way (a split of uncapped NICs gives it blocks 4..7)
    d.instances["de0"].worker.store.faults.fail_next_read(bad)
    d.expect_recv("de0", de_req)
    assert d.prefill("pe0", pe_req) == set()  # check_layers: the hit rows are there before each layer
    _, failed = d.finish("de0", {de_req.req_id})
    assert failed == set()
    assert_caches_equal(d.instances["de0"].caches, expected_de_caches([(de_req, rows)]))
    pe, de = d.instances["pe0"].status(), d.instances["de0"].status()
    assert (pe["takeovers"], pe["fallbacks"], pe["failures"]) == (1, 0, 0)
    assert de["fallbacks"] == 1  # the DE stopped pushing and took complete layers
    own = 4 if split else 0
    assert pe["snic_read_blocks"] == own + (8 - own)  # its own half, then the DE's half it took over
    assert d.store.contains(bad)  # the block was fine: nothing dropped
    d.done("pe0", pe_req)
    assert pe["quarantined_bytes"] == 0


@pytest.mark.parametrize("failing_push", range(LAYERS))
def test_a_takeover_after_some_pushed_layers_sends_the_de_every_layer_again(deploy, failing_push):
    """The DE's push of hit layer ``failing_push`` fails after the layers before it arrived: the PE takes over from
    that layer, and the layers this step had already sent into the DE's old lease go again into the fresh one."""
    d = deploy(1, 1)
    first_req, first_rows, _ = run_request(d, "pe0", "de0", 17, 2, "de", False, 3)  # the pair's link exists now
    de = d.instances["de0"].worker
    link = de.dataplane.links[d.instances["pe0"].address]
    link.leg = FaultInjectingLeg(link.leg)
    link.leg.fail_after(failing_push)
    rows = Deployment.true_rows(12, 37)
    pe_req, de_req = d.request("pe0", "de0", rows, 8, "de")
    d.expect_recv("de0", de_req)
    assert d.prefill("pe0", pe_req) == set()
    _, failed = d.finish("de0", {de_req.req_id})
    assert failed == set()
    assert_caches_equal(d.instances["de0"].caches, expected_de_caches([(first_req, first_rows), (de_req, rows)]))
    assert d.instances["pe0"].status()["takeovers"] == 1


def test_a_failed_takeover_recomputes(deploy):
    """The other path fails too (the PE's read of the block the DE could not read fails as well): only then does
    vLLM recompute, from the first hit block, and the DE still gets complete layers."""
    d = deploy(1, 1)
    rows = Deployment.true_rows(13, 41)
    pe_req, de_req = d.request("pe0", "de0", rows, 8, "de")
    bad = pe_req.store_ids[5]
    d.instances["de0"].worker.store.faults.fail_next_read(bad)
    d.instances["pe0"].worker.store.faults.fail_next_read(bad)
    d.expect_recv("de0", de_req)
    assert d.prefill("pe0", pe_req) == set(pe_req.block_ids[:8])
    _, failed = d.finish("de0", {de_req.req_id})
    assert failed == set()
    assert_caches_equal(d.instances["de0"].caches, expected_de_caches([(de_req, rows)]))
    pe = d.instances["pe0"].status()
    assert (pe["takeovers"], pe["fallbacks"]) == (1, 1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = Deployment(tmp_path_factory.mktemp("split-store"), 1, 1)
    yield d
    d.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    hit_blocks=st.integers(0, 10),
    extra=st.integers(1, 2 * BLOCK + 3),
    de_cap_ratio=st.sampled_from([0.01, 0.3, 1.0, 3.0, 100.0]),
)
def test_the_split_merge_is_bit_exact_for_any_hit_and_prompt(pair, hit_blocks, extra, de_cap_ratio):
    de = pair.instances["de0"]
    for cache in de.caches:  # every example starts from a poisoned DE and fresh block tables
        cache.view(torch.uint8).fill_(POISON)
    de._blocks = type(de._blocks)()
    pair.instances["pe0"]._blocks = type(de._blocks)()
    de.worker.settings = dataclasses.replace(de.worker.settings, snic_bytes_per_s=1e12 * de_cap_ratio)
    prompt = hit_blocks * BLOCK + extra
    pe_before = pair.instances["pe0"].status()
    de_req, rows, bad = run_request(pair, "pe0", "de0", prompt, hit_blocks, "de", True, hit_blocks * 100 + extra)
    assert bad == set()
    assert_caches_equal(de.caches, expected_de_caches([(de_req, rows)]))
    pe_after = pair.instances["pe0"].status()
    halves = [pe_after[k] - pe_before[k] for k in ("split_blocks_pe", "split_blocks_de")]
    assert sum(halves) == hit_blocks


def test_device_id_is_validated_and_defaults_by_role():
    def config(role, **extra):
        return type(
            "C", (), {"kv_role": role, "kv_connector_extra_config": {"store": "/s", "side_port": 7000, **extra}}
        )

    assert from_kv_transfer_config(config("kv_producer")).device_id == 0
    assert from_kv_transfer_config(config("kv_consumer")).device_id == 1
    assert from_kv_transfer_config(config("kv_consumer", device_id=5)).device_id == 5
    for bad in (-1, True, "2", 1.0):
        with pytest.raises(ConfigError, match="device_id"):
            from_kv_transfer_config(config("kv_producer", device_id=bad))


def test_split_is_an_optional_bool_in_the_params():
    raw = {"xfer_id": "x", "role": "prefill", "path": "pe", "peer": "tcp://h:1"}
    assert XferParams.from_request({"dualpath": raw}).split is False
    params = XferParams.from_request({"dualpath": {**raw, "split": True}})
    assert params.split is True and XferParams.from_request(params.as_params()) == params
    with pytest.raises(ConfigError, match="split"):
        XferParams.from_request({"dualpath": {**raw, "split": "yes"}})


def test_instances_starting_together_share_one_fabric(tmp_path):
    name = f"race{os.getpid()}"
    barrier, fabrics, errors, devices, regions = threading.Barrier(4), [], [], [], []

    def start() -> None:
        try:
            barrier.wait(5)
            fabrics.append(open_fabric(name, 5.0))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=start) for _ in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert not errors, errors
        devices = [emu.open_device(fabric, device_id=i) for i, fabric in enumerate(fabrics)]
        regions = [device.alloc_region(4096, _ext.load().MemKind.HOST_DRAM, 7) for device in devices]
        assert [fabric.num_live_regions for fabric in fabrics] == [4] * 4  # one registry, not four
    finally:
        for closable in regions + devices + fabrics:
            closable.close()
        remove_fabric_shm(name)


def test_a_peer_with_a_taken_device_id_is_refused(tmp_path):
    fabric = f"dup{os.getpid()}"
    settings = ConnectorSettings(
        "prefill", str(tmp_path), "pe", 1e15, 7000, fabric, 5.0, device_id=3, hccl_buffer_mb=1, host_buffer_mb=1
    )
    dp = open_dataplane(settings, 0)
    try:
        with pytest.raises(ConfigError, match="device_id 3"):
            dp.new_link("tcp://de", 3)
        dp.new_link("tcp://de0", 4)
        with pytest.raises(ConfigError, match="device_id 4"):
            dp.new_link("tcp://de1", 4)
        assert dp.new_link("tcp://de0", 5).peer_device == 5  # the same address again: a restarted peer
    finally:
        dp.close()
        remove_fabric_shm(fabric)


def test_a_fallback_while_the_des_half_is_still_being_read_uses_a_fresh_lease(deploy):
    """The PE's half fails at once while the DE's slow reads are still landing: the complete layers go into a
    fresh lease (the late reads cannot overwrite them), and the old lease is released once its reads ended."""
    d = deploy(1, 1, snic={"de0": 3000.0})  # the DE's 4 blocks of 768 bytes take about a second
    de = d.instances["de0"].worker
    de.settings = dataclasses.replace(de.settings, snic_bytes_per_s=1e15)  # it reports a fast NIC: 4 / 4 split
    rows = Deployment.true_rows(11, 37)
    pe_req, de_req = d.request("pe0", "de0", rows, 8, "de", True)
    _damage(d, pe_req.store_ids[0], "corrupt")
    d.expect_recv("de0", de_req)
    assert d.prefill("pe0", pe_req) == set(pe_req.block_ids[:8])
    d.finish("de0", {de_req.req_id})
    assert de.read_queue.stats().bytes > 0  # the DE's reads had not ended when the merge ran
    assert_caches_equal(d.instances["de0"].caches, expected_de_caches([(de_req, rows)]))
    deadline = time.monotonic() + 10
    while de.dataplane.host.stats().live_leases and time.monotonic() < deadline:
        time.sleep(0.05)
    assert de.dataplane.host.stats().live_leases == 0


def test_a_timed_out_receive_keeps_its_lease_from_the_next_requests_while_its_reads_land(deploy):
    """The DE's receive times out while its slow hit reads are in flight: their lease must stay out of the host
    buffer (the reads still write into it, the PE may too), so a lease allocated after the timeout keeps its bytes
    and the next request is bit-exact. Reads still queued at the timeout fail on the released lease's views; the
    ones in flight write through raw views the release cannot take back."""
    d = deploy(2, 1, snic={"de0": 3000.0})  # the DE's 4 blocks of 768 bytes: one every quarter second
    de, pe0 = d.instances["de0"].worker, d.instances["pe0"].worker
    de.store.faults.delay_reads(2.0)  # outlasts the receive's 0.3 s by a margin a loaded machine keeps
    de.decode.settings = dataclasses.replace(de.decode.settings, timeout_s=0.3)
    pe0.prefill.settings = dataclasses.replace(pe0.prefill.settings, timeout_s=1.5)  # gives up on hit layers sooner
    pe_req, de_req = d.request("pe0", "de0", Deployment.true_rows(12, 21), 4, "de")
    d.expect_recv("de0", de_req)
    prefill = threading.Thread(target=d.prefill, args=("pe0", pe_req), kwargs={"check_layers": False}, daemon=True)
    prefill.start()
    _, failed = d.finish("de0", {de_req.req_id})
    assert failed == {de_req.req_id}
    assert de.read_queue.stats().inflight_requests > 0  # the timed-out receive's reads are still landing
    probe = de.dataplane.host.allocate("probe", LAYOUT.kv_bytes(21), timeout_s=1.0)  # the next request's lease
    probe.tensor.fill_(POISON)

    de.decode.settings = dataclasses.replace(de.decode.settings, timeout_s=10.0)
    de_req2, rows2, bad = run_request(d, "pe1", "de0", 21, 2, "pe", False, 13)
    assert bad == set()
    assert_caches_equal(d.instances["de0"].caches, expected_de_caches([(de_req2, rows2)]))
    deadline = time.monotonic() + 10
    while de.read_queue.stats().requests and time.monotonic() < deadline:
        time.sleep(0.05)
    prefill.join(10)
    assert bool((probe.tensor == POISON).all()), "a late read of the timed-out request landed in another lease"
    probe.release()
    assert de.counters.quarantined_leases == 1  # the PE might have been writing into it
    de.quarantine.sweep()  # its reads ended, and the PE answers that its writes did
    assert (de.counters.reclaimed_leases, de.status().quarantined_bytes) == (1, 0)
    assert de.dataplane.host.stats().live_leases == 0


def test_a_pe_load_whose_read_outlives_its_wait_quarantines_its_lease(deploy):
    """The PE's wait for its slow hit reads expires: the load falls back, and its lease, which the reads still
    write into, is quarantined instead of released, so a lease allocated afterwards keeps its bytes."""
    d = deploy(1, 1)
    pe = d.instances["pe0"].worker
    # the reads must outlast the load's wait and the release's bounded waits after it (0.3 s each) by a margin
    # a loaded machine cannot eat up
    pe.store.faults.delay_reads(3.0)
    pe.prefill.settings = dataclasses.replace(pe.prefill.settings, timeout_s=0.3)
    rows = Deployment.true_rows(14, 21)
    pe_req, de_req = d.request("pe0", "de0", rows, 2, "pe")
    d.expect_recv("de0", de_req)
    assert d.prefill("pe0", pe_req, check_layers=False) == set(pe_req.block_ids[:2])  # recomputed instead
    probe = pe.dataplane.host.allocate("probe", 2 * LAYOUT.full_block_bytes, timeout_s=1.0)
    probe.tensor.fill_(POISON)
    _, failed = d.finish("de0", {de_req.req_id})
    assert failed == set()
    assert_caches_equal(d.instances["de0"].caches, expected_de_caches([(de_req, rows)]))
    deadline = time.monotonic() + 20
    while pe.read_queue.stats().requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert bool((probe.tensor == POISON).all()), "a late read of the failed load landed in another lease"
    probe.release()
    assert pe.counters.quarantined_leases == 1
    pe.quarantine.sweep()  # the reads ended: the lease goes back
    assert (pe.counters.reclaimed_leases, pe.status().quarantined_bytes) == (1, 0)
    assert pe.dataplane.host.stats().live_leases == 0


def test_a_failed_load_keeps_its_window_slots_while_the_des_pushes_may_still_land_there(deploy):
    """The DE's pushes of the hit layers are stuck in its NIC when the PE's wait for them expires: the PE takes the
    DE's half over (reading it itself) and keeps the two window slots (and their notify group) out of its pool, so a
    buffer allocated afterwards keeps its bytes when the pushes land at last. Once the DE says they ended, the slots
    go back to the pool."""
    d = deploy(1, 1)
    pe, de = d.instances["pe0"].worker, d.instances["de0"].worker
    pe.prefill.settings = dataclasses.replace(pe.prefill.settings, timeout_s=0.3)
    de.decode.settings = dataclasses.replace(de.decode.settings, timeout_s=0.3)
    rows = Deployment.true_rows(15, 21)
    pe_req, de_req = d.request("pe0", "de0", rows, 2, "de")
    d.expect_recv("de0", de_req)
    nic, on_start = de.dataplane.device.nic, de.decode._on_start

    def start_paused(message: m.Start) -> m.Ok:
        nic.set_paused(True)  # the DE read its half; the pushes the start lets go are posted and wait in its NIC
        return on_start(message)

    de.decode._on_start = start_paused
    try:
        assert d.prefill("pe0", pe_req) == set()  # read by the PE instead, every layer before its attention
        assert pe.counters.takeovers == 1
        link = pe.prefill._peers[d.instances["de0"].address].link
        nbytes = 2 * 2 * BLOCK * LAYOUT.token_bytes  # both slots' bytes: where first fit puts them once freed
        probe = link.window_alloc(nbytes)
        view = link.window_view(probe, nbytes)
        view[:] = bytes([POISON]) * nbytes
        pe.quarantine.sweep()  # the DE's pushes are still in flight: nothing goes back
        assert pe.counters.reclaimed_slots == 0
    finally:
        nic.set_paused(False)
    deadline = time.monotonic() + 10  # the DE's pusher ends and its late pushes land
    while not de.decode.handlers()[m.PushesEnded](m.PushesEnded(xfer_id=de_req.xfer.xfer_id)).ended:
        assert time.monotonic() < deadline, "the DE's pushes did not end after its NIC resumed"
        time.sleep(0.05)
    assert bytes(view) == bytes([POISON]) * nbytes, "a late DE push landed in a buffer allocated after the load"
    link.window_free(probe)
    assert pe.counters.quarantined_slots == 1
    pe.quarantine.sweep()
    assert (pe.counters.reclaimed_slots, pe.status().quarantined_bytes) == (1, 0)
    assert link.window_alloc(nbytes) == link.window.base_addr  # the slots are free again
    d.finish("de0", {de_req.req_id})
