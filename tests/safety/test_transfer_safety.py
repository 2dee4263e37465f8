"""Memory safety, the transfer rows: every byte-moving path refuses a bad request at submit, before anything moves.

Each test is one row of the issue's table. Cases that crashed the process before the fix (raw copies from addresses no
region holds) run in a child interpreter that must exit normally; every region of both ranks is watched and must hold
exactly what the test expects afterwards.
"""

from __future__ import annotations

import math
import textwrap
import time

import numpy as np
import pytest

from ascend_dualpath import errors
from ascend_dualpath.transport import MemorySegment, TransferKind
from tests.safety.rig import Rig, run_child

CHILD_PRELUDE = """
import numpy as np
from ascend_dualpath import errors
from ascend_dualpath.backends import emulator as emu
from ascend_dualpath.transport import MemoryKind, MemorySegment, RemoteSlot
from ascend_dualpath.transport.emulator import EmulatedTransferEngine
from tests.safety.rig import Rig, assert_refused
H, D = MemoryKind.HOST, MemoryKind.DEVICE
UB = 192 * 1024
"""


def child(body: str) -> None:
    """Run ``body`` (indented code) after CHILD_PRELUDE in a child; it must print ``ok`` and exit 0."""
    out = run_child(CHILD_PRELUDE + textwrap.dedent(body) + "\nprint('ok')\n")
    assert out.strip().endswith("ok"), out


def test_d01_staging_aicpu_and_host_refuse_addresses_no_region_holds():
    """A raw address, a freed tensor's memory and a closed region: refused at submit on every kind, and by the kernel
    launchers themselves; nothing moves, and the engine still works."""
    child("""
        import torch
        with emu.emulated_devices(2) as devices:
            rig = Rig(devices)
            C = rig.C
            tensor = torch.empty(1 << 20, dtype=torch.uint8)
            freed = tensor.data_ptr()
            del tensor  # a 1 MiB block goes back to the system: the address is unmapped
            region = devices[0].alloc_region(8192, C.MemKind.HOST_DRAM, 7)
            closed = MemorySegment.of_region(region)
            region.close()
            del region
            cases = [("staging", MemorySegment(0x10, 4096, H, 0)), ("staging", MemorySegment(freed, 4096, H, 0)),
                     ("staging", closed), ("aicpu", MemorySegment(0x10, 4096, D, 0)),
                     ("aicpu", MemorySegment(freed, 4096, D, 0)), ("aiv", MemorySegment(0x10, 4096, D, 0)),
                     ("host", MemorySegment(0x10, 4096, H, 0)), ("host", closed)]
            for kind, segment in cases:
                assert_refused(lambda: rig.engine.submit([segment], rig.slot(), notify_slot=1, kind=kind),
                               errors.NotRegistered, "names no live registration")
            assert rig.engine.staging.num_held == 0
            window = rig.comms[0].windows_out
            assert_refused(lambda: C.launch_hccl_stage(devices[0], freed, 0, window.addr, window.lkey, 4096, 1, 4096,
                                                       2, UB, 5.0), errors.NotRegistered, "hccl_stage source: lkey")
            items = devices[0].alloc_region(4096, C.MemKind.DEVICE_GM, 7)
            rig.comms[0].register_local(items)
            arrays = [np.array([a], np.uint64) for a in (0x10, rig.comms[1].windows_in.addr, 64)]
            assert_refused(lambda: C.launch_aicpu_batch_write(rig.comms[0], items.addr, *arrays, 1, 2, 8, UB, 5.0),
                           errors.NotRegistered, "BatchWrite item 0: local address 0x10")
            rig.assert_intact()
            src = rig.source("src", 10000, host=True)
            rig.engine.transfer([MemorySegment.of_region(src)], rig.slot(), kind="staging")
            rig.expect("rank1.windows_in", 0, rig.view("src"))
            rig.expect("rank0.windows_out", 0, rig.view("src"))
            rig.assert_intact()
    """)


def test_d02_a_staging_pool_larger_than_the_window_is_refused():
    """The pool must fit windows_out (ConfigError naming both sizes); a request larger than the pool is refused, and
    the stage kernel's launcher refuses a destination past the window whatever the engine asks."""
    child("""
        with emu.emulated_devices(2) as devices:
            rig = Rig(devices)
            C = rig.C
            assert_refused(lambda: EmulatedTransferEngine(rig.comms[0], 1, staging_capacity=1 << 30),
                           errors.ConfigError,
                           "staging_capacity 1073741824 bytes exceeds the HCCL window windows_out of 4194304 bytes")
            src = rig.source("src", 6 << 20, host=True)
            dst = devices[1].alloc_region(8 << 20, C.MemKind.DEVICE_GM, 7)
            rig.watch("dst", dst)
            slot = RemoteSlot(1, dst.addr, 8 << 20, dst.rkey)
            assert_refused(lambda: rig.engine.submit([MemorySegment.of_region(src)], slot), errors.CapacityError,
                           "staging allocation of 6291456 bytes failed: the HCCL window pool of 4194304 bytes")
            window = rig.comms[0].windows_out
            past_end = window.addr + window.size - 4096
            assert_refused(lambda: C.launch_hccl_stage(devices[0], src.addr, src.lkey, past_end, window.lkey, 8192, 2,
                                                       4096, 2, UB, 5.0),
                           errors.BoundsError, r"hccl_stage destination: local range .* is outside region lkey")
            rig.assert_intact()  # rank 0's windows_in (after windows_out) above all
    """)


def test_d03_a_segment_longer_than_its_region_is_refused_on_every_kind():
    """A segment that runs past the registration its lkey names: BoundsError at submit (staging, host, host per piece,
    aiv, aicpu); the neighbouring memory is never sent."""
    child("""
        with emu.emulated_devices(2) as devices:
            rig = Rig(devices)
            host = rig.source("host", 1000, host=True)
            device = rig.source("device", 1000)
            per_piece = EmulatedTransferEngine(rig.comms[0], 1, block_dim=1, sq_depth=32, max_single_aiv_payload=4096,
                                               host_call_per_piece=True, timeout_s=5.0)
            cases = [(rig.engine, "staging", host, H), (rig.engine, "host", host, H), (per_piece, "host", host, H),
                     (rig.engine, "aiv", device, D), (rig.engine, "aicpu", device, D), (rig.engine, "staging", device, D)]
            for engine, kind, region, memory in cases:
                for offset, nbytes in [(0, 1 << 20), (500, 1000), (999, 2)]:
                    segment = MemorySegment(region.addr + offset, nbytes, memory, region.lkey)
                    assert_refused(lambda: engine.submit([segment], rig.slot(nbytes=2 << 20), kind=kind), errors.BoundsError,
                                   r"local range .* is outside region lkey")
            per_piece.close()
            assert rig.engine.staging.num_held == 0
            rig.assert_intact()
    """)


def test_d10_submit_on_a_closed_engine_raises_at_once(emu):
    with emu.emulated_devices(2) as devices:
        rig = Rig(devices, timeout_s=3.0)
        src = rig.source("src", 5000)
        in_flight = rig.engine.submit([MemorySegment.of_region(src, 0, 100)], rig.slot())
        in_flight.wait()
        rig.expect("rank1.windows_in", 0, rig.view("src")[:100])
        devices[0].nic.set_paused(True)  # the next ticket cannot complete before the close
        pending = rig.engine.submit([MemorySegment.of_region(src)], rig.slot(), kind="aiv")
        rig.engine.close()
        started = time.monotonic()
        with pytest.raises(errors.QueueError, match=r"EmulatedTransferEngine\(rank 0 -> peer 1\) was closed"):
            pending.wait()
        for kind in TransferKind:
            with pytest.raises(errors.QueueError, match=r"EmulatedTransferEngine\(rank 0 -> peer 1\) is closed"):
                rig.engine.submit([MemorySegment.of_region(src)], rig.slot(), kind=kind)
        rig.engine.close()  # closing twice is harmless
        assert time.monotonic() - started < 1.0
        rig.assert_intact()


@pytest.mark.parametrize("kind", list(TransferKind))
def test_d11_a_notify_slot_out_of_range_is_refused_before_the_data_moves(emu, kind):
    with emu.emulated_devices(2) as devices:
        rig = Rig(devices)
        src = rig.source("src", 3 * 4096 + 5, host=kind is TransferKind.STAGING)
        segment = MemorySegment.of_region(src)
        for slot in (1024, -1, 1 << 40):
            with pytest.raises(errors.BoundsError, match=rf"notify slot {slot!r} is outside \[0, 1024\)"):
                rig.engine.submit([segment], rig.slot(), notify_slot=slot, kind=kind)
        with pytest.raises(errors.ArgumentTypeError, match="notify_slot must be int or None, got float"):
            rig.engine.submit([segment], rig.slot(), notify_slot=2.0, kind=kind)
        prepared = rig.engine.prepare([segment], rig.slot(), notify_slot=1024, kind=kind)
        with pytest.raises(errors.BoundsError, match="notify slot 1024"):
            prepared.submit()
        rig.assert_intact()  # no data landed, no flag was written
        result = rig.engine.transfer([segment], rig.slot(), notify_slot=1023, kind=kind)
        assert rig.comms[1].notify_value(1023) == result.notify_magic


CONSTRUCTOR_CASES = [
    ({"max_pieces": 0}, "max_pieces 0 is outside"),
    ({"peer": -1}, r"peer -1 is outside \[0, 1\]"),
    ({"peer": 2}, r"peer 2 is outside \[0, 1\]"),
    ({"peer": 1.0}, r"peer 1.0 is outside"),
    ({"block_dim": 0}, r"block_dim 0 is outside \[1, 48\]"),
    ({"sq_depth": 48}, "sq_depth 48 is not a power of two"),
    ({"doorbell_batch": 0}, r"doorbell_batch 0 is outside \[1, 4294967295\]"),
    ({"max_single_aiv_payload": 0}, "max_single_aiv_payload 0 is outside"),
    ({"stage_chunk_bytes": 100}, "stage_chunk_bytes 100 is not a multiple of 32"),
    ({"stage_chunk_bytes": 1 << 20}, r"stage_chunk_bytes 1048576 is outside \[32, 98304\]"),
    ({"staging_capacity": 0}, "staging_capacity 0 is outside"),
    ({"timeout_s": math.nan}, "timeout_s must be a finite number > 0, got nan"),
    ({"timeout_s": 0}, "timeout_s must be > 0, got 0"),
]


def test_d12_engine_arguments_are_validated_by_name(emu):
    """Each bad constructor argument raises ConfigError naming it, its value and its range; so does a bad wait bound."""
    from ascend_dualpath.transport.emulator import EmulatedTransferEngine

    with emu.emulated_devices(2) as devices:
        rig = Rig(devices)
        for kwargs, match in CONSTRUCTOR_CASES:
            args = {"peer": 1, "sq_depth": 32, **kwargs}
            peer = args.pop("peer")
            with pytest.raises(errors.ConfigError, match=match):
                EmulatedTransferEngine(rig.comms[0], peer, **args)
        src = rig.source("src", 100)
        ticket = rig.engine.submit([MemorySegment.of_region(src)], rig.slot())
        with pytest.raises(errors.ConfigError, match="timeout_s must be a finite number >= 0, got inf"):
            ticket.wait(math.inf)
        ticket.wait()


BAD_FIGURES = [0.0, -1.0, math.nan, math.inf]
RATES = ["link_bytes_per_ns", "pcie_bytes_per_ns", "local_bytes_per_ns", "link_latency_ns", "pcie_latency_ns"]
STEPS = ["aiv_submit_ns", "aicpu_issue_ns", "aicpu_wqe_ns", "host_submit_ns", "nic_wqe_ns"]


def test_d13_cost_model_profile_and_depths_reject_non_positive_nan_and_inf(C, emu):
    from ascend_dualpath.transport.emulator import EmulatedTransferEngine

    for field in RATES:
        for value in BAD_FIGURES:
            with pytest.raises(errors.ConfigError, match=rf"CostModel.{field} must be finite and > 0, got {value:g}"):
                emu.cost_model(**{field: value})
    for field in STEPS:
        emu.cost_model(**{field: 0.0})  # a free step is a valid model
        for value in BAD_FIGURES[1:]:
            with pytest.raises(errors.ConfigError, match=rf"CostModel.{field} must be finite and >= 0, got {value:g}"):
                emu.cost_model(**{field: value})
    by_hand = C.CostModel()
    by_hand.link_latency_ns = math.nan  # past cost_model(): the device checks it too
    fabric = emu.create_fabric()
    try:
        with pytest.raises(errors.ConfigError, match="CostModel.link_latency_ns must be finite and > 0, got nan"):
            emu.open_device(fabric, cost=by_hand)
        profile = C.ProductProfile("A2")
        profile.sq_depth = 0
        with pytest.raises(errors.ConfigError, match=r"ProductProfile.sq_depth 0 is outside \[2, 32768\]"):
            C.Device(fabric, 0, profile, C.CostModel())
    finally:
        fabric.close()
    for overrides, match in [
        ({"sq_depth": 0}, r"sq_depth 0 is outside \[2, 32768\]"),
        ({"sq_depth": 48}, "sq_depth 48 is not a power of two"),
        ({"vector_cores": 0}, r"vector_cores 0 is outside \[1, 1024\]"),
        ({"ub_bytes": 100}, "ub_bytes 100 is not a multiple of 32"),
        ({"rdma_sl": 9}, r"rdma_sl 9 is outside \[0, 7\]"),
    ]:
        with pytest.raises(errors.ConfigError, match=f"ProductProfile.{match}"):
            emu.product_profile(**overrides)
    with emu.emulated_devices(2) as devices:
        rig = Rig(devices)
        with pytest.raises(errors.ConfigError, match=r"sq_depth 0 is outside \[2, 32768\]"):
            EmulatedTransferEngine(rig.comms[0], 1, sq_depth=0)


def test_d18_a_cq_overrun_is_reported_on_the_first_poll(C, emu):
    """As a RoCE CQ overrun is an error event of the whole CQ, the first poll after it raises (and every later one),
    instead of handing out the 4 entries that fit as if they were all."""
    with emu.emulated_devices(2) as (d0, d1):
        rig_src = d0.alloc_region(4096, C.MemKind.DEVICE_GM, 7)
        dst = d1.alloc_region(4096, C.MemKind.DEVICE_GM, 7)
        src_view, dst_view = np.frombuffer(rig_src, np.uint8), np.frombuffer(dst, np.uint8)
        src_view[:] = np.arange(4096) % 251
        dst_view[:] = 0xA5
        cq = d0.create_cq(4)
        qp = d0.create_qp(cq, None, 32, 4)
        qp.post(
            [C.WorkRequest(3, rig_src.addr + 8 * i, rig_src.lkey, 8, dst.addr + 8 * i, dst.rkey) for i in range(20)],
            0.0,
            10.0,
        )
        qp.drain(10.0)
        for _ in range(2):
            with pytest.raises(errors.QueueError, match=r"depth 4\) overran: 16 completions found it full"):
                cq.poll(32, 0.0)
        expected = np.full(4096, 0xA5, np.uint8)
        expected[:160] = src_view[:160]
        assert np.array_equal(dst_view, expected)  # the WQEs executed; only their completions were lost
