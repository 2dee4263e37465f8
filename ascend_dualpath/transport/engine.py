"""The transfer engine interface: submit source segments to a remote slot, get a ticket, wait for it.

Every backend follows the same sequence (the seed's ``aiv_candidate_layer_transfer``): select the kind
through the gates, stage if the kind is ``staging``, split into pieces, post them, wait for every
completion, publish remote-ready (the notify), and release the staging buffer on every path, errors
included.

Waiting
    Every wait of the package's tickets is ``wait(timeout_s=None)``: it returns once the work completed or
    raises :class:`~ascend_dualpath.errors.WaitTimeout` after ``timeout_s`` seconds (``None``: the owner's
    default bound, ``ADP_TIMEOUT_S`` unless configured). No wait is unbounded.

Registration
    Sources live in memory registered with the engine (every backend's ``register`` / ``unregister``: the
    emulator's take a region, the NPU's an address range, the CUDA engine's a pinned host buffer); after the
    matching unregister a request with a source there raises :class:`~ascend_dualpath.errors.NotRegistered`
    before anything moves. :meth:`TransferEngine.locate` and :meth:`TransferEngine.remote_slot` turn addresses
    into segments and slots, so a caller holding only addresses (DualPath's transfer leg) needs no backend.
"""

from __future__ import annotations

import abc
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ascend_dualpath import _env
from ascend_dualpath import errors as E
from ascend_dualpath._checks import check_bound, check_type
from ascend_dualpath.transport.kinds import MemoryKind, Selection, TransferKind
from ascend_dualpath.transport.segments import MemorySegment, RemoteSlot, WirePiece, split_segments

STAGING_ALIGN = 512  # staging buffers start on 512-byte boundaries (full-speed MTE bursts)
SPIN_S = 2e-3  # a wait polls without sleeping this long (a layer block lands in tens of µs), then every POLL_S
POLL_S = 50e-6


def poll_until(done, timeout_s: float, what) -> None:
    """Call ``done()`` until it returns true or ``timeout_s`` passed (then WaitTimeout naming ``what()``, a callable so
    the message is built only on failure). The first ``SPIN_S`` poll without sleeping (a sleep, even of 0 s, costs
    the thread's timer slack: ~50 µs on Linux), then in ``POLL_S`` steps; ``done`` may raise the waited work's error."""
    start = time.monotonic()
    deadline = start + timeout_s
    while not done():
        now = time.monotonic()
        if now >= deadline:
            raise E.WaitTimeout(f"timed out after {timeout_s} s waiting for {what()}")
        if now - start > SPIN_S:
            time.sleep(POLL_S)


@dataclass(frozen=True)
class TransferResult:
    """What a completed transfer reports.

    ``*_vtime_ns`` fields are on the emulator's virtual clock (0 on real hardware); ``notify_magic`` is
    the value published in the remote notify slot (None without a notify).
    """

    kind: TransferKind
    selection: Selection
    nbytes: int
    num_pieces: int
    start_vtime_ns: float = 0.0
    submit_vtime_ns: float = 0.0
    complete_vtime_ns: float = 0.0
    staging_bytes: int = 0
    notify_magic: int | None = None

    @property
    def latency_vtime_ns(self) -> float:
        return self.complete_vtime_ns - self.start_vtime_ns

    def with_notify(self, magic: int) -> TransferResult:
        """This result with ``notify_magic`` set. On the hot path of every notified request, so the fields are
        copied as one dict (~0.3 µs) rather than through the frozen ``__init__`` (~1 µs)."""
        copy = object.__new__(TransferResult)
        fields = copy.__dict__
        fields.update(self.__dict__)
        fields["notify_magic"] = magic
        return copy


@dataclass
class Ticket:
    """A submitted transfer; ``wait`` it until it ended (``finished``): once, unless a wait timed out."""

    id: int
    kind: TransferKind
    selection: Selection
    pieces: list[WirePiece]
    remote: RemoteSlot
    notify_slot: int | None
    engine: TransferEngine
    state: dict = field(default_factory=dict)  # backend-private progress
    notify_value: int | None = None  # the caller's value for the notify slot; None: the engine picks a fresh magic
    notify_magic: int | None = None  # known at submit where the device itself publishes remote-ready
    result: TransferResult | None = None
    error: BaseException | None = None
    finished: bool = False

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def wait(self, timeout_s: float | None = None) -> TransferResult:
        """Block (bounded: ``timeout_s``, None for the engine's default) until the transfer completed and
        remote-ready was published; returns its result (again on a later call) or raises its failure."""
        return self.engine.wait(self, timeout_s)


@dataclass(eq=False)
class PreparedTransfer:
    """A request routed once (gates and split into pieces), to be submitted many times: DualPath moves the same
    layer pattern with every request. Get one from :meth:`TransferEngine.prepare`."""

    engine: TransferEngine
    sources: list[MemorySegment]
    remote: RemoteSlot
    notify_slot: int | None
    selection: Selection
    pieces: list[WirePiece]
    state: dict = field(default_factory=dict)  # backend-private work built once for every submission

    def submit(self, notify_value: int | None = None) -> Ticket:
        """Start one transfer of the prepared request; returns its ticket. ``notify_value`` is written into the
        notify slot after every byte landed (None: a fresh magic of the engine's choosing)."""
        return self.engine._submit_prepared(self, notify_value)

    def transfer(self, timeout_s: float | None = None, notify_value: int | None = None) -> TransferResult:
        """``submit`` then ``wait``."""
        return self.submit(notify_value).wait(timeout_s)


NOTIFY_VALUE_MAX = (1 << 63) - 1  # notify slots hold signed 64-bit words; 0 means "nothing published"


def check_notify_value(value: int, notify_slot: int | None, where: str) -> int:
    """``value`` as a caller's notify value: an int in [1, NOTIFY_VALUE_MAX] going with a notify slot;
    ArgumentTypeError / ProtocolError / BoundsError naming it otherwise."""
    check_type("notify_value", value, int, where=where)
    if notify_slot is None:
        raise E.ProtocolError(f"{where}: notify_value {value} given without a notify_slot to write it into")
    if not 1 <= value <= NOTIFY_VALUE_MAX:
        raise E.BoundsError(f"{where}: notify_value {value} is outside [1, {NOTIFY_VALUE_MAX}]")
    return value


class StagingPool:
    """First-fit allocator of staging buffers inside one registered region (the HCCL window).

    Parameters
    ----------
    base_addr : int
        Address of the first byte of the pool.
    capacity : int
        Bytes in the pool.
    """

    def __init__(self, base_addr: int, capacity: int):
        self.base_addr = base_addr
        self.capacity = capacity
        self._used: dict[int, int] = {}  # offset -> bytes
        self.peak_bytes = 0

    @property
    def in_use_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def num_held(self) -> int:
        return len(self._used)

    def allocate(self, nbytes: int) -> int:
        """Address of a free buffer of ``nbytes``; CapacityError naming the request and the free space."""
        size = -(-nbytes // STAGING_ALIGN) * STAGING_ALIGN
        cursor = 0
        for offset in sorted(self._used):
            if offset - cursor >= size:
                break
            cursor = offset + -(-self._used[offset] // STAGING_ALIGN) * STAGING_ALIGN
        if cursor + size > self.capacity:
            raise E.CapacityError(
                f"staging allocation of {nbytes} bytes failed: the HCCL window pool of "
                f"{self.capacity} bytes has {self.capacity - self.in_use_bytes} free "
                f"in {len(self._used)} held buffers"
            )
        self._used[cursor] = nbytes
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
        return self.base_addr + cursor

    def release(self, addr: int) -> None:
        offset = addr - self.base_addr
        if self._used.pop(offset, None) is None:
            raise E.ProtocolError(f"staging buffer at offset {offset} is not held (double release?)")


class TransferEngine(abc.ABC):
    """One channel's transfer engine: layer blocks from this rank into a slot of a peer's memory, by the kind its
    gates choose (``aiv``, ``aicpu``, ``staging``, ``host``); :func:`~ascend_dualpath.transport.create_engine`
    builds the one of a backend. Backends implement ``select``, ``_start``, ``_finish`` and ``_write_notify``.

    Example, on the emulator (two ranks of one process; rank 0 writes three blocks into rank 1's window):

    >>> import numpy as np
    >>> from ascend_dualpath import _ext
    >>> from ascend_dualpath.backends import emulator as emu
    >>> from ascend_dualpath.transport import MemorySegment, RemoteSlot, create_engine
    >>> C = _ext.load()
    >>> with emu.emulated_devices(2) as devices:
    ...     comms = [C.HcclComm(d, r, 2, emu.comm_config(hcclBufferSize=4)) for r, d in enumerate(devices)]
    ...     for comm in comms:
    ...         comm.connect([c.local_info() for c in comms])
    ...     region = devices[0].alloc_region(1 << 16, C.MemKind.DEVICE_GM, 7)
    ...     comms[0].register_local(region)
    ...     np.frombuffer(region, np.uint8)[:] = np.arange(1 << 16) % 251
    ...     engine = create_engine("emulator", comms[0], 1, timeout_s=10.0)
    ...     blocks = [MemorySegment.of_region(region, offset, 4096) for offset in (0, 8192, 16384)]
    ...     window = comms[1].windows_in
    ...     prepared = engine.prepare(blocks, RemoteSlot(1, window.addr, 3 * 4096, window.rkey))
    ...     result = prepared.transfer()  # submit, then a bounded wait
    ...     landed = np.frombuffer(window, np.uint8)[4096:8192]  # the second block
    ...     same = bool((landed == np.frombuffer(region, np.uint8)[8192:12288]).all())
    ...     engine.close()
    ...     for comm in comms:
    ...         comm.close()
    >>> result.kind.value, result.nbytes, same
    ('aiv', 12288, True)
    """

    _ticket_ids = itertools.count(1)

    def __init__(self, timeout_s: float | None = None):
        where = type(self).__name__
        self._magics = itertools.count(1)  # fresh notify values where the caller gives none
        self.timeout_s = _env.timeout_s() if timeout_s is None else check_bound("timeout_s", timeout_s, where=where)

    @abc.abstractmethod
    def select(self, sources: Sequence[MemorySegment]) -> Selection:
        """The kind the gates choose for ``sources``."""

    @abc.abstractmethod
    def _max_piece(self, kind: TransferKind) -> int:
        """Largest wire piece of ``kind``."""

    @abc.abstractmethod
    def _start(self, ticket: Ticket, prepared: PreparedTransfer) -> None:
        """Stage (if needed) and post ``prepared``'s sources for ``ticket``; record progress in ``ticket.state``.
        Must leave nothing held on error."""

    @abc.abstractmethod
    def _finish(self, ticket: Ticket, timeout_s: float) -> TransferResult:
        """Wait for every completion of ``ticket`` (bounded) and return its result; its ``notify_magic`` is None
        unless the device itself already published remote-ready (then :meth:`_publish_ready` is not called). After
        it raised :class:`~ascend_dualpath.errors.WaitTimeout` it is called again for the same ticket (the
        transfer is still under way), so it must keep whatever progress it consumed in ``ticket.state``."""

    def _publish_ready(self, ticket: Ticket, timeout_s: float) -> int:
        """Write ``ticket.notify_value`` (a fresh magic when it is None) into the remote notify slot; returns the
        value written."""
        value = self._fresh_magic() if ticket.notify_value is None else ticket.notify_value
        self._write_notify(ticket.notify_slot, value, timeout_s, f"ticket {ticket.id}")
        return value

    def _fresh_magic(self) -> int:
        """A notify value no earlier notify of this engine used."""
        return next(self._magics)

    @abc.abstractmethod
    def _write_notify(self, slot: int, value: int, timeout_s: float, what: str) -> None:
        """Write ``value`` into the peer's notify ``slot`` and wait (bounded) until it landed; ``what`` names the
        notify in errors. Called only after every byte it follows landed."""

    @abc.abstractmethod
    def _release(self, ticket: Ticket) -> None:
        """Release whatever the ticket holds (staging buffer); idempotent."""

    @abc.abstractmethod
    def locate(self, addr: int, nbytes: int) -> MemorySegment:
        """The source segment of ``nbytes`` at ``addr`` in memory this engine may read (its key and memory kind);
        :class:`~ascend_dualpath.errors.NotRegistered` or BoundsError naming the range otherwise."""

    @abc.abstractmethod
    def remote_slot(self, addr: int, nbytes: int) -> RemoteSlot:
        """The remote slot of ``nbytes`` at ``addr`` on the engine's peer (its key); BoundsError or NotRegistered
        naming the range when the peer exposes no memory there."""

    @abc.abstractmethod
    def record(self, slot: int, magic: int, timeout_s: float | None = None) -> None:
        """Write the caller's ``magic`` into the peer's notify ``slot`` now (bounded by ``timeout_s``): a notify
        outside a transfer (DualPath's per-attempt magics, aborts). Call it after the transfers it must follow
        completed (their ``wait`` returned)."""

    def submit(
        self,
        sources: Sequence[MemorySegment],
        remote: RemoteSlot,
        notify_slot: int | None = None,
        kind: TransferKind | str | None = None,
        notify_value: int | None = None,
    ) -> Ticket:
        """Start moving ``sources`` (concatenated) into ``remote``; returns a ticket to ``wait`` on.

        ``kind`` overrides the gates (benchmarks); an override the sources do not allow raises ConfigError.
        ``notify_value`` (with ``notify_slot``) is the caller's value, written into the peer's notify slot only after
        every byte landed, as Mooncake's batch transfer carries its notify; None lets the engine pick a fresh magic
        (the result's ``notify_magic`` says which).
        """
        return self._submit_prepared(self.prepare(sources, remote, notify_slot, kind), notify_value)

    def prepare(
        self,
        sources: Sequence[MemorySegment],
        remote: RemoteSlot,
        notify_slot: int | None = None,
        kind: TransferKind | str | None = None,
    ) -> PreparedTransfer:
        """Route a request once (as :meth:`submit` would) for repeated submission; errors of the gates, an
        override the sources do not allow and a slot overflow are raised here; so is an argument of the wrong
        type (:class:`~ascend_dualpath.errors.ArgumentTypeError`, naming it)."""
        where = f"{type(self).__name__}.submit"
        check_type("sources", sources, (list, tuple), where=where)
        if set(map(type, sources)) != {MemorySegment}:  # one pass in C; the loop names the culprit
            for index, source in enumerate(sources):
                check_type(f"sources[{index}]", source, MemorySegment, where=where)
        check_type("remote", remote, RemoteSlot, where=where)
        check_type("notify_slot", notify_slot, (int, type(None)), where=where)
        check_type("kind", kind, (TransferKind, str, type(None)), where=where)
        sources = list(sources)
        selection, pieces = self._route(sources, remote, kind)
        return PreparedTransfer(self, sources, remote, notify_slot, selection, pieces)

    def _submit_prepared(self, prepared: PreparedTransfer, notify_value: int | None = None) -> Ticket:
        if prepared.engine is not self:
            raise E.ProtocolError("the prepared transfer belongs to another engine")
        if notify_value is not None:
            check_notify_value(notify_value, prepared.notify_slot, where=f"{type(self).__name__}.submit")
        selection = prepared.selection
        ticket = Ticket(
            next(self._ticket_ids),
            selection.kind,
            selection,
            prepared.pieces,
            prepared.remote,
            prepared.notify_slot,
            self,
            notify_value=notify_value,
        )
        try:
            self._start(ticket, prepared)
        except BaseException:
            self._end(ticket)
            raise
        return ticket

    def _route(self, sources: list[MemorySegment], remote: RemoteSlot, kind) -> tuple[Selection, list[WirePiece]]:
        """The gates' selection (or the caller's override) and the request's wire pieces."""
        selection = self.select(sources)
        if kind is not None:
            selection = self._forced(selection, TransferKind(kind), sources)
        return selection, split_segments(sources, remote, self._max_piece(selection.kind))

    def wait(self, ticket: Ticket, timeout_s: float | None = None) -> TransferResult:
        """Wait (bounded) until every piece completed, then publish remote-ready; raises on any failure. A
        :class:`~ascend_dualpath.errors.WaitTimeout` of the pieces leaves the ticket unfinished (its bytes may still
        land; it holds its resources): wait again to complete it."""
        if ticket.engine is not self:
            raise E.ProtocolError(f"ticket {ticket.id} belongs to another engine")
        if ticket.finished:
            if ticket.error is not None:
                raise E.ProtocolError(f"ticket {ticket.id} already failed: {ticket.error}") from ticket.error
            if ticket.result is None:
                raise E.ProtocolError(f"ticket {ticket.id} was never started")
            return ticket.result
        timeout_s = (
            self.timeout_s
            if timeout_s is None
            else check_bound("timeout_s", timeout_s, zero_ok=True, where=f"ticket {ticket.id}")
        )
        try:
            result = self._finish(ticket, timeout_s)
        except E.WaitTimeout:
            # not ended: the backend may still be moving its bytes, so the ticket keeps what it holds (staging)
            # and stays unfinished; a later wait completes it or times out again
            raise
        except BaseException as exc:
            self._end(ticket, error=exc)
            raise
        try:
            if ticket.notify_slot is not None and result.notify_magic is None:  # only after every piece completed
                magic = self._publish_ready(ticket, timeout_s)
                result = result.with_notify(magic)
            ticket.result = result
            return result
        except BaseException as exc:  # every byte landed: a notify that timed out ends the ticket as failed
            ticket.error = exc
            raise
        finally:
            self._end(ticket)

    def _end(self, ticket: Ticket, error: BaseException | None = None) -> None:
        """Mark ``ticket`` ended (no byte of it may still land; ``error`` its failure) and release what it holds."""
        if error is not None:
            ticket.error = error
        self._release(ticket)
        ticket.finished = True

    def transfer(
        self,
        sources: Sequence[MemorySegment],
        remote: RemoteSlot,
        notify_slot: int | None = None,
        kind: TransferKind | str | None = None,
        timeout_s: float | None = None,
        notify_value: int | None = None,
    ) -> TransferResult:
        """``submit`` then ``wait``."""
        return self.submit(sources, remote, notify_slot, kind, notify_value).wait(timeout_s)

    def _forced(self, selection: Selection, kind: TransferKind, sources: Sequence[MemorySegment]) -> Selection:
        host = [i for i, s in enumerate(sources) if s.memory is MemoryKind.HOST]
        if kind in (TransferKind.AIV, TransferKind.AICPU) and host:
            raise E.ConfigError(f"kind {kind.value!r} needs device-memory sources; sources {host} are in host DRAM")
        segmented = kind in (TransferKind.AIV, TransferKind.STAGING) and selection.segmented
        return Selection(
            kind,
            "override",
            f"kind {kind.value!r} requested by the caller (the gates chose {selection.kind.value!r})",
            selection.gates,
            segmented,
        )
