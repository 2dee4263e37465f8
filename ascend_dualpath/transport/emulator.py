"""The transfer engine on the emulated Ascend device: the three-way comparison's real code paths.

- ``aiv``: the ``aiv_post_wqe`` kernel on ``block_dim`` emulated vector cores, one SQ per core, every
  WQE signaled; the engine collects one CQE per piece.
- ``staging``: the ``hccl_stage`` kernel copies the sources into a buffer of the HCCL window
  (``windows_out``), then ``aiv`` from there; the buffer is released on every path.
- ``aicpu``: the ``aicpu_batch_write`` kernel fills 32-byte items, core 0 submits them to the
  communicator's AICPU server and waits.
- ``host``: ``HcclBatchPut`` from the host.

Virtual time: each request starts at the later of the engine's clock and the NIC's; AIV cores post
in parallel at ``aiv_submit_ns`` per WQE; staging costs its bytes over PCIe (host source) or the local
copy bandwidth, plus the PCIe latency; the communicator's AICPU and host paths keep their own clocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ascend_dualpath import _ext
from ascend_dualpath import errors as E
from ascend_dualpath.backends.emulator import completion_error
from ascend_dualpath.transport.engine import PreparedTransfer, StagingPool, Ticket, TransferEngine, TransferResult
from ascend_dualpath.transport.kinds import ROCE, ChannelCapabilities, MemoryKind, Selection, TransferKind, select_kind
from ascend_dualpath.transport.segments import MemorySegment, RemoteSlot, split_segments

MAX_MESSAGE_BYTES = 1 << 31
DEFAULT_MAX_SINGLE_AIV_PAYLOAD = 1 << 20  # assumption: 1 MiB per AIV-posted WQE (configurable)
HCCL_DATA_TYPE_INT8 = 0


MAX_CQ_DEPTH = 1 << 22  # the emulated CQ's limit (csrc/emulator/device.cpp)
MAX_SQ_DEPTH = 1 << 15


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check_int(name: str, value, low: int, high: int) -> None:
    """ConfigError unless ``value`` is an int in ``[low, high]`` (bool is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise E.ConfigError(f"{name} {value!r} is outside [{low}, {high}]")


class EmulatedTransferEngine(TransferEngine):
    """Transfers from ``comm``'s rank to ``peer`` on the emulated device.

    Parameters
    ----------
    comm : ascend_dualpath._C.HcclComm
        A connected communicator; its device posts, its windows stage, its AICPU server serves.
    peer : int
        Destination rank.
    protocol : str
        How the peer is reached (``"RoCE"``, ``"HCCS"``): the protocol gate.
    block_dim : int
        Vector cores used by the kernels (<= the product's vector cores).
    sq_depth : int
        Depth of each core's send queue (power of two).
    doorbell_batch : int
        WQEs per doorbell in ``aiv_post_wqe``.
    max_single_aiv_payload : int
        Largest piece one AIV-posted WQE carries.
    max_pieces : int
        Most pieces one request may have (sizes the completion queue and the BatchWrite items).
    staging_capacity : int or None
        Bytes of ``windows_out`` used for staging (default: all of it).
    stage_chunk_bytes : int
        UB buffer size of ``hccl_stage`` (two in flight per core).
    host_call_per_piece : bool
        The host path posts each piece as its own host submission on a host-side queue pair (as
        DualPath issues one copy per layer block) instead of one HcclBatchPut for the whole request.
    timeout_s : float or None
        Default bound of every wait.
    """

    def __init__(
        self,
        comm,
        peer: int,
        *,
        protocol: str = ROCE,
        block_dim: int = 8,
        sq_depth: int = 256,
        doorbell_batch: int = 32,
        max_single_aiv_payload: int = DEFAULT_MAX_SINGLE_AIV_PAYLOAD,
        max_pieces: int = 8192,
        staging_capacity: int | None = None,
        stage_chunk_bytes: int = 64 * 1024,
        host_call_per_piece: bool = False,
        timeout_s: float | None = None,
    ):
        super().__init__(timeout_s)
        C = _ext.load()
        self._C = C
        self.comm = comm
        self.peer = peer
        self.device = comm.device
        profile = self.device.profile
        _check_int("block_dim", block_dim, 1, profile.vector_cores)
        _check_int("peer", peer, 0, comm.world_size - 1)
        _check_int("sq_depth", sq_depth, 2, MAX_SQ_DEPTH)
        if sq_depth & (sq_depth - 1):
            raise E.ConfigError(f"sq_depth {sq_depth} is not a power of two")
        _check_int("doorbell_batch", doorbell_batch, 1, 0xFFFFFFFF)  # the kernel also rings whenever its SQ is full
        _check_int("max_single_aiv_payload", max_single_aiv_payload, 1, MAX_MESSAGE_BYTES)
        _check_int("max_pieces", max_pieces, 1, MAX_CQ_DEPTH)
        _check_int("stage_chunk_bytes", stage_chunk_bytes, 32, profile.ub_bytes // 2)  # two in flight per core
        if stage_chunk_bytes % 32:
            raise E.ConfigError(f"stage_chunk_bytes {stage_chunk_bytes} is not a multiple of 32 (DataCopy)")
        window = comm.windows_out
        if staging_capacity is not None:
            _check_int("staging_capacity", staging_capacity, 1, 1 << 62)
            if staging_capacity > window.size:  # the pool lives inside windows_out: it would stage past its end
                raise E.ConfigError(
                    f"staging_capacity {staging_capacity} bytes exceeds the HCCL window windows_out of "
                    f"{window.size} bytes that holds the staging pool"
                )
        self.caps = ChannelCapabilities(comm.capability_bitmap, protocol, max_single_aiv_payload)
        self.block_dim = block_dim
        self.doorbell_batch = doorbell_batch
        self.max_pieces = max_pieces
        self.stage_chunk_bytes = stage_chunk_bytes
        self.host_call_per_piece = host_call_per_piece
        self.ub_bytes = profile.ub_bytes
        self.cost = self.device.nic.cost
        self._cq = self.device.create_cq(_next_pow2(max(max_pieces, 2 * sq_depth)))
        sl = comm.resolved["service_level"]
        self._qps = [self.device.create_qp(self._cq, None, sq_depth, sl) for _ in range(block_dim)]
        self._items = self.device.alloc_region(max_pieces * 32, C.MemKind.DEVICE_GM, 1 | 4)
        comm.register_local(self._items)
        self.staging = StagingPool(window.addr, window.size if staging_capacity is None else staging_capacity)
        self._vclock_ns = 0.0  # AIV and staging requests
        self._host_clock_ns = 0.0
        self._aicpu_clock_ns = 0.0
        self._in_flight: Ticket | None = None
        self._broken: str | None = None
        self._closed = False
        self._registered: dict[int, object] = {}  # lkey -> region registered through this engine
        self._revoked: set[int] = set()  # lkeys unregistered from this engine: refused as sources

    def __repr__(self) -> str:
        return f"EmulatedTransferEngine(rank {self.comm.rank} -> peer {self.peer})"

    # ---- memory -----------------------------------------------------------------------------------

    def register(self, region) -> None:
        """Make ``region`` (an emulated registered region) a source of this engine's transfers (HcclRegisterMem)."""
        self.comm.register_local(region)
        self._registered[region.lkey] = region
        self._revoked.discard(region.lkey)

    def unregister(self, region) -> None:
        """Undo :meth:`register`: later requests with a source under ``region``'s key raise NotRegistered before
        anything moves. NotRegistered when ``region`` is not registered through this engine.

        The emulated communicator has no deregistration of its own; the engine refuses the key instead (closing
        the region ends the key for every user).
        """
        if self._registered.pop(region.lkey, None) is None:
            raise E.NotRegistered(
                f"region [{region.addr:#x}, +{region.size}) (lkey {region.lkey:#x}) is not registered with {self!r}"
            )
        self._revoked.add(region.lkey)

    def locate(self, addr: int, nbytes: int) -> MemorySegment:
        for region in (self.comm.windows_in, self.comm.windows_out, *self._registered.values()):
            if region.addr <= addr and addr + nbytes <= region.addr + region.size:
                memory = MemoryKind.HOST if int(region.kind) == 1 else MemoryKind.DEVICE
                return MemorySegment(addr, nbytes, memory, region.lkey)
        raise E.NotRegistered(
            f"source [{addr:#x}, +{nbytes}) is in no region registered with {self!r} (its "
            f"communicator's windows or register())"
        )

    def remote_slot(self, addr: int, nbytes: int) -> RemoteSlot:
        for mem in self.comm.remote_mems(self.peer):
            if mem.addr <= addr and addr + nbytes <= mem.addr + mem.size:
                return RemoteSlot(self.peer, addr, nbytes, mem.rkey)
        raise E.BoundsError(f"destination [{addr:#x}, +{nbytes}) on rank {self.peer} is in no memory it registered")

    def record(self, slot: int, magic: int, timeout_s: float | None = None) -> None:
        self.comm.notify_record(self.peer, slot, magic, self.timeout_s if timeout_s is None else timeout_s)

    # ---- gates ------------------------------------------------------------------------------------

    def select(self, sources: Sequence[MemorySegment]) -> Selection:
        return select_kind(self.caps, [s.memory for s in sources], max((s.nbytes for s in sources), default=0))

    def _max_piece(self, kind: TransferKind) -> int:
        if kind in (TransferKind.AIV, TransferKind.STAGING):
            return self.caps.max_single_aiv_payload
        return MAX_MESSAGE_BYTES

    # ---- start ------------------------------------------------------------------------------------

    def _start(self, ticket: Ticket, prepared: PreparedTransfer) -> None:
        sources = prepared.sources
        self._check_usable()
        if self._in_flight is not None and not self._in_flight.finished:
            raise E.QueueError(f"ticket {self._in_flight.id} is still in flight; wait for it before submitting more")
        self._check_request(ticket)
        kind = ticket.kind
        # the communicator's host and AICPU paths keep their own clocks, which end at their last completion
        start = {TransferKind.HOST: self._host_clock_ns, TransferKind.AICPU: self._aicpu_clock_ns}.get(
            kind, max(self._vclock_ns, self.device.nic.virtual_time_ns)
        )
        ticket.state.update(start_vtime_ns=start, staging_bytes=0)
        if kind is TransferKind.HOST:
            self._start_host(ticket)
        elif kind is TransferKind.AICPU:
            self._launch_aicpu(ticket)
        elif kind is TransferKind.AIV:
            self._launch_aiv(ticket, ticket.pieces, start)
        else:
            self._start_staging(ticket, sources, start)
        self._in_flight = ticket

    def _check_usable(self) -> None:
        if self._closed:
            raise E.QueueError(f"{self!r} is closed")
        if self._broken:
            raise E.QueueError(f"the engine is unusable after an earlier failure: {self._broken}")

    def _check_request(self, ticket: Ticket) -> None:
        """Refuse the request before anything moves: the peer, the notify slot, and every piece's ranges as the
        NIC would check them (local inside its lkey's registration on this device; remote inside its rkey's,
        writable, on the kinds whose WQEs carry the rkey; HcclBatchPut and BatchWrite find the remote by address
        and their C++ calls check it before they start)."""
        revoked = next((i for i, p in enumerate(ticket.pieces) if p.lkey in self._revoked), None)
        if revoked is not None:
            p = ticket.pieces[revoked]
            raise E.NotRegistered(
                f"piece {revoked} [{p.local_addr:#x}, +{p.nbytes}) is in a region unregistered "
                f"from {self!r} (lkey {p.lkey:#x})"
            )
        if len(ticket.pieces) > self.max_pieces:
            raise E.CapacityError(f"{len(ticket.pieces)} pieces exceed the engine's max_pieces {self.max_pieces}")
        if ticket.remote.peer != self.peer:
            raise E.ConfigError(f"remote slot on rank {ticket.remote.peer}, but {self!r} writes to rank {self.peer}")
        slot = ticket.notify_slot
        if slot is not None and (
            isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self._C.NOTIFY_SLOTS
        ):
            raise E.BoundsError(f"notify slot {slot!r} is outside [0, {self._C.NOTIFY_SLOTS})")
        keyed_remote = ticket.kind in (TransferKind.AIV, TransferKind.STAGING) or (
            ticket.kind is TransferKind.HOST and self.host_call_per_piece
        )
        self._C.check_segments(self.device, *self._arrays(ticket.pieces), keyed_remote)

    def _start_host(self, ticket: Ticket) -> None:
        if self.host_call_per_piece:
            # one host submission per piece, each rung at once: the NIC overlaps the transfers with the
            # next submissions, as the copy engine does with one cudaMemcpyAsync per layer block
            qp = self._qps[0]
            qp.poster_vtime_ns = ticket.state["start_vtime_ns"]
            for p in ticket.pieces:
                qp.post(
                    [self._C.WorkRequest(3, p.local_addr, p.lkey, p.nbytes, p.remote_addr, p.rkey)],
                    self.cost.host_submit_ns,
                    self.timeout_s,
                )
                qp.drain(self.timeout_s)  # the NIC latched this doorbell's post time before the next one
            ticket.state["posted"] = len(ticket.pieces)
            ticket.state["submit_vtime_ns"] = len(ticket.pieces) * self.cost.host_submit_ns
            return
        descs = [self._C.OneSideDesc(p.local_addr, p.remote_addr, p.nbytes, HCCL_DATA_TYPE_INT8) for p in ticket.pieces]
        # HcclBatchPut is synchronous in the emulator; the ticket carries its outcome to wait()
        ticket.state["complete_vtime_ns"] = self.comm.batch_put(self.peer, descs, self.timeout_s)
        ticket.state["submit_vtime_ns"] = self.cost.host_submit_ns

    def _launch_aicpu(self, ticket: Ticket) -> None:
        local, remote, lengths, _, _ = self._arrays(ticket.pieces)
        ticket.state["run"] = self._C.launch_aicpu_batch_write(
            self.comm,
            self._items.addr,
            local,
            remote,
            lengths,
            self.peer,
            self.block_dim,
            64,
            self.ub_bytes,
            self.timeout_s,
        )
        ticket.state["submit_vtime_ns"] = self.cost.aicpu_issue_ns + len(ticket.pieces) * self.cost.aicpu_wqe_ns

    def _launch_aiv(self, ticket: Ticket, pieces, start: float) -> None:
        ticket.state["run"] = self._C.launch_aiv_post_wqe(
            self._qps,
            *self._arrays(pieces),
            self.doorbell_batch,
            start,
            self.cost.aiv_submit_ns,
            self.ub_bytes,
            self.timeout_s,
        )
        per_core = -(-len(pieces) // self.block_dim)
        ticket.state["submit_vtime_ns"] = ticket.state.get("stage_vtime_ns", 0.0) + per_core * self.cost.aiv_submit_ns

    def _start_staging(self, ticket: Ticket, sources: Sequence[MemorySegment], start: float) -> None:
        total = sum(s.nbytes for s in sources)
        buffer = self.staging.allocate(total)
        ticket.state.update(staging_addr=buffer, staging_bytes=total)
        offset = 0
        stage_ns = self.cost.pcie_latency_ns
        window_key = self.comm.windows_out.lkey
        for s in sources:
            self._C.launch_hccl_stage(
                self.device,
                s.addr,
                s.key,
                buffer + offset,
                window_key,
                s.nbytes,
                self.block_dim,
                self.stage_chunk_bytes,
                2,
                self.ub_bytes,
                self.timeout_s,
            ).wait(self.timeout_s)
            bandwidth = self.cost.pcie_bytes_per_ns if s.memory is MemoryKind.HOST else self.cost.local_bytes_per_ns
            stage_ns += s.nbytes / bandwidth
            offset += s.nbytes
        ticket.state["stage_vtime_ns"] = stage_ns
        staged = [MemorySegment(buffer, total, MemoryKind.DEVICE, window_key)]
        ticket.pieces = split_segments(staged, ticket.remote, self.caps.max_single_aiv_payload)
        self._launch_aiv(ticket, ticket.pieces, start + stage_ns)

    @staticmethod
    def _arrays(pieces):
        """The pieces as the launchers take them: local and remote addresses, lengths (uint64), lkeys, rkeys (uint32)."""
        return (
            np.array([p.local_addr for p in pieces], np.uint64),
            np.array([p.remote_addr for p in pieces], np.uint64),
            np.array([p.nbytes for p in pieces], np.uint64),
            np.array([p.lkey for p in pieces], np.uint32),
            np.array([p.rkey for p in pieces], np.uint32),
        )

    # ---- finish -----------------------------------------------------------------------------------

    def _finish(self, ticket: Ticket, timeout_s: float) -> TransferResult:
        if self._closed:  # its queues are gone: no completion can arrive
            raise E.QueueError(f"{self!r} was closed before ticket {ticket.id} completed")
        state = ticket.state
        if ticket.kind is TransferKind.HOST:
            complete = (
                state["complete_vtime_ns"]
                if "posted" not in state
                else self._collect(ticket, state["posted"], timeout_s)
            )
            self._host_clock_ns = max(self._host_clock_ns, complete)
        elif ticket.kind is TransferKind.AICPU:
            state["run"].wait(timeout_s)
            complete = state["run"].hccl_done_vtime_ns
            self._aicpu_clock_ns = max(self._aicpu_clock_ns, complete)
        else:
            complete = self._collect_aiv(ticket, timeout_s)
            self._vclock_ns = max(self._vclock_ns, complete)
        return TransferResult(
            ticket.kind,
            ticket.selection,
            ticket.nbytes,
            len(ticket.pieces),
            start_vtime_ns=state["start_vtime_ns"],
            submit_vtime_ns=state["submit_vtime_ns"],
            complete_vtime_ns=complete,
            staging_bytes=state["staging_bytes"],
        )

    def _collect_aiv(self, ticket: Ticket, timeout_s: float) -> float:
        status = ticket.state["run"].wait(timeout_s)
        posted = sum(s["posted"] for s in status)
        stuck = [i for i, s in enumerate(status) if s["code"] != self._C.CORE_OK]
        if stuck:  # the NIC retired nothing for timeout_s: the posted WQEs will not complete either
            self._broken = f"vector cores {stuck} could not post"
            raise E.QueueError(
                f"post failed for ticket {ticket.id}: the SQ of vector cores {stuck} stayed full for "
                f"{timeout_s} s; {posted} of {len(ticket.pieces)} pieces were posted"
            )
        return self._collect(ticket, posted, timeout_s)

    def _collect(self, ticket: Ticket, posted: int, timeout_s: float) -> float:
        """Exactly ``posted`` CQEs (every WQE is signaled); raises the first real error among them. The CQEs polled
        so far stay in ``ticket.state``: after a timeout the ticket is still in flight (it blocks every later submit)
        and a later call collects the rest."""
        completions, cause = ticket.state.setdefault("completions", []), None
        while len(completions) < posted:
            try:
                got = self._cq.poll(posted - len(completions), timeout_s)
            except E.WaitTimeout as exc:
                got, cause = [], exc
            if not got:
                raise E.WaitTimeout(
                    f"timed out after {timeout_s} s waiting for the completions of ticket {ticket.id} "
                    f"({ticket.kind.value}): {len(completions)} of {posted} posted WQEs completed"
                ) from cause
            completions += got
        errors = [c for c in completions if c.status != 0]
        if errors:
            for qp in self._qps:  # ERROR -> ready-to-send once every posted WQE is flushed
                qp.reset(timeout_s)
            first = next((c for c in errors if c.syndrome != 16), errors[0])  # the cause, not a FLUSHED follower
            raise completion_error(first)
        return max(c.vtime_ns for c in completions)

    def _fresh_magic(self) -> int:
        return self.comm.next_magic()  # the communicator's: unique across every engine and notify of the rank

    def _write_notify(self, slot: int, value: int, timeout_s: float, what: str) -> None:
        self.comm.notify_record(self.peer, slot, value, timeout_s)

    def _release(self, ticket: Ticket) -> None:
        addr = ticket.state.pop("staging_addr", None)
        if addr is not None:
            self.staging.release(addr)

    def close(self) -> None:
        """Close the engine's queues and item array; later submits raise QueueError naming the engine."""
        self._closed = True
        for qp in self._qps:
            qp.close()
        self._cq.close()
        self._items.close()
