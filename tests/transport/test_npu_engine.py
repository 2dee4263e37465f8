"""The NPU transfer engine on the CPU, over a fake of ``_C.npu_transfer`` (nothing here touches an NPU).

The fake keeps the native module's contract (raw return codes, an event per put, an async error slot) and moves
bytes between CPU tensors when a put's event completes, so the engine's gates, range checks, registration order,
error naming and wait bounds are checked end to end, bit-exact.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import time

import pytest
import torch

from ascend_dualpath import errors as E
from ascend_dualpath.transport import MemoryKind, MemorySegment, RemoteSlot, TransferKind, npu

COMM, PEER, DEVICE = 0xC0, 1, 0


class FakeNative:
    """The native module's contract over host memory; ``rcs`` forces a return code per call name."""

    def __init__(self, missing=(), polls_to_complete=2):
        self.calls: list[tuple] = []
        self.rcs: dict[str, int] = {}
        self.missing = list(missing)
        self.device = DEVICE
        self.polls_to_complete = polls_to_complete  # None: a put never completes
        self.async_error = None
        self.events: dict[int, dict] = {}
        self.pending: list = []  # descriptors of puts queued without an event
        self._next = 0x1000

    def _handle(self):
        self._next += 0x10
        return self._next

    def missing_symbols(self):
        return self.missing

    def register_global_mem(self, addr, nbytes, is_device):
        self.calls.append(("register_global_mem", addr, nbytes, is_device))
        return self.rcs.get("HcclRegisterGlobalMem", 0), self._handle()

    def deregister_global_mem(self, handle):
        self.calls.append(("deregister_global_mem", handle))
        return self.rcs.get("HcclDeregisterGlobalMem", 0)

    def comm_bind_mem(self, comm, handle):
        self.calls.append(("comm_bind_mem", comm, handle))
        return self.rcs.get("HcclCommBindMem", 0)

    def comm_unbind_mem(self, comm, handle):
        self.calls.append(("comm_unbind_mem", comm, handle))
        return self.rcs.get("HcclCommUnbindMem", 0)

    def comm_prepare(self, comm, timeout_s):
        self.calls.append(("comm_prepare", comm, timeout_s))
        return self.rcs.get("HcclCommPrepare", 0)

    def current_device(self):
        return self.rcs.get("aclrtGetDevice", 0), self.device

    def create_event(self):
        event = self._handle()
        self.events[event] = {"descs": None, "polls": 0, "destroyed": False}
        return self.rcs.get("aclrtCreateEventWithFlag", 0), event

    def destroy_event(self, event):
        self.events[event]["destroyed"] = True
        return self.rcs.get("aclrtDestroyEvent", 0)

    def enqueue_batch_put(self, comm, remote_rank, descs, event):
        assert descs.dtype == torch.int64 and descs.dim() == 2 and descs.shape[1] == 3
        self.calls.append(("enqueue_batch_put", comm, remote_rank, descs.tolist(), event))
        self.pending += descs.tolist()
        if event:  # recorded after this put: everything queued so far completes with it
            self.events[event]["descs"], self.pending = self.pending, []
        if "HcclBatchPut" in self.rcs:
            self.async_error = ("HcclBatchPut", self.rcs["HcclBatchPut"])

    def take_async_error(self):
        out, self.async_error = self.async_error, None
        return out

    def query_event(self, event):
        state = self.events[event]
        state["polls"] += 1
        done = self.polls_to_complete is not None and state["polls"] >= self.polls_to_complete
        if done and state["descs"] is not None:
            for local, remote, nbytes in state["descs"]:
                ctypes.memmove(remote, local, nbytes)
            state["descs"] = None
        return self.rcs.get("aclrtQueryEventStatus", 0), done


def _engine(fake=None, notify_slots=0, remote=None, **options):
    fake = FakeNative() if fake is None else fake
    notify = torch.zeros(notify_slots, dtype=torch.int64) if notify_slots else None
    remote_addr = remote.data_ptr() + remote.numel() - notify_slots * 8 if notify_slots else None
    engine = npu.NpuTransferEngine(
        COMM, PEER, DEVICE, notify=notify, notify_remote_addr=remote_addr, native_module=fake, **options
    )
    return engine, fake


def _names(fake):
    return [c[0] for c in fake.calls]


@pytest.fixture
def memory():
    """A local source buffer and the peer's destination buffer (both host tensors standing in for HBM)."""
    src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)  # 16 KiB of distinct bytes
    dst = torch.full((16384 + 64,), 0xEE, dtype=torch.uint8)  # poisoned; the last 64 bytes hold notify slots
    return src, dst


def _ready(engine, src, dst):
    engine.register(src.data_ptr(), src.numel())
    engine.add_remote_region(dst.data_ptr(), dst.numel())
    engine.prepare_comm(30)


# ---- import and availability --------------------------------------------------------------------------------


def test_module_imports_without_torch_npu():
    code = (
        "import sys; sys.modules['torch_npu'] = None; import ascend_dualpath.transport.npu as m; "
        "assert 'torch_npu' not in sys.modules or sys.modules['torch_npu'] is None; print(m.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ascend_dualpath.transport.npu" in out.stdout, out.stderr[-2000:]


def test_docstring_says_not_run_on_hardware():
    assert "not yet run on hardware" in npu.__doc__.lower()
    assert "not yet run on hardware" in npu.NpuTransferEngine.__doc__.lower()


def test_missing_hcomm_symbols_make_the_engine_unavailable_by_name():
    with pytest.raises(E.BackendUnavailable, match="HcclCommBindMem, HcclCommPrepare"):
        _engine(FakeNative(missing=["HcclCommBindMem", "HcclCommPrepare"]))


# ---- error-code naming --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, rc, name",
    [
        ("HcclBatchPut", 1, "HCCL_E_PARA (1)"),
        ("HcclCommPrepare", 9, "HCCL_E_TIMEOUT (9)"),
        ("HcclCommBindMem", 5, "HCCL_E_NOT_SUPPORT (5)"),
        ("HcclRegisterGlobalMem", 24, "HCCL_E_OOM (24)"),
        ("aclrtQueryEventStatus", 507002, "ACL_ERROR_RT_STREAM_TASK_FULL (507002)"),
        ("aclrtGetDevice", 100000, "ACL_ERROR_INVALID_PARAM (100000)"),
        ("aclrtRecordEvent", 424242, "unknown code (424242)"),
    ],
)
def test_return_codes_are_named(call, rc, name):
    assert npu.code_name(call, rc) == name
    with pytest.raises(E.DeviceError, match=rf"{call} returned {name.replace('(', '[(]').replace(')', '[)]')}"):
        npu.check(call, rc, "in a test")
    npu.check(call, 0, "in a test")


def test_every_hccl_result_of_the_wheel_header_has_a_name():
    assert sorted(npu.HCCL_RESULT_NAMES) == list(range(25))


# ---- registration order -------------------------------------------------------------------------------------


def test_register_binds_then_prepare_then_put(memory):
    src, dst = memory
    engine, fake = _engine()
    _ready(engine, src, dst)
    engine.transfer([MemorySegment(src.data_ptr(), 1024, MemoryKind.DEVICE)], RemoteSlot(PEER, dst.data_ptr(), 1024))
    assert _names(fake) == ["register_global_mem", "comm_bind_mem", "comm_prepare", "enqueue_batch_put"]
    handle = fake.calls[0]
    assert fake.calls[1] == ("comm_bind_mem", COMM, fake.calls[1][2]) and fake.calls[2] == ("comm_prepare", COMM, 30)
    assert handle[1:] == (src.data_ptr(), src.numel(), True)


def test_no_put_before_prepare_or_after_a_new_registration(memory):
    src, dst = memory
    engine, fake = _engine()
    engine.register(src.data_ptr(), 8192)
    engine.add_remote_region(dst.data_ptr(), dst.numel())
    seg, slot = [MemorySegment(src.data_ptr(), 64, MemoryKind.DEVICE)], RemoteSlot(PEER, dst.data_ptr(), 64)
    with pytest.raises(E.ProtocolError, match="call prepare_comm"):
        engine.submit(seg, slot)
    engine.prepare_comm()
    engine.transfer(seg, slot)
    engine.register(src.data_ptr() + 8192, 8192)  # a new registration needs another HcclCommPrepare
    with pytest.raises(E.ProtocolError, match="call prepare_comm"):
        engine.submit(seg, slot)
    assert _names(fake).count("enqueue_batch_put") == 1


def test_prepare_needs_a_registration_and_its_code_is_checked(memory):
    src, _ = memory
    engine, fake = _engine()
    with pytest.raises(E.ProtocolError, match="register memory before prepare_comm"):
        engine.prepare_comm()
    engine.register(src.data_ptr(), 64)
    fake.rcs["HcclCommPrepare"] = 9
    with pytest.raises(
        E.DeviceError,
        match=r"HcclCommPrepare returned HCCL_E_TIMEOUT \(9\) on communicator 0xc0 "
        r"within 2 s",
    ):
        engine.prepare_comm(1.5)


def test_failed_bind_is_rolled_back(memory):
    src, _ = memory
    engine, fake = _engine()
    fake.rcs["HcclCommBindMem"] = 5
    with pytest.raises(E.DeviceError, match=r"HcclCommBindMem returned HCCL_E_NOT_SUPPORT \(5\) binding"):
        engine.register(src.data_ptr(), 64)
    assert _names(fake) == ["register_global_mem", "comm_bind_mem", "deregister_global_mem"]
    assert fake.calls[2][1] == fake.calls[1][2]  # the handle just registered
    fake.rcs.clear()
    engine.register(src.data_ptr(), 64)  # nothing was kept: the range is free


def test_failed_registration_binds_nothing(memory):
    src, _ = memory
    engine, fake = _engine()
    fake.rcs["HcclRegisterGlobalMem"] = 3
    with pytest.raises(E.DeviceError, match=r"HcclRegisterGlobalMem returned HCCL_E_MEMORY \(3\) for device memory"):
        engine.register(src.data_ptr(), 64)
    assert _names(fake) == ["register_global_mem"]


def test_overlapping_registration_is_refused(memory):
    src, _ = memory
    engine, _ = _engine()
    engine.register(src.data_ptr(), 1024)
    with pytest.raises(E.ConfigError, match="overlaps"):
        engine.register(src.data_ptr() + 1023, 16)


def test_unregister_unbinds_then_deregisters_and_waits_for_readers(memory):
    src, dst = memory
    fake = FakeNative(polls_to_complete=None)
    engine, _ = _engine(fake, timeout_s=0.05)
    region = engine.register(src.data_ptr(), src.numel())
    engine.add_remote_region(dst.data_ptr(), dst.numel())
    engine.prepare_comm()
    ticket = engine.submit([MemorySegment(src.data_ptr(), 64, MemoryKind.DEVICE)], RemoteSlot(PEER, dst.data_ptr(), 64))
    with pytest.raises(E.ProtocolError, match=f"tickets \\[{ticket.id}\\] still read"):
        engine.unregister(region)
    with pytest.raises(E.WaitTimeout):
        ticket.wait()
    with pytest.raises(E.ProtocolError, match=f"tickets \\[{ticket.id}\\] still read"):  # the put may still read
        engine.unregister(region)
    fake.polls_to_complete = 0  # the put completes: a later wait ends the ticket
    ticket.wait()
    fake.calls.clear()
    engine.unregister(region)
    assert fake.calls == [("comm_unbind_mem", COMM, region.handle), ("deregister_global_mem", region.handle)]
    with pytest.raises(E.NotRegistered):
        engine.unregister(region)


# ---- gates and range checks ---------------------------------------------------------------------------------


def test_every_request_goes_to_the_host_path(memory):
    src, dst = memory
    engine, _ = _engine()
    _ready(engine, src, dst)
    selection = engine.select([MemorySegment(src.data_ptr(), 64, MemoryKind.DEVICE)])
    assert selection.kind is TransferKind.HOST and selection.decided_by == "capability"
    for kind in ("aiv", "aicpu", "staging"):
        with pytest.raises(E.ConfigError, match=f"kind '{kind}' is not wired on the NPU engine"):
            engine.submit(
                [MemorySegment(src.data_ptr(), 64, MemoryKind.DEVICE)], RemoteSlot(PEER, dst.data_ptr(), 64), kind=kind
            )


@pytest.mark.parametrize(
    "case, error, words",
    [
        ("source before the region", E.NotRegistered, "piece 0 .* lies in no registered local region"),
        ("source past the region's end", E.NotRegistered, "piece 1 .* lies in no registered local region"),
        ("slot past the peer's region", E.BoundsError, "remote slot .* lies in no region the peer registered"),
        ("slot on another rank", E.ConfigError, "remote slot on rank 2"),
    ],
)
def test_ranges_are_checked_before_anything_moves(memory, case, error, words):
    src, dst = memory
    engine, fake = _engine()
    engine.register(src.data_ptr() + 64, 4096)
    engine.add_remote_region(dst.data_ptr(), 8192)
    engine.prepare_comm()
    base, peer = src.data_ptr() + 64, PEER
    sources = [MemorySegment(base, 64, MemoryKind.DEVICE)]
    slot_addr, slot_bytes = dst.data_ptr(), 8192
    if case == "source before the region":
        sources = [MemorySegment(base - 1, 64, MemoryKind.DEVICE)]
    elif case == "source past the region's end":
        sources = [MemorySegment(base, 64, MemoryKind.DEVICE), MemorySegment(base + 4096 - 63, 64, MemoryKind.DEVICE)]
    elif case == "slot past the peer's region":
        slot_addr = dst.data_ptr() + 1
    else:
        peer = 2
    with pytest.raises(error, match=words):
        engine.submit(sources, RemoteSlot(peer, slot_addr, slot_bytes))
    assert "enqueue_batch_put" not in _names(fake)
    assert all(not e["descs"] for e in fake.events.values())
    # the exact edges pass
    engine.transfer(
        [MemorySegment(base + 4096 - 64, 64, MemoryKind.DEVICE)], RemoteSlot(PEER, dst.data_ptr() + 8192 - 64, 64)
    )


def test_the_current_device_must_be_the_engines(memory):
    src, dst = memory
    engine, fake = _engine()
    _ready(engine, src, dst)
    fake.device = 3
    with pytest.raises(E.ConfigError, match="the current NPU is 3, this engine runs on NPU 0"):
        engine.submit([MemorySegment(src.data_ptr(), 64, MemoryKind.DEVICE)], RemoteSlot(PEER, dst.data_ptr(), 64))
    fake.device, fake.rcs["aclrtGetDevice"] = DEVICE, 107003
    with pytest.raises(E.DeviceError, match=r"aclrtGetDevice returned ACL_ERROR_RT_STREAM_CONTEXT \(107003\)"):
        engine.submit([MemorySegment(src.data_ptr(), 64, MemoryKind.DEVICE)], RemoteSlot(PEER, dst.data_ptr(), 64))
    assert "enqueue_batch_put" not in _names(fake)


# ---- data, notify, errors and waits -------------------------------------------------------------------------


def test_pieces_land_bit_exact_and_the_notify_follows(memory):
    src, dst = memory
    engine, fake = _engine(notify_slots=4, remote=dst)
    _ready(engine, src, dst)
    sources = [MemorySegment(src.data_ptr() + off, n, MemoryKind.DEVICE) for off, n in ((0, 1000), (5000, 3000))]
    result = engine.transfer(sources, RemoteSlot(PEER, dst.data_ptr() + 100, 4000), notify_slot=2)
    assert torch.equal(dst[100:1100], src[:1000]) and torch.equal(dst[1100:4100], src[5000:8000])
    assert bool((dst[:100] == 0xEE).all()) and bool((dst[4100:-32] == 0xEE).all())  # nothing else written
    notify_words = dst[-32:].view(torch.int64)  # the 4 slots end the buffer
    assert result.notify_magic == 1 and notify_words.tolist() == [
        -0x1111111111111112,
        -0x1111111111111112,
        1,
        -0x1111111111111112,
    ]
    puts = [c for c in fake.calls if c[0] == "enqueue_batch_put"]
    assert len(puts) == 2 and puts[0][3] == [
        [src.data_ptr(), dst.data_ptr() + 100, 1000],
        [src.data_ptr() + 5000, dst.data_ptr() + 1100, 3000],
    ]
    assert all(e["destroyed"] for e in fake.events.values())
    assert result.kind is TransferKind.HOST and result.nbytes == 4000 and result.num_pieces == 2


def test_large_requests_take_several_puts_and_one_event(memory):
    src, dst = memory
    engine, fake = _engine()
    _ready(engine, src, dst)
    sources = [MemorySegment(src.data_ptr() + 16 * i, 16, MemoryKind.DEVICE) for i in range(600)]
    engine.transfer(sources, RemoteSlot(PEER, dst.data_ptr(), 9600))
    puts = [c for c in fake.calls if c[0] == "enqueue_batch_put"]
    assert [len(c[3]) for c in puts] == [256, 256, 88]
    assert [c[4] != 0 for c in puts] == [False, False, True]  # the event follows the last put only
    assert torch.equal(dst[:9600], src[:9600])


def test_a_failed_put_on_the_task_queue_is_raised_by_name(memory):
    src, dst = memory
    engine, fake = _engine()
    _ready(engine, src, dst)
    fake.rcs["HcclBatchPut"] = 4
    ticket = engine.submit([MemorySegment(src.data_ptr(), 64, MemoryKind.DEVICE)], RemoteSlot(PEER, dst.data_ptr(), 64))
    with pytest.raises(E.DeviceError, match=r"HcclBatchPut returned HCCL_E_INTERNAL \(4\) on torch_npu's task queue"):
        ticket.wait()
    assert engine._orphans and not fake.events[engine._orphans[0]]["destroyed"]


def test_wait_is_bounded_and_keeps_the_pending_event(memory):
    src, dst = memory
    engine, fake = _engine(FakeNative(polls_to_complete=None))
    _ready(engine, src, dst)
    ticket = engine.submit([MemorySegment(src.data_ptr(), 64, MemoryKind.DEVICE)], RemoteSlot(PEER, dst.data_ptr(), 64))
    start = time.monotonic()
    with pytest.raises(E.WaitTimeout, match=f"0.2 s waiting for the 1 pieces \\(64 bytes\\) of ticket {ticket.id}"):
        ticket.wait(timeout_s=0.2)
    assert 0.2 <= time.monotonic() - start < 2.0
    event = ticket.state["event"]  # the ticket is still in flight: it keeps its event
    assert not engine._orphans and not fake.events[event]["destroyed"]  # the stream may still record it
    fake.polls_to_complete = 0  # the put completes: a later wait ends the ticket and destroys its event
    assert ticket.wait().nbytes == 64 and fake.events[event]["destroyed"]


def test_an_event_query_failure_is_named(memory):
    src, dst = memory
    engine, fake = _engine()
    _ready(engine, src, dst)
    fake.rcs["aclrtQueryEventStatus"] = 507014
    with pytest.raises(E.DeviceError, match=r"aclrtQueryEventStatus returned ACL_ERROR_RT_AICORE_TIMEOUT \(507014\)"):
        engine.transfer([MemorySegment(src.data_ptr(), 64, MemoryKind.DEVICE)], RemoteSlot(PEER, dst.data_ptr(), 64))


def test_notify_slot_bounds(memory):
    src, dst = memory
    engine, _ = _engine(notify_slots=2, remote=dst)
    _ready(engine, src, dst)
    with pytest.raises(E.BoundsError, match=r"notify slot 2 is outside \[0, 2\)"):
        engine.submit(
            [MemorySegment(src.data_ptr(), 64, MemoryKind.DEVICE)], RemoteSlot(PEER, dst.data_ptr(), 64), notify_slot=2
        )
    elsewhere, _ = _engine(notify_slots=2, remote=dst)
    elsewhere.register(src.data_ptr(), src.numel())
    elsewhere.add_remote_region(dst.data_ptr(), 16384)  # the peer's notify words are not in a declared region
    elsewhere.prepare_comm()
    with pytest.raises(E.BoundsError, match="notify slot 1 .* lies in no region the peer registered"):
        elsewhere.submit(
            [MemorySegment(src.data_ptr(), 64, MemoryKind.DEVICE)], RemoteSlot(PEER, dst.data_ptr(), 64), notify_slot=1
        )
    plain, _ = _engine()
    with pytest.raises(E.ConfigError, match="no notify tensor"):
        plain.submit(
            [MemorySegment(src.data_ptr(), 64, MemoryKind.DEVICE)], RemoteSlot(PEER, dst.data_ptr(), 64), notify_slot=0
        )


def test_prepared_request_is_resubmitted_and_close_unregisters_all(memory):
    src, dst = memory
    engine, fake = _engine(notify_slots=1, remote=dst)
    _ready(engine, src, dst)
    prepared = engine.prepare(
        [MemorySegment(src.data_ptr(), 256, MemoryKind.DEVICE)], RemoteSlot(PEER, dst.data_ptr(), 256)
    )
    for _ in range(3):
        prepared.transfer()
    assert torch.equal(dst[:256], src[:256])
    fake.calls.clear()
    engine.close()
    assert _names(fake) == ["comm_unbind_mem", "deregister_global_mem"] * 2  # the notify buffer and the source
