"""The transfer leg of DualPath loading: move one layer's KV segments to a peer and raise its notify flag.

Both read paths stream KV between the prefill engine (PE) and the decode engine (DE) one layer at a time:
hit Layer Blocks DE -> PE HBM (DE read path), complete or miss layers PE -> DE buffer. Everything that moves
those bytes goes through a :class:`LayerTransferLeg`:

- :class:`TransportTransferLeg` (the default, ``EngineConfig.transfer == "transport"``): one transfer engine
  per destination rank (:class:`~ascend_dualpath.transport.TransferEngine`, any backend: given, made by a
  factory, or the emulator's from the communicator), so each layer goes the way the gates choose (aiv / aicpu
  / staging / host), then the engine's ``record`` of the caller's per-attempt magic.
- :class:`HcclTransferLeg`: one ``HcclBatchPut`` with one descriptor per segment (validated as a whole before
  anything moves), then ``notify_record`` with the caller's magic.

Submissions run in order on one worker thread, so ``submit`` returns at once and the transfer of layer
``l + 1`` overlaps the compute of layer ``l``. Every wait is ``wait(ticket, timeout_s=None)``, bounded.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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


@dataclasses.dataclass
class TransferTicket:
    """One submitted layer transfer; ``vtime_ns`` is the emulator's virtual completion time once done."""

    layer: int
    nbytes: int
    what: str
    future: Future = dataclasses.field(repr=False)
    vtime_ns: float | None = None


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


class _QueuedLeg:
    """The worker thread, the checks, the queue and the waits shared by both legs; a leg adds ``_notify``."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = (
            check_bound("timeout_s", timeout_s, where=type(self).__name__)
            if timeout_s is not None
            else _env.timeout_s()
        )
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adp-leg")
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.last_vtime_ns = 0.0

    def _notify(self, dst_peer: int, notify_slot: int, magic: int) -> None:
        raise NotImplementedError

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

    def _queue(
        self,
        layer: int,
        segments: Sequence[Segment],
        dst_peer: int,
        dst_addr: int,
        move: Callable[[], float],
        notify_slot: int | None,
        magic: int | None,
    ) -> TransferTicket:
        """Run ``move`` (returns its virtual completion time) on the worker, then the notify, then accounting."""
        nbytes = sum(seg.nbytes for seg in segments)
        what = f"layer {layer} ({len(segments)} segments, {nbytes} bytes) to rank {dst_peer} at {dst_addr:#x}"

        def run() -> float:
            vtime = move()
            if notify_slot is not None:  # only after every byte of the layer completed
                self._notify(dst_peer, notify_slot, magic)
            with self._lock:
                self.bytes_sent += nbytes
                self.last_vtime_ns = max(self.last_vtime_ns, vtime)
            return vtime

        return TransferTicket(layer, nbytes, what, self._worker.submit(run))

    def raise_if_failed(self, ticket: TransferTicket) -> None:
        """Raise :class:`TransferFailed` now if the transfer already failed (never blocks)."""
        if ticket.future.done() and ticket.future.exception() is not None:
            self.wait(ticket, 0)

    def wait(self, ticket: TransferTicket, timeout_s: float | None = None) -> float:
        """Block (bounded: ``timeout_s``, None for the leg's) until the transfer is done; returns its virtual
        completion time in ns (0 where the backend has no virtual clock)."""
        timeout = (
            check_bound("timeout_s", timeout_s, zero_ok=True, where=f"wait for {ticket.what}")
            if timeout_s is not None
            else self.timeout_s
        )
        try:
            ticket.vtime_ns = ticket.future.result(timeout)
        except TimeoutError as error:
            raise WaitTimeout(f"transfer of {ticket.what} not done after {timeout} s") from error
        except AdpError as error:
            raise TransferFailed(f"transfer of {ticket.what} failed: {error}") from error
        return ticket.vtime_ns

    def close(self) -> None:
        self._worker.shutdown(wait=True)


class HcclTransferLeg(_QueuedLeg):
    """Layer transfers over an emulated (or real) HCCL communicator: ``batch_put`` + ``notify_record``.

    Parameters
    ----------
    comm : HcclComm
        Connected communicator; sources must be in its windows or ``register_local`` memory, destinations in
        the peer's windows or memory added with ``add_remote_mem``.
    timeout_s : float, optional
        Bound of each put and notify (default ``ADP_TIMEOUT_S``).
    """

    def __init__(self, comm: Any, timeout_s: float | None = None) -> None:
        from ascend_dualpath import _ext

        super().__init__(timeout_s)
        self._C = _ext.load()
        self.comm = comm

    def register_local(self, region: Any) -> None:
        """Make ``region`` usable as a source (HcclRegisterMem)."""
        self.comm.register_local(region)

    def submit(
        self,
        layer: int,
        segments: Sequence[Segment],
        dst_peer: int,
        dst_addr: int,
        notify_slot: int | None = None,
        magic: int | None = None,
    ) -> TransferTicket:
        """Queue layer ``layer``'s segments for ``dst_peer`` at ``dst_addr``; then set ``notify_slot`` to ``magic``.

        Returns at once; :meth:`wait` on the ticket re-raises any failure as :class:`TransferFailed`.
        """
        self._check(layer, segments, notify_slot, magic)
        descs = [self._C.OneSideDesc(seg.src_addr, dst_addr + seg.dst_offset, seg.nbytes, 0) for seg in segments]

        def move() -> float:
            return self.comm.batch_put(dst_peer, descs, self.timeout_s) if descs else self.last_vtime_ns

        return self._queue(layer, segments, dst_peer, dst_addr, move, notify_slot, magic)

    def _notify(self, dst_peer: int, notify_slot: int, magic: int) -> None:
        self.comm.notify_record(dst_peer, notify_slot, magic, self.timeout_s)

    def record(self, dst_peer: int, notify_slot: int, magic: int) -> None:
        """Set a notify flag on the peer now (not queued behind transfers): used for aborts."""
        self.comm.notify_record(dst_peer, notify_slot, magic, self.timeout_s)


class TransportTransferLeg(_QueuedLeg):
    """Layer transfers through transfer engines (:mod:`ascend_dualpath.transport`), one per destination rank, so
    each layer goes the way the gates choose: ``aiv`` for device-memory sources, ``staging`` for host-DRAM
    sources (the DE buffer), falling back to ``aicpu`` / ``host``.

    Addresses become segments and slots through the engines (:meth:`~ascend_dualpath.transport.TransferEngine.locate`,
    ``remote_slot``): sources must lie in memory the engine may read (given to :meth:`register_local`, or the
    communicator's windows on the emulator); each run of segments that lands back to back at the destination goes
    as one request. The notify carries the caller's magic (the engine's ``record``) and is written only after
    every byte of the layer completed.

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
        super().__init__(timeout_s)
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

    def submit(
        self,
        layer: int,
        segments: Sequence[Segment],
        dst_peer: int,
        dst_addr: int,
        notify_slot: int | None = None,
        magic: int | None = None,
    ) -> TransferTicket:
        """Queue layer ``layer``'s segments for ``dst_peer`` at ``dst_addr``, then ``record`` ``magic`` in
        ``notify_slot``; every address is resolved (BoundsError / NotRegistered naming the layer) before anything
        is queued. :meth:`wait` on the ticket re-raises a failure as :class:`TransferFailed`."""
        self._check(layer, segments, notify_slot, magic)
        engine = self.engine(dst_peer)
        runs: list[tuple[int, list]] = []  # (destination offset, sources) per back-to-back run of segments
        cursor = None
        try:
            for seg in segments:
                if cursor != seg.dst_offset:
                    runs.append((seg.dst_offset, []))
                runs[-1][1].append(engine.locate(seg.src_addr, seg.nbytes))
                cursor = seg.dst_offset + seg.nbytes
            requests = [
                (sources, engine.remote_slot(dst_addr + offset, sum(s.nbytes for s in sources)))
                for offset, sources in runs
            ]
        except AdpError as error:
            raise type(error)(f"layer {layer}: {error}") from error

        def move() -> float:
            vtime = self.last_vtime_ns
            for sources, slot in requests:
                result = engine.transfer(sources, slot, timeout_s=self.timeout_s)
                vtime = max(vtime, result.complete_vtime_ns)
                with self._lock:
                    self.kinds_used[result.kind.value] = self.kinds_used.get(result.kind.value, 0) + 1
            return vtime

        return self._queue(layer, segments, dst_peer, dst_addr, move, notify_slot, magic)

    def _notify(self, dst_peer: int, notify_slot: int, magic: int) -> None:
        self.engine(dst_peer).record(notify_slot, magic, self.timeout_s)

    def record(self, dst_peer: int, notify_slot: int, magic: int) -> None:
        """Set a notify flag on the peer now (not queued behind transfers): used for aborts."""
        self.engine(dst_peer).record(notify_slot, magic, self.timeout_s)


class FaultInjectingLeg:
    """A leg that fails chosen submissions (test hook): ``fail_after(n)`` makes the n-th next submit fail.

    The failure happens where a real one would: the transfer is queued, then completes with an error before
    its notify, so the receiver never sees the layer.
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
            future: Future = Future()
            future.set_exception(QueueError(f"injected transfer failure in the middle of layer {layer}"))
            return TransferTicket(layer, 0, f"layer {layer} to rank {dst_peer} (injected failure)", future)
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
