"""The transfer engine interface on CUDA GPUs: the seed's gates and fallbacks over the CUDA analogues of the kinds.

============  ===========================================================================  ======================
kind          CUDA analogue                                                                issued by
============  ===========================================================================  ======================
``aiv``       :class:`~.cuda.DeviceCopier`: one Triton launch copies every piece (host        the GPU's own programs
              pieces read in place from mapped pinned memory: zero-copy)
``staging``   :class:`~.cuda.StagingCopy`: registered pinned host buffer -> device staging    copy engine, then GPU
              slots -> destination, chunk by chunk
``aicpu``     one ``cudaMemcpyBatchAsync`` for all pieces (a proxy, the CUDA runtime, issues   the runtime
              the copies; one ``cudaMemcpyAsync`` each where the runtime lacks the batch call)
``host``      one ``cudaMemcpyAsync`` per piece, or one ``cudaMemcpy2DAsync`` for pieces of  the host program
              one length at a constant stride (:func:`~.segments.uniform_stride`)
============  ===========================================================================  ======================

The gates are :func:`~.kinds.select_kind`'s, with CUDA meanings: *capability* — device-initiated copies are available
(Triton imports; bit 0x04 of the engine's bitmap), *protocol* — the GPU reaches the destination with loads and stores
(``local`` or ``peer access``), *addressable* — every source is device memory (host DRAM goes through ``staging``),
then *strided copy* — host sources in registered pinned buffers, of one length (at least
``strided_min_piece_bytes``) at a constant stride (DualPath's layer block: layer ``l`` of hit Full Block ``b`` at
``base + b * full_block + l * layer_block``), go to the copy engine as one ``cudaMemcpy2DAsync`` (kind ``host``),
then *zero-copy* — host sources in registered pinned buffers mapped for the GPU are read in place by the kernel
(``aiv`` after all), and *copy engine* — one device piece of ``copy_engine_min_bytes`` or more goes to
``cudaMemcpyAsync``. A failed capability or protocol gate falls back to ``aicpu`` for device sources, else ``host``.

Every request is enqueued on the current stream of the engine's GPU, like a torch op (the batch call of ``aicpu`` on
the tail stream below, joined to it, since it refuses the legacy default stream). Remote-ready is the caller's
``notify_value``, else a fresh magic, in the ``notify`` slot after every byte landed, known at submit
(``Ticket.notify_magic``; a receiver may poll the slot instead of waiting on the ticket): for ``aiv`` the copy
kernel's last program releases it into the slot itself, for the
other kinds one driver call of stream writes follows the copies on a tail stream (:class:`~.cudart.TailStream`), so
the current stream goes on as soon as the bytes landed (any stream operation after a copy-engine copy holds the
stream ~2.7 µs on H200; an event costs nothing). Work enqueued on the current stream after a submission is ordered
after the request's bytes, not after its notify; a kernel that publishes into a slot whose tail write is still in
flight waits for it, so each slot ends with the value published last. Then a pinned host word
(:class:`~.cuda.HostWord`) gets the request's engine magic (never the caller's value, so its values only grow), and
``wait`` polls that word in host memory, bounded by the timeout: completion costs no event record and no driver query.
Plans (tile tables, staging slots, batch arrays) are built once per piece pattern and kept for the last
``PLAN_CACHE`` patterns: DualPath moves the same layer pattern every request. An ``aiv`` pattern is captured in a
CUDA graph at :meth:`~CudaTransferEngine.prepare`, or at its second plain :meth:`~CudaTransferEngine.submit`, and
replayed from then on; the graph bakes in no notify value (a replay with the caller's value writes it into the plan's
value cell first, in stream order).

Before anything moves, every range is checked where it lives (one driver query per allocation): device sources in
the engine's GPU, host sources inside a registered pinned buffer, the remote slot in the destination GPU or inside
a registered pinned host buffer mapped for the GPU (another process's shared host region, as the connector's
``cuda`` dataplane maps its peer's).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from ascend_dualpath import errors as E
from ascend_dualpath._checks import check_bound
from ascend_dualpath._triton_launch import raw_stream_getter
from ascend_dualpath.transport import cudart
from ascend_dualpath.transport.engine import PreparedTransfer, Ticket, TransferEngine, TransferResult, poll_until
from ascend_dualpath.transport.kinds import (
    AIV_DATAPLANE_BIT,
    ChannelCapabilities,
    GateDecision,
    MemoryKind,
    Selection,
    TransferKind,
    select_kind,
)
from ascend_dualpath.transport.segments import MemorySegment, RemoteSlot, uniform_stride

LOCAL, PEER_ACCESS, NO_PEER_ACCESS = "local", "peer access", "no peer access"
DIRECT_PROTOCOLS = (LOCAL, PEER_ACCESS)
DEFAULT_MAX_SINGLE_PIECE = 1 << 30  # the device kernel tiles any piece; this only bounds one cudaMemcpy
# one contiguous piece from here goes to the copy engine: on H200 one 64 MiB piece took 34.8 µs of GPU time with
# cudaMemcpyAsync against 47.8 µs end to end through the kernel (docs/transfer.md); 8 MiB is the smallest size
# where the copy engine's launch cost (a few µs) is below a tenth of the copy
COPY_ENGINE_MIN_BYTES = 8 << 20
GRAPH_FIRST_MAGIC = 1 << 40  # graph replays publish from here: far above the magics of eager submissions
GRAPH_MAGIC_STRIDE = 1 << 32  # each prepared graph publishes in its own range of 2^32 replays
ZERO_COPY_CONFIG = None  # the device kernel's shape for host sources; None: cuda.choose_config by request size
PLAN_CACHE = 64
# host pieces of one length at a constant stride, each at least this long, go to one 2-D copy-engine copy (the
# *strided copy* gate) rather than the zero-copy kernel: on H200 (docs/benchmarks.md) the copy engine read pinned
# memory at the link's rate while the kernel's reads reached ~51 of ~55 GB/s; 4 KiB rows, the smallest measured,
# still took less GPU time through the copy engine (313 against 335 µs for 4096 of them)
STRIDED_MIN_PIECE_BYTES = 4 << 10


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class CudaTransferEngine(TransferEngine):
    """Transfers from GPU ``device`` into memory of GPU ``peer_device`` (the same GPU or a peer).

    Parameters
    ----------
    device, peer_device : torch.device or str
        The GPU whose current stream each request is enqueued on (its sources' GPU) and the GPU that holds the
        remote slots; ``RemoteSlot.peer`` must be ``peer_device``'s index.
    notify : torch.Tensor or None
        int64 CUDA tensor on ``peer_device``, one element per notify slot: remote-ready writes a fresh magic there.
    capability_bitmap : int or None
        None: ``0x04`` (the AIV-dataplane bit, here "device-initiated copies") when Triton imports, else 0.
    max_single_aiv_payload : int
        Largest piece of the ``aiv`` and ``staging`` kinds, in bytes.
    copy_engine_min_bytes : int
        A request of one device source of at least this many bytes goes to the copy engine (the *copy engine*
        gate: one ``cudaMemcpyAsync``, kind ``host``) instead of the device kernel; default
        :data:`COPY_ENGINE_MIN_BYTES`.
    strided_min_piece_bytes : int
        Host sources of one length at a constant stride, each at least this many bytes, go to one 2-D copy-engine
        copy (the *strided copy* gate, kind ``host``); default :data:`STRIDED_MIN_PIECE_BYTES`.
    zero_copy : bool
        Host sources in registered pinned buffers mapped for the GPU are read in place by the device kernel (the
        *zero-copy* gate, default True); False sends them through ``staging``.
    graphs : bool
        An ``aiv`` pattern is captured in a CUDA graph at :meth:`prepare` (or at its second plain :meth:`submit`,
        which costs one device synchronisation) and each later submission replays it (default True): Triton's
        launcher costs ~7.5 µs per launch, a replay ~1 µs. Each graph publishes its own magics
        (``GRAPH_MAGIC_STRIDE`` apart), known at submit.
    timeout_s : float or None
        Default bound of every wait.
    """

    def __init__(
        self,
        device,
        peer_device,
        notify=None,
        *,
        capability_bitmap: int | None = None,
        max_single_aiv_payload: int = DEFAULT_MAX_SINGLE_PIECE,
        copy_engine_min_bytes: int = COPY_ENGINE_MIN_BYTES,
        strided_min_piece_bytes: int = STRIDED_MIN_PIECE_BYTES,
        graphs: bool = True,
        zero_copy: bool = True,
        timeout_s: float | None = None,
    ):
        import torch

        from ascend_dualpath.transport.cuda import enable_peer_access

        super().__init__(timeout_s)
        self.copy_engine_min_bytes = check_bound(
            "copy_engine_min_bytes", copy_engine_min_bytes, integer=True, where=type(self).__name__
        )
        self.strided_min_piece_bytes = check_bound(
            "strided_min_piece_bytes", strided_min_piece_bytes, integer=True, where=type(self).__name__
        )
        if not torch.cuda.is_available():
            raise E.BackendUnavailable("the CUDA transfer engine needs a CUDA GPU")
        self.torch = torch
        self.device = _indexed(torch, device)
        self.max_pitch = cudart.max_pitch(self.device.index)
        self.peer_device = _indexed(torch, peer_device)
        if self.device == self.peer_device:
            protocol = LOCAL
        elif torch.cuda.can_device_access_peer(self.device, self.peer_device):
            protocol = PEER_ACCESS
            enable_peer_access(self.device, self.peer_device)
        else:
            protocol = NO_PEER_ACCESS
        if capability_bitmap is None:
            capability_bitmap = AIV_DATAPLANE_BIT if _triton_available() else 0
        self.caps = ChannelCapabilities(capability_bitmap, protocol, max_single_aiv_payload)
        if notify is not None and (
            notify.dtype != torch.int64 or notify.device != self.peer_device or notify.dim() != 1
        ):
            raise E.ConfigError(
                f"notify must be a 1-D int64 tensor on {self.peer_device}, got {notify.dtype} "
                f"{tuple(notify.shape)} on {notify.device}"
            )
        self.notify = notify
        self.graphs = bool(graphs)
        self.zero_copy = bool(zero_copy)
        self.zero_copy_config = ZERO_COPY_CONFIG  # the kernel's shape where it reads host memory (None: by size)
        self._zero_copy_buffers: dict[int, bool] = {}  # data_ptr of a registered host buffer -> mapped for the GPU
        self._graph_magic = GRAPH_FIRST_MAGIC
        self._notify_stream = torch.cuda.Stream(self.peer_device)
        self._tail = (
            None  # cudart.TailStream of the copy-engine kinds (aicpu's batch, the writes), made when first used
        )
        self._tail_notify: dict = {}  # notify slot -> (host word, value) of its last write on the tail stream
        self._done = torch.zeros(1, dtype=torch.int64, device=self.device)  # the device kinds' ready flag
        self._copier = None
        self._host_buffers: dict[int, object] = {}  # data_ptr -> registered pinned uint8 tensor
        self._plans: OrderedDict = OrderedDict()
        self._routes: dict = {}
        self._submissions: OrderedDict = OrderedDict()  # plain submit: (slot, notify, kind) -> its last request
        # every value the engine publishes outside a graph comes from this one counter, so each host word only grows
        self._raw_stream = raw_stream_getter()
        self._registrations = 0  # bumped by unregister: prepared work is checked again before its next submission

    # ---- memory ------------------------------------------------------------------------------------

    def register(self, buffer) -> None:
        """Let ``buffer`` (a pinned, 1-D uint8 CPU tensor) be a source of host-DRAM segments (``staging``, ``host``).

        Memory of the engine's GPU needs no registration (every device kind addresses it): such a tensor is accepted
        and nothing is recorded."""
        torch = self.torch
        if buffer.device == self.device:
            return
        if buffer.device.type != "cpu" or buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_pinned():
            raise E.ConfigError(
                f"a registered host buffer must be a pinned 1-D uint8 CPU tensor, got {buffer.dtype} "
                f"{tuple(buffer.shape)} on {buffer.device} (pinned: {buffer.is_pinned()})"
            )
        self._host_buffers[buffer.data_ptr()] = buffer
        self._zero_copy_buffers[buffer.data_ptr()] = _mapped_in_place(buffer.data_ptr())
        self._routes.clear()  # a route through staging may now read in place

    def unregister(self, buffer) -> None:
        """Undo :meth:`register`: later requests (prepared ones too) with a source in ``buffer`` raise NotRegistered
        before anything moves. NotRegistered when the host ``buffer`` is not registered."""
        if buffer.device == self.device:
            return
        if self._host_buffers.pop(buffer.data_ptr(), None) is None:
            raise E.NotRegistered(
                f"host buffer at {buffer.data_ptr():#x} ({buffer.numel()} bytes) is not registered with this engine"
            )
        self._zero_copy_buffers.pop(buffer.data_ptr(), None)
        self._plans.clear()  # cached work was checked against the old registrations
        self._routes.clear()
        self._submissions.clear()
        self._registrations += 1

    def locate(self, addr: int, nbytes: int) -> MemorySegment:
        """A host segment inside a registered buffer, else a device segment (its GPU is checked when it is routed)."""
        memory = MemoryKind.DEVICE if self._host_buffer(addr) is None else MemoryKind.HOST
        return MemorySegment(addr, nbytes, memory)

    def remote_slot(self, addr: int, nbytes: int) -> RemoteSlot:
        return RemoteSlot(self.peer_device.index, addr, nbytes)

    def record(self, slot: int, magic: int, timeout_s: float | None = None) -> None:
        self._check_request(RemoteSlot(self.peer_device.index, 0, 0), slot)
        self._write_notify(slot, magic, self.timeout_s if timeout_s is None else timeout_s, "a recorded magic")

    def notify_value(self, slot: int) -> int:
        """The value in notify ``slot`` now (a read on the destination GPU): what a receiver there polls."""
        return int(self.notify[slot].item())

    def segment(self, tensor, offset: int = 0, nbytes: int | None = None) -> MemorySegment:
        """Bytes ``[offset, offset + nbytes)`` of a contiguous tensor (on this GPU, or a registered host buffer).

        A segment is an address, as an RDMA work request's is: keep the tensor alive while transfers use it (torch
        hands freed memory to the next allocation at once)."""
        size = tensor.numel() * tensor.element_size()
        nbytes = size - offset if nbytes is None else nbytes
        if not tensor.is_contiguous() or offset < 0 or nbytes < 1 or offset + nbytes > size:
            raise E.BoundsError(f"segment [{offset}, +{nbytes}) is outside the contiguous tensor of {size} bytes")
        memory = MemoryKind.DEVICE if tensor.is_cuda else MemoryKind.HOST
        return MemorySegment(tensor.data_ptr() + offset, nbytes, memory)

    def slot(self, tensor, offset: int = 0, nbytes: int | None = None) -> RemoteSlot:
        """A remote slot over bytes of a contiguous tensor on ``peer_device``."""
        if tensor.device != self.peer_device:
            raise E.ConfigError(f"a remote slot must be on {self.peer_device}, the tensor is on {tensor.device}")
        seg = self.segment(tensor, offset, nbytes)
        return RemoteSlot(self.peer_device.index, seg.addr, seg.nbytes)

    # ---- gates -------------------------------------------------------------------------------------

    def select(self, sources: Sequence[MemorySegment]) -> Selection:
        """:func:`~.kinds.select_kind`'s gates, then the *zero-copy* gate (:meth:`_zero_copy_gate`: host sources the
        GPU can read in place go to the device kernel too), then the *copy engine* gate: where the device kernel was
        chosen for one source of at least ``copy_engine_min_bytes``, one ``cudaMemcpyAsync`` (kind ``host``) moves it
        faster."""
        largest = max((s.nbytes for s in sources), default=0)
        selection = select_kind(self.caps, [s.memory for s in sources], largest, DIRECT_PROTOCOLS)
        if selection.kind is TransferKind.STAGING and selection.decided_by == "addressable":
            selection = self._strided_gate(selection, sources)
        if selection.kind is TransferKind.STAGING and selection.decided_by == "addressable":
            selection = self._zero_copy_gate(selection, sources)
        if selection.kind is not TransferKind.AIV:
            return selection
        large = len(sources) == 1 and largest >= self.copy_engine_min_bytes
        gate = GateDecision(
            "copy engine",
            not large,
            f"{len(sources)} source(s), largest {largest} B "
            f"{'>=' if large else '<'} copy_engine_min_bytes {self.copy_engine_min_bytes} B",
        )
        gates = (*selection.gates, gate)
        if not large:
            return Selection(selection.kind, selection.decided_by, selection.reason, gates, selection.segmented)
        return Selection(
            TransferKind.HOST,
            "copy engine",
            f"one contiguous piece of {largest} B: the copy engine "
            "(cudaMemcpyAsync) moves it faster than the device kernel",
            gates,
            False,
        )

    def _strided_gate(self, selection: Selection, sources: Sequence[MemorySegment]) -> Selection:
        """Where the gates chose ``staging`` for host sources: one 2-D copy-engine copy (kind ``host``, one
        ``cudaMemcpy2DAsync``) when every source lies in a registered pinned buffer and the sources are of one
        length, at least ``strided_min_piece_bytes``, at a constant stride (they land end to end, so the destination
        stride is the length). On H200 the copy engine reads pinned memory at the link's rate, the zero-copy kernel
        at ~92 % of it (docs/benchmarks.md); one call enqueues every row."""
        strided, detail = self._strided(sources)
        gates = (*selection.gates, GateDecision("strided copy", strided is not None, detail))
        if strided is None:
            return Selection(selection.kind, selection.decided_by, selection.reason, gates, selection.segmented)
        return Selection(
            TransferKind.HOST,
            "strided copy",
            f"{detail}: one 2-D copy on the copy engine (cudaMemcpy2DAsync) at the link's rate",
            gates,
            False,
        )

    def _strided(self, sources: Sequence[MemorySegment]):
        """(the sources as one :class:`~.segments.Strided` copy into a packed slot, or None; why)."""
        outside = [
            i for i, s in enumerate(sources) if s.memory is not MemoryKind.HOST or self._host_buffer(s.addr) is None
        ]
        if outside:
            return None, f"source {outside[0]} is not in a registered pinned host buffer"
        sizes = [s.nbytes for s in sources]
        strided = uniform_stride(
            [s.addr for s in sources], [0, *itertools.accumulate(sizes[:-1])], sizes, self.max_pitch
        )
        if strided is None:
            return None, f"the {len(sources)} sources are not of one length at a constant stride"
        rows = f"{strided.height} row(s) of {strided.width} B, {strided.spitch} B apart"
        if strided.width < self.strided_min_piece_bytes:
            return None, f"{rows}: rows below strided_min_piece_bytes {self.strided_min_piece_bytes} B"
        return strided, rows

    def _zero_copy_gate(self, selection: Selection, sources: Sequence[MemorySegment]) -> Selection:
        """Where the gates chose ``staging`` for host sources: the device kernel reads them in place (kind ``aiv``)
        when every host source lies in a registered buffer mapped for the GPU (pinned memory under unified
        addressing) and ``zero_copy`` is on. On H200 the kernel's PCIe reads beat the copy engine's staging copy then
        a scatter for every shape measured (docs/benchmarks.md), the layer block above all: its staging copy and
        scatter run one after the other, while the kernel's reads land where they belong."""
        unmapped = [i for i, s in enumerate(sources) if s.memory is MemoryKind.HOST and not self._mapped(s.addr)]
        passed = self.zero_copy and not unmapped
        if passed:
            detail = "every host source lies in registered pinned memory mapped for the GPU"
        elif unmapped:
            detail = f"host source {unmapped[0]} is not in a registered buffer mapped for the GPU"
        else:
            detail = "zero-copy reads are switched off (zero_copy=False)"
        gates = (*selection.gates, GateDecision("zero-copy", passed, detail))
        if not passed:
            return Selection(selection.kind, selection.decided_by, selection.reason, gates, selection.segmented)
        return Selection(
            TransferKind.AIV,
            "zero-copy",
            "the copy kernel reads the host sources in place over PCIe (mapped pinned memory): no staging copy",
            gates,
            selection.segmented,
        )

    def _mapped(self, addr: int) -> bool:
        buffer = self._host_buffer(addr)
        return buffer is not None and self._zero_copy_buffers.get(buffer.data_ptr(), False)

    def _forced(self, selection: Selection, kind: TransferKind, sources: Sequence[MemorySegment]) -> Selection:
        """As the interface's, except that ``aiv`` may read host sources in place where they are mapped."""
        host = [s for s in sources if s.memory is MemoryKind.HOST]
        if kind is not TransferKind.AIV or not host or not all(self._mapped(s.addr) for s in host):
            return super()._forced(selection, kind, sources)
        return super()._forced(selection, kind, [MemorySegment(s.addr, s.nbytes, MemoryKind.DEVICE) for s in sources])

    def _max_piece(self, kind: TransferKind) -> int:
        return self.caps.max_single_aiv_payload if kind in (TransferKind.AIV, TransferKind.STAGING) else 1 << 62

    def _route(self, sources, remote, kind):
        """The gates and the split, computed once per request pattern (they cost ~5 µs per piece in Python).

        The key is the sources' addresses and lengths (two list comprehensions, ~0.03 µs per source; faster here
        than ``map(attrgetter)``): CUDA addresses are unified, so an address also names the memory it lies in."""
        key = (kind, remote, tuple([s.addr for s in sources]), tuple([s.nbytes for s in sources]))
        routed = self._routes.get(key)
        if routed is None:
            routed = self._routes[key] = super()._route(sources, remote, kind)
            if len(self._routes) > PLAN_CACHE:
                self._routes.pop(next(iter(self._routes)))
        return routed

    # ---- prepare and start ---------------------------------------------------------------------------

    def prepare(self, sources, remote, notify_slot=None, kind=None) -> PreparedTransfer:
        """Route the request and build its work once (plans uploaded, every range checked, an ``aiv`` pattern
        captured in a CUDA graph): a submission of the prepared request is the launch alone, with no per-call
        allocation, torch op or synchronisation."""
        return self._prepared(sources, remote, notify_slot, kind, capture=True)

    def submit(self, sources, remote, notify_slot=None, kind=None, notify_value=None) -> Ticket:
        """As the interface's (``notify_value``: the caller's value for the notify slot, else a fresh magic). A request with the sources of the last one to the same slot (DualPath's layer
        patterns) reuses that one's routing and work: the list comparison finds the same segment objects at ~2 ns
        each, so the cost barely grows with the pattern. Its graph is captured at the second submission (a one-off
        request would pay the capture, ~400 µs, for nothing)."""
        key = _submission_key(sources, remote, notify_slot, kind)
        prepared = None if key is None else self._submissions.get(key)
        if prepared is None or prepared.sources != (sources if type(sources) is list else list(sources)):
            prepared = self._prepared(sources, remote, notify_slot, kind, capture=False)
            if key is not None:
                self._submissions[key] = prepared
                if len(self._submissions) > PLAN_CACHE:
                    self._submissions.popitem(last=False)
        return self._submit_prepared(prepared, notify_value)

    def _prepared(self, sources, remote, notify_slot, kind, capture: bool) -> PreparedTransfer:
        prepared = super().prepare(sources, remote, notify_slot, kind)
        self._check_request(prepared.remote, prepared.notify_slot)
        prepared.state["capture"] = capture and self.graphs
        self._prepare_work(prepared)
        return prepared

    def _prepare_work(self, prepared: PreparedTransfer) -> None:
        """Build (or find) the prepared request's work, every range checked against the current registrations, its
        result and, where the request asks for one, its CUDA graph (:meth:`_capture_work`)."""
        prepared.state.pop("work", None)  # a refused check leaves no stale work behind
        work = self._on_device(
            self._work, prepared.selection.kind, prepared.pieces, prepared.remote, prepared.notify_slot
        )
        prepared.state["result"] = TransferResult(
            prepared.selection.kind,
            prepared.selection,
            work.nbytes,
            len(prepared.pieces),
            staging_bytes=work.staging_bytes,
        )
        prepared.state["work"] = work
        prepared.state["registrations"] = self._registrations
        if prepared.state["capture"] and work.graph is None and work.graphable:
            self._on_device(self._capture_work, work)

    def _capture_work(self, work: _Work, first_magic: int | None = None):
        """Capture ``work``'s one plan in a CUDA graph (publishing from ``first_magic``, default the engine's next
        range of ``GRAPH_MAGIC_STRIDE``); every later submission of the work replays it."""
        if first_magic is None:
            first_magic, self._graph_magic = self._graph_magic, self._graph_magic + GRAPH_MAGIC_STRIDE
        work.graph = self._copier.capture(work.plans[0], first_magic)
        return work.graph

    def _start(self, ticket: Ticket, prepared: PreparedTransfer) -> None:
        """Enqueue ``prepared``'s work (built at prepare; built again when a registration went away since), or
        launch its CUDA graph (captured here at a plain submission's second sighting of the pattern)."""
        state = prepared.state
        if state["registrations"] != self._registrations:
            self._prepare_work(prepared)
        work = state["work"]
        if work.graph is None and work.graphable and self.graphs:
            if work.sightings:
                self._on_device(self._capture_work, work)
            work.sightings += 1
        ticket.state["result"] = state["result"]
        if work.graph is None:
            self._on_device(self._enqueue, ticket, work)
        else:
            self._on_device(self._replay, ticket, work.graph)

    def _check_request(self, remote: RemoteSlot, notify_slot: int | None) -> None:
        if remote.peer != self.peer_device.index:
            raise E.ConfigError(f"remote slot on rank {remote.peer}, but this engine writes to {self.peer_device}")
        if notify_slot is not None:
            if self.notify is None:
                raise E.ConfigError("a notify slot was asked for, but the engine has no notify tensor")
            if not 0 <= notify_slot < self.notify.numel():
                raise E.BoundsError(f"notify slot {notify_slot} is outside [0, {self.notify.numel()})")

    def _on_device(self, call, *args):
        """``call(*args)`` with the engine's GPU current (switching only when another one is)."""
        if self.torch._C._cuda_getDevice() == self.device.index:
            return call(*args)
        with self.torch.cuda.device(self.device):
            return call(*args)

    def _replay(self, ticket: Ticket, graph) -> None:
        """Replay a prepared request's graph on the current stream (the engine's GPU is current)."""
        stream = self._raw_stream(self.device.index)
        if ticket.notify_slot is not None and self._tail_notify:  # the call only where a tail write may be pending
            self._after_tail_notify(ticket.notify_slot, stream)
        value = graph.replay(stream, ticket.notify_value)
        ticket.state["done"] = (graph.host_word, value)
        if ticket.notify_slot is not None:
            ticket.notify_magic = value if ticket.notify_value is None else ticket.notify_value

    def _enqueue(self, ticket: Ticket, work: _Work) -> None:
        """Enqueue ``work`` for ``ticket`` on the current stream (the engine's GPU is current): the copies, then the
        value that says they landed (notify slot, host word), known now."""
        stream = self._raw_stream(self.device.index)
        value = next(self._magics)  # the host word's; the notify slot gets the caller's value where one is given
        notify = value if ticket.notify_value is None else ticket.notify_value
        if ticket.notify_slot is not None:
            ticket.notify_magic = notify
        if work.graphable and ticket.notify_slot is not None:
            self._after_tail_notify(ticket.notify_slot, stream)
        for plan in work.plans:  # an aiv plan's flag is the notify slot: the kernel releases the value itself
            self._copier.run(plan, notify, value)
        for copy in work.staging_copies:
            copy.run(value)
        if work.batch is not None:  # on the tail stream: the batch call refuses the legacy default stream
            work.batch(self._tail_stream().follow(stream))
            self._tail.join(stream)  # the caller's later work sees the bytes
        if work.copy2d is not None:
            work.copy2d(stream)
        if work.each:
            cudart.memcpy_each(work.each, stream)
        if work.graphable:
            ticket.state["done"] = (work.plans[0].host_word, value)
        else:
            self._tail_writes(ticket, work, stream, value)

    def _tail_writes(self, ticket: Ticket, work: _Work, stream: int, value: int) -> None:
        """End a request of the kinds without a publishing kernel: the writes of ``value`` (:meth:`_writes_of`) on
        the tail stream, after the request's copies on ``stream``, which goes on at once (stream order covers the
        bytes, not the notify); the notify slot gets the caller's value where one is given."""
        writes = self._writes_of(work, ticket.notify_slot)
        if ticket.notify_value is None or ticket.notify_slot is None:
            writes(self._tail_stream().follow(stream), value)
        else:
            writes(self._tail_stream().follow(stream), ticket.notify_value, value)
        work.host_word.enqueued = value
        ticket.state["done"] = (work.host_word, value)
        if ticket.notify_slot is not None:
            self._tail_notify[ticket.notify_slot] = (work.host_word, value)

    def _tail_stream(self):
        if self._tail is None:
            self._tail = cudart.TailStream(self.torch, self.device)
        return self._tail

    def _after_tail_notify(self, slot: int | None, stream: int) -> None:
        """Before a kernel publishes into notify ``slot`` from ``stream``: if the slot's last value went through the
        tail stream and has not landed, ``stream`` waits for it, so the slot ends with the value published last."""
        pending = self._tail_notify.pop(slot, None) if self._tail_notify else None
        if pending is not None and not pending[0].reached(pending[1]):
            self._tail.join(stream)

    def _writes_of(self, work: _Work, slot: int | None):
        """The stream writes that end a request of the kinds without a publishing kernel (``staging``, ``aicpu``,
        ``host``): its notify slot (if any), then the work's host word, in one driver call after the copies."""
        writes = work.writes.get(slot)
        if writes is None:
            from ascend_dualpath.transport.cuda import HostWord

            if work.host_word is None:
                work.host_word = HostWord(self.torch)
            notify = [] if slot is None else [self.notify.data_ptr() + slot * self.notify.element_size()]
            writes = work.writes[slot] = cudart.StreamWrites([*notify, work.host_word.addr])
        return writes

    def _work(self, kind: TransferKind, pieces, remote: RemoteSlot, notify_slot: int | None) -> _Work:
        """The cached work of this piece list (the routed list of a request pattern, :meth:`_route`), built and every
        range checked the first time it is seen. An ``aiv`` request with a notify slot gets a plan whose ready flag
        is that slot: the copy kernel publishes remote-ready itself, as the AIV path's trailing flag write does."""
        key = (kind, id(pieces), notify_slot if kind is TransferKind.AIV else None)
        cached = self._plans.get(key)
        if cached is not None and cached[0] is pieces:  # the entry keeps the list alive, so its id is not reused
            self._plans.move_to_end(key)
            return cached[1]
        self._check_ranges(pieces, remote)
        work = _Work()
        work.nbytes = sum(p.nbytes for p in pieces)
        build = {
            TransferKind.AIV: self._aiv_work,
            TransferKind.STAGING: self._staging_work,
            TransferKind.AICPU: self._aicpu_work,
            TransferKind.HOST: self._host_work,
        }[kind]
        build(work, pieces, notify_slot)
        self._plans[key] = (pieces, work)
        if len(self._plans) > PLAN_CACHE:
            self._plans.popitem(last=False)  # in-flight tickets keep their own reference
        return work

    def _aiv_work(self, work: _Work, pieces, notify_slot: int | None) -> None:
        """One device-copy plan over every piece; with a notify slot, that slot is the plan's ready flag."""
        flag = None if notify_slot is None else self.notify[notify_slot : notify_slot + 1]
        zero_copy = any(self._host_buffer(p.local_addr) is not None for p in pieces)
        config = self.zero_copy_config if zero_copy else None
        work.plans.append(self._device_copier().plan(*_columns(pieces), config=config, flag=flag, host_word=True))
        work.graphable = True

    def _staging_work(self, work: _Work, pieces, notify_slot: int | None) -> None:
        """A device-copy plan for the device-resident pieces, one StagingCopy per host buffer for the others."""
        device = [p for p in pieces if self._host_buffer(p.local_addr) is None]
        host = [p for p in pieces if self._host_buffer(p.local_addr) is not None]
        if device:
            work.plans.append(self._device_copier().plan(*_columns(device)))
        work.staging_copies = self._staging_copies(host)
        work.staging_bytes = sum(s.staging_bytes for s in work.staging_copies)

    def _aicpu_work(self, work: _Work, pieces, notify_slot: int | None) -> None:
        """One batched runtime copy of every piece."""
        dsts, srcs, sizes = zip(*_copies(pieces), strict=True)
        work.batch = cudart.MemcpyBatch(dsts, srcs, sizes)

    def _host_work(self, work: _Work, pieces, notify_slot: int | None) -> None:
        """One cudaMemcpy2DAsync where the pieces are of one length at constant strides, else one cudaMemcpyAsync
        per piece."""
        strided = uniform_stride(*_columns(pieces), self.max_pitch)
        if strided is None:
            work.each = _copies(pieces)
            return
        work.copy2d = cudart.Memcpy2D(
            strided.dst, strided.dpitch, strided.src, strided.spitch, strided.width, strided.height
        )

    def _staging_copies(self, pieces) -> list:
        """One StagingCopy per registered host buffer the pieces come from."""
        from ascend_dualpath.transport.cuda import StagingCopy

        by_buffer: dict[int, list] = {}
        for p in pieces:
            by_buffer.setdefault(self._host_buffer(p.local_addr).data_ptr(), []).append(p)
        copies = []
        for base, group in by_buffer.items():
            offsets = [p.local_addr - base for p in group]
            copies.append(
                StagingCopy(
                    self._device_copier(),
                    self._host_buffers[base],
                    offsets,
                    [p.remote_addr for p in group],
                    [p.nbytes for p in group],
                )
            )
        return copies

    def _device_copier(self):
        if self._copier is None:
            from ascend_dualpath.transport.cuda import DeviceCopier

            self._copier = DeviceCopier(self.device, self._done)
        return self._copier

    def _host_buffer(self, addr: int):
        for base, buffer in self._host_buffers.items():
            if base <= addr < base + buffer.numel():
                return buffer
        return None

    def _check_ranges(self, pieces, remote: RemoteSlot) -> None:
        """NotRegistered for host bytes outside every registered buffer, BoundsError for device sources off this GPU
        or a remote slot off the destination GPU."""
        for i, p in enumerate(pieces):
            buffer = self._host_buffer(p.local_addr)
            if buffer is None:
                continue
            if p.local_addr + p.nbytes > buffer.data_ptr() + buffer.numel():
                raise E.BoundsError(
                    f"piece {i} [{p.local_addr:#x}, +{p.nbytes}) runs past the end of its registered "
                    f"host buffer of {buffer.numel()} bytes at {buffer.data_ptr():#x}"
                )
        device = [p for p in pieces if self._host_buffer(p.local_addr) is None]
        if device:
            found = cudart.memory_devices([p.local_addr for p in device], [p.nbytes for p in device])
            if found != {self.device.index}:
                raise E.NotRegistered(
                    f"sources must be memory of {self.device} or of a registered host buffer; the unregistered "
                    f"sources lie in {_where(found)} (first at {device[0].local_addr:#x})"
                )
        if self._host_destination(remote):
            return
        found = cudart.memory_devices([remote.addr], [remote.nbytes])
        if found != {self.peer_device.index}:
            raise E.BoundsError(
                f"remote slot [{remote.addr:#x}, +{remote.nbytes}) must lie in memory of "
                f"{self.peer_device} or inside one registered host buffer mapped for the GPU; it lies in "
                f"{_where(found)}"
            )

    def _host_destination(self, remote: RemoteSlot) -> bool:
        """Whether the remote slot lies wholly inside a registered host buffer mapped for the GPU (a peer process's
        shared host region mapped here: the copy engine and the device kernel write it at its own address)."""
        buffer = self._host_buffer(remote.addr)
        return (
            buffer is not None
            and self._mapped(remote.addr)
            and remote.addr + remote.nbytes <= buffer.data_ptr() + buffer.numel()
        )

    def capture(self, prepared: PreparedTransfer, first_magic: int | None = None):
        """The prepared ``aiv`` request's CUDA graph (:class:`~.cuda.GraphedCopy`), captured anew: its ``replay()``
        enqueues the request on the current stream and returns the value it publishes, ``first_magic + k`` for
        replay ``k`` (default: the engine's next range of ``GRAPH_MAGIC_STRIDE``), in the request's notify slot (else
        the engine's ready flag). The request's later submissions replay this same graph, which replaces the one
        captured before (one epoch counter per plan, so one graph per pattern). ConfigError for another kind (their
        host work cannot be replayed)."""
        if prepared.engine is not self:
            raise E.ProtocolError("the prepared transfer belongs to another engine")
        work = prepared.state["work"]
        if not work.graphable:
            raise E.ConfigError(
                f"only an aiv request can be captured in a CUDA graph; this one is "
                f"{prepared.selection.kind.value!r} ({prepared.selection.decided_by})"
            )
        return self._on_device(self._capture_work, work, first_magic)

    # ---- finish ------------------------------------------------------------------------------------

    def _finish(self, ticket: Ticket, timeout_s: float) -> TransferResult:
        word, value = ticket.state["done"]
        if not word.reached(value):  # the closures of a bounded wait are built only when there is one
            poll_until(
                lambda: word.reached(value), timeout_s, lambda: f"{self._waited_for(ticket)}: the GPU has not finished"
            )
        result = ticket.state["result"]
        # the notify was published in stream order after every byte: the result carries it, no write follows
        return result if ticket.notify_magic is None else result.with_notify(ticket.notify_magic)

    def _waited_for(self, ticket: Ticket) -> str:
        return (
            f"the {len(ticket.pieces)} pieces ({ticket.nbytes} bytes, {ticket.kind.value}) of "
            f"ticket {ticket.id} to {self.peer_device}"
        )

    def _publish_ready(self, ticket: Ticket, timeout_s: float) -> int:
        """Never called: every notified request publishes at submit, in stream order (the copy kernel, or the tail
        stream's writes), so its result already carries the magic."""
        raise E.ProtocolError(f"ticket {ticket.id} reached the wait without a published notify")

    def _write_notify(self, slot: int, magic: int, timeout_s: float, what: str) -> None:
        """Fill notify ``slot`` with ``magic`` and wait for it (bounded): on a stream of the notify's own GPU (a fill
        runs on its tensor's GPU), after the transfers it follows completed (the caller waited for them)."""
        torch = self.torch
        with torch.cuda.device(self.peer_device), torch.cuda.stream(self._notify_stream):
            self.notify[slot].fill_(magic)
            event = torch.cuda.Event()
            event.record(self._notify_stream)
        poll_until(
            event.query, timeout_s, lambda: f"the notify write of {what} (slot {slot}): the GPU has not finished"
        )

    def _release(self, ticket: Ticket) -> None:
        # a ticket holds nothing: staging slots belong to the pattern's cached StagingCopy and are reused only in
        # stream order, and a host word outlives every request that writes it
        ticket.state.clear()


class _Work:
    """What one piece pattern enqueues: device-copy plans, staging copies, one batch call, or single copies."""

    def __init__(self):
        self.plans: list = []
        self.staging_copies: list = []
        self.batch = None
        self.each: list[tuple[int, int, int]] = []
        self.copy2d = None  # cudart.Memcpy2D of the host kind's pieces where they are of one length at constant strides
        self.staging_bytes = 0
        self.nbytes = 0
        self.graphable = False  # one aiv plan: a CUDA graph can replay the whole request
        self.graph = None  # its GraphedCopy, shared by every submission of the pattern
        self.sightings = 0  # plain submissions so far, before the graph
        self.host_word = None  # HostWord of the copy-engine and runtime kinds, made at their first submission
        self.writes: dict = {}  # notify slot (or None) -> cudart.StreamWrites ending those kinds' requests


def _submission_key(sources, remote, notify_slot, kind):
    """Where a plain submission goes and how (its sources are compared separately), or None when the arguments
    cannot be a key (the full checks of :meth:`TransferEngine.prepare` then name what is wrong)."""
    if (
        type(sources) not in (list, tuple)
        or type(remote) is not RemoteSlot
        or type(notify_slot) not in (int, type(None))
        or type(kind) not in (str, TransferKind, type(None))
    ):
        return None
    return remote, notify_slot, kind


def _columns(pieces):
    return [p.local_addr for p in pieces], [p.remote_addr for p in pieces], [p.nbytes for p in pieces]


def _copies(pieces) -> list[tuple[int, int, int]]:
    """(destination, source, bytes) of each piece: the runtime copies' argument order."""
    return [(p.remote_addr, p.local_addr, p.nbytes) for p in pieces]


def _indexed(torch, device):
    device = torch.device(device)
    if device.type != "cuda":
        raise E.ConfigError(f"the CUDA transfer engine needs CUDA devices, got {device}")
    return torch.device("cuda", torch.cuda.current_device()) if device.index is None else device


def _mapped_in_place(addr: int) -> bool:
    """Whether the GPU reads pinned host memory at ``addr`` at that same address (mapped, unified addressing): the
    device kernel's tile table holds host addresses as they are."""
    try:
        return cudart.host_device_pointer(addr) == addr
    except E.BackendUnavailable:
        return False


def _where(devices: set[int]) -> str:
    names = sorted("host or unknown memory" if d == cudart.NOT_DEVICE_MEMORY else f"cuda:{d}" for d in devices)
    return ", ".join(names)
