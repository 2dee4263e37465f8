"""The worker half of the DualPath connector (runs in each vLLM worker; tensor parallelism 1).

Per request and path (docs/vllm.md has the sequence diagrams):

- **PE read path** (the PE): ``start_load_kv`` queues the hit full blocks on the PE node's storage read
  queue into a host lease; ``wait_for_layer_load(l)`` puts layer ``l``'s hit rows into the paged cache
  before layer ``l``'s attention; ``save_kv_layer(l)`` sends the complete layer (hit and new rows) to the
  DE's lease while layer ``l + 1`` computes.
- **DE read path**: the DE reads the hit blocks through its own storage NIC into its lease and pushes hit
  layer ``l`` into one of two slots in the PE's HCCL window (notify after the last byte); the PE consumes it
  in ``wait_for_layer_load(l)`` and returns only the new rows of each layer; the DE pushes layer ``l + 2``
  once the PE has consumed layer ``l``.
- **The DE** merges hit and new rows in token order into its paged blocks when every row has arrived, then
  reports the request in ``finished_recving`` (or ``failed_recving``); finished requests' new full blocks
  are persisted to the store.

A load that fails on the PE (storage read error, checksum mismatch, the DE aborting its pushes, a timeout)
reports the request's hit blocks from the first failed one in ``get_block_ids_with_load_errors``, so vLLM
recomputes them or fails the request (``kv_load_failure_policy``); the PE then sends the DE complete layers.
A corrupted block is removed from the store (it is persisted again when its request finishes).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Any

import torch

from ascend_dualpath.dualpath.scheduler import ReadPath
from ascend_dualpath.dualpath.transfer_leg import PeerAborted, Segment
from ascend_dualpath.errors import AdpError, ChecksumMismatch, ProtocolError, WaitTimeout
from ascend_dualpath.integrations.vllm.dataplane import DE_RANK, PE_RANK, Dataplane, open_dataplane
from ascend_dualpath.integrations.vllm.metadata import DualPathMetadata, LoadSpec, PersistSpec, RecvSpec, SaveSpec
from ascend_dualpath.integrations.vllm.persisting import PersistAnnouncements
from ascend_dualpath.integrations.vllm.protocol import PeerClient, SideChannel, XferParams
from ascend_dualpath.integrations.vllm.settings import ConnectorSettings
from ascend_dualpath.kv.layout import KVLayout
from ascend_dualpath.kv.read_queue import ReadQueue
from ascend_dualpath.kv.store import LocalBlockStore

NOTIFY_POLL_S = 0.0002
log = logging.getLogger(__name__)


def _request_amx_state() -> None:
    """Ask Linux for the AMX tile state now, before the connector's threads exist (x86-64 only, best effort).

    Without it, the DE's first forward after the fabric handshake died with SIGILL inside vLLM's CPU attention
    (vLLM 0.32.0 on Sapphire Rapids): the lazy request made there did not take effect for that process.
    """
    import ctypes
    import platform

    if platform.machine() != "x86_64":
        return
    arch_prctl, req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    ctypes.CDLL(None, use_errno=True).syscall(arch_prctl, req_xcomp_perm, xfeature_xtiledata)


@dataclasses.dataclass
class Counters:
    """What the worker reports in ``status`` (and so what the proxy's /metrics shows)."""

    loads_pe: int = 0
    loads_de: int = 0
    fallbacks: int = 0
    failures: int = 0
    checksum_errors: int = 0
    persisted_blocks: int = 0


@dataclasses.dataclass
class _Load:
    """One request's hit rows arriving during this step's forward (PE or standalone)."""

    spec: LoadSpec
    full_rows: bool  # the DE gets complete layers from this PE (PE path, or after a fallback)
    lease: Any = None  # storage reads (PE path)
    tickets: list = dataclasses.field(default_factory=list)
    slots: list[int] = dataclasses.field(default_factory=list)  # DE path: two layer slots in the window
    notify_base: int = -1
    magics: list[int] = dataclasses.field(default_factory=list)
    abort_magic: int = 0
    error: BaseException | None = None

    @property
    def rows(self) -> int:
        return self.spec.hit_tokens - self.spec.computed


@dataclasses.dataclass
class _PeXfer:
    """PE-side state of one request across the steps of its prefill."""

    lease_addr: int
    full_rows: bool
    hit_tokens: int
    prompt_tokens: int
    first_save: bool = True


@dataclasses.dataclass
class _DeXfer:
    """DE-side state of one request: the plan from the PE, the lease, what has arrived."""

    plan: dict
    lease: Any
    full_rows: bool
    received_end: int
    created: float
    reads_ok: bool = False
    error: str | None = None
    recv: RecvSpec | None = None
    consumed: queue.Queue | None = None  # layers the PE consumed (DE path pusher)


class DualPathWorker:
    """Worker-side state of one instance.

    Parameters
    ----------
    settings : ConnectorSettings
        The instance's connector settings.
    layout : KVLayout
        Token rows of this model (must match the adapter's).
    store : LocalBlockStore
        The shared block store.
    adapter_factory : callable
        ``(layer_name, cache) -> adapter``: the paged-layout adapter of the model's attention backend.
    """

    def __init__(self, settings: ConnectorSettings, layout: KVLayout, store: LocalBlockStore, adapter_factory):
        self.settings, self.layout, self.store = settings, layout, store
        self._adapter_factory = adapter_factory
        self.read_queue = ReadQueue(store, settings.snic_bytes_per_s, node=settings.node)
        self.announcements = PersistAnnouncements(settings.store, settings.persist_wait_s)
        self.counters = Counters()
        self.caches: list[torch.Tensor] = []
        self._layer_of: dict[str, int] = {}
        self.adapter = None
        self.dataplane: Dataplane | None = None
        self._private_host = None
        self.side: SideChannel | None = None
        self._peer: PeerClient | None = None
        self._lock = threading.Lock()
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="adp-persist")
        # PE / standalone, per step
        self._loads: list[_Load] = []
        self._saves: list[tuple[SaveSpec, _PeXfer, list]] = []
        self._invalid_blocks: set[int] = set()
        self._pe_xfers: dict[str, _PeXfer] = {}
        self._pe_xfer_of: dict[str, str] = {}  # PE req_id -> xfer_id
        # DE
        self._de_xfers: dict[str, _DeXfer] = {}
        self._recvs: dict[str, RecvSpec] = {}
        self._recv_since: dict[str, float] = {}
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._finished_sending: set[str] = set()
        self._writes: list[tuple[str, concurrent.futures.Future]] = []  # persists in flight

    # -- set-up ---------------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any], layer_index) -> None:
        """Take vLLM's per-layer caches (``layer_index(name) -> int`` orders them) and open the side channel."""
        _request_amx_state()
        names = sorted(kv_caches, key=layer_index)
        self.caches = [kv_caches[name] for name in names]
        self._layer_of = {name: i for i, name in enumerate(names)}
        self.adapter = self._adapter_factory(names[0], self.caches[0])
        if self.settings.role == "prefill":
            self.dataplane = open_dataplane(self.settings, PE_RANK)
        if self.settings.side_port is not None:
            self.side = SideChannel(self.settings.side_port, self._handle, name=f"adp-{self.settings.node}")

    def shutdown(self) -> None:
        if self.side is not None:
            self.side.close()
        if self._peer is not None:
            self._peer.close()
        self._writer.shutdown(wait=True)
        self.read_queue.close()
        with self._lock:
            for xfer in self._de_xfers.values():
                xfer.lease.release()
            self._de_xfers.clear()
        if self.dataplane is not None:
            self.dataplane.close()
        self.store.close()

    # -- PE and standalone: loads ---------------------------------------------------------------------------------------
    def start_step(self, meta: DualPathMetadata) -> None:
        """Everything of one step that must precede its forward: vLLM calls ``start_load_kv`` after the forward
        when no request of the step loads synchronously, but binds the metadata before it."""
        self._invalid_blocks = set()
        self._loads = [self._start_load(spec) for spec in meta.loads]
        self._saves = []
        for spec in meta.saves:
            xfer = self._pe_xfers.get(spec.xfer.xfer_id)
            if xfer is not None:
                self._saves.append((spec, xfer, []))
        for spec in meta.recvs:
            self._add_recv(spec)
        for spec in meta.persists:
            self._persist(spec)
        self._complete_recvs()

    def _start_load(self, spec: LoadSpec) -> _Load:
        xfer = spec.xfer
        via_peer = xfer is not None and xfer.path is ReadPath.DE
        load = _Load(spec, full_rows=not via_peer)
        try:
            if xfer is not None:
                self._plan(load)
            if not via_peer and load.rows > 0:
                self._queue_reads(load)
            if load.rows > 0:
                if via_peer:
                    self.counters.loads_de += 1
                else:
                    self.counters.loads_pe += 1
        except Exception as error:  # a load that cannot even start fails like one that broke later
            self._fail_load(load, error)
        return load

    def _queue_reads(self, load: _Load) -> None:
        spec, fb = load.spec, self.layout.full_block_bytes
        first, last = spec.computed // self.block_size, spec.hit_tokens // self.block_size
        self.store.refresh(spec.store_ids[:last])  # the scheduler half's store saw them; this index may not yet
        load.lease = self._host().allocate(spec.req_id, (last - first) * fb, timeout_s=self.settings.timeout_s)
        load.tickets = [
            self.read_queue.submit(spec.store_ids[b], load.lease.slice((b - first) * fb, fb).view)
            for b in range(first, last)
        ]

    @property
    def block_size(self) -> int:
        return self.layout.block_tokens

    def _host(self):
        """Where this instance's storage reads land: the registered host buffer, or (standalone) a private one."""
        if self.dataplane is not None:
            return self.dataplane.host
        if self._private_host is None:
            from ascend_dualpath.kv.buffers import HostBuffer

            self._private_host = HostBuffer(
                self.settings.host_buffer_mb << 20, role="pe_buffer", timeout_s=self.settings.timeout_s
            )
        return self._private_host

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        for load in self._loads:
            if load.error is None and load.rows > 0:
                try:
                    rows = self._layer_rows(load, layer)
                    self.adapter.write_tokens(self.caches[layer], load.spec.block_ids, load.spec.computed, rows)
                    if load.slots and layer + 2 < self.layout.num_layers:
                        self._peer_request({"op": "consumed", "xfer_id": load.spec.xfer.xfer_id, "layer": layer})
                except Exception as error:
                    self._fail_load(load, error)

    def _layer_rows(self, load: _Load, layer: int) -> torch.Tensor:
        """uint8 ``[rows, C]``: layer ``layer`` of the load's hit rows, once they are here."""
        C = self.layout.token_bytes
        if load.slots:  # DE path: the DE pushed this layer into slot layer % 2
            self._wait_notify(load, layer)
            view = self.dataplane.window_view(load.slots[layer % 2], load.rows * C)
            return torch.frombuffer(view, dtype=torch.uint8).view(load.rows, C)
        if layer == 0:
            for ticket in load.tickets:
                ticket.wait(self.settings.timeout_s)
        blocks = load.lease.full_blocks(self.layout, load.rows // self.block_size)
        return self.layout.layer_rows(blocks, layer)

    def _wait_notify(self, load: _Load, layer: int) -> None:
        comm, deadline = self.dataplane.comm, time.monotonic() + self.settings.timeout_s
        slot, magic = load.notify_base + layer % 2, load.magics[layer]
        while comm.notify_value(slot) != magic:
            if comm.notify_value(load.notify_base + 2) == load.abort_magic:
                raise PeerAborted(f"the DE aborted its pushes of request {load.spec.xfer.xfer_id}")
            if time.monotonic() > deadline:
                raise WaitTimeout(
                    f"hit layer {layer} of request {load.spec.xfer.xfer_id} not pushed by the DE "
                    f"within {self.settings.timeout_s} s (notify slot {slot})"
                )
            time.sleep(NOTIFY_POLL_S)

    def _fail_load(self, load: _Load, error: BaseException) -> None:
        """Report the load's hit blocks from the first one that may be wrong; the DE then gets full layers."""
        if load.error is not None:
            return
        load.error = error
        spec = load.spec
        log.warning(
            "DualPath: load of request %s failed, its hit blocks are reported to vLLM: %s: %s",
            spec.req_id,
            type(error).__name__,
            error,
        )
        first_bad = spec.computed // self.block_size
        if isinstance(error, ChecksumMismatch):
            self.counters.checksum_errors += 1
            first_bad = self._drop_corrupt(load, first_bad)
        self._invalid_blocks.update(spec.block_ids[first_bad : spec.hit_tokens // self.block_size])
        self.counters.fallbacks += 1
        if spec.xfer is not None and spec.xfer.xfer_id in self._pe_xfers:
            self._pe_xfers[spec.xfer.xfer_id].full_rows = True
            self._pe_xfers[spec.xfer.xfer_id].first_save = True
        self._release_load(load)

    def _drop_corrupt(self, load: _Load, first: int) -> int:
        """Remove the first corrupted block (and so its descendants) from the store; returns its index."""
        spec = load.spec
        for i, ticket in enumerate(load.tickets):
            if ticket.done and isinstance(getattr(ticket, "_error", None), ChecksumMismatch):
                self.store.remove(spec.store_ids[first + i])
                return first + i
        return first

    def _release_load(self, load: _Load) -> None:
        if load.lease is not None:
            for ticket in load.tickets:  # a read still in flight writes into the lease: let it end first
                if not ticket.done:
                    try:
                        ticket.wait(self.settings.timeout_s)
                    except Exception:  # its error is already the load's error or irrelevant now
                        pass
            load.lease.release()
            load.lease = None
        if load.slots:
            for addr in load.slots:
                self.dataplane.window_free(addr)
            self.dataplane.notify_free(load.notify_base)
            load.slots = []

    # -- PE: the plan and the saves ---------------------------------------------------------------------------------
    def _connect_peer(self, address: str) -> None:
        if self._peer is not None:
            return
        self._peer = PeerClient(address, self.settings.timeout_s)
        dp = self.dataplane
        reply = self._peer_request(
            {
                "op": "hello",
                "rank_info": dp.local_info(),
                "fabric": self.settings.fabric,
                "host_mem": list(dp.host_mem()),
            }
        )
        dp.connect(reply["rank_info"], tuple(reply["host_mem"]))

    def _peer_request(self, message: dict) -> dict:
        return self._peer.request(message)

    def _plan(self, load: _Load) -> None:
        """Tell the DE what is coming (and, on the DE path, where to push the hit layers); take its lease."""
        spec, dp, C = load.spec, self.dataplane, self.layout.token_bytes
        self._connect_peer(spec.xfer.peer)
        message = {
            "op": "plan",
            "xfer_id": spec.xfer.xfer_id,
            "path": spec.xfer.path.value,
            "hit_tokens": spec.hit_tokens,
            "prompt_tokens": spec.prompt_tokens,
            "load_start": spec.computed,
            "store_ids": spec.store_ids[: spec.hit_tokens // self.block_size],
        }
        if not load.full_rows and load.rows > 0:
            load.notify_base = dp.notify_alloc()
            load.slots = [dp.window_alloc(load.rows * C) for _ in range(2)]
            load.magics = [dp.comm.next_magic() for _ in range(self.layout.num_layers)]
            load.abort_magic = dp.comm.next_magic()
            message.update(
                slots=load.slots, notify_base=load.notify_base, magics=load.magics, abort_magic=load.abort_magic
            )
        reply = self._peer_request(message)
        self._pe_xfers[spec.xfer.xfer_id] = _PeXfer(
            reply["lease_addr"], load.full_rows, spec.hit_tokens, spec.prompt_tokens
        )
        self._pe_xfer_of[spec.req_id] = spec.xfer.xfer_id

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        layer = self._layer_of.get(layer_name)

        if layer is None:
            return
        failed = {load.spec.req_id for load in self._loads if load.error is not None}
        for spec, xfer, sends in self._saves:
            if spec.req_id in failed:
                continue
            start = self._save_start(spec, xfer)
            if start >= spec.end:
                continue
            sends.append(self._send_rows(layer, kv_layer, spec, xfer, start))

    @staticmethod
    def _save_start(spec: SaveSpec, xfer: _PeXfer) -> int:
        if xfer.full_rows:
            return 0 if xfer.first_save else spec.start
        return max(spec.start, xfer.hit_tokens)

    def _send_rows(self, layer: int, kv_layer: torch.Tensor, spec: SaveSpec, xfer: _PeXfer, start: int) -> tuple:
        """Gather rows ``[start, spec.end)`` of ``layer`` into the window and queue them to the DE lease."""
        C, L, dp = self.layout.token_bytes, self.layout.num_layers, self.dataplane
        rows = self.adapter.read_tokens(kv_layer, spec.block_ids, start, spec.end)
        nbytes = rows.numel()
        addr = dp.window_alloc(nbytes)
        torch.frombuffer(dp.window_view(addr, nbytes), dtype=torch.uint8).copy_(rows.reshape(-1))
        if xfer.full_rows:
            offset = (layer * xfer.prompt_tokens + start) * C
        else:
            miss = xfer.prompt_tokens - xfer.hit_tokens
            offset = L * xfer.hit_tokens * C + (layer * miss + start - xfer.hit_tokens) * C
        ticket = dp.leg.submit(layer, [Segment(addr, nbytes, 0)], DE_RANK, xfer.lease_addr + offset)
        return start, addr, ticket

    def wait_for_save(self) -> None:
        failed = {load.spec.req_id for load in self._loads if load.error is not None}
        for spec, xfer, sends in self._saves:
            if spec.req_id in failed:  # vLLM recomputes or fails it; the next attempt sends complete layers
                sends = [(start, addr, ticket) for start, addr, ticket in sends if self._settle(addr, ticket)]
            error = None
            for _, addr, ticket in sends:
                try:
                    self.dataplane.leg.wait(ticket, self.settings.timeout_s)
                except Exception as exc:
                    error = error or exc
                self.dataplane.window_free(addr)
            if not sends:
                continue
            start = sends[0][0]
            try:
                if error is not None:
                    raise error
                self._peer_request(
                    {
                        "op": "rows",
                        "xfer_id": spec.xfer.xfer_id,
                        "start": start,
                        "end": spec.end,
                        "full": xfer.full_rows,
                    }
                )
                xfer.first_save = False
            except Exception as exc:
                log.warning("DualPath: saves of request %s failed: %s: %s", spec.req_id, type(exc).__name__, exc)
                self.counters.failures += 1
                self._abort_peer(spec.xfer, f"{type(exc).__name__}: {exc}")
        self._saves = []
        for load in self._loads:
            self._release_load(load)
        self._loads = []

    def _settle(self, addr: int, ticket: Any) -> bool:
        """Let a send of a failed load end and free its buffer; False: nothing of it is reported."""
        try:
            self.dataplane.leg.wait(ticket, self.settings.timeout_s)
        except Exception:  # the load already failed; this send's outcome changes nothing
            pass
        self.dataplane.window_free(addr)
        return False

    def _abort_peer(self, xfer: XferParams, reason: str) -> None:
        try:
            self._peer_request({"op": "abort", "xfer_id": xfer.xfer_id, "reason": reason})
        except Exception:  # the DE then times out on this request, within its own bound
            pass

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._invalid_blocks = self._invalid_blocks, set()
        return bad

    # -- DE: the side channel ----------------------------------------------------------------------------------------
    def _handle(self, message: dict) -> dict:
        op = message.get("op")

        handler = {
            "status": self._on_status,
            "hello": self._on_hello,
            "plan": self._on_plan,
            "consumed": self._on_consumed,
            "rows": self._on_rows,
            "abort": self._on_abort,
        }.get(op)
        if handler is None:
            raise ProtocolError(f"unknown side-channel op {op!r}")
        return handler(message)

    def _on_hello(self, message: dict) -> dict:
        with self._lock:
            if self.dataplane is None:
                self.dataplane = open_dataplane(self.settings, DE_RANK)
            dp = self.dataplane
            if not dp.connected:
                dp.connect(message["rank_info"], tuple(message["host_mem"]))
            return {"op": "ok", "rank_info": dp.local_info(), "host_mem": list(dp.host_mem())}

    def _on_plan(self, message: dict) -> dict:
        P, H = message["prompt_tokens"], message["hit_tokens"]
        full = message["path"] == ReadPath.PE.value or H == message["load_start"]
        nbytes = max(1, self.layout.kv_bytes(P))
        lease = self.dataplane.host.allocate(message["xfer_id"], nbytes, timeout_s=self.settings.timeout_s)
        xfer = _DeXfer(
            message, lease, full_rows=full, received_end=0 if full else H, created=time.monotonic(), reads_ok=full
        )
        with self._lock:
            self._de_xfers[message["xfer_id"]] = xfer
        if not full:
            xfer.consumed = queue.Queue()
            threading.Thread(target=self._push_hits, args=(xfer,), name="adp-de-push", daemon=True).start()
        return {"op": "ok", "lease_addr": int(lease.addr)}

    def _push_hits(self, xfer: _DeXfer) -> None:
        """DE read path: read the hit blocks, then push hit layers two ahead of what the PE consumed."""
        plan, fb, lb = xfer.plan, self.layout.full_block_bytes, self.layout.layer_block_bytes
        ids = plan["store_ids"]
        first = plan["load_start"] // self.block_size
        try:
            self.store.refresh(ids)
            tickets = [self.read_queue.submit(ids[b], xfer.lease.slice(b * fb, fb).view) for b in range(len(ids))]
            for ticket in tickets:
                ticket.wait(self.settings.timeout_s)
            xfer.reads_ok = True
            leg, pushes = self.dataplane.leg, []
            for layer in range(self.layout.num_layers):
                if layer >= 2:
                    self._await_consumed(xfer, layer - 2, pushes)
                segments = [
                    Segment(xfer.lease.addr + b * fb + layer * lb, lb, (b - first) * lb) for b in range(first, len(ids))
                ]
                pushes.append(
                    leg.submit(
                        layer,
                        segments,
                        PE_RANK,
                        plan["slots"][layer % 2],
                        plan["notify_base"] + layer % 2,
                        plan["magics"][layer],
                    )
                )
            for ticket in pushes:
                leg.wait(ticket, self.settings.timeout_s)
        except Exception as error:
            log.warning(
                "DualPath: DE read path of request %s broke, the PE falls back: %s: %s",
                plan["xfer_id"],
                type(error).__name__,
                error,
            )
            if isinstance(error, ChecksumMismatch):
                self.counters.checksum_errors += 1
            self._de_fail(xfer, f"{type(error).__name__}: {error}", full=True)
            try:
                self.dataplane.leg.record(PE_RANK, plan["notify_base"] + 2, plan["abort_magic"])
            except Exception:  # the PE then times out waiting for the layer, within its bound
                pass

    def _await_consumed(self, xfer: _DeXfer, layer: int, pushes: list) -> None:
        """Wait (bounded) until the PE consumed hit layer ``layer``; a failed push ends the wait at once."""
        deadline = time.monotonic() + self.settings.timeout_s
        while True:
            for ticket in pushes:
                self.dataplane.leg.raise_if_failed(ticket)
            try:
                xfer.consumed.get(timeout=0.05)
                return
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise WaitTimeout(
                        f"the PE did not consume hit layer {layer} of request {xfer.plan['xfer_id']} "
                        f"within {self.settings.timeout_s} s"
                    ) from None

    def _de_fail(self, xfer: _DeXfer, reason: str, *, full: bool = False) -> None:
        """The DE path broke: wait for complete layers from the PE (it recomputes), or fail the receive."""
        with self._lock:
            if full:
                xfer.full_rows, xfer.received_end, xfer.reads_ok = True, 0, True
                self.counters.fallbacks += 1
            else:
                xfer.error = reason

    def _on_consumed(self, message: dict) -> dict:
        xfer = self._de_xfers.get(message["xfer_id"])
        if xfer is not None and xfer.consumed is not None:
            xfer.consumed.put(message["layer"])
        return {"op": "ok"}

    def _on_rows(self, message: dict) -> dict:
        with self._lock:
            xfer = self._de_xfers.get(message["xfer_id"])
            if xfer is None:
                raise ProtocolError(f"rows for unknown request {message['xfer_id']!r}")
            if message["full"] and not xfer.full_rows:
                xfer.full_rows, xfer.received_end, xfer.reads_ok = True, 0, True
            if message["start"] > xfer.received_end:
                xfer.error = f"rows [{message['start']}, {message['end']}) arrived after only {xfer.received_end} rows"
            xfer.received_end = max(xfer.received_end, message["end"])
        return {"op": "ok"}

    def _on_abort(self, message: dict) -> dict:
        xfer = self._de_xfers.get(message["xfer_id"])
        if xfer is not None:
            self._de_fail(xfer, f"the PE aborted: {message.get('reason')}")
        return {"op": "ok"}

    def status(self) -> dict:
        stats = self.read_queue.stats()
        token_bytes = self.layout.kv_bytes(1)
        with self._lock:
            unfinished = [x.plan["prompt_tokens"] for x in self._de_xfers.values()]
        c = self.counters
        return {
            "op": "status",
            "role": self.settings.role,
            "node": self.settings.node,
            "read_queue_tokens": stats.bytes // token_bytes,
            "read_queue_bytes": stats.bytes,
            "snic_read_bytes": stats.completed_bytes,
            "snic_read_blocks": stats.completed_requests,
            "unfinished_requests": len(unfinished) + len(self._pe_xfers),
            "unfinished_tokens": sum(unfinished) + sum(x.prompt_tokens for x in self._pe_xfers.values()),
            "loads": {"pe": c.loads_pe, "de": c.loads_de},
            "fallbacks": c.fallbacks,
            "failures": c.failures,
            "checksum_errors": c.checksum_errors,
            "persisted_blocks": c.persisted_blocks,
        }

    def _on_status(self, message: dict) -> dict:
        return self.status()

    # -- DE: receives, merge, persist --------------------------------------------------------------------------------
    def _add_recv(self, spec: RecvSpec) -> None:
        self._recvs[spec.xfer.xfer_id] = spec
        self._recv_since[spec.xfer.xfer_id] = time.monotonic()

    def _complete_recvs(self) -> None:
        now = time.monotonic()
        for xfer_id, spec in list(self._recvs.items()):
            with self._lock:
                xfer = self._de_xfers.get(xfer_id)
            if xfer is None:
                if now - self._recv_since[xfer_id] > self.settings.timeout_s:
                    self._end_recv(xfer_id, spec, None, failed=True)
                continue
            if xfer.error is not None or now - xfer.created > self.settings.timeout_s:
                self._end_recv(xfer_id, spec, xfer, failed=True)
            elif xfer.reads_ok and xfer.received_end >= xfer.plan["prompt_tokens"]:  # the PE is done with it
                self._merge(spec, xfer)
                self._end_recv(xfer_id, spec, xfer, failed=False)

    def _end_recv(self, xfer_id: str, spec: RecvSpec, xfer: _DeXfer | None, *, failed: bool) -> None:
        self._recvs.pop(xfer_id)
        self._recv_since.pop(xfer_id)
        if xfer is not None:
            with self._lock:
                self._de_xfers.pop(xfer_id, None)
            xfer.lease.release()
        if failed:
            why = "no plan from the PE" if xfer is None else (xfer.error or "timed out")
            log.warning("DualPath: receive of request %s failed: %s", spec.req_id, why)
            self.counters.failures += 1
            self._failed_recving.add(spec.req_id)
        self._finished_recving.add(spec.req_id)

    def _merge(self, spec: RecvSpec, xfer: _DeXfer) -> None:
        """Write the request's rows ``[spec.computed, spec.end)`` into the DE's paged blocks, in token order.

        The lease holds the rows of all ``P`` prompt tokens: ``[L, P, C]`` (complete layers from the PE), or on the
        DE path the hit Full Blocks ``[H / T, L, T, C]`` then the PE's new rows ``[L, P - H, C]``.
        """
        C, L, P = self.layout.token_bytes, self.layout.num_layers, xfer.plan["prompt_tokens"]
        data = xfer.lease.tensor
        H = 0 if xfer.full_rows else xfer.plan["hit_tokens"]
        start, end = spec.computed, spec.end
        for layer in range(L):
            cache = self.caches[layer]
            if start < min(H, end):
                blocks = xfer.lease.full_blocks(self.layout, H // self.block_size)
                hit = self.layout.layer_rows(blocks, layer)[start : min(H, end)]
                self.adapter.write_tokens(cache, spec.block_ids, start, hit)
            new_from = max(start, H)
            if new_from < end:
                base = L * H * C + layer * (P - H) * C
                rows = data[base + (new_from - H) * C : base + (end - H) * C].view(end - new_from, C)
                self.adapter.write_tokens(cache, spec.block_ids, new_from, rows)

    def _persist(self, spec: PersistSpec) -> None:
        """Copy a finished request's new full blocks out of the cache now; write them to the store behind."""
        T = self.block_size
        payloads = []
        for i in range(spec.first_block, len(spec.store_ids)):
            layers = [self.adapter.read_tokens(cache, spec.block_ids, i * T, (i + 1) * T) for cache in self.caches]
            payloads.append((i, torch.stack(layers).contiguous()))
        self._writes.append((spec.req_id, self._writer.submit(self._write_blocks, spec, payloads)))

    def _write_blocks(self, spec: PersistSpec, payloads: list) -> None:
        try:
            for i, payload in payloads:
                parent = spec.store_ids[i - 1] if i > 0 else None
                try:
                    if self.store.write_block(spec.store_ids[i], parent, payload):
                        self.counters.persisted_blocks += 1
                except AdpError:
                    self.counters.failures += 1
                    return  # the chain is broken here: later blocks would be unreachable
                self.announcements.withdraw([spec.store_ids[i]])
        finally:
            self.announcements.withdraw(spec.store_ids[spec.first_block :])  # none is awaited any longer

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call."""
        self._complete_recvs()
        # a persisted request is reported once its blocks are stored, so its next turn finds them
        done = [(req_id, f) for req_id, f in self._writes if f.done()]
        self._writes = [(req_id, f) for req_id, f in self._writes if not f.done()]
        self._finished_sending.update(req_id for req_id, _ in done)
        for req_id in finished_req_ids:  # a finished PE request sends nothing more
            self._pe_xfers.pop(self._pe_xfer_of.pop(req_id, None), None)
        sending, self._finished_sending = self._finished_sending, set()
        recving, self._finished_recving = self._finished_recving, set()
        failed, self._failed_recving = self._failed_recving, set()
        return sending, recving, failed
