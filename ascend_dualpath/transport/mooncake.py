"""The transfer engine over the Mooncake Transfer Engine: batch writes by address to a peer on another host.

Mooncake (``pip install 'ascend_dualpath[mooncake]'``, docs/mooncake.md) moves bytes between registered memory of
two processes on any hosts, over ``tcp`` (runs anywhere), ``rdma`` (RDMA NICs) or ``ascend`` (its NPU transport,
the ``-npu`` wheel with CANN). Peers meet by Mooncake's P2P handshake: no etcd, no metadata server; each side
publishes a :class:`MooncakePeer` (its session ``host:port``, the buffers it registered, its notify area) and the
caller carries it to the other side (a pipe, the side channel).

Sequence:

1. :meth:`MooncakeTransferEngine.register` each local buffer (``register_memory``); :meth:`~MooncakeTransferEngine.info`
   is what the peer needs; :meth:`~MooncakeTransferEngine.connect` takes the peer's (checked, then probed).
2. ``submit``: every piece's local range checked against this engine's registrations (Mooncake itself sends from
   unregistered memory) and the remote slot against the buffers the peer published, before any byte moves; then
   one ``transfer_submit_write`` per piece (Mooncake's per-batch status call polls only a batch's first task, so
   one piece per batch is what a bounded, non-blocking wait can follow).
3. ``wait``: polls every piece's ``transfer_check_status`` until all completed, bounded by the timeout; then the
   notify: the 8-byte value is written from the engine's registered outbox into the peer's notify slot, after
   every byte landed (Mooncake >= 0.3.12's TCP completes a write once the destination applied it).
4. The receiver watches its own notify area with :meth:`~MooncakeTransferEngine.notify_value` (what DualPath's
   ``wait_notify`` polls).

A piece whose wait timed out stays in flight inside Mooncake: the engine keeps it as an orphan and refuses to
unregister memory it still reads until Mooncake reports it done.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from ascend_dualpath import errors as E
from ascend_dualpath._checks import check_bound, check_type
from ascend_dualpath.transport.engine import (
    POLL_S,
    PreparedTransfer,
    Ticket,
    TransferEngine,
    TransferResult,
    check_notify_value,
    poll_until,
)
from ascend_dualpath.transport.kinds import GateDecision, MemoryKind, Selection, TransferKind
from ascend_dualpath.transport.segments import MemorySegment, RemoteSlot, WirePiece

PROTOCOLS = ("tcp", "rdma", "ascend")
NOTIFY_BYTES = 8  # one int64 per notify slot
NOTIFY_SLOTS = 1024  # as many as the emulated communicator's notify area (DualPath's abort slot is 1023)
MAX_PIECE = 1 << 40  # Mooncake slices a request itself; the engine does not split
MIN_VERSION = (0, 3, 12)  # acknowledged TCP framing: COMPLETED means applied at the destination (Mooncake #2850)
WHEELS = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine", "mooncake-transfer-engine-npu")
INSTALL_HINT = (
    "pip install 'ascend_dualpath[mooncake]' (the CPU wheel; CUDA: mooncake-transfer-engine, Ascend: "
    "mooncake-transfer-engine-npu with CANN; docs/mooncake.md)"
)
# Mooncake's return codes (mooncake-transfer-engine/include/error.h)
MOONCAKE_ERRORS = {
    -1: "ERR_INVALID_ARGUMENT",
    -2: "ERR_TOO_MANY_REQUESTS",
    -3: "ERR_ADDRESS_NOT_REGISTERED",
    -4: "ERR_BATCH_BUSY",
    -6: "ERR_DEVICE_NOT_FOUND",
    -7: "ERR_ADDRESS_OVERLAPPED",
    -101: "ERR_DNS",
    -102: "ERR_SOCKET",
    -103: "ERR_MALFORMED_JSON",
    -104: "ERR_REJECT_HANDSHAKE",
    -200: "ERR_METADATA",
    -201: "ERR_ENDPOINT",
    -202: "ERR_CONTEXT",
    -300: "ERR_NUMA",
    -301: "ERR_CLOCK",
    -302: "ERR_MEMORY",
    -303: "ERR_NOT_IMPLEMENTED",
}
STATUS_PENDING, STATUS_COMPLETED, STATUS_FAILED, STATUS_TIMEOUT = 0, 1, -1, -2  # transfer_check_status


def code_name(rc: int) -> str:
    """``NAME (value)`` of a Mooncake return code."""
    return f"{MOONCAKE_ERRORS.get(rc, 'unknown code')} ({rc})"


class PeerUnreachable(E.DeviceError):
    """The Mooncake peer did not answer (its session refused the connection, or it is gone)."""


class MooncakePeer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one engine publishes for its peer to write into it (:meth:`MooncakeTransferEngine.info`).

    ``session`` is Mooncake's ``host:port`` of its P2P handshake listener; ``buffers`` are the ``(addr, nbytes)``
    ranges registered for remote writes; the notify area is ``notify_slots`` int64 words at ``notify_addr``.
    Carry it as bytes with :meth:`encode` / :meth:`decode`."""

    session: str
    protocol: str
    buffers: tuple[tuple[int, int], ...]
    notify_addr: int
    notify_slots: int

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> MooncakePeer:
        """The peer info in ``data``; ProtocolError naming what is wrong with it."""
        try:
            return msgspec.msgpack.decode(data, type=cls)
        except (msgspec.ValidationError, msgspec.DecodeError) as error:
            raise E.ProtocolError(f"malformed Mooncake peer info ({len(data)} bytes): {error}") from error


@dataclass(frozen=True)
class Region:
    """A registered range: ``nbytes`` at ``addr`` in ``memory``."""

    addr: int
    nbytes: int
    memory: MemoryKind = MemoryKind.HOST

    def holds(self, addr: int, nbytes: int) -> bool:
        return self.addr <= addr and addr + nbytes <= self.addr + self.nbytes

    def overlaps(self, addr: int, nbytes: int) -> bool:
        return self.addr < addr + nbytes and addr < self.addr + self.nbytes


@dataclass
class _Write:
    """One piece in flight: Mooncake's batch id; ``done`` once Mooncake freed the batch (never polled again)."""

    batch: int
    piece: WirePiece
    index: int
    done: bool = False


def load_mooncake() -> Any:
    """The ``mooncake.engine`` module; BackendUnavailable naming what is missing (the wheel, a system library, a
    version with acknowledged TCP writes)."""
    try:
        from mooncake import engine
    except ImportError as error:
        need = (
            "install the system libraries it links: apt-get install -y libibverbs1 libnl-route-3-200"
            if ".so" in str(error)
            else INSTALL_HINT
        )
        raise E.BackendUnavailable(f"the Mooncake Transfer Engine does not import ({error}): {need}") from error
    version = installed_version()
    if version is not None and version[1] < MIN_VERSION:
        raise E.BackendUnavailable(
            f"{version[0]} {'.'.join(map(str, version[1]))} is older than "
            f"{'.'.join(map(str, MIN_VERSION))}: its TCP writes complete before the peer applied them, so a "
            f"notify could overtake the data; {INSTALL_HINT}"
        )
    return engine


def installed_version() -> tuple[str, tuple[int, ...]] | None:
    """(wheel name, release numbers) of the installed Mooncake wheel, None when none of :data:`WHEELS` is."""
    for wheel in WHEELS:
        try:
            text = importlib.metadata.version(wheel)
        except importlib.metadata.PackageNotFoundError:
            continue
        return wheel, tuple(int(n) for n in re.findall(r"\d+", text.split("+")[0])[:3])
    return None


def _range_of(target: Any, nbytes: int | None) -> tuple[int, int]:
    """``(addr, nbytes)`` of an address and a length, a numpy array, a torch tensor or a region (``addr``/``size``)."""
    if isinstance(target, int) and not isinstance(target, bool):
        if nbytes is None:
            raise E.ConfigError(f"register({target:#x}) needs nbytes")
        return target, check_type("nbytes", nbytes, int, where="register")
    if isinstance(target, np.ndarray):
        if not target.flags.c_contiguous:
            raise E.ConfigError("a registered array must be C-contiguous")
        return target.ctypes.data, target.nbytes
    if hasattr(target, "data_ptr"):  # a torch tensor
        if not target.is_contiguous():
            raise E.ConfigError("a registered tensor must be contiguous")
        return target.data_ptr(), target.numel() * target.element_size()
    if hasattr(target, "addr") and hasattr(target, "size"):
        return int(target.addr), int(target.size)
    raise E.ArgumentTypeError(
        f"register takes an address and nbytes, a numpy array, a tensor or a region, got {type(target).__name__}"
    )


class MooncakeTransferEngine(TransferEngine):
    """Transfers from this process into registered memory of one peer, through the Mooncake Transfer Engine.

    Parameters
    ----------
    peer : int
        The peer's rank: remote slots name it (``RemoteSlot.peer``).
    hostname : str
        Address this engine listens on and publishes (its session is ``hostname:port``, the port Mooncake's
        P2P handshake picked).
    protocol : str
        ``tcp`` (anywhere), ``rdma`` (needs RDMA NICs) or ``ascend`` (the ``-npu`` wheel with CANN).
    device_name : str
        Mooncake's device filter (RDMA NIC names, comma-separated; empty for all).
    notify_slots : int
        int64 words of this engine's notify area (where the peer's notifies land).
    timeout_s : float or None
        Default bound of every wait.
    module : module or None
        ``mooncake.engine`` (loaded when None); tests pass a fake.
    """

    def __init__(
        self,
        peer: int,
        *,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        notify_slots: int = NOTIFY_SLOTS,
        timeout_s: float | None = None,
        module: Any = None,
    ):
        super().__init__(timeout_s)
        where = type(self).__name__
        self.peer = check_type("peer", peer, int, where=where)
        check_type("hostname", hostname, str, where=where)
        check_type("protocol", protocol, str, where=where)
        if protocol not in PROTOCOLS:
            raise E.ConfigError(f"{where}: protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
        if protocol == "tcp" and os.environ.get("MC_TCP_PROTO") == "1":
            raise E.ConfigError(
                "MC_TCP_PROTO=1 selects Mooncake's unacknowledged TCP framing, whose writes complete before the "
                "peer applied them: a notify could overtake the data; unset it"
            )
        self.notify_slots = check_bound("notify_slots", notify_slots, integer=True, where=where)
        self.protocol, self.hostname = protocol, hostname
        self._te = self._initialize(load_mooncake() if module is None else module, device_name)
        self.session = f"{hostname}:{self._te.get_rpc_port()}"
        self._lock = threading.Lock()  # the bookkeeping below: record() may run beside the leg's worker
        self._local: list[Region] = []
        self._in_flight: dict[int, Ticket] = {}
        self._orphans: list[_Write] = []  # pieces whose wait ended before Mooncake did: still read their source
        self._remote: MooncakePeer | None = None
        self._closed = False
        # inbox: the peer's notifies land here; outbox: the source word of each notify this engine writes
        self._notify = np.zeros(2 * self.notify_slots, np.int64)
        self._check_rc("register_memory", self._te.register_memory(self._notify.ctypes.data, self._notify.nbytes), "")

    def _initialize(self, module: Any, device_name: str) -> Any:
        te = module.TransferEngine()
        rc = te.initialize(self.hostname, "P2PHANDSHAKE", self.protocol, device_name)
        if rc != 0:
            raise E.BackendUnavailable(
                f"Mooncake initialize({self.hostname!r}, P2PHANDSHAKE, {self.protocol!r}, {device_name!r}) returned "
                f"{code_name(rc)}"
            )
        if self.protocol == "rdma" and not any(
            hcas for lists in json.loads(te.get_local_topology()).values() for hcas in lists
        ):
            raise E.BackendUnavailable(
                f"protocol 'rdma': Mooncake found no RDMA NIC{f' matching {device_name!r}' if device_name else ''} "
                f"(it would fall back to TCP); use protocol 'tcp'"
            )
        if self.protocol == "ascend" and (installed_version() or ("",))[0] != WHEELS[2]:
            raise E.BackendUnavailable(
                "protocol 'ascend' needs the mooncake-transfer-engine-npu wheel (with CANN); this Mooncake is "
                f"{(installed_version() or ('an unknown build',))[0]}"
            )
        return te

    def __repr__(self) -> str:
        peer = self._remote.session if self._remote is not None else "not connected"
        return f"MooncakeTransferEngine({self.session} -> rank {self.peer} at {peer}, {self.protocol})"

    def __enter__(self) -> MooncakeTransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- peers -------------------------------------------------------------------------------------

    def info(self) -> MooncakePeer:
        """What the peer needs to write here: this session, the registered buffers, the notify area."""
        self._check_open()
        with self._lock:
            buffers = tuple((r.addr, r.nbytes) for r in self._local)
        return MooncakePeer(self.session, self.protocol, buffers, self._notify.ctypes.data, self.notify_slots)

    def connect(self, peer: MooncakePeer, probe: bool = True) -> None:
        """Write to ``peer`` (its :meth:`info`) from now on; with ``probe``, PeerUnreachable unless it answers and
        ConfigError unless its handshake matches the info."""
        self._check_open()
        check_type("peer", peer, MooncakePeer, where=f"{self!r}.connect")
        host, _, port = peer.session.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise E.ConfigError(f"peer session {peer.session!r} is not host:port with a port in [1, 65535]")
        if peer.protocol != self.protocol:
            raise E.ConfigError(f"peer {peer.session} speaks {peer.protocol!r}, this engine {self.protocol!r}")
        bad = [b for b in (*peer.buffers, (peer.notify_addr, peer.notify_slots)) if b[0] <= 0 or b[1] < 1]
        if bad:
            raise E.ConfigError(f"peer {peer.session} published empty or null ranges {bad}")
        if probe:
            self._handshake(peer)
        self._remote = peer

    def _handshake(self, peer: MooncakePeer) -> None:
        """Probe ``peer``, then run Mooncake's handshake now (a first write would, and would block on a stalled
        peer for Mooncake's socket timeout); its first buffer must be the notify area the info names."""
        rc = self._te.send_probe(peer.session)
        if rc != 0:
            raise PeerUnreachable(
                f"Mooncake peer {peer.session} ({self.protocol}) does not answer: send_probe returned {code_name(rc)}"
            )
        first = self._te.get_first_buffer_address(peer.session)
        if first == 0:
            raise PeerUnreachable(f"Mooncake's handshake with {peer.session} ({self.protocol}) failed")
        if first != peer.notify_addr:
            raise E.ConfigError(
                f"the peer info names the notify area {peer.notify_addr:#x}, but {peer.session} registered "
                f"{first:#x} first: the info is not that engine's"
            )

    # ---- memory ------------------------------------------------------------------------------------

    def register(self, target: Any, nbytes: int | None = None, memory: MemoryKind = MemoryKind.HOST) -> Region:
        """Register ``nbytes`` at address ``target`` (or a numpy array, a tensor, a region) with Mooncake, as a
        source of this engine's writes and a destination of the peer's; ConfigError on an overlap."""
        self._check_open()
        addr, nbytes = _range_of(target, nbytes)
        if nbytes < 1 or addr <= 0:
            raise E.ConfigError(f"a registration needs an address and >= 1 byte, got [{addr:#x}, +{nbytes})")
        region = Region(addr, nbytes, MemoryKind(memory))
        with self._lock:
            clash = next((r for r in self._local if r.overlaps(addr, nbytes)), None)
            if clash is not None:
                raise E.ConfigError(
                    f"[{addr:#x}, +{nbytes}) overlaps the registered region [{clash.addr:#x}, +{clash.nbytes})"
                )
            self._check_rc("register_memory", self._te.register_memory(addr, nbytes), f"for [{addr:#x}, +{nbytes})")
            self._local.append(region)
        return region

    def unregister(self, region: Region) -> None:
        """Undo :meth:`register`; refused while a ticket in flight (or a timed-out piece Mooncake still runs) reads
        from it. Later requests with a source there raise NotRegistered before anything moves."""
        self._check_open()
        with self._lock:
            if region not in self._local:
                raise E.NotRegistered(f"[{region.addr:#x}, +{region.nbytes}) is not registered with {self!r}")
            self._reap_orphans()
            busy = [t.id for t in self._in_flight.values() if any(region.overlaps(*_src(p)) for p in t.pieces)]
            busy += [f"orphan of piece {w.index}" for w in self._orphans if region.overlaps(*_src(w.piece))]
            if busy:
                raise E.ProtocolError(f"{busy} still read from [{region.addr:#x}, +{region.nbytes}): wait for them")
            self._local.remove(region)
            self._check_rc("unregister_memory", self._te.unregister_memory(region.addr), f"for {region}")

    def close(self) -> None:
        """Unregister everything and end Mooncake's engine (after waiting, bounded, for orphaned pieces); later
        calls raise QueueError naming the engine."""
        if self._closed:
            return
        for ticket in list(self._in_flight.values()):  # not ended (never waited, or its wait timed out): orphaned
            self._release(ticket)
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            while self._orphans and time.monotonic() < deadline:
                self._reap_orphans()
                time.sleep(POLL_S)
            self._closed = True
            for region in self._local:
                self._te.unregister_memory(region.addr)
            self._local.clear()
            self._te.unregister_memory(self._notify.ctypes.data)
            self._te = None  # Mooncake's destructor closes its sessions and stops its threads

    def _check_open(self) -> None:
        if self._closed:
            raise E.QueueError(f"the Mooncake engine {self.session} is closed")

    def _check_rc(self, call: str, rc: int, what: str) -> None:
        if rc != 0:
            raise E.DeviceError(f"Mooncake {call} returned {code_name(rc)} {what} on {self.session}".rstrip())

    # ---- addresses ---------------------------------------------------------------------------------

    def locate(self, addr: int, nbytes: int) -> MemorySegment:
        with self._lock:
            region = next((r for r in self._local if r.holds(addr, nbytes)), None)
        if region is None:
            raise E.NotRegistered(
                f"source [{addr:#x}, +{nbytes}) lies in no region registered with {self!r} ({len(self._local)} "
                f"registered)"
            )
        return MemorySegment(addr, nbytes, region.memory)

    def remote_slot(self, addr: int, nbytes: int) -> RemoteSlot:
        self._check_remote(addr, nbytes, "destination")
        return RemoteSlot(self.peer, addr, nbytes)

    def _peer_info(self) -> MooncakePeer:
        if self._remote is None:
            raise E.ProtocolError(f"{self!r} has no peer: connect() it with the peer's info() first")
        return self._remote

    def _check_remote(self, addr: int, nbytes: int, what: str) -> None:
        peer = self._peer_info()
        if not any(a <= addr and addr + nbytes <= a + n for a, n in peer.buffers):
            raise E.BoundsError(
                f"{what} [{addr:#x}, +{nbytes}) on {peer.session} lies in no buffer it published "
                f"({len(peer.buffers)} buffers)"
            )

    def notify_value(self, slot: int) -> int:
        """The value last written into notify ``slot`` of this engine's area (0: none yet); what ``wait_notify``
        polls on the receiving side."""
        self._check_slot(slot, self.notify_slots, "this engine's")
        return int(self._notify[slot])

    def reset_notify(self, slot: int) -> None:
        """Set this engine's notify ``slot`` back to 0 (nothing published), before reusing a slot whose next value
        may equal its last."""
        self._check_slot(slot, self.notify_slots, "this engine's")
        self._notify[slot] = 0

    @staticmethod
    def _check_slot(slot: int, slots: int, whose: str) -> None:
        check_type("notify slot", slot, int)
        if not 0 <= slot < slots:
            raise E.BoundsError(f"notify slot {slot} is outside [0, {slots}) of {whose} notify area")

    # ---- gates -------------------------------------------------------------------------------------

    def select(self, sources: Sequence[MemorySegment]) -> Selection:
        if not sources:
            raise E.EmptyTransfer("a transfer needs at least one source segment")
        gate = GateDecision(
            "capability", False, f"Mooncake Transfer Engine over {self.protocol}: no device-posted path"
        )
        return Selection(
            TransferKind.HOST, "capability", f"the host posts every piece to Mooncake ({self.protocol})", (gate,), False
        )

    def _forced(self, selection: Selection, kind: TransferKind, sources: Sequence[MemorySegment]) -> Selection:
        if kind is not TransferKind.HOST:
            raise E.ConfigError(f"kind {kind.value!r} does not exist on the Mooncake engine; only 'host'")
        return selection

    def _max_piece(self, kind: TransferKind) -> int:
        return MAX_PIECE

    # ---- start -------------------------------------------------------------------------------------

    def _start(self, ticket: Ticket, prepared: PreparedTransfer) -> None:
        self._check_open()
        peer = self._peer_info()
        if ticket.remote.peer != self.peer:
            raise E.ConfigError(f"remote slot on rank {ticket.remote.peer}, but {self!r} writes to rank {self.peer}")
        if ticket.notify_slot is not None:
            self._check_slot(ticket.notify_slot, peer.notify_slots, f"{peer.session}'s")
        with self._lock:
            self._reap_orphans()
            for i, p in enumerate(ticket.pieces):
                if not any(r.holds(p.local_addr, p.nbytes) for r in self._local):
                    raise E.NotRegistered(
                        f"piece {i} [{p.local_addr:#x}, +{p.nbytes}) lies in no region registered with {self!r} "
                        f"({len(self._local)} registered): nothing was sent"
                    )
            self._check_remote(ticket.remote.addr, ticket.remote.nbytes, "remote slot")
            self._in_flight[ticket.id] = ticket
        writes: list[_Write] = ticket.state.setdefault("writes", [])
        for i, p in enumerate(ticket.pieces):
            writes.append(self._submit_write(p, i, peer))

    def _submit_write(self, piece: WirePiece, index: int, peer: MooncakePeer) -> _Write:
        batch = self._te.transfer_submit_write(peer.session, piece.local_addr, piece.remote_addr, piece.nbytes)
        if batch == 0:  # Mooncake's failure sentinel: the handshake or the submission failed
            raise PeerUnreachable(
                f"Mooncake transfer_submit_write of piece {index} [{piece.local_addr:#x}, +{piece.nbytes}) -> "
                f"{peer.session} [{piece.remote_addr:#x}, +{piece.nbytes}) failed: the peer is unreachable or "
                f"refused the handshake"
            )
        return _Write(batch, piece, index)

    # ---- finish ------------------------------------------------------------------------------------

    def _await(self, writes: list[_Write], timeout_s: float, what: str) -> None:
        """Poll every write until Mooncake completed it, bounded by ``timeout_s``; the first failure raises."""

        def done() -> bool:
            for w in writes:
                if not w.done:
                    self._check_write(w, what)
            return all(w.done for w in writes)

        poll_until(done, timeout_s, lambda: f"{what}: {sum(w.done for w in writes)} of {len(writes)} pieces completed")

    def _check_write(self, w: _Write, what: str) -> None:
        """One poll of ``w``: marks it done once Mooncake completed (or failed) it; raises its failure."""
        status = self._te.transfer_check_status(w.batch)
        if status in (STATUS_COMPLETED, STATUS_FAILED):
            w.done = True  # Mooncake freed the batch
        if status in (STATUS_FAILED, STATUS_TIMEOUT):
            p = w.piece
            raise E.DeviceError(
                f"Mooncake reported {'FAILED' if status == STATUS_FAILED else 'TIMEOUT'} for {what}: piece "
                f"{w.index} [{p.local_addr:#x}, +{p.nbytes}) -> {self._peer_info().session} "
                f"[{p.remote_addr:#x}, +{p.nbytes}) (the peer died, closed, or refused the range)"
            )

    def _finish(self, ticket: Ticket, timeout_s: float) -> TransferResult:
        self._check_open()
        peer = self._peer_info().session
        what = f"the {len(ticket.pieces)} pieces ({ticket.nbytes} bytes) of ticket {ticket.id} to {peer}"
        self._await(ticket.state["writes"], timeout_s, what)
        return TransferResult(ticket.kind, ticket.selection, ticket.nbytes, len(ticket.pieces))

    def record(self, slot: int, magic: int, timeout_s: float | None = None) -> None:
        self._check_open()
        peer = self._peer_info()
        self._check_slot(slot, peer.notify_slots, f"{peer.session}'s")
        check_notify_value(magic, slot, where=f"{self!r}.record")
        timeout = self.timeout_s if timeout_s is None else check_bound("timeout_s", timeout_s, zero_ok=True)
        self._write_notify(slot, magic, timeout, "a recorded magic")

    def _write_notify(self, slot: int, magic: int, timeout_s: float, what: str) -> None:
        """Write ``magic`` from this engine's outbox word of ``slot`` into the peer's notify ``slot``; bounded."""
        peer = self._peer_info()
        self._notify[self.notify_slots + slot] = magic  # host memory: set before Mooncake reads it
        source = self._notify.ctypes.data + (self.notify_slots + slot) * NOTIFY_BYTES
        piece = WirePiece(source, peer.notify_addr + slot * NOTIFY_BYTES, NOTIFY_BYTES, 0, 0, 0)
        write = self._submit_write(piece, 0, peer)
        try:
            self._await([write], timeout_s, f"the notify of {what} (slot {slot})")
        finally:
            if not write.done:
                with self._lock:
                    self._orphans.append(write)

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            self._in_flight.pop(ticket.id, None)
            self._orphans += [w for w in ticket.state.pop("writes", []) if not w.done]

    def _reap_orphans(self) -> None:
        """Drop the orphaned pieces Mooncake has finished with (caller holds the lock; never blocks)."""
        for w in self._orphans:
            if self._te.transfer_check_status(w.batch) in (STATUS_COMPLETED, STATUS_FAILED):
                w.done = True
        self._orphans = [w for w in self._orphans if not w.done]


def _src(piece: WirePiece) -> tuple[int, int]:
    return piece.local_addr, piece.nbytes
