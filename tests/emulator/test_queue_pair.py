"""RoCE queue pairs on the emulated NIC: execution, completions, every kind of bad input, back-pressure."""

import threading

import numpy as np
import pytest

from ascend_dualpath import errors
from tests.conftest import poll_all


@pytest.fixture
def link(C, two_devices, poisoned):
    """A QP on device 0 writing into device 1, with poisoned source and destination regions."""
    d0, d1 = two_devices
    src = poisoned(d0, access=4)  # no LOCAL_WRITE: a READ into it must be refused
    dst = poisoned(d1, access=1 | 2 | 4)
    src.view[:] = np.random.default_rng(0).integers(0, 256, src.view.size, dtype=np.uint8)
    src.expected[:] = src.view
    cq = d0.create_cq(256)
    qp = d0.create_qp(cq, None, 64, 4)
    return d0, d1, src, dst, cq, qp


def write(C, src, s_off, dst, d_off, n, **kw):
    return C.WorkRequest(3, src.addr + s_off, src.region.lkey, n, dst.addr + d_off, dst.region.rkey, **kw)


def test_write_lands_exactly(C, link):
    d0, d1, src, dst, cq, qp = link
    qp.post([write(C, src, 100, dst, 4000, 3000)], 0.0, 10.0)
    [c] = poll_all(cq, 1)
    assert (c.status, c.opcode, c.byte_cnt, c.qpn, c.wqe_index) == (0, 3, 3000, qp.qpn, 0)
    dst.expect(4000, src.view[100:3100])
    dst.assert_intact()
    src.assert_intact()


def test_read_pulls_remote_bytes(C, link):
    d0, d1, src, dst, cq, qp = link
    dst.view[:64] = np.arange(64, dtype=np.uint8)
    dst.expected[:] = dst.view
    local = d0.alloc_region(4096, C.MemKind.DEVICE_GM, 1)
    qp.post([C.WorkRequest(5, local.addr + 8, local.lkey, 64, dst.addr, dst.region.rkey)], 0.0, 10.0)
    assert poll_all(cq, 1)[0].status == 0
    assert np.array_equal(np.frombuffer(local, dtype=np.uint8)[8:72], np.arange(64, dtype=np.uint8))
    dst.assert_intact()


def test_write_with_imm_completes_on_the_receiver(C, link):
    d0, d1, src, dst, cq, qp = link
    rcq = d1.create_cq(16)
    receiver = d1.create_qp(d1.create_cq(16), rcq, 16, 4)
    qp.connect(receiver.qpn)
    qp.post([C.WorkRequest(4, src.addr, src.region.lkey, 128, dst.addr, dst.region.rkey, imm=0xBEEF)], 0.0, 10.0)
    assert poll_all(cq, 1)[0].status == 0
    [r] = poll_all(rcq, 1)
    assert (r.opcode, r.imm, r.byte_cnt, r.qpn) == (0x10, 0xBEEF, 128, receiver.qpn)
    dst.expect(0, src.view[:128])
    dst.assert_intact()


def test_unsignaled_success_makes_no_cqe(C, link):
    d0, d1, src, dst, cq, qp = link
    qp.post([write(C, src, 0, dst, 0, 64, signaled=False), write(C, src, 64, dst, 64, 64)], 0.0, 10.0)
    [c] = poll_all(cq, 1)
    assert c.wqe_index == 1
    assert cq.poll(4, 0.0) == []


BAD_INPUTS = {
    # name: (work-request builder, expected status, expected syndrome, words the detail must contain)
    "bad rkey": (
        lambda C, s, d: C.WorkRequest(3, s.addr, s.region.lkey, 64, d.addr, d.region.rkey ^ 0x1),
        0x13,
        4,
        ["rkey", "no live registration"],
    ),
    "remote out of bounds": (
        lambda C, s, d: C.WorkRequest(3, s.addr, s.region.lkey, 64, d.addr + (1 << 16) - 32, d.region.rkey),
        0x13,
        5,
        ["outside region", "+65536"],
    ),
    "local out of bounds": (
        lambda C, s, d: C.WorkRequest(3, s.addr + (1 << 16) - 8, s.region.lkey, 64, d.addr, d.region.rkey),
        0x04,
        2,
        ["local range", "outside"],
    ),
    "unregistered memory": (
        lambda C, s, d: C.WorkRequest(3, s.addr, 0x7777700, 64, d.addr, d.region.rkey),
        0x04,
        1,
        ["unregistered memory"],
    ),
    "zero length": (
        lambda C, s, d: C.WorkRequest(3, s.addr, s.region.lkey, 0, d.addr, d.region.rkey),
        0x01,
        7,
        ["length 0"],
    ),
    "bad opcode": (
        lambda C, s, d: C.WorkRequest(9, s.addr, s.region.lkey, 64, d.addr, d.region.rkey),
        0x02,
        9,
        ["opcode 9"],
    ),
    "read from write-only region": (
        lambda C, s, d: C.WorkRequest(5, s.addr, s.region.lkey, 64, d.addr, d.region.rkey),
        0x04,
        3,
        ["LOCAL_WRITE"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_each_bad_input_ends_in_its_error_cqe(C, emu, link, case):
    d0, d1, src, dst, cq, qp = link
    make, status, syndrome, words = BAD_INPUTS[case]
    # a valid write first (it must land), the bad one, then a valid one that must be flushed, not executed
    qp.post([write(C, src, 0, dst, 0, 32), make(C, src, dst), write(C, src, 32, dst, 32, 32)], 0.0, 10.0)
    done = poll_all(cq, 3)
    assert [c.status for c in done] == [0, status, emu.CqeStatus.WR_FLUSH_ERROR]
    assert done[1].syndrome == syndrome and done[2].syndrome == emu.Syndrome.FLUSHED
    assert all(w in done[1].detail for w in words), done[1].detail
    error = emu.completion_error(done[1])
    assert isinstance(error, errors.AdpError) and done[1].detail in str(error)
    assert qp.state == C.QpState.ERROR
    dst.expect(0, src.view[:32])
    dst.assert_intact()
    src.assert_intact()
    qp.reset(10.0)
    qp.post([write(C, src, 64, dst, 64, 32)], 0.0, 10.0)
    assert poll_all(cq, 1)[0].status == 0


def test_remote_permission_is_checked(C, emu, two_devices, poisoned):
    d0, d1 = two_devices
    src, read_only = poisoned(d0), poisoned(d1, access=1 | 4)
    cq = d0.create_cq(16)
    qp = d0.create_qp(cq, None, 16, 4)
    qp.post([C.WorkRequest(3, src.addr, src.region.lkey, 64, read_only.addr, read_only.region.rkey)], 0.0, 10.0)
    [c] = poll_all(cq, 1)
    assert (c.status, c.syndrome) == (0x13, emu.Syndrome.REMOTE_PERMISSION) and "REMOTE_WRITE" in c.detail
    read_only.assert_intact()


def test_wrong_service_level_in_doorbell(C, emu, link):
    d0, d1, src, dst, cq, qp = link
    qp.post([write(C, src, 0, dst, 0, 64), write(C, src, 0, dst, 64, 64)], 0.0, 10.0, sl=5)
    first, second = poll_all(cq, 2)
    assert (first.status, first.syndrome) == (0x02, emu.Syndrome.SL_MISMATCH)
    assert "doorbell SL 5 differs from the communicator's configured SL 4" in first.detail
    assert second.syndrome == emu.Syndrome.FLUSHED
    dst.assert_intact()


def test_owner_bit_over_many_ring_passes(C, emu, two_devices, poisoned):
    d0, d1 = two_devices
    src, dst = poisoned(d0), poisoned(d1)
    src.view[:] = np.arange(src.view.size, dtype=np.uint64).astype(np.uint8)
    cq = d0.create_cq(64)
    qp = d0.create_qp(cq, None, 8, 4)  # shift 3: owner flips every 8 posts
    posts = 5 * qp.depth + 3  # > 2 x depth
    for i in range(posts):
        qp.post([write(C, src, i * 16, dst, i * 16, 16)], 0.0, 10.0)
        assert poll_all(cq, 1)[0].status == 0
    dst.expect(0, src.view[: posts * 16])
    dst.assert_intact()
    # hand-write a WQE with the owner value of the previous pass: the NIC must refuse it as stale
    head = qp.head
    stale = emu.encode_rdma_wqe(
        3, ((head >> qp.owner_shift) & 1) ^ 1, True, 16, dst.region.rkey, dst.addr, src.region.lkey, src.addr
    )
    qp.write_wqe_bytes(head, stale)
    qp.set_head(head + 1)
    qp.ring_doorbell(emu.encode_sq_doorbell(qp.qpn, head + 1, 4))
    [c] = poll_all(cq, 1)
    assert c.syndrome == emu.Syndrome.OWNER_MISMATCH and "stale" in c.detail
    dst.assert_intact()


def test_doorbell_before_flush_is_caught(C, emu, link):
    d0, d1, src, dst, cq, qp = link
    head = qp.head
    wqe = emu.encode_rdma_wqe(
        3, (head >> qp.owner_shift) & 1, True, 16, dst.region.rkey, dst.addr, src.region.lkey, src.addr
    )
    qp.write_wqe_bytes(head, wqe)
    np.frombuffer(qp.region, dtype=np.uint8)[qp.dirty_addr - qp.region.addr + head % qp.depth] = (
        1  # written, not flushed
    )
    qp.set_head(head + 1)
    qp.ring_doorbell(emu.encode_sq_doorbell(qp.qpn, head + 1, 4))
    [c] = poll_all(cq, 1)
    assert c.syndrome == emu.Syndrome.UNFLUSHED_WQE and "DataCacheCleanAndInvalid" in c.detail
    dst.assert_intact()


def test_sq_full_backpressure_is_bounded(C, emu, link):
    d0, d1, src, dst, cq, qp = link
    # fill the ring with WQEs but ring no doorbell: the NIC consumes nothing, so the SQ stays full
    for i in range(qp.depth - 1):
        qp.write_wqe_bytes(
            i, emu.encode_rdma_wqe(3, 0, True, 8, dst.region.rkey, dst.addr + 8 * i, src.region.lkey, src.addr + 8 * i)
        )
    qp.set_head(qp.depth - 1)
    with pytest.raises(errors.WaitTimeout, match=r"SQ space on qpn \d+: head=63 tail=0 depth=64"):
        qp.post([write(C, src, 0, dst, 0, 8)], 0.0, 0.2)
    # a poster blocked on the full ring proceeds as soon as the doorbell lets the NIC drain it
    result = {}
    blocked = threading.Thread(target=lambda: result.update(head=qp.post([write(C, src, 0, dst, 1000, 8)], 0.0, 10.0)))
    blocked.start()
    qp.ring_doorbell(emu.encode_sq_doorbell(qp.qpn, qp.depth - 1, 4))
    blocked.join(15)
    assert result["head"] == qp.depth
    assert len(poll_all(cq, qp.depth)) == qp.depth
    for i in range(qp.depth - 1):
        dst.expect(8 * i, src.view[8 * i : 8 * i + 8])
    dst.expect(1000, src.view[:8])
    dst.assert_intact()


def test_poll_timeout_says_what_it_waited_for(link):
    cq = link[4]
    with pytest.raises(errors.WaitTimeout, match=r"waiting for a completion on CQ .*consumer index 0"):
        cq.poll(1, 0.05)


def test_cq_overrun_is_reported(C, two_devices, poisoned):
    d0, d1 = two_devices
    src, dst = poisoned(d0), poisoned(d1)
    cq = d0.create_cq(4)
    qp = d0.create_qp(cq, None, 16, 4)
    qp.post([write(C, src, 0, dst, 8 * i, 8) for i in range(8)], 0.0, 10.0)
    qp.drain(10.0)
    for _ in range(2):  # the CQ is in error: its first poll and every later one report the 4 lost completions
        with pytest.raises(errors.QueueError, match="overran: 4 completions"):
            cq.poll(16, 0.0)


def test_queue_arguments_are_validated(C, two_devices):
    d0, _ = two_devices
    cq = d0.create_cq(8)
    with pytest.raises(errors.ConfigError, match="SQ depth must be a power of two in \\[2, 32768\\], got 48"):
        d0.create_qp(cq, None, 48, 4)
    with pytest.raises(errors.ConfigError, match="service level must be in \\[0, 7\\], got 9"):
        d0.create_qp(cq, None, 16, 9)
    with pytest.raises(errors.ConfigError, match="CQ depth"):
        d0.create_cq(3)
    qp = d0.create_qp(cq, None, 16, 4)
    with pytest.raises(errors.InvalidKey, match="qpn 999999 names no live queue pair"):
        qp.connect(999999)


def test_virtual_clock_follows_the_cost_model(C, emu):
    cost = emu.cost_model(link_bytes_per_ns=10.0, link_latency_ns=500.0, nic_wqe_ns=0.0)
    fabric = emu.create_fabric()
    d0, d1 = (emu.open_device(fabric, i, cost=cost) for i in range(2))
    try:
        src = d0.alloc_region(1 << 20, C.MemKind.DEVICE_GM, 7)
        dst = d1.alloc_region(1 << 20, C.MemKind.DEVICE_GM, 7)
        host = d0.alloc_region(1 << 20, C.MemKind.HOST_DRAM, 7)
        cq = d0.create_cq(16)
        qp = d0.create_qp(cq, None, 16, 4)
        qp.post([C.WorkRequest(3, src.addr, src.lkey, 10000, dst.addr, dst.rkey)], 1000.0, 10.0)
        assert poll_all(cq, 1)[0].vtime_ns == 1000 + 10000 / 10 + 500
        qp.post([C.WorkRequest(3, host.addr, host.lkey, 26000, dst.addr, dst.rkey)], 0.0, 10.0)
        # host DRAM crosses PCIe: bandwidth min(link, PCIe) = 10 B/ns, latency + PCIe latency
        assert poll_all(cq, 1)[0].vtime_ns == 2000 + 26000 / 10 + 500 + cost.pcie_latency_ns
    finally:
        d0.close()
        d1.close()
