"""The transfer engine on the emulator: bit-exact delivery for every kind, the gates, segmenting, notify
ordering, and injected failures at each step leaving no staging buffer held."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ascend_dualpath import errors
from ascend_dualpath.transport import (
    ChannelCapabilities,
    MemoryKind,
    MemorySegment,
    RemoteSlot,
    TransferKind,
    select_kind,
    split_segments,
)
from tests.conftest import POISON

MAX_PIECE = 4096
WINDOW_MB = 4
SLOT_BYTES = 1 << 20


class Channel:
    """Two emulated ranks; an engine on rank 0 writing into rank 1's window, which starts poisoned."""

    def __init__(self, C, emu, devices, **engine_kwargs):
        from ascend_dualpath.transport.emulator import EmulatedTransferEngine

        self.C = C
        self.devices = devices
        self.comms = [C.HcclComm(d, r, 2, emu.comm_config(hcclBufferSize=WINDOW_MB)) for r, d in enumerate(devices)]
        infos = [c.local_info() for c in self.comms]
        for c in self.comms:
            c.connect(infos)
        engine_kwargs.setdefault("max_single_aiv_payload", MAX_PIECE)
        engine_kwargs.setdefault("block_dim", 4)
        engine_kwargs.setdefault("sq_depth", 32)
        self.engine = EmulatedTransferEngine(self.comms[0], 1, timeout_s=10.0, **engine_kwargs)
        self.window = np.frombuffer(self.comms[1].windows_in, np.uint8)
        self.window[:] = POISON
        self.regions = []

    def source(self, nbytes, memory=MemoryKind.DEVICE, seed=0):
        kind = self.C.MemKind.HOST_DRAM if memory is MemoryKind.HOST else self.C.MemKind.DEVICE_GM
        region = self.devices[0].alloc_region(nbytes, kind, 7)
        view = np.frombuffer(region, np.uint8)
        view[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        self.comms[0].register_local(region)
        self.regions.append(region)
        return region, view

    def slot(self, offset=0, nbytes=SLOT_BYTES, rkey=None):
        w = self.comms[1].windows_in
        return RemoteSlot(1, w.addr + offset, nbytes, w.rkey if rkey is None else rkey)

    def assert_window(self, offset, data):
        expected = np.full(self.window.size, POISON, np.uint8)
        expected[offset : offset + len(data)] = data
        diff = np.flatnonzero(self.window != expected)
        assert diff.size == 0, f"{diff.size} window bytes differ, first at {diff[0]}"


@pytest.fixture
def channel(C, emu):
    with emu.emulated_devices(2) as devices:
        ch = Channel(C, emu, devices)
        yield ch
        ch.engine.close()


# ---- delivery ------------------------------------------------------------------------------------

SHAPES = [[1], [100, 4096, 3], [MAX_PIECE * 3], [MAX_PIECE * 3 + 1, 5000, 17], [777] * 61]


@pytest.mark.parametrize("kind", list(TransferKind))
@pytest.mark.parametrize("sizes", SHAPES, ids=lambda s: f"{len(s)}x{s[0]}")
def test_every_kind_delivers_bit_exact(channel, kind, sizes):
    memory = MemoryKind.HOST if kind is TransferKind.STAGING else MemoryKind.DEVICE
    region, view = channel.source(sum(sizes) + 64, memory, seed=len(sizes))
    offsets = np.cumsum([0] + sizes[:-1]) + 11  # unaligned sources
    sources = [MemorySegment.of_region(region, int(o), n) for o, n in zip(offsets, sizes, strict=True)]
    result = channel.engine.transfer(sources, channel.slot(offset=333), kind=kind)
    assert result.kind is kind and result.nbytes == sum(sizes)
    channel.assert_window(333, np.concatenate([view[o : o + n] for o, n in zip(offsets, sizes, strict=True)]))
    assert channel.engine.staging.num_held == 0
    assert result.complete_vtime_ns > result.start_vtime_ns


@pytest.mark.parametrize("kind", [None, TransferKind.AIV, TransferKind.STAGING, TransferKind.HOST])
def test_a_prepared_transfer_routes_once_and_delivers_every_time(channel, kind):
    """prepare() runs the gates and the split once; each submit of it moves the sources' current bytes exactly,
    under a fresh ticket and notify magic; a prepared transfer refuses another engine."""
    memory = MemoryKind.HOST if kind is TransferKind.STAGING else MemoryKind.DEVICE
    sizes = [777] * 61
    region, view = channel.source(sum(sizes) + 16, memory, seed=4)
    sources = [MemorySegment.of_region(region, 16 + i * 777, 777) for i in range(len(sizes))]
    prepared = channel.engine.prepare(sources, channel.slot(offset=64), notify_slot=2, kind=kind)
    assert prepared.selection.kind is (kind or TransferKind.AIV) and len(prepared.pieces) == 61
    tickets, magics = set(), set()
    for round_ in range(3):
        view[:] = np.random.default_rng(round_).integers(0, 256, view.size, dtype=np.uint8)
        ticket = prepared.submit()
        result = ticket.wait()
        tickets.add(ticket.id)
        magics.add(result.notify_magic)
        channel.assert_window(64, view[16 : 16 + sum(sizes)])
    assert len(tickets) == len(magics) == 3 and channel.engine.staging.num_held == 0
    with pytest.raises(errors.BoundsError, match="overflow the remote slot"):
        channel.engine.prepare(sources, channel.slot(nbytes=100))
    other = type(prepared)(
        object(), *[getattr(prepared, f) for f in ("sources", "remote", "notify_slot", "selection", "pieces")]
    )
    with pytest.raises(errors.ProtocolError, match="another engine"):
        channel.engine._submit_prepared(other)


def test_host_dram_source_on_the_host_path(channel):
    region, view = channel.source(10000, MemoryKind.HOST, seed=3)
    result = channel.engine.transfer([MemorySegment.of_region(region)], channel.slot(), kind="host")
    channel.assert_window(0, view)
    assert result.selection.decided_by == "override" and "staging" in result.selection.reason


@given(sizes=st.lists(st.integers(1, 3 * MAX_PIECE + 5), min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_aiv_delivery_property(C, emu, sizes, seed):
    with emu.emulated_devices(2) as devices:
        ch = Channel(C, emu, devices)
        region, view = ch.source(sum(sizes), seed=seed)
        offsets = np.cumsum([0] + sizes[:-1])
        result = ch.engine.transfer(
            [MemorySegment.of_region(region, int(o), n) for o, n in zip(offsets, sizes, strict=True)],
            ch.slot(offset=seed % 1000),
        )
        assert result.kind is TransferKind.AIV
        ch.assert_window(seed % 1000, view)
        ch.engine.close()


# ---- the gates -----------------------------------------------------------------------------------

D, H = MemoryKind.DEVICE, MemoryKind.HOST
BIG = MAX_PIECE + 1
SELECTION_TABLE = [
    # capability, protocol, memory, largest -> kind, decided_by, segmented
    (0x04, "RoCE", [D], 100, TransferKind.AIV, "addressable", False),
    (0x04, "RoCE", [D, D], BIG, TransferKind.AIV, "addressable", True),
    (0x04, "RoCE", [H], 100, TransferKind.STAGING, "addressable", False),
    (0x04, "RoCE", [D, H], BIG, TransferKind.STAGING, "addressable", True),
    (0x04, "HCCS", [D], 100, TransferKind.AICPU, "protocol", False),
    (0x04, "HCCS", [H], BIG, TransferKind.HOST, "protocol", False),
    (0x05, "RoCE", [D], 100, TransferKind.AIV, "addressable", False),
    (0x00, "RoCE", [D], BIG, TransferKind.AICPU, "capability", False),
    (0x00, "RoCE", [H], 100, TransferKind.HOST, "capability", False),
    (0x03, "HCCS", [D, H], 100, TransferKind.HOST, "capability", False),
]


@pytest.mark.parametrize("bitmap,protocol,memory,largest,kind,gate,segmented", SELECTION_TABLE)
def test_selection_table(bitmap, protocol, memory, largest, kind, gate, segmented):
    sel = select_kind(ChannelCapabilities(bitmap, protocol, MAX_PIECE), memory, largest)
    assert (sel.kind, sel.decided_by, sel.segmented) == (kind, gate, segmented)
    assert sel.gates[-1].gate == gate or sel.gates[-1].gate == "payload"
    assert [g.passed for g in sel.gates if g.gate != "payload"][-1] == (kind in (TransferKind.AIV,))
    assert sel.reason


def test_engine_without_the_aiv_dataplane_bit_uses_aicpu(C, emu):
    with emu.emulated_devices(2, capability_bitmap=0) as devices:
        ch = Channel(C, emu, devices)
        region, view = ch.source(3 * MAX_PIECE)
        result = ch.engine.transfer([MemorySegment.of_region(region)], ch.slot())
        assert (result.kind, result.selection.decided_by) == (TransferKind.AICPU, "capability")
        assert "0x0" in result.selection.gates[0].detail
        ch.assert_window(0, view)
        ch.engine.close()


def test_engine_over_hccs_falls_back(C, emu):
    with emu.emulated_devices(2) as devices:
        ch = Channel(C, emu, devices, protocol="HCCS")
        region, view = ch.source(5000, MemoryKind.HOST)
        result = ch.engine.transfer([MemorySegment.of_region(region)], ch.slot())
        assert (result.kind, result.selection.decided_by) == (TransferKind.HOST, "protocol")
        ch.assert_window(0, view)
        ch.engine.close()


def test_forcing_aiv_on_host_dram_is_refused(channel):
    region, _ = channel.source(100, MemoryKind.HOST)
    with pytest.raises(errors.ConfigError, match=r"kind 'aiv' needs device-memory sources; sources \[0\]"):
        channel.engine.submit([MemorySegment.of_region(region)], channel.slot(), kind="aiv")
    channel.assert_window(0, [])


# ---- segmenting ----------------------------------------------------------------------------------


@given(k=st.integers(1, 40), extra=st.sampled_from([0, 1]), max_piece=st.integers(1, 1 << 20))
def test_split_is_exact_at_k_max_and_k_max_plus_one(k, extra, max_piece):
    nbytes = k * max_piece + extra
    pieces = split_segments([MemorySegment(1000, nbytes, D, 7)], RemoteSlot(1, 5000, nbytes, 9), max_piece)
    assert len(pieces) == k + extra
    assert all(p.nbytes == max_piece for p in pieces[:k]) and sum(p.nbytes for p in pieces) == nbytes
    assert [p.remote_addr - 5000 for p in pieces] == [p.local_addr - 1000 for p in pieces]
    if extra:
        assert pieces[-1].nbytes == 1


@pytest.mark.parametrize("extra", [0, 1])
@pytest.mark.parametrize("kind", [TransferKind.AIV, TransferKind.STAGING])
def test_engine_segments_exactly(channel, kind, extra):
    nbytes = 5 * MAX_PIECE + extra
    memory = MemoryKind.HOST if kind is TransferKind.STAGING else MemoryKind.DEVICE
    region, view = channel.source(nbytes, memory)
    ticket = channel.engine.submit([MemorySegment.of_region(region)], channel.slot(), kind=kind)
    assert [p.nbytes for p in ticket.pieces] == [MAX_PIECE] * 5 + [1] * extra
    assert ticket.wait().num_pieces == 5 + extra
    channel.assert_window(0, view)


def test_sources_overflowing_the_slot_are_refused(channel):
    region, _ = channel.source(200)
    with pytest.raises(errors.BoundsError, match="200 source bytes overflow the remote slot of 199 bytes on rank 1"):
        channel.engine.submit([MemorySegment.of_region(region)], channel.slot(nbytes=199))
    with pytest.raises(errors.EmptyTransfer):
        channel.engine.submit([], channel.slot())
    channel.assert_window(0, [])


# ---- notify ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(TransferKind))
def test_remote_ready_is_published_after_every_piece(channel, kind):
    memory = MemoryKind.HOST if kind is TransferKind.STAGING else MemoryKind.DEVICE
    region, view = channel.source(20 * MAX_PIECE + 5, memory, seed=9)
    receiver = channel.comms[1]
    before = receiver.notify_value(7)
    seen = {}

    def watch():  # the receiver snapshots its window the moment the flag flips
        deadline = time.monotonic() + 10
        while receiver.notify_value(7) == before and time.monotonic() < deadline:
            pass
        seen["window"] = channel.window[: view.size].copy()

    watcher = threading.Thread(target=watch)
    watcher.start()
    result = channel.engine.transfer([MemorySegment.of_region(region)], channel.slot(), notify_slot=7, kind=kind)
    watcher.join()
    assert result.notify_magic == receiver.notify_value(7) != before
    receiver.notify_wait(7, result.notify_magic, 1.0)
    assert np.array_equal(seen["window"], view)


# ---- injected failures -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [TransferKind.AIV, TransferKind.STAGING])
def test_error_completion_raises_and_releases(channel, kind):
    memory = MemoryKind.HOST if kind is TransferKind.STAGING else MemoryKind.DEVICE
    region, view = channel.source(10 * MAX_PIECE, memory)
    sources = [MemorySegment.of_region(region)]
    before = channel.comms[1].notify_value(3)
    stale = channel.slot(rkey=channel.comms[1].windows_in.rkey ^ 0x80)  # a stale generation of the key
    with pytest.raises(errors.InvalidKey, match="segment 0: rkey .* names no live registration"):
        channel.engine.submit(sources, stale, notify_slot=3, kind=kind)  # refused before anything moves
    # a destination deregistered after the submit's checks and before the NIC executes: only the NIC sees it
    target = channel.devices[1].alloc_region(10 * MAX_PIECE, channel.C.MemKind.DEVICE_GM, 7)
    nic = channel.devices[0].nic
    nic.set_paused(True)
    ticket = channel.engine.submit(
        sources, RemoteSlot(1, target.addr, target.size, target.rkey), notify_slot=3, kind=kind
    )
    target.close()
    nic.set_paused(False)
    with pytest.raises(errors.InvalidKey, match="REMOTE_ACCESS_ERROR"):
        ticket.wait()
    assert channel.engine.staging.num_held == 0
    assert channel.comms[1].notify_value(3) == before  # never published
    channel.assert_window(0, [])
    with pytest.raises(errors.ProtocolError, match="already failed"):
        ticket.wait()
    # the queues were reset: the next transfer goes through
    channel.engine.transfer([MemorySegment.of_region(region)], channel.slot(), kind=kind)
    channel.assert_window(0, view)


def test_aicpu_rejection_raises(channel):
    region, _ = channel.source(100)
    outside = RemoteSlot(1, channel.comms[1].windows_in.addr + (WINDOW_MB << 20) - 50, 100, 0)
    with pytest.raises(errors.BoundsError, match="BatchWrite item 0"):
        channel.engine.transfer([MemorySegment.of_region(region)], outside, kind="aicpu")
    channel.assert_window(0, [])


def test_staging_allocation_failure_holds_nothing(C, emu):
    with emu.emulated_devices(2) as devices:
        ch = Channel(C, emu, devices, staging_capacity=8192)
        big, _ = ch.source(8193, MemoryKind.HOST)
        with pytest.raises(
            errors.CapacityError, match="staging allocation of 8193 bytes failed: .* 8192 bytes has 8192 free"
        ):
            ch.engine.submit([MemorySegment.of_region(big)], ch.slot())
        assert ch.engine.staging.num_held == 0
        small, view = ch.source(8192, MemoryKind.HOST)
        result = ch.engine.transfer([MemorySegment.of_region(small)], ch.slot())
        assert result.kind is TransferKind.STAGING and ch.engine.staging.peak_bytes == 8192
        ch.assert_window(0, view)
        ch.engine.close()


@pytest.mark.parametrize("kind", [TransferKind.AIV, TransferKind.STAGING])
def test_post_error_when_the_sq_never_drains(C, emu, kind):
    with emu.emulated_devices(2) as devices:
        ch = Channel(C, emu, devices, sq_depth=4, block_dim=1)
        memory = MemoryKind.HOST if kind is TransferKind.STAGING else MemoryKind.DEVICE
        region, _ = ch.source(10 * MAX_PIECE, memory)
        ch.engine.timeout_s = 0.3  # the kernel's bound on each wait for SQ space
        devices[0].nic.set_paused(True)  # nothing retires
        ticket = ch.engine.submit([MemorySegment.of_region(region)], ch.slot(), notify_slot=1, kind=kind)
        with pytest.raises(errors.QueueError, match=r"post failed .* vector cores \[0\] stayed full .* 3 of 10 pieces"):
            ticket.wait(timeout_s=10.0)
        assert ch.engine.staging.num_held == 0
        ch.assert_window(0, [])
        with pytest.raises(errors.QueueError, match="unusable after an earlier failure"):
            ch.engine.submit([MemorySegment.of_region(region)], ch.slot(), kind=kind)


@pytest.mark.parametrize("kind", [TransferKind.AIV, TransferKind.STAGING])
def test_a_timed_out_wait_leaves_the_transfer_in_flight_until_a_later_wait_ends_it(C, emu, kind):
    """A timeout is not an ending: the bytes may still land, so the ticket keeps its staging and blocks the
    engine's next submit until a later wait sees every completion."""
    with emu.emulated_devices(2) as devices:
        ch = Channel(C, emu, devices)
        memory = MemoryKind.HOST if kind is TransferKind.STAGING else MemoryKind.DEVICE
        region, view = ch.source(2 * MAX_PIECE, memory)
        sources = [MemorySegment.of_region(region)]
        devices[0].nic.set_paused(True)  # the NIC executes nothing: the posts fit in the SQ, no CQE comes
        ticket = ch.engine.submit(sources, ch.slot(), notify_slot=2, kind=kind)
        for _ in range(2):  # a timed-out wait may time out again
            with pytest.raises(errors.WaitTimeout, match=r"completions of ticket .*: 0 of 2 posted WQEs completed"):
                ticket.wait(timeout_s=0.05)
        assert not ticket.finished and ticket.error is None
        assert ch.engine.staging.num_held == (1 if kind is TransferKind.STAGING else 0)
        assert ch.comms[1].notify_value(2) == 0
        ch.assert_window(0, [])
        with pytest.raises(errors.QueueError, match=f"ticket {ticket.id} is still in flight"):
            ch.engine.submit(sources, ch.slot(), kind=kind)
        devices[0].nic.set_paused(False)  # the late bytes land
        result = ticket.wait(timeout_s=10.0)
        assert ticket.finished and result.nbytes == 2 * MAX_PIECE and ticket.wait() is result
        assert ch.engine.staging.num_held == 0
        assert ch.comms[1].notify_value(2) == result.notify_magic != 0
        ch.assert_window(0, view)
        ch.engine.transfer(sources, ch.slot(4 * MAX_PIECE), kind=kind)  # the engine goes on
        ch.assert_window(0, np.concatenate([view, np.full(2 * MAX_PIECE, POISON, np.uint8), view]))
        ch.engine.close()


# ---- registration --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["aiv", "aicpu", "host"])
def test_a_source_unregistered_from_the_engine_is_refused_and_moves_nothing(channel, C, kind):
    region = channel.devices[0].alloc_region(8192, C.MemKind.DEVICE_GM, 7)
    channel.regions.append(region)
    np.frombuffer(region, np.uint8)[:] = 7
    channel.engine.register(region)
    segment = MemorySegment.of_region(region)
    assert channel.engine.transfer([segment], channel.slot(), kind=kind).nbytes == 8192
    channel.window[:] = POISON
    prepared = channel.engine.prepare([segment], channel.slot(), kind=kind)
    channel.engine.unregister(region)
    for submit in (lambda: channel.engine.submit([segment], channel.slot(), kind=kind), prepared.submit):
        with pytest.raises(errors.NotRegistered, match="unregistered"):
            submit()
    channel.assert_window(0, np.zeros(0, np.uint8))
    with pytest.raises(errors.NotRegistered, match="not registered"):
        channel.engine.unregister(region)
    channel.engine.register(region)  # registered again, it is a source again
    assert channel.engine.transfer([segment], channel.slot(), kind=kind).nbytes == 8192
