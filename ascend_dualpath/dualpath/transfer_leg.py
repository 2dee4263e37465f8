"""The transfer leg of DualPath loading: move one layer's KV segments to a peer and raise its notify flag.

Both read paths stream KV between the prefill engine (PE) and the decode engine (DE) one layer at a time:
hit Layer Blocks DE -> PE HBM (DE read path), complete or miss layers PE -> DE buffer. Everything that moves
those bytes goes through a :class:`LayerTransferLeg`; :class:`TransportTransferLeg` is the one implementation:
one transfer engine per destination rank (:class:`~ascend_dualpath.transport.TransferEngine`, any backend: given,
made by a factory, or the emulator's from the communicator), so each layer goes the way the gates choose (aiv /
aicpu / staging / host), and the engine writes the caller's per-attempt magic into the notify slot after the
layer's bytes landed (``notify_value``). The leg runs no thread of its own: the caller's submits and waits drive the
engines. Every wait is ``wait(ticket, timeout_s=None)``, bounded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from ascend_dualpath import _env
from ascend_dualpath._checks import check_bound
from ascend_dualpath.dualpath.traffic import TrafficClass, comm_config_fields
from ascend_dualpath.errors import AdpError, BoundsError, ConfigError, ProtocolError, QueueError, WaitTimeout

NOTIFY_POLL_S = 50e-6
ABORT_SLOT = 1023  # notify slot reserved for "the peer gave up on this request"
# The comm_config fields of every communicator a leg moves KV over (the DualPath engines', the vLLM connector's
# dataplane): the low traffic class, so the NIC serves model collectives first and KV still progresses
KV_COMM_FIELDS = comm_config_fields(TrafficClass.KV)


class TransferFailed(QueueError):
    """A layer transfer did not complete; nothing after the failed descriptor can be trusted."""


class PeerAborted(ProtocolError):
    """The peer engine abandoned the request (its abort flag carries this request's magic)."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """``nbytes`` contiguous bytes at ``src_addr`` (registered local memory) going to ``dst_offset`` bytes past
    the destination address of the submission."""

    src_addr: int
    nbytes: int
    dst_offset: int


def contiguous(segments: Sequence[tuple[int, int]]) -> list[Segment]:
    """Segments ``[(src_addr, nbytes), ...]`` packed back to back at the destination."""
    out, cursor = [], 0
    for src_addr, nbytes in segments:
        out.append(Segment(src_addr, nbytes, cursor))
        cursor += nbytes
    return out


@dataclasses.dataclass(eq=False)
class TransferTicket:
    """One submitted layer transfer. ``vtime_ns`` is the emulator's virtual completion time once it ended well;
    ``error`` what ended it otherwise. While ``pending`` (the engine's ticket of the layer's notified request)
    is set, bytes of the layer may still land; a wait for it that timed out leaves it set (``waited_out``)."""

    layer: int
    nbytes: int
    what: str
    leg: Any = dataclasses.field(default=None, repr=False)
    pending: Any = dataclasses.field(default=None, repr=False)
    vtime_ns: float | None = None
    error: BaseException | None = None
    waited_out: bool = False  # a wait for ``pending`` timed out: later polls of done() look without waiting

    def done(self) -> bool:
        """Whether the transfer ended (no byte of it may still land). Never waits for another thread; when its
        leg is free and this is the request in flight, it finishes it (bounded by the leg's timeout)."""
        if self.pending is not None and self.leg is not None:
            self.leg.progress(self)
        return self.pending is None


class LayerTransferLeg(Protocol):
    """What the read paths need from a transfer engine."""

    def submit(
        self,
        layer: int,
        segments: Sequence[Segment],
        dst_peer: int,
        dst_addr: int,
        notify_slot: int | None,
        magic: int | None,
    ) -> TransferTicket: ...

    def wait(self, ticket: TransferTicket, timeout_s: float | None = None) -> float: ...

    def raise_if_failed(self, ticket: TransferTicket) -> None: ...

    def register_local(self, region: Any) -> None: ...

    def record(self, dst_peer: int, notify_slot: int, magic: int) -> None: ...

    def close(self) -> None: ...


class TransportTransferLeg:
    """Layer transfers through transfer engines (:mod:`ascend_dualpath.transport`), one per destination rank, so
    each layer goes the way the gates choose: ``aiv`` for device-memory sources, ``staging`` for host-DRAM
    sources (the DE buffer), falling back to ``aicpu`` / ``host``.

    Addresses become segments and slots through the engines (:meth:`~ascend_dualpath.transport.TransferEngine.locate`,
    ``remote_slot``): sources must lie in memory the engine may read (given to :meth:`register_local`, or the
    communicator's windows on the emulator); each run of segments that lands back to back at the destination goes
    as one request. The layer's last request carries the caller's magic as its ``notify_value``: the engine writes
    it after every byte of that request landed, and the requests before it were waited first, so the notify follows
    every byte of the layer.

    No thread: one engine request is in flight per leg (the emulator's engines allow one each, and the engines of
    one communicator share its staging window). :meth:`submit` therefore blocks until the request before it ended
    (the previous layer's, whose notify the emulator and NPU engines write in that wait) and, for a layer of several
    back-to-back runs, until all but its last run landed; it returns once the last run started, so the layer's
    transfer overlaps the caller's next compute. The engines' own submits block too, on the caller's thread: the
    emulator's stages a ``staging`` request (the ``hccl_stage`` copy into its window) and runs a ``host`` request's
    HcclBatchPut inside ``submit``; the CUDA and NPU engines only enqueue. The request in flight ends at the next :meth:`submit`, its
    :meth:`wait`, or a :meth:`raise_if_failed` / :meth:`TransferTicket.done` poll while the leg is free: a caller
    that polls for its peer's answer (``wait_notify``'s ``check``) so publishes its own notifies. Submits, waits and
    polls may come from several threads (one lock, every acquisition bounded).

    Parameters
    ----------
    comm : HcclComm or None
        Connected communicator of the default engines (the emulator's, one per rank of ``comm``); unused when
        ``engines`` is given.
    timeout_s : float, optional
        Bound of each transfer and notify (default ``ADP_TIMEOUT_S``).
    backend : str
        Backend of the default engines (:func:`~ascend_dualpath.transport.create_engine`).
    engines : sequence of TransferEngine, or callable, optional
        ``engines[rank]`` writes to ``rank``; a callable ``rank -> TransferEngine`` (a factory) is asked once per
        rank, when the leg first sends there. Either replaces the default engines.
    **engine_options
        Passed to the default engines' constructor (``block_dim``, ...).
    """

    def __init__(
        self,
        comm: Any = None,
        timeout_s: float | None = None,
        backend: str = "emulator",
        *,
        engines: Sequence[Any] | Callable[[int], Any] | None = None,
        **engine_options: Any,
    ) -> None:
        self.timeout_s = (
            check_bound("timeout_s", timeout_s, where=type(self).__name__)
            if timeout_s is not None
            else _env.timeout_s()
        )
        self._lock = threading.Lock()
        self._in_flight: TransferTicket | None = None
        self._closed = False
        self.bytes_sent = 0
        self.last_vtime_ns = 0.0
        self._engines: dict[int, Any] = {}
        if engines is None:
            if comm is None:
                raise ConfigError("TransportTransferLeg needs a communicator (for the default engines) or engines")
            from ascend_dualpath.transport import create_engine

            # one engine per destination rank (itself included: the DE loads into its own HBM), made up front so
            # their queues and buffers exist for the leg's whole life
            for peer in range(comm.world_size):
                self._engines[peer] = create_engine(backend, comm, peer, timeout_s=self.timeout_s, **engine_options)
            self._factory = None
        elif callable(engines):
            self._factory = engines
        else:
            self._engines = dict(enumerate(engines))
            self._factory = None
        self._registered: list[Any] = []
        self.kinds_used: dict[str, int] = {}

    def engine(self, peer: int) -> Any:
        """The engine that writes to rank ``peer`` (made by the factory on first use, with every registration)."""
        engine = self._engines.get(peer)
        if engine is None:
            if self._factory is None:
                raise ConfigError(f"the leg has no transfer engine to rank {peer} (ranks {sorted(self._engines)})")
            engine = self._engines[peer] = self._factory(peer)
            for region in self._registered:
                engine.register(region)
        return engine

    def register_local(self, region: Any) -> None:
        """Make ``region`` usable as a source with every engine (its ``register``)."""
        self._registered.append(region)
        for engine in {id(e): e for e in self._engines.values()}.values():
            engine.register(region)

    @staticmethod
    def _check(layer: int, segments: Sequence[Segment], notify_slot: int | None, magic: int | None) -> None:
        if (notify_slot is None) != (magic is None):
            raise ProtocolError(f"layer {layer}: notify_slot and magic go together, got {notify_slot} and {magic}")
        for seg in segments:
            if seg.nbytes < 1 or seg.dst_offset < 0:
                raise BoundsError(
                    f"layer {layer}: segment of {seg.nbytes} bytes at destination offset "
                    f"{seg.dst_offset}; needs >= 1 byte at offset >= 0"
                )

    @staticmethod
    def _requests(layer: int, engine: Any, segments: Sequence[Segment], dst_addr: int) -> list[tuple[list, Any]]:
        """One ``(sources, remote slot)`` per back-to-back run of ``segments``; every address resolved (BoundsError /
        NotRegistered naming the layer) before anything moves."""
        runs: list[tuple[int, list]] = []  # (destination offset, sources) per back-to-back run of segments
        cursor = None
        try:
            for seg in segments:
                if cursor != seg.dst_offset:
                    runs.append((seg.dst_offset, []))
                runs[-1][1].append(engine.locate(seg.src_addr, seg.nbytes))
                cursor = seg.dst_offset + seg.nbytes
            return [
                (sources, engine.remote_slot(dst_addr + offset, sum(s.nbytes for s in sources)))
                for offset, sources in runs
            ]
        except AdpError as error:
            raise type(error)(f"layer {layer}: {error}") from error

    @contextlib.contextmanager
    def _locked(self, timeout_s: float, what: str) -> Iterator[None]:
        if not self._lock.acquire(timeout=timeout_s):
            raise WaitTimeout(
                f"the transfer leg stayed busy for {timeout_s} s (another thread's transfer) before {what}"
            )
        try:
            yield
        finally:
            self._lock.release()

    def submit(
        self,
        layer: int,
        segments: Sequence[Segment],
        dst_peer: int,
        dst_addr: int,
        notify_slot: int | None = None,
        magic: int | None = None,
    ) -> TransferTicket:
        """Start moving layer ``layer``'s segments to ``dst_peer`` at ``dst_addr``, then have ``magic`` written into
        ``notify_slot`` once every byte landed; every address is resolved (BoundsError / NotRegistered naming the
        layer) before anything moves. Blocks while the request before it ends (see the class). :meth:`wait` on the
        ticket re-raises a failure as :class:`TransferFailed`."""
        self._check(layer, segments, notify_slot, magic)
        engine = self.engine(dst_peer)
        requests = self._requests(layer, engine, segments, dst_addr)
        nbytes = sum(seg.nbytes for seg in segments)
        what = f"layer {layer} ({len(segments)} segments, {nbytes} bytes) to rank {dst_peer} at {dst_addr:#x}"
        ticket = TransferTicket(layer, nbytes, what, self)
        with self._locked(self.timeout_s, f"the transfer of {what}"):
            if self._closed:
                raise QueueError(f"the transfer leg is closed; cannot send {what}")
            try:
                if self._in_flight is not None:  # one request in flight: the previous one ends (and notifies) first
                    self._settle(self._in_flight, self.timeout_s)  # its timeout fails this one: nothing moved
                ticket.vtime_ns = self.last_vtime_ns
                for sources, slot in requests[:-1]:  # earlier runs land before the last one carries the notify
                    self._account(ticket, engine.transfer(sources, slot, timeout_s=self.timeout_s))
                if requests:
                    sources, slot = requests[-1]
                    ticket.pending = engine.submit(sources, slot, notify_slot, notify_value=magic)
                    self._in_flight = ticket
                elif notify_slot is not None:  # a layer with nothing to move still tells the peer
                    engine.record(notify_slot, magic, self.timeout_s)
            except Exception as error:  # reported by wait, as a failure during the transfer would be
                ticket.error = error
            if ticket.pending is None:
                self._ended(ticket)
        return ticket

    def _account(self, ticket: TransferTicket, result: Any) -> None:
        ticket.vtime_ns = max(ticket.vtime_ns or 0.0, result.complete_vtime_ns)
        self.kinds_used[result.kind.value] = self.kinds_used.get(result.kind.value, 0) + 1

    def _ended(self, ticket: TransferTicket) -> None:
        if ticket.error is None:
            self.bytes_sent += ticket.nbytes
            self.last_vtime_ns = max(self.last_vtime_ns, ticket.vtime_ns or 0.0)

    def _settle(self, ticket: TransferTicket, timeout_s: float) -> None:
        """Wait (bounded, lock held) for ``ticket``'s request in flight: its bytes, then the engine's notify. Raises
        WaitTimeout, leaving it in flight, when the engine's ticket did not end in time (its bytes may still land)."""
        pending = ticket.pending
        if pending is None:
            return
        try:
            self._account(ticket, pending.wait(timeout_s))
        except WaitTimeout as error:
            if not getattr(pending, "finished", True):  # still under way: not ended, the next wait resumes it
                ticket.waited_out = True
                raise
            ticket.error = error
        except Exception as error:
            ticket.error = error
        ticket.pending = None
        if self._in_flight is ticket:
            self._in_flight = None
        self._ended(ticket)

    def progress(self, ticket: TransferTicket) -> None:
        """Finish ``ticket``'s request if it is in flight and no other thread holds the leg (never waits for one)."""
        if ticket.pending is not None and self._lock.acquire(blocking=False):
            try:
                with contextlib.suppress(WaitTimeout):  # still under way: done() says False, wait() says why
                    self._settle(ticket, 0.0 if ticket.waited_out else self.timeout_s)
            finally:
                self._lock.release()

    def raise_if_failed(self, ticket: TransferTicket) -> None:
        """Raise :class:`TransferFailed` now if the transfer failed; finishes it first when the leg is free (see
        :meth:`progress`), so that polling for the peer's answer also publishes this rank's notify."""
        self.progress(ticket)
        if ticket.error is not None:
            self._outcome(ticket, self.timeout_s)

    def wait(self, ticket: TransferTicket, timeout_s: float | None = None) -> float:
        """Block (bounded: ``timeout_s``, None for the leg's) until the transfer is done; returns its virtual
        completion time in ns (0 where the backend has no virtual clock)."""
        timeout = (
            check_bound("timeout_s", timeout_s, zero_ok=True, where=f"wait for {ticket.what}")
            if timeout_s is not None
            else self.timeout_s
        )
        if ticket.pending is not None:
            with self._locked(timeout, f"the wait for {ticket.what}"):
                try:
                    self._settle(ticket, timeout)
                except WaitTimeout as error:
                    raise WaitTimeout(f"transfer of {ticket.what} not done after {timeout} s: {error}") from error
        return self._outcome(ticket, timeout)

    @staticmethod
    def _outcome(ticket: TransferTicket, timeout: float) -> float:
        error = ticket.error
        if isinstance(error, WaitTimeout):
            raise WaitTimeout(f"transfer of {ticket.what} not done after {timeout} s: {error}") from error
        if isinstance(error, AdpError):
            raise TransferFailed(f"transfer of {ticket.what} failed: {error}") from error
        if error is not None:
            raise error
        return ticket.vtime_ns or 0.0

    def record(self, dst_peer: int, notify_slot: int, magic: int) -> None:
        """Set a notify flag on the peer now (not behind the request in flight): used for aborts."""
        self.engine(dst_peer).record(notify_slot, magic, self.timeout_s)

    def close(self) -> None:
        """End the request in flight (bounded); later submits raise QueueError."""
        with self._locked(self.timeout_s, "closing the transfer leg"):
            # one still under way after the bound stays pending (its done() False) for whoever holds its lease
            with contextlib.suppress(WaitTimeout):
                if self._in_flight is not None:
                    self._settle(self._in_flight, self.timeout_s)
            self._closed = True


class FaultInjectingLeg:
    """A leg that fails chosen submissions (test hook): ``fail_after(n)`` makes the n-th next submit fail.

    The failure happens where a real one would: the layer's transfer ends with an error before its notify, so
    the receiver never sees the layer.
    """

    def __init__(self, inner: LayerTransferLeg) -> None:
        self.inner = inner
        self._lock = threading.Lock()
        self._countdowns: list[int] = []

    def fail_after(self, submissions: int = 0) -> None:
        with self._lock:
            self._countdowns.append(submissions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def submit(
        self,
        layer: int,
        segments: Sequence[Segment],
        dst_peer: int,
        dst_addr: int,
        notify_slot: int | None = None,
        magic: int | None = None,
    ) -> TransferTicket:
        with self._lock:
            fire = 0 in self._countdowns
            if fire:
                self._countdowns.remove(0)
            self._countdowns = [n - 1 for n in self._countdowns]
        if fire:
            error = QueueError(f"injected transfer failure in the middle of layer {layer}")
            return TransferTicket(layer, 0, f"layer {layer} to rank {dst_peer} (injected failure)", error=error)
        return self.inner.submit(layer, segments, dst_peer, dst_addr, notify_slot, magic)

    def wait(self, ticket: TransferTicket, timeout_s: float | None = None) -> float:
        return self.inner.wait(ticket, timeout_s)


def wait_notify(
    comm: Any,
    slot: int,
    magic: int,
    what: str,
    *,
    abort_magic: int | None = None,
    abort_slot: int = ABORT_SLOT,
    timeout_s: float | None = None,
    check: Callable[[], None] | None = None,
    poll_s: float = NOTIFY_POLL_S,
) -> None:
    """Wait until notify ``slot`` holds ``magic``, or ``abort_slot`` holds ``abort_magic`` (then PeerAborted),
    polling every ``poll_s``: the one notify wait of both DualPath hosts.

    Parameters
    ----------
    comm : HcclComm
        The communicator whose notify area is watched.
    what : str
        What the wait is for, used in the timeout message.
    check : callable, optional
        Called on every poll; raises to end the wait early (e.g. a transfer of this rank failed, so the peer
        will never answer).
    """
    timeout = timeout_s if timeout_s is not None else _env.timeout_s()
    deadline = time.monotonic() + timeout
    while True:
        if comm.notify_value(slot) == magic:
            return
        if abort_magic is not None and comm.notify_value(abort_slot) == abort_magic:
            raise PeerAborted(f"peer aborted while this rank waited for {what}")
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise WaitTimeout(
                f"timed out after {timeout} s waiting for {what} (notify slot {slot}, magic "
                f"{magic:#x}; slot holds {comm.notify_value(slot):#x})"
            )
        time.sleep(poll_s)
