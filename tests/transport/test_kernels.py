"""The transfer kernels on emulated vector cores, and the hardware mistakes the emulated AscendC layer punishes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ascend_dualpath import errors
from tests.conftest import POISON, poll_all

UB_BYTES = 192 * 1024
TIMEOUT_S = 10.0


def fill_random(poisoned_region, seed):
    data = np.random.default_rng(seed).integers(0, 256, poisoned_region.view.size, dtype=np.uint8)
    poisoned_region.view[:] = data
    poisoned_region.expected[:] = data


def segment_arrays(src, dst, offsets, lengths, dst_offsets):
    n = len(lengths)
    return (
        np.array([src.addr + o for o in offsets], np.uint64),
        np.array([dst.addr + o for o in dst_offsets], np.uint64),
        np.array(lengths, np.uint64),
        np.full(n, src.region.lkey, np.uint32),
        np.full(n, dst.region.rkey, np.uint32),
    )


@pytest.mark.parametrize("cores,depth,batch", [(1, 8, 1), (4, 8, 3), (7, 16, 32), (3, 256, 16)])
def test_aiv_post_wqe_moves_every_segment_exactly(C, two_devices, poisoned, cores, depth, batch):
    d0, d1 = two_devices
    src, dst = poisoned(d0, 1 << 18), poisoned(d1, 1 << 18)
    fill_random(src, cores)
    rng = np.random.default_rng(depth)
    lengths = rng.integers(1, 3000, 53).tolist()
    offsets = np.cumsum([0] + lengths[:-1]).tolist()
    dst_offsets = [o + 7 for o in offsets]  # unaligned destinations are fine for RDMA
    cq = d0.create_cq(1024)
    qps = [d0.create_qp(cq, None, depth, 4) for _ in range(cores)]
    run = C.launch_aiv_post_wqe(
        qps, *segment_arrays(src, dst, offsets, lengths, dst_offsets), batch, 0.0, 1000.0, UB_BYTES, TIMEOUT_S
    )
    status = run.wait(TIMEOUT_S)
    assert [s["code"] for s in status] == [C.CORE_OK] * cores
    assert sum(s["posted"] for s in status) == len(lengths)
    completions = poll_all(cq, len(lengths))
    assert all(c.status == 0 for c in completions)
    for o, d, n in zip(offsets, dst_offsets, lengths, strict=True):
        dst.expect(d, src.view[o : o + n])
    dst.assert_intact()
    src.assert_intact()
    # every doorbell covered flushed WQEs, so no slot is left dirty
    for qp in qps:
        assert qp.tail == qp.head


def test_aiv_post_wqe_reports_a_full_sq_that_never_drains(C, emu, poisoned):
    with emu.emulated_devices(2) as (d0, d1):
        src, dst = poisoned(d0, 1 << 16), poisoned(d1, 1 << 16)
        cq = d0.create_cq(64)
        qp = d0.create_qp(cq, None, 4, 4)
        d0.nic.set_paused(True)  # nothing retires, the SQ stays full
        run = C.launch_aiv_post_wqe(
            [qp], *segment_arrays(src, dst, [0] * 6, [64] * 6, [0] * 6), 2, 0.0, 1000.0, UB_BYTES, 0.3
        )
        [status] = run.wait(TIMEOUT_S)
        assert status["code"] == C.CORE_SQ_TIMEOUT
        assert status["posted"] == 3  # depth - 1 WQEs fit
        dst.assert_intact()


@given(total=st.integers(1, 70000), cores=st.integers(1, 6), chunk_blocks=st.integers(1, 64))
def test_hccl_stage_copies_exactly(C, emu, total, cores, chunk_blocks):
    with emu.emulated_devices(1) as (d0,):
        src = d0.alloc_region(1 << 17, C.MemKind.HOST_DRAM, 7)
        dst = d0.alloc_region(1 << 17, C.MemKind.DEVICE_GM, 7)
        s, d = np.frombuffer(src, np.uint8), np.frombuffer(dst, np.uint8)
        s[:] = np.random.default_rng(total).integers(0, 256, s.size, dtype=np.uint8)
        d[:] = POISON
        C.launch_hccl_stage(
            d0, src.addr + 3, src.lkey, dst.addr + 5, dst.lkey, total, cores, chunk_blocks * 32, 2, UB_BYTES, TIMEOUT_S
        ).wait(TIMEOUT_S)
        assert np.array_equal(d[5 : 5 + total], s[3 : 3 + total])
        assert (d[:5] == POISON).all() and (d[5 + total :] == POISON).all()


def test_hccl_stage_chunk_past_ub_overflows(C, emu):
    with emu.emulated_devices(1) as (d0,):
        src = d0.alloc_region(1 << 18, C.MemKind.DEVICE_GM, 7)
        dst = d0.alloc_region(1 << 18, C.MemKind.DEVICE_GM, 7)
        np.frombuffer(dst, np.uint8)[:] = POISON
        run = C.launch_hccl_stage(
            d0, src.addr, src.lkey, dst.addr, dst.lkey, 1 << 18, 2, 128 * 1024, 2, UB_BYTES, TIMEOUT_S
        )
        with pytest.raises(errors.CapacityError, match="UB overflow .* 262144 bytes .* holds 196608"):
            run.wait(TIMEOUT_S)
        assert (np.frombuffer(dst, np.uint8) == POISON).all()
        with pytest.raises(errors.AlignmentError, match="chunk_bytes 100"):
            C.launch_hccl_stage(d0, src.addr, src.lkey, dst.addr, dst.lkey, 64, 1, 100, 2, UB_BYTES, TIMEOUT_S)


def test_hccl_stage_refuses_ranges_outside_their_registrations(C, emu):
    """The cores copy through raw pointers, so the launcher checks both ranges as the NIC checks an SGE."""
    with emu.emulated_devices(2) as (d0, d1):
        src = d0.alloc_region(4096, C.MemKind.HOST_DRAM, 7)
        dst = d0.alloc_region(4096, C.MemKind.DEVICE_GM, 7)
        read_only = d0.alloc_region(4096, C.MemKind.DEVICE_GM, 4)
        other = d1.alloc_region(4096, C.MemKind.DEVICE_GM, 7)
        np.frombuffer(dst, np.uint8)[:] = POISON
        cases = [
            ((src.addr, 0, dst.addr, dst.lkey, 64), errors.NotRegistered, "source: lkey 0x0 names no live"),
            ((src.addr + 4000, src.lkey, dst.addr, dst.lkey, 200), errors.BoundsError, "source: local range"),
            ((src.addr, src.lkey, dst.addr + 1, dst.lkey, 4096), errors.BoundsError, "destination: local range"),
            ((src.addr, src.lkey, read_only.addr, read_only.lkey, 64), errors.AccessDenied, "destination: .*WRITE"),
            ((other.addr, other.lkey, dst.addr, dst.lkey, 64), errors.NotRegistered, "source: .*protection domain"),
        ]
        for (src_addr, src_lkey, dst_addr, dst_lkey, n), error, match in cases:
            with pytest.raises(error, match=f"hccl_stage {match}"):
                C.launch_hccl_stage(d0, src_addr, src_lkey, dst_addr, dst_lkey, n, 1, 4096, 2, UB_BYTES, TIMEOUT_S)
        assert (np.frombuffer(dst, np.uint8) == POISON).all()


def make_comm_pair(C, emu, devices, **config):
    comms = [C.HcclComm(d, r, 2, emu.comm_config(hcclBufferSize=8, **config)) for r, d in enumerate(devices)]
    infos = [c.local_info() for c in comms]
    for c in comms:
        c.connect(infos)
    return comms


@pytest.mark.parametrize("cores,per_round", [(1, 1), (3, 4), (8, 64)])
def test_aicpu_batch_write_delivers_through_the_server(C, emu, two_devices, poisoned, cores, per_round):
    c0, c1 = make_comm_pair(C, emu, two_devices)
    d0, _ = two_devices
    src = poisoned(d0, 1 << 16)
    fill_random(src, cores)
    c0.register_local(src.region)
    items = d0.alloc_region(64 * 32, C.MemKind.DEVICE_GM, 7)
    c0.register_local(items)
    window = np.frombuffer(c1.windows_in, np.uint8)
    window[: 1 << 16] = POISON
    lengths = [100 + 37 * i for i in range(29)]
    offsets = np.cumsum([0] + lengths[:-1]).tolist()
    issues = c0.batch_write_issues
    run = C.launch_aicpu_batch_write(
        c0,
        items.addr,
        np.array([src.addr + o for o in offsets], np.uint64),
        np.array([c1.windows_in.addr + 2 * o for o in offsets], np.uint64),
        np.array(lengths, np.uint64),
        1,
        cores,
        per_round,
        UB_BYTES,
        TIMEOUT_S,
    )
    status = run.wait(TIMEOUT_S)
    assert [s["code"] for s in status] == [C.CORE_OK] * cores
    assert c0.batch_write_issues == issues + 1  # one submission, from core 0, after SyncAll
    expected = np.full(1 << 16, POISON, np.uint8)
    for o, n in zip(offsets, lengths, strict=True):
        expected[2 * o : 2 * o + n] = src.view[o : o + n]
    assert np.array_equal(window[: 1 << 16], expected)
    assert run.hccl_done_vtime_ns > 0
    # the items the cores wrote are the 32-byte BatchWriteItem layout
    item = np.frombuffer(items, np.uint64)[:4]
    assert item.tolist() == [src.addr, c1.windows_in.addr, lengths[0], 1 << 32]


def test_aicpu_batch_write_refuses_bad_items_before_the_cores_start(C, emu, two_devices, poisoned):
    """What the AICPU server would reject when it serves the issue is refused at launch, so nothing moves."""
    c0, c1 = make_comm_pair(C, emu, two_devices)
    d0, _ = two_devices
    items = d0.alloc_region(4096, C.MemKind.DEVICE_GM, 7)
    c0.register_local(items)
    unregistered = d0.alloc_region(4096, C.MemKind.DEVICE_GM, 7)
    window = c1.windows_in

    def launch(local, remote, nbytes, items_addr=items.addr, peer=1):
        arrays = [np.array([v], np.uint64) for v in (local, remote, nbytes)]
        return C.launch_aicpu_batch_write(c0, items_addr, *arrays, peer, 2, 8, UB_BYTES, TIMEOUT_S)

    with pytest.raises(errors.NotRegistered, match="BatchWrite item 0: local address"):
        launch(unregistered.addr, window.addr, 64)
    with pytest.raises(errors.BoundsError, match="BatchWrite item 0: remote range .* on rank 1 runs past"):
        launch(c0.windows_out.addr, window.addr + window.size - 8, 64)
    with pytest.raises(errors.NotRegistered, match="BatchWrite item array"):
        launch(c0.windows_out.addr, window.addr, 64, items_addr=unregistered.addr)
    with pytest.raises(errors.ConfigError, match="peer rank 5 is outside world size 2"):
        launch(c0.windows_out.addr, window.addr, 64, peer=5)
    assert c0.batch_write_issues == 0


# ---- what hardware punishes --------------------------------------------------------------------


def test_doorbell_before_flush_fails_the_wqe(C, two_devices, poisoned):
    d0, d1 = two_devices
    src, dst = poisoned(d0), poisoned(d1)
    fill_random(src, 1)
    cq = d0.create_cq(16)
    qp = d0.create_qp(cq, None, 16, 4)
    C.launch_emu_probe(4, qp, src.addr, src.region.lkey, dst.addr, dst.region.rkey, 64).wait(TIMEOUT_S)
    [ok] = poll_all(cq, 1)
    assert ok.status == 0  # control: flushed, then rung
    dst.expect(0, src.view[:64])
    C.launch_emu_probe(3, qp, src.addr + 64, src.region.lkey, dst.addr + 64, dst.region.rkey, 64).wait(TIMEOUT_S)
    [bad] = poll_all(cq, 1)
    assert (bad.status, bad.syndrome) == (0x02, 12)  # LOCAL_QP_OPERATION_ERROR, UNFLUSHED_WQE
    assert "missing DataCacheCleanAndInvalid" in bad.detail
    dst.assert_intact()  # the unflushed WQE moved nothing


def test_unaligned_datacopy_raises(C, emu):
    with emu.emulated_devices(1) as (d0,):
        buf = d0.alloc_region(4096, C.MemKind.DEVICE_GM, 7)
        with pytest.raises(errors.AlignmentError, match="48 bytes is not a multiple of 32"):
            C.launch_emu_probe(1, local_addr=buf.addr).wait(TIMEOUT_S)


def test_ub_overflow_raises(C):
    with pytest.raises(errors.CapacityError, match="UB overflow on vector core 0: .* 204800 bytes .* holds 196608"):
        C.launch_emu_probe(2).wait(TIMEOUT_S)


def test_waitflag_without_setflag_raises(C):
    with pytest.raises(errors.ProtocolError, match="without a matching SetFlag"):
        C.launch_emu_probe(5).wait(TIMEOUT_S)
