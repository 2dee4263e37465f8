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
from ascend_dualpath.transport.engine import StagingPool, Ticket, TransferEngine, TransferResult
from ascend_dualpath.transport.kinds import ROCE, ChannelCapabilities, MemoryKind, Selection, TransferKind, select_kind
from ascend_dualpath.transport.segments import MemorySegment, split_segments

MAX_MESSAGE_BYTES = 1 << 31
DEFAULT_MAX_SINGLE_AIV_PAYLOAD = 1 << 20  # assumption: 1 MiB per AIV-posted WQE (configurable)
HCCL_DATA_TYPE_INT8 = 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


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
        if not 1 <= block_dim <= profile.vector_cores:
            raise E.ConfigError(f"block_dim {block_dim} is outside [1, {profile.vector_cores}] vector cores")
        if peer >= comm.world_size:
            raise E.ConfigError(f"peer rank {peer} is outside world size {comm.world_size}")
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
        window = comm.windows_out
        self.staging = StagingPool(window.addr, window.size if staging_capacity is None else staging_capacity)
        self._vclock_ns = 0.0  # AIV and staging requests
        self._host_clock_ns = 0.0
        self._aicpu_clock_ns = 0.0
        self._in_flight: Ticket | None = None
        self._broken: str | None = None

    # ---- gates ------------------------------------------------------------------------------------

    def select(self, sources: Sequence[MemorySegment]) -> Selection:
        return select_kind(self.caps, [s.memory for s in sources], max((s.nbytes for s in sources), default=0))

    def _max_piece(self, kind: TransferKind) -> int:
        if kind in (TransferKind.AIV, TransferKind.STAGING):
            return self.caps.max_single_aiv_payload
        return MAX_MESSAGE_BYTES

    # ---- start ------------------------------------------------------------------------------------

    def _start(self, ticket: Ticket, sources: Sequence[MemorySegment]) -> None:
        if self._broken:
            raise E.QueueError(f"the engine is unusable after an earlier failure: {self._broken}")
        if self._in_flight is not None and not self._in_flight.finished:
            raise E.QueueError(f"ticket {self._in_flight.id} is still in flight; wait for it before submitting more")
        if len(ticket.pieces) > self.max_pieces:
            raise E.CapacityError(f"{len(ticket.pieces)} pieces exceed the engine's max_pieces {self.max_pieces}")
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
        local, remote, lengths = self._arrays(ticket.pieces)
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
        local, remote, lengths = self._arrays(pieces)
        lkeys = np.array([p.lkey for p in pieces], np.uint32)
        rkeys = np.array([p.rkey for p in pieces], np.uint32)
        ticket.state["run"] = self._C.launch_aiv_post_wqe(
            self._qps,
            local,
            remote,
            lengths,
            lkeys,
            rkeys,
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
        for s in sources:
            self._C.launch_hccl_stage(
                s.addr,
                buffer + offset,
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
        window_key = self.comm.windows_out.lkey
        staged = [MemorySegment(buffer, total, MemoryKind.DEVICE, window_key)]
        ticket.pieces = split_segments(staged, ticket.remote, self.caps.max_single_aiv_payload)
        self._launch_aiv(ticket, ticket.pieces, start + stage_ns)

    @staticmethod
    def _arrays(pieces):
        return (
            np.array([p.local_addr for p in pieces], np.uint64),
            np.array([p.remote_addr for p in pieces], np.uint64),
            np.array([p.nbytes for p in pieces], np.uint64),
        )

    # ---- finish -----------------------------------------------------------------------------------

    def _finish(self, ticket: Ticket, timeout_s: float) -> TransferResult:
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
        """Exactly ``posted`` CQEs (every WQE is signaled); raises the first real error among them."""
        completions, cause = [], None
        while len(completions) < posted:
            try:
                got = self._cq.poll(posted - len(completions), timeout_s)
            except E.WaitTimeout as exc:
                got, cause = [], exc
            if not got:
                self._broken = f"ticket {ticket.id} lost completions"
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

    def _publish_ready(self, ticket: Ticket, timeout_s: float) -> int:
        magic = self.comm.next_magic()
        self.comm.notify_record(self.peer, ticket.notify_slot, magic, timeout_s)
        return magic

    def _release(self, ticket: Ticket) -> None:
        addr = ticket.state.pop("staging_addr", None)
        if addr is not None:
            self.staging.release(addr)

    def close(self) -> None:
        for qp in self._qps:
            qp.close()
        self._cq.close()
        self._items.close()
