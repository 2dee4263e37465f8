"""The transfer engine interface on Ascend NPUs: the host path, HCCL one-sided puts. **Not yet run on hardware.**

Nothing here has run on an NPU: the engine is written against the documented HCOMM/ACL/torch_npu APIs, its C++
half (``csrc/npu/transfer_npu.cpp``, ``_C.npu_transfer``) is compile-checked against the torch_npu wheel's headers,
and this module is tested on the CPU with a fake of that native module (``tests/transport/test_npu_engine.py``).
Importing it needs neither torch_npu nor CANN; the native module is loaded when an engine is created.

What moves the data: the host posts ``HcclBatchPut`` (kind ``host``). The device-posted kinds are not wired on
NPU yet (``aiv`` needs the AIV queue descriptors from HCOMM's AIV channels, ``aicpu`` the aclnn/MC2 launch path
for ``GetHcclContext``), so the capability gate sends every request to ``host`` and an override to another
kind is refused.

Sequence, after hixl (the public user of HCOMM's one-sided API):

1. :meth:`NpuTransferEngine.register` each local buffer: ``HcclRegisterGlobalMem`` then ``HcclCommBindMem``
   (rolled back if the bind fails). :meth:`~NpuTransferEngine.add_remote_region` declares what the peer
   registered (its addresses, exchanged out of band, e.g. ``all_gather_object``).
2. :meth:`NpuTransferEngine.prepare_comm`: ``HcclCommPrepare`` (a blocking collective over every rank of the
   communicator). A registration after it needs another ``prepare_comm`` before the next put.
3. ``submit``: every piece checked against the registered regions (local sources, remote slot) and the engine's
   device checked against the current one before anything moves; then ``HcclBatchPut`` and an event record,
   both in order on torch_npu's task queue for the current stream (an OpCommand custom handler; the raw stream
   is taken only inside it, so the put cannot overtake queued kernels).
4. ``wait``: polls the event and the queue's error slot, bounded by the timeout; remote-ready is an 8-byte put
   of a fresh magic from the engine's registered host notify buffer into the peer's notify slot, after every
   byte landed.
5. :meth:`NpuTransferEngine.unregister` / :meth:`~NpuTransferEngine.close`: ``HcclCommUnbindMem`` then
   ``HcclDeregisterGlobalMem``.

Every ACL/HCCL return code is checked and raised as :class:`~ascend_dualpath.errors.DeviceError` with its name
(``HCCL_E_PARA (1)``, ``ACL_ERROR_RT_STREAM_TASK_FULL (507002)``).

Open question for the first run: hixl binds memory to a communicator it creates itself
(``HcclCommInitClusterInfoMemConfig``); whether ``HcclCommBindMem`` accepts the communicator behind a torch_npu
process group (:func:`hccl_comm_handle`) is not known here. If it does not, the engine reports the code by name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ascend_dualpath import _ext
from ascend_dualpath import errors as E
from ascend_dualpath.transport.engine import PreparedTransfer, Ticket, TransferEngine, TransferResult, poll_until
from ascend_dualpath.transport.kinds import GateDecision, MemoryKind, Selection, TransferKind
from ascend_dualpath.transport.segments import MemorySegment, RemoteSlot, WirePiece

NOTIFY_BYTES = 8  # one int64 magic per notify slot
MAX_PIECE = 1 << 62  # HcclBatchPut takes any byte count per descriptor (u64); the engine does not split
DEFAULT_PREPARE_TIMEOUT_S = 120  # hixl's default for HcclCommPrepare
# descriptors per HcclBatchPut: hixl's batch size (no limit is documented; larger requests take several calls)
MAX_DESCS_PER_PUT = 256

# HcclResult (hccl/hccl_types.h of the torch_npu wheel)
HCCL_RESULT_NAMES = {
    0: "HCCL_SUCCESS",
    1: "HCCL_E_PARA",
    2: "HCCL_E_PTR",
    3: "HCCL_E_MEMORY",
    4: "HCCL_E_INTERNAL",
    5: "HCCL_E_NOT_SUPPORT",
    6: "HCCL_E_NOT_FOUND",
    7: "HCCL_E_UNAVAIL",
    8: "HCCL_E_SYSCALL",
    9: "HCCL_E_TIMEOUT",
    10: "HCCL_E_OPEN_FILE_FAILURE",
    11: "HCCL_E_TCP_CONNECT",
    12: "HCCL_E_ROCE_CONNECT",
    13: "HCCL_E_TCP_TRANSFER",
    14: "HCCL_E_ROCE_TRANSFER",
    15: "HCCL_E_RUNTIME",
    16: "HCCL_E_DRV",
    17: "HCCL_E_PROFILING",
    18: "HCCL_E_CCE",
    19: "HCCL_E_NETWORK",
    20: "HCCL_E_AGAIN",
    21: "HCCL_E_REMOTE",
    22: "HCCL_E_SUSPENDING",
    23: "HCCL_E_OPRETRY_FAIL",
    24: "HCCL_E_OOM",
}
# aclError values an engine call can plausibly return (acl/acl_base_rt.h, acl/error_codes/rt_error_codes.h)
ACL_ERROR_NAMES = {
    0: "ACL_SUCCESS",
    100000: "ACL_ERROR_INVALID_PARAM",
    100001: "ACL_ERROR_UNINITIALIZE",
    107000: "ACL_ERROR_RT_PARAM_INVALID",
    107003: "ACL_ERROR_RT_STREAM_CONTEXT",
    107017: "ACL_ERROR_RT_INVALID_HANDLE",
    107022: "ACL_ERROR_RT_DEVICE_TASK_ABORT",
    200002: "ACL_ERROR_INVALID_DEVICE",
    207000: "ACL_ERROR_RT_FEATURE_NOT_SUPPORT",
    207001: "ACL_ERROR_RT_MEMORY_ALLOCATION",
    507000: "ACL_ERROR_RT_INTERNAL_ERROR",
    507002: "ACL_ERROR_RT_STREAM_TASK_FULL",
    507014: "ACL_ERROR_RT_AICORE_TIMEOUT",
}


def code_name(call: str, rc: int) -> str:
    """``NAME (value)`` of a return code of ``call`` (an HCCL call: ``Hccl*``; otherwise ACL)."""
    names = HCCL_RESULT_NAMES if call.startswith("Hccl") else ACL_ERROR_NAMES
    return f"{names.get(rc, 'unknown code')} ({rc})"


def check(call: str, rc: int, what: str) -> None:
    """Raise DeviceError naming ``call``, its code and ``what`` was asked, unless ``rc`` is 0."""
    if rc != 0:
        raise E.DeviceError(f"{call} returned {code_name(call, rc)} {what}")


def native():
    """The ``_C.npu_transfer`` submodule; BackendUnavailable in builds without CANN."""
    module = getattr(_ext.load(), "npu_transfer", None)
    if module is None:
        raise E.BackendUnavailable(
            "this build has no NPU transfer launchers: rebuild where CANN and torch_npu are "
            "installed (ADP_WITH_NPU=1 python3 setup.py build_ext --inplace)"
        )
    return module


def hccl_comm_handle(process_group, rank: int) -> int:
    """The ``HcclComm`` handle behind a torch_npu process group."""
    import torch

    return int(process_group._get_backend(torch.device("npu")).get_hccl_comm(rank))


@dataclass(frozen=True)
class Region:
    """A registered range: ``nbytes`` at ``addr`` in ``memory``; ``handle`` is HCCL's (0 for a peer's region)."""

    addr: int
    nbytes: int
    memory: MemoryKind
    handle: int = 0

    def holds(self, addr: int, nbytes: int) -> bool:
        return self.addr <= addr and addr + nbytes <= self.addr + self.nbytes


class NpuTransferEngine(TransferEngine):
    """Transfers from this rank's NPU ``device`` into registered memory of rank ``peer``, by ``HcclBatchPut``.

    Not yet run on hardware (see the module docstring).

    Parameters
    ----------
    comm : int
        The ``HcclComm`` handle (:func:`hccl_comm_handle` of a torch_npu process group, or
        :meth:`from_process_group`).
    peer : int
        Destination rank in ``comm``.
    device : int
        Index of this rank's NPU: every request is enqueued on the current stream, which must be on it.
    notify : torch.Tensor or None
        int64 1-D CPU tensor (pinned), one element per notify slot: the source of the remote-ready magic, registered
        by the engine as host memory. ``notify_remote_addr`` is where slot 0 lands on the peer (inside one of its
        regions declared with :meth:`add_remote_region`).
    native_module : module or None
        The native half (``_C.npu_transfer`` when None); tests pass a fake.
    timeout_s : float or None
        Default bound of every wait.
    """

    def __init__(
        self,
        comm: int,
        peer: int,
        device: int,
        *,
        notify=None,
        notify_remote_addr: int | None = None,
        native_module=None,
        timeout_s: float | None = None,
    ):
        super().__init__(timeout_s)
        self.native = native() if native_module is None else native_module
        missing = list(self.native.missing_symbols())
        if missing:
            raise E.BackendUnavailable(f"this CANN lacks the HCOMM one-sided functions {', '.join(missing)}")
        self.comm, self.peer, self.device = int(comm), int(peer), int(device)
        self._local: list[Region] = []
        self._remote: list[Region] = []
        self._prepared = False
        self._in_flight: dict[int, Ticket] = {}
        self._orphans: list[int] = []  # events of tickets that timed out: still recorded on a stream, never reused
        self.notify, self.notify_remote_addr = None, None
        if notify is not None:
            self._set_notify(notify, notify_remote_addr)

    @classmethod
    def from_process_group(cls, process_group, peer: int, **options) -> NpuTransferEngine:
        """An engine over the HCCL communicator of a torch_npu process group, on the current NPU.

        The group's HCCL config decides the traffic class of the puts: a group that carries KV is made with
        ``pg_options=hccl_pg_options(TrafficClass.KV)`` (:mod:`ascend_dualpath.dualpath.traffic`), so the NIC
        serves the model's collectives first."""
        import torch
        import torch.distributed as dist
        import torch_npu  # noqa: F401  (adds torch.npu)

        rank = dist.get_rank(process_group)
        return cls(hccl_comm_handle(process_group, rank), peer, torch.npu.current_device(), **options)

    def _set_notify(self, notify, remote_addr: int | None) -> None:
        import torch

        if notify.dtype != torch.int64 or notify.dim() != 1 or notify.device.type != "cpu" or notify.numel() < 1:
            raise E.ConfigError(
                f"notify must be a 1-D int64 CPU tensor, got {notify.dtype} {tuple(notify.shape)} on {notify.device}"
            )
        if remote_addr is None:
            raise E.ConfigError("a notify tensor needs notify_remote_addr (where slot 0 lands on the peer)")
        self.register(notify.data_ptr(), notify.numel() * NOTIFY_BYTES, MemoryKind.HOST)
        self.notify, self.notify_remote_addr = notify, int(remote_addr)

    # ---- memory ------------------------------------------------------------------------------------

    def register(self, addr: int, nbytes: int, memory: MemoryKind = MemoryKind.DEVICE) -> Region:
        """Register ``nbytes`` at ``addr`` (device or host memory) and bind it to the communicator.

        ``HcclRegisterGlobalMem`` then ``HcclCommBindMem``; a failed bind deregisters again. The engine needs
        :meth:`prepare_comm` again before its next put."""
        memory = MemoryKind(memory)
        if nbytes < 1 or addr <= 0:
            raise E.ConfigError(f"a registration needs an address and >= 1 byte, got [{addr:#x}, +{nbytes})")
        clash = next((r for r in self._local if r.addr < addr + nbytes and addr < r.addr + r.nbytes), None)
        if clash is not None:
            raise E.ConfigError(
                f"[{addr:#x}, +{nbytes}) overlaps the registered region [{clash.addr:#x}, +{clash.nbytes})"
            )
        rc, handle = self.native.register_global_mem(addr, nbytes, memory is MemoryKind.DEVICE)
        check("HcclRegisterGlobalMem", rc, f"for {memory.value} memory [{addr:#x}, +{nbytes})")
        rc = self.native.comm_bind_mem(self.comm, handle)
        if rc != 0:
            undo = self.native.deregister_global_mem(handle)
            check(
                "HcclCommBindMem",
                rc,
                f"binding [{addr:#x}, +{nbytes}) to communicator {self.comm:#x}"
                + (
                    ""
                    if undo == 0
                    else f"; the rollback's HcclDeregisterGlobalMem returned "
                    f"{code_name('HcclDeregisterGlobalMem', undo)}"
                ),
            )
        region = Region(addr, nbytes, memory, handle)
        self._local.append(region)
        self._prepared = False
        return region

    def register_tensor(self, tensor) -> Region:
        """:meth:`register` the bytes of a contiguous tensor (on this NPU, or on the host)."""
        if not tensor.is_contiguous():
            raise E.ConfigError("a registered tensor must be contiguous")
        memory = MemoryKind.HOST if tensor.device.type == "cpu" else MemoryKind.DEVICE
        if memory is MemoryKind.DEVICE and tensor.device.index != self.device:
            raise E.ConfigError(f"the tensor is on {tensor.device}, this engine runs on NPU {self.device}")
        return self.register(tensor.data_ptr(), tensor.numel() * tensor.element_size(), memory)

    def unregister(self, region: Region) -> None:
        """``HcclCommUnbindMem`` then ``HcclDeregisterGlobalMem`` of a region :meth:`register` returned; refused
        while a ticket in flight reads from it."""
        if region not in self._local:
            raise E.NotRegistered(f"[{region.addr:#x}, +{region.nbytes}) is not registered with this engine")
        busy = [t.id for t in self._in_flight.values() if any(region.holds(p.local_addr, p.nbytes) for p in t.pieces)]
        if busy:
            raise E.ProtocolError(f"tickets {busy} still read from [{region.addr:#x}, +{region.nbytes}): wait them")
        check(
            "HcclCommUnbindMem",
            self.native.comm_unbind_mem(self.comm, region.handle),
            f"for [{region.addr:#x}, +{region.nbytes})",
        )
        self._local.remove(region)
        check(
            "HcclDeregisterGlobalMem",
            self.native.deregister_global_mem(region.handle),
            f"for [{region.addr:#x}, +{region.nbytes})",
        )

    def add_remote_region(self, addr: int, nbytes: int) -> Region:
        """Declare ``nbytes`` at ``addr`` registered by the peer (remote slots must lie in one)."""
        if nbytes < 1 or addr <= 0:
            raise E.ConfigError(f"a remote region needs an address and >= 1 byte, got [{addr:#x}, +{nbytes})")
        region = Region(addr, nbytes, MemoryKind.DEVICE)
        self._remote.append(region)
        return region

    def prepare_comm(self, timeout_s: float | None = None) -> None:
        """``HcclCommPrepare`` after the registrations: a blocking collective every rank of ``comm`` must enter."""
        if not self._local:
            raise E.ProtocolError("register memory before prepare_comm: HcclCommPrepare links the bound memory")
        timeout = DEFAULT_PREPARE_TIMEOUT_S if timeout_s is None else timeout_s
        seconds = max(1, math.ceil(timeout))
        check(
            "HcclCommPrepare",
            self.native.comm_prepare(self.comm, seconds),
            f"on communicator {self.comm:#x} within {seconds} s",
        )
        self._prepared = True

    def close(self) -> None:
        """Unregister every region (the notify buffer too); the engine is unusable afterwards."""
        for region in list(self._local):
            self.unregister(region)
        self._prepared = False

    # ---- gates -------------------------------------------------------------------------------------

    def select(self, sources: Sequence[MemorySegment]) -> Selection:
        if not sources:
            raise E.EmptyTransfer("a transfer needs at least one source segment")
        gate = GateDecision(
            "capability",
            False,
            "NPU engine: the AIV queue descriptors (HCOMM AIV channels) and the "
            "aclnn launch path of aicpu_batch_write are not wired",
        )
        return Selection(
            TransferKind.HOST,
            "capability",
            "the device-posted kinds are not wired on NPU yet: the host posts HcclBatchPut",
            (gate,),
            False,
        )

    def _forced(self, selection: Selection, kind: TransferKind, sources: Sequence[MemorySegment]) -> Selection:
        if kind is not TransferKind.HOST:
            raise E.ConfigError(f"kind {kind.value!r} is not wired on the NPU engine yet; only 'host' (HcclBatchPut)")
        return selection

    def _max_piece(self, kind: TransferKind) -> int:
        return MAX_PIECE

    # ---- start -------------------------------------------------------------------------------------

    def _check_ranges(
        self, pieces: Sequence[WirePiece], remote_addr: int, remote_nbytes: int, what: str = "remote slot"
    ) -> None:
        for i, p in enumerate(pieces):
            if not any(r.holds(p.local_addr, p.nbytes) for r in self._local):
                raise E.NotRegistered(
                    f"piece {i} [{p.local_addr:#x}, +{p.nbytes}) lies in no registered local "
                    f"region ({len(self._local)} registered)"
                )
        if not any(r.holds(remote_addr, remote_nbytes) for r in self._remote):
            raise E.BoundsError(
                f"{what} [{remote_addr:#x}, +{remote_nbytes}) lies in no region the peer "
                f"registered ({len(self._remote)} declared with add_remote_region)"
            )

    def _check_device(self) -> None:
        rc, device = self.native.current_device()
        check("aclrtGetDevice", rc, "while checking the current NPU")
        if device != self.device:
            raise E.ConfigError(
                f"the current NPU is {device}, this engine runs on NPU {self.device}: set the device "
                f"(torch.npu.set_device({self.device})) before submitting"
            )

    def _start(self, ticket: Ticket, prepared: PreparedTransfer) -> None:
        if ticket.remote.peer != self.peer:
            raise E.ConfigError(f"remote slot on rank {ticket.remote.peer}, but this engine writes to rank {self.peer}")
        if ticket.notify_slot is not None:
            self._check_notify_slot(ticket.notify_slot)
        self._check_ranges(ticket.pieces, ticket.remote.addr, ticket.remote.nbytes)
        if not self._prepared:
            raise E.ProtocolError("HcclCommPrepare has not run since the last registration: call prepare_comm() first")
        self._check_device()
        ticket.state["event"] = self._put(ticket.pieces)
        self._in_flight[ticket.id] = ticket

    def _check_notify_slot(self, slot: int) -> None:
        if self.notify is None:
            raise E.ConfigError("a notify slot was asked for, but the engine has no notify tensor")
        if not 0 <= slot < self.notify.numel():
            raise E.BoundsError(f"notify slot {slot} is outside [0, {self.notify.numel()})")
        self._check_ranges([], self.notify_remote_addr + slot * NOTIFY_BYTES, NOTIFY_BYTES, f"notify slot {slot}")

    def _put(self, pieces: Sequence[WirePiece]) -> int:
        """Enqueue HcclBatchPut of ``pieces`` (``MAX_DESCS_PER_PUT`` per call) and an event record after the last;
        returns the event."""
        import torch

        descs = torch.tensor([[p.local_addr, p.remote_addr, p.nbytes] for p in pieces], dtype=torch.int64)
        rc, event = self.native.create_event()
        check("aclrtCreateEventWithFlag", rc, "for a put's completion")
        try:
            for start in range(0, len(pieces), MAX_DESCS_PER_PUT):
                last = start + MAX_DESCS_PER_PUT >= len(pieces)
                self.native.enqueue_batch_put(
                    self.comm, self.peer, descs[start : start + MAX_DESCS_PER_PUT], event if last else 0
                )
        except BaseException:
            # an earlier chunk may be queued: the event was not recorded, so it can go
            check("aclrtDestroyEvent", self.native.destroy_event(event), "after a failed enqueue")
            raise
        return event

    # ---- finish ------------------------------------------------------------------------------------

    def _await(self, event: int, timeout_s: float, what) -> None:
        """Poll the event (and the task queue's error slot) until done, bounded by ``timeout_s``."""

        def done() -> bool:
            failed = self.native.take_async_error()
            if failed is not None:
                call, rc = failed
                raise E.DeviceError(f"{call} returned {code_name(call, rc)} on torch_npu's task queue during {what()}")
            rc, finished = self.native.query_event(event)
            check("aclrtQueryEventStatus", rc, f"while waiting for {what()}")
            return finished

        poll_until(done, timeout_s, lambda: f"{what()}: the put has not completed")

    def _finish(self, ticket: Ticket, timeout_s: float) -> TransferResult:
        self._await(
            ticket.state["event"],
            timeout_s,
            lambda: (
                f"the {len(ticket.pieces)} pieces ({ticket.nbytes} bytes) of ticket {ticket.id} to rank {self.peer}"
            ),
        )
        ticket.state["done"] = True
        return TransferResult(ticket.kind, ticket.selection, ticket.nbytes, len(ticket.pieces))

    def record(self, slot: int, magic: int, timeout_s: float | None = None) -> None:
        self._check_notify_slot(slot)
        self._write_notify(slot, magic, self.timeout_s if timeout_s is None else timeout_s, "a recorded magic")

    def locate(self, addr: int, nbytes: int) -> MemorySegment:
        region = next((r for r in self._local if r.holds(addr, nbytes)), None)
        if region is None:
            raise E.NotRegistered(
                f"source [{addr:#x}, +{nbytes}) lies in no registered local region ({len(self._local)} registered)"
            )
        return MemorySegment(addr, nbytes, region.memory)

    def remote_slot(self, addr: int, nbytes: int) -> RemoteSlot:
        if not any(r.holds(addr, nbytes) for r in self._remote):
            raise E.BoundsError(
                f"destination [{addr:#x}, +{nbytes}) on rank {self.peer} lies in no region it "
                f"registered ({len(self._remote)} declared with add_remote_region)"
            )
        return RemoteSlot(self.peer, addr, nbytes)

    def _write_notify(self, slot: int, magic: int, timeout_s: float, what: str) -> None:
        """Put ``magic`` from the registered host notify buffer into the peer's notify ``slot`` and wait for it."""
        self.notify[slot] = magic  # host memory: written before the put is enqueued
        local = self.notify.data_ptr() + slot * NOTIFY_BYTES
        remote = self.notify_remote_addr + slot * NOTIFY_BYTES
        piece = WirePiece(local, remote, NOTIFY_BYTES, 0, 0, 0)
        event = self._put([piece])
        try:
            self._await(event, timeout_s, lambda: f"the notify put of {what} (slot {slot})")
        except BaseException:  # the stream may still record the event: never destroy or reuse it
            self._orphans.append(event)
            raise
        check("aclrtDestroyEvent", self.native.destroy_event(event), f"of {what}'s notify put")

    def _release(self, ticket: Ticket) -> None:
        self._in_flight.pop(ticket.id, None)
        event = ticket.state.pop("event", None)
        if event is None:
            return
        if not ticket.state.get("done"):  # timed out or failed: the stream may still record it
            self._orphans.append(event)
            return
        check("aclrtDestroyEvent", self.native.destroy_event(event), f"of ticket {ticket.id}")
