"""The DE's half of the worker: the side channel's request handlers, the hit-layer pusher, receives and the merge.

A DE serves any number of PEs. Each PE says ``hello`` once (its side-channel address and device id): the DE makes
that pair's communicator (:class:`~ascend_dualpath.dualpath.dataplane.PairLink`) and every request the
PE plans afterwards uses it. All PEs' leases come from the DE's one registered host buffer.

Tensor parallelism: a DE rank pairs with each PE rank that is a source of its rows (``KVShard.sources``); a pair
moves the smaller of the two ranks' shares (its plan's lease, reads and pushes are in that share's layout). Where a
PE of a larger size gives this rank several source ranks, each sends its own plan (transfer id ``<request>@<PE
rank>``, :func:`~ascend_dualpath.dualpath.messages.pair_id`), this rank reads only that PE rank's heads for it on the
DE path, and the request's receive ends once every source's plan received its rows: their columns are merged into
the cache rows at once.

Per request (``plan``), the lease holds ``L x P x C`` bytes: complete layers ``[L, P, C]`` when the PE sends them
(PE read path, or after any fallback), else the hit Full Blocks ``[H / T, L, T, C]`` then the PE's new rows
``[L, P - H, C]``. The DE reads the hit blocks the PE does not (all of them on the DE read path; on a split the PE
reads ``pe_blocks`` of them, writes them into the lease's hit-block area and says ``hits``) as soon as the plan
arrives, which is before the PE's step takes the request (the read before the batch): once read it writes the
plan's ``ready_magic`` into the PE's notify slot ``notify_base``, and waits (at most ``hold_s``) for the PE's
``start``, which names the two window slots; then it pushes the hit layers of its own half into them, two layers
ahead of what the PE consumed. A request's receive timeout counts from its ``start``.

A lease goes back to the host buffer only when nothing can still write into it or read from it: the DE's own
storage reads and pushes (the pusher's, waited for with a bound) and the PE's RDMA writes (its new rows, a split's
hit half), which the DE cannot stop. The rule: when the request lets go of a lease the pusher still uses (a
receive ending, a fallback), the pusher retires it when it ends; a lease is released if every read and push into
or from it ended and the PE can no longer write into it (the receive completed: every row arrived; or, on a
fallback, the PE reports its writes into the old lease ended), else it is quarantined
(:mod:`~ascend_dualpath.dualpath.quarantine`; ``quarantined_leases`` in ``status``, logged) until the
reads and pushes ended and the PE answers ``writes_ended`` for the request. A failed or timed-out receive therefore
always quarantines its lease first: the PE may still be sending into it. The DE answers ``pushes_ended`` the same
way for the PE's window slots.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any

import torch

from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.dataplane import NOTIFY_SLOTS_PER_XFER, NUM_NOTIFY_SLOTS, PE_RANK, Dataplane, PairLink
from ascend_dualpath.dualpath.lease import LeaseLayout
from ascend_dualpath.dualpath.quarantine import Quarantine, tickets_ended
from ascend_dualpath.dualpath.scheduler import ReadPath
from ascend_dualpath.dualpath.settings import ConnectorSettings
from ascend_dualpath.dualpath.side_channel import expect, request_once
from ascend_dualpath.dualpath.specs import RecvSpec
from ascend_dualpath.errors import AdmissionDeferred, BoundsError, ChecksumMismatch, ProtocolError, WaitTimeout
from ascend_dualpath.kv.layout import BLOCK_ID_BYTES, KVLayout, KVShard
from ascend_dualpath.kv.read_queue import ReadQueue
from ascend_dualpath.kv.store import LocalBlockStore
from ascend_dualpath.transport.engine import NOTIFY_VALUE_MAX

log = logging.getLogger(__name__)
CONSUMED_POLL_S = 0.05  # how often the pusher, waiting for the PE, looks at its stop flag and its pushes


class _PushStopped(Exception):
    """The PE fell back (``fallback``): the pusher ends without raising the abort flag."""


@dataclasses.dataclass
class _DeXfer:
    """DE-side state of one request: the plan from the PE, the pair's link, the lease, what has arrived."""

    plan: m.Plan
    link: PairLink
    lease: Any
    full_rows: bool
    received_end: int
    created: float  # the plan's arrival, then its start: the receive's timeout counts from there
    reads_ok: bool = False  # the DE's own hit reads (and pushes) are done
    hits_ok: bool = True  # a split's PE half has landed in the lease
    error: str | None = None
    consumed: queue.Queue | None = None  # layers the PE consumed (pusher)
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)  # set under push_lock
    push_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    quiet: threading.Event = dataclasses.field(default_factory=threading.Event)  # no push in flight (set: reading)
    pusher: threading.Thread | None = None
    pusher_done: bool = False  # under the DecodeSide's lock: the pusher no longer touches its lease
    read_lease: Any = None  # the lease the pusher reads into and pushes from (the plan's, on a DE read)
    reads: list = dataclasses.field(default_factory=list)  # the pusher's storage read tickets
    reads_ended: bool = True  # under the lock, once the pusher is done: none of its reads or pushes is in flight
    pushes: list = dataclasses.field(default_factory=list)  # the pusher's push tickets (appended by the pusher)
    peer_done: bool | None = None  # under the lock: the request let go of read_lease; whether the PE writes no more
    slots: list[int] = dataclasses.field(default_factory=list)  # the PE's two window slots, from its start
    started: threading.Event = dataclasses.field(default_factory=threading.Event)  # the PE's step took the request
    shard: KVShard | None = None  # the pair's rows: the smaller of the two ranks' shards (the lease's layout)
    base: str = ""  # the request's transfer id (the plan's, less ``@<PE rank>`` where this DE rank has several)
    sources: int = 1  # how many PE ranks' pairs make up the request's receive here

    @property
    def layout(self) -> KVLayout:
        return self.shard.local

    def __post_init__(self) -> None:
        self.quiet.set()


def check_plan(plan: m.Plan, layout: KVLayout, pushes: bool) -> None:
    """Refuse a plan whose numbers do not describe one request of ``layout`` before anything is leased or read:
    token counts and block alignment, one 16-byte store id per hit block, the PE's share, and when the DE pushes
    (``pushes``) a notify group inside the link's slots and one valid notify value per layer, for the abort and
    for the reads being done. BoundsError names the field, its value and the limit."""
    T, P, H, start = layout.block_tokens, plan.prompt_tokens, plan.hit_tokens, plan.load_start
    where = f"plan of request {plan.xfer_id!r}"
    if plan.path not in (ReadPath.PE.value, ReadPath.DE.value):
        raise BoundsError(f"{where}: path must be 'pe' or 'de', got {plan.path!r}")
    if not (1 <= P and 0 <= start <= H <= P and H % T == 0 and start % T == 0):
        raise BoundsError(f"{where}: load_start {start} <= hit_tokens {H} <= prompt_tokens {P} (>= 1), both "
                          f"multiples of the block's {T} tokens")  # fmt: skip
    if len(plan.store_ids) != H // T or any(len(i) != BLOCK_ID_BYTES for i in plan.store_ids):
        raise BoundsError(f"{where}: {H // T} store ids of {BLOCK_ID_BYTES} bytes for {H} hit tokens, got "
                          f"{len(plan.store_ids)}")  # fmt: skip
    if not 0 <= plan.pe_blocks <= (H - start) // T:
        raise BoundsError(f"{where}: pe_blocks {plan.pe_blocks} not in [0, {(H - start) // T}]")
    if pushes:
        _check_notify(plan, layout, where)


def check_start(start: m.Start, plan: m.Plan, layout: KVLayout, pe_window: tuple[int, int]) -> None:
    """Refuse a start whose slots are not two inside the PE's window (``(addr, size)``), each holding the DE's half
    of a layer of ``plan``; BoundsError names them and the window."""
    base, size = pe_window
    slot_bytes = (
        (plan.hit_tokens - plan.load_start) // layout.block_tokens - plan.pe_blocks
    ) * layout.layer_block_bytes
    if len(start.slots) != 2 or any(not (base <= a and a + slot_bytes <= base + size) for a in start.slots):
        raise BoundsError(f"start of request {plan.xfer_id!r}: two slots of {slot_bytes} bytes inside the PE's window "
                          f"[{base:#x}, {base + size:#x}), got {[hex(a) for a in start.slots]}")  # fmt: skip


def _check_notify(plan: m.Plan, layout: KVLayout, where: str) -> None:
    if not 0 <= plan.notify_base <= NUM_NOTIFY_SLOTS - NOTIFY_SLOTS_PER_XFER:
        raise BoundsError(f"{where}: notify_base {plan.notify_base} not in "
                          f"[0, {NUM_NOTIFY_SLOTS - NOTIFY_SLOTS_PER_XFER}]")  # fmt: skip
    values = [*plan.magics, plan.abort_magic, plan.ready_magic]
    if len(plan.magics) != layout.num_layers or any(not 1 <= v <= NOTIFY_VALUE_MAX for v in values):
        raise BoundsError(f"{where}: one notify value in [1, {NOTIFY_VALUE_MAX}] per layer ({layout.num_layers}) "
                          f"and for the abort and the reads' end, got {len(plan.magics)} layers")  # fmt: skip


class DecodeSide:
    """The DE's requests from all its PEs. The worker owns it and binds the caches once vLLM has made them.

    Parameters
    ----------
    settings, store, read_queue :
        The worker's (the read queue is the DE node's storage NIC; the store reads the shard's bytes only).
    shard : KVShard
        What this tensor-parallel rank holds of the model's rows (``shard.full`` for the hello's digest,
        ``shard.local`` its own rows, :attr:`layout`).
    counters :
        The worker's ``Counters``; this side counts fallbacks, failures and checksum errors there.
    quarantine :
        The worker's quarantine, where leases a late write may still reach wait.
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        shard: KVShard,
        store: LocalBlockStore,
        read_queue: ReadQueue,
        counters: Any,
        quarantine: Quarantine,
    ) -> None:
        self.settings, self.shard, self.layout, self.store = settings, shard, shard.local, store
        self.read_queue, self.counters, self.quarantine = read_queue, counters, quarantine
        self._pushing: dict[str, _DeXfer] = {}  # xfer_id -> its pusher's request, until its pushes are seen ended
        self.dataplane: Dataplane | None = None
        self.caches: list = []
        self.adapter = None
        self._lock = threading.Lock()
        self._xfers: dict[str, _DeXfer] = {}
        self._recvs: dict[str, RecvSpec] = {}
        self._recv_since: dict[str, float] = {}
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self._pe_shards: dict[str, KVShard] = {}  # PE side channel -> the PE rank's shard, from its hello

    def bind(self, caches: list, adapter: Any, dataplane: Dataplane) -> None:
        self.caches, self.adapter, self.dataplane = caches, adapter, dataplane

    @property
    def block_size(self) -> int:
        return self.layout.block_tokens

    def handlers(self) -> dict:
        """The side-channel ops a DE answers (``status`` is the worker's)."""
        return {
            m.Hello: self._on_hello,
            m.Plan: self._on_plan,
            m.Start: self._on_start,
            m.Consumed: self._on_consumed,
            m.Hits: self._on_hits,
            m.Rows: self._on_rows,
            m.Fallback: self._on_fallback,
            m.Abort: self._on_abort,
            m.PushesEnded: self._on_pushes_ended,
        }

    @staticmethod
    def _hit_lease(xfer: _DeXfer) -> LeaseLayout:
        """The lease of a plan whose hit blocks this DE (or a split's PE half) reads: hit blocks then new rows."""
        return LeaseLayout(xfer.layout, xfer.plan.prompt_tokens, xfer.plan.hit_tokens)

    def unfinished_tokens(self) -> list[int]:
        """Prompt tokens of each request planned here and not yet received."""
        with self._lock:
            return list({x.base: x.plan.prompt_tokens for x in self._xfers.values()}.values())

    def reading(self) -> list[str]:
        """The transfers whose hit reads through this DE's storage NIC are queued or running."""
        with self._lock:
            # from the plan on (the pusher submits its reads a moment later) until they ended
            return list(
                dict.fromkeys(x.base for x in self._xfers.values() if x.pusher and not (x.reads_ok or x.pusher_done))
            )

    # -- handlers --------------------------------------------------------------------------------------------------
    def _on_hello(self, message: m.Hello) -> m.Welcome:
        """A PE's first message: check that it speaks this version, serves this model and holds what this rank
        holds, then make (or, after its restart, remake) the pair's communicator."""
        dp, s = self.dataplane, self.settings
        if dp is None:
            raise ProtocolError("hello before the DE registered its KV caches")
        m.check_peer(dp.compat(self.shard.full), message.speaks, f"DE {s.node}", f"PE {message.pe}")
        m.check_tp(self.shard, message.tp_size, message.tp_rank, f"DE {s.node}", f"PE {message.pe}", decode=True)
        link = dp.new_link(message.pe, message.device_id)
        link.connect(message.rank_info, message.host_mem)
        self._pe_shards[message.pe] = self.shard.full.shard(message.tp_size, message.tp_rank)
        return m.Welcome(rank_info=link.local_info(), host_mem=dp.host_mem(), tp_size=s.tp_size, tp_rank=s.tp_rank)

    def _xfer(self, message: m.Message) -> _DeXfer | None:
        with self._lock:
            return self._xfers.get(message.xfer_id)

    def _on_plan(self, message: m.Plan) -> m.Planned:
        link = self.dataplane.links.get(message.pe)
        if link is None or not link.connected:
            raise ProtocolError(f"plan of request {message.xfer_id!r} from {message.pe!r}, which sent no hello")
        P, H, xfer_id = message.prompt_tokens, message.hit_tokens, message.xfer_id
        full = message.path == ReadPath.PE.value or H == message.load_start
        pe_shard = self._pe_shards[message.pe]
        shard = pe_shard if len(pe_shard.units) < len(self.shard.units) else self.shard
        check_plan(message, shard.local, pushes=not full)
        base = self._base_id(xfer_id, pe_shard)
        with self._lock:
            in_use = xfer_id in self._xfers
        if in_use:  # refused, never overwritten: the earlier plan's lease may be written into right now
            raise ProtocolError(f"plan of request {xfer_id!r}: that transfer id is already planned here")
        nbytes = LeaseLayout.complete(shard.local, P).nbytes
        try:
            lease = self.dataplane.host.allocate(xfer_id, nbytes, timeout_s=0 if message.defer else None)
        except AdmissionDeferred:
            if message.defer:  # the PE tries again at a later step; nothing is planned here
                return m.Planned(lease_addr=0, deferred=True)
            raise
        xfer = _DeXfer(
            message,
            link,
            lease,
            full_rows=full,
            received_end=0 if full else H,
            created=time.monotonic(),
            reads_ok=full,
            hits_ok=full or not message.pe_blocks,
            shard=shard,
            base=base,
            sources=len(self.shard.sources(pe_shard.size)),
        )
        with self._lock:
            if xfer_id in self._xfers:  # a second plan of the id won the race: this one takes nothing
                lease.release()
                raise ProtocolError(f"plan of request {xfer_id!r}: that transfer id is already planned here")
            self._xfers[xfer_id] = xfer
        if not full:
            xfer.consumed, xfer.read_lease, xfer.reads_ended = queue.Queue(), lease, False
            with self._lock:
                self._pushing[message.xfer_id] = xfer
            xfer.pusher = threading.Thread(target=self._push_hits, args=(xfer,), name="adp-de-push", daemon=True)
            xfer.pusher.start()
        return m.Planned(lease_addr=int(lease.addr))

    def _base_id(self, xfer_id: str, pe: KVShard) -> str:
        """The request's transfer id of a plan from PE rank ``pe`` (:func:`messages.pair_id`); ProtocolError if the
        plan's id does not name that PE rank where it must."""
        paired = m.pair_id("", pe, self.shard)
        if not xfer_id.endswith(paired) or len(xfer_id) == len(paired):
            raise ProtocolError(f"plan of request {xfer_id!r} from PE rank {pe.rank} of {pe.size}: this DE rank takes "
                                f"rows from several PE ranks, so the transfer id must end in {paired!r}")  # fmt: skip
        return xfer_id[: len(xfer_id) - len(paired)]

    def _on_start(self, message: m.Start) -> m.Ok:
        """The PE's step takes the request: the receive's timeout counts from now, and when this DE pushes hit
        layers they go into ``slots`` (checked against the PE's window; none otherwise)."""
        xfer = self._xfer(message)
        if xfer is None:
            raise ProtocolError(f"start of request {message.xfer_id!r}, which has no plan here")
        if xfer.started.is_set():
            raise ProtocolError(f"start of request {message.xfer_id!r}: it was started already")
        if not xfer.full_rows:  # this DE pushes hit layers (no fallback since the plan)
            check_start(message, xfer.plan, xfer.layout, xfer.link.peer_window())
        elif message.slots:
            raise BoundsError(f"start of request {message.xfer_id!r}: no slots for a plan this DE pushes nothing for, "
                              f"got {len(message.slots)}")  # fmt: skip
        with self._lock:
            xfer.slots, xfer.created = list(message.slots), time.monotonic()
        xfer.started.set()
        return m.Ok()

    def _on_consumed(self, message: m.Consumed) -> m.Ok:
        if not 0 <= message.layer < self.layout.num_layers:
            raise BoundsError(f"consumed layer {message.layer} of request {message.xfer_id!r}: layers are "
                              f"[0, {self.layout.num_layers})")  # fmt: skip
        xfer = self._xfer(message)
        if xfer is not None and xfer.consumed is not None:
            xfer.consumed.put(message.layer)
        return m.Ok()

    def _on_hits(self, message: m.Hits) -> m.Ok:
        """A split's PE half (its hit blocks) is in the lease."""
        xfer = self._xfer(message)
        if xfer is None:
            raise ProtocolError(f"hits for unknown request {message.xfer_id!r}")
        xfer.hits_ok = True
        return m.Ok()

    def _on_rows(self, message: m.Rows) -> m.Ok:
        with self._lock:
            xfer = self._xfers.get(message.xfer_id)
            if xfer is None:
                raise ProtocolError(f"rows for unknown request {message.xfer_id!r}")
            if not 0 <= message.start <= message.end <= xfer.plan.prompt_tokens:
                raise BoundsError(f"rows [{message.start}, {message.end}) of request {message.xfer_id!r}: its prompt "
                                  f"has {xfer.plan.prompt_tokens} tokens")  # fmt: skip
            if message.full and not xfer.full_rows:
                xfer.full_rows, xfer.received_end, xfer.reads_ok, xfer.hits_ok = True, 0, True, True
            if message.start > xfer.received_end:
                xfer.error = f"rows [{message.start}, {message.end}) arrived after only {xfer.received_end} rows"
            xfer.received_end = max(xfer.received_end, message.end)
        return m.Ok()

    def _on_fallback(self, message: m.Fallback) -> m.Planned:
        """The PE's load failed (it recomputes): stop pushing into its slots, then take complete layers.

        Replies once no push will start and the pusher's bounded waits for those in flight ended: ``pushes_ended``
        says whether they all did, so the PE frees its slots only then (else it quarantines them). The complete
        layers go into a fresh lease (its address is the reply), because reads of the DE's half may still be landing
        in the old one (the pusher retires it when they are done). ``settled`` (from the PE): its writes into the
        old lease ended; without it the old lease is quarantined.
        """
        xfer = self._xfer(message)
        if xfer is None:
            raise ProtocolError(f"fallback for unknown request {message.xfer_id!r}")
        with xfer.push_lock:
            xfer.stop.set()
        if not xfer.quiet.wait(self.settings.timeout_s):
            raise WaitTimeout(f"pushes of request {message.xfer_id!r} in flight after {self.settings.timeout_s} s")
        nbytes = LeaseLayout.complete(xfer.layout, xfer.plan.prompt_tokens).nbytes
        lease = self.dataplane.host.allocate(message.xfer_id, nbytes, timeout_s=self.settings.timeout_s)
        with self._lock:
            old, xfer.lease = xfer.lease, lease
            xfer.full_rows, xfer.received_end, xfer.reads_ok, xfer.hits_ok = True, 0, True, True
            self.counters.fallbacks += 1
        self._let_go(xfer, old, message.settled, "the PE's writes into it may not have ended")
        pushes_ended = all(t.done() for t in xfer.pushes)  # quiet: the pusher appends no more
        return m.Planned(lease_addr=int(lease.addr), pushes_ended=pushes_ended)

    def _on_abort(self, message: m.Abort) -> m.Ok:
        """The PE gave the request up: its receive fails; a plan no receive waits for yet (the PE dropped a load
        read ahead of its step) is let go of at once, its lease released when the DE's reads into it ended and
        (``settled``) the PE wrote nothing into it."""
        xfer = self._xfer(message)
        if xfer is None:
            return m.Ok()
        self._de_fail(xfer, f"the PE aborted: {message.reason}")
        with self._lock:
            orphan = xfer.base not in self._recvs and self._xfers.pop(message.xfer_id, None) is xfer
        if orphan:
            with xfer.push_lock:  # once set, no signal of the plan lands in the PE's notify group, which it frees next
                xfer.stop.set()
            self.read_queue.cancel(list(xfer.reads))  # queued reads end now; started ones run to their end
            self._let_go(xfer, xfer.lease, message.settled, "the PE aborted it: its writes may not have ended")
        return m.Ok()

    def _on_pushes_ended(self, message: m.PushesEnded) -> m.Ended:
        """Whether none of this DE's pushes of the request into the PE's slots is still in flight (a request it never
        pushed for, or whose pushes all ended, has none)."""
        with self._lock:
            xfer = self._pushing.get(message.xfer_id)
            ended = xfer is None or (xfer.pusher_done and all(t.done() for t in xfer.pushes))
            if ended:
                self._pushing.pop(message.xfer_id, None)
        return m.Ended(ended=ended)

    # -- the pusher --------------------------------------------------------------------------------------------------
    @staticmethod
    def _signal(xfer: _DeXfer, slot: int, magic: int, unless_started: bool = False) -> None:
        """Write ``magic`` into the PE's notify ``slot`` unless the PE let go of the plan (``stop``, set under
        ``push_lock``): the PE frees the plan's notify group once its abort was answered, and a later request's
        signal in that group must not be overwritten by this one."""
        with xfer.push_lock:
            if xfer.stop.is_set() or (unless_started and xfer.started.is_set()):
                return  # a PE that already started the request does not poll for its ready signal
            xfer.link.leg.record(PE_RANK, slot, magic)

    def _push_hits(self, xfer: _DeXfer) -> None:
        """Read the DE's hit blocks, say so (``ready_magic``), wait for the PE's ``start``, then push its half's hit
        layers two ahead of what the PE consumed.

        On a failure the DE raises the request's abort flag; the PE then falls back (``fallback``).
        """
        plan, lease, pushes = xfer.plan, xfer.read_lease, xfer.pushes
        try:
            self._read_hits(xfer, lease)
            xfer.reads_ok = True
            self._signal(xfer, plan.notify_base, plan.ready_magic, unless_started=True)
            self._await_start(xfer)
            self._push_layers(xfer, lease, pushes)
        except _PushStopped:
            pass
        except Exception as error:
            self._settle(xfer.link, pushes)  # nothing may land in the PE's slots once it frees them
            log.warning(
                "DualPath: DE read path of request %s broke, the PE falls back: %s: %s",
                plan.xfer_id,
                type(error).__name__,
                error,
            )
            if isinstance(error, ChecksumMismatch):
                self.counters.checksum_errors += 1
            try:
                self._signal(xfer, plan.notify_base + 2, plan.abort_magic)
            except Exception:  # the PE then times out waiting for the layer, within its bound
                pass
        finally:
            self._settle(xfer.link, pushes)
            xfer.quiet.set()
            with self._lock:
                xfer.pusher_done = True
                if all(t.done() for t in pushes):
                    self._pushing.pop(plan.xfer_id, None)
                xfer.reads_ended = tickets_ended(xfer.reads, xfer.pushes)
                peer_done = xfer.peer_done
            if peer_done is not None:  # the request let go of the lease while this pusher still used it
                why = "the PE may still write into it" if xfer.reads_ended else "reads or pushes outlived their wait"
                self._retire(xfer, lease, peer_done, why)

    def _read_hits(self, xfer: _DeXfer, lease: Any) -> None:
        """Read every hit block but the PE's half (``[first, first + pe_blocks)``) into the lease's hit area; a
        corrupted block leaves the store. A read whose wait expired may still be landing (``xfer.reads``)."""
        plan, fb, hits = xfer.plan, xfer.layout.full_block_bytes, self._hit_lease(xfer)
        ids = plan.store_ids
        first = plan.load_start // self.block_size
        mine = [b for b in range(len(ids)) if not first <= b < first + plan.pe_blocks]
        self.store.refresh(ids)
        shard = None if xfer.shard == self.shard else xfer.shard  # the PE rank's heads only: one copy per instance
        # with several source PE ranks, the pair of the first counts the blocks; the others read other heads of them
        block = shard is None or shard.rank == min(source for source, _ in self.shard.sources(shard.size))
        tickets = xfer.reads = [
            self.read_queue.submit(ids[b], lease.slice(hits.block_offset(b), fb).view, shard, block) for b in mine
        ]
        corrupt, first_error = None, None
        for b, ticket in zip(mine, tickets, strict=True):
            try:
                ticket.wait(self.settings.timeout_s)
            except ChecksumMismatch as error:
                corrupt = corrupt or (b, error)
            except Exception as error:
                first_error = first_error or error
        if corrupt is not None:  # the root cause: later blocks may fail only because this one is bad
            self.store.remove(ids[corrupt[0]])  # and its descendants: persisted again when the request finishes
            raise corrupt[1]
        if first_error is not None:
            raise first_error

    def _await_start(self, xfer: _DeXfer) -> None:
        """Wait (at most ``hold_s``) for the PE's step to take the request; a stop ends the wait at once."""
        deadline = time.monotonic() + self.settings.hold_s
        while not xfer.started.wait(CONSUMED_POLL_S):
            if xfer.stop.is_set():
                raise _PushStopped()
            if time.monotonic() > deadline:
                raise WaitTimeout(
                    f"the PE's step did not take request {xfer.plan.xfer_id} within hold_s={self.settings.hold_s} s "
                    "of its hit reads"
                )

    def _push_layers(self, xfer: _DeXfer, lease: Any, pushes: list) -> None:
        plan, hits, leg = xfer.plan, self._hit_lease(xfer), xfer.link.leg
        first = plan.load_start // self.block_size + plan.pe_blocks
        last = len(plan.store_ids)
        for layer in range(self.layout.num_layers):
            if layer >= 2:
                self._await_consumed(xfer, layer - 2, pushes)
            segments = hits.hit_layer_segments(lease.addr, layer, first, last)
            with xfer.push_lock:  # a fallback sets stop under it: no push starts after the PE let go of its slots
                if xfer.stop.is_set():
                    raise _PushStopped()
                xfer.quiet.clear()
                pushes.append(
                    leg.submit(
                        layer,
                        segments,
                        PE_RANK,
                        xfer.slots[layer % 2],
                        plan.notify_base + layer % 2,
                        plan.magics[layer],
                    )
                )
        for ticket in pushes:
            leg.wait(ticket, self.settings.timeout_s)

    def _await_consumed(self, xfer: _DeXfer, layer: int, pushes: list) -> None:
        """Wait (bounded) until the PE consumed hit layer ``layer``; a failed push or a stop ends the wait at once."""
        deadline = time.monotonic() + self.settings.timeout_s
        while True:
            for ticket in pushes:
                xfer.link.leg.raise_if_failed(ticket)
            if xfer.stop.is_set():
                raise _PushStopped()
            try:
                xfer.consumed.get(timeout=CONSUMED_POLL_S)
                return
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise WaitTimeout(
                        f"the PE did not consume hit layer {layer} of request {xfer.plan.xfer_id} "
                        f"within {self.settings.timeout_s} s"
                    ) from None

    def _settle(self, link: PairLink, pushes: list) -> None:
        for ticket in pushes:
            try:
                link.leg.wait(ticket, self.settings.timeout_s)
            except Exception:  # the request already failed; this push's outcome changes nothing
                pass

    def _let_go(self, xfer: _DeXfer, lease: Any, peer_done: bool, why: str) -> None:
        """The request no longer uses ``lease``: retire it now, or leave it to the pusher if it still uses it.

        ``peer_done``: the PE can no longer write into it.
        """
        with self._lock:
            if lease is xfer.read_lease and not xfer.pusher_done:
                xfer.peer_done = peer_done
                return
            reads_ended = lease is not xfer.read_lease or xfer.reads_ended
        if not reads_ended:
            why = "the DE's reads or pushes outlived their wait"
        self._retire(xfer, lease, peer_done, why)

    def _retire(self, xfer: _DeXfer, lease: Any, peer_done: bool, why: str) -> None:
        """Release ``lease`` now if nothing can reach it, else quarantine it until the DE's own reads and pushes
        from it ended and (unless ``peer_done``) the PE answers that its writes of the request ended."""
        mine = lease is xfer.read_lease
        xfer_id, pe, timeout_s = xfer.plan.xfer_id, xfer.plan.pe, self.settings.timeout_s
        framing = self.settings.side_framing

        def ended() -> bool:
            if mine and not tickets_ended(xfer.reads, xfer.pushes):
                return False
            return (
                peer_done
                or expect(request_once(pe, m.WritesEnded(xfer_id=xfer_id), timeout_s, **framing), m.Ended).ended
            )

        safe = peer_done and (not mine or xfer.reads_ended)
        self.quarantine.retire("leases", f"lease of request {xfer_id}", lease.nbytes, lease.release, safe, ended, why)

    def _de_fail(self, xfer: _DeXfer, reason: str) -> None:
        """Fail the receive (vLLM recomputes the prompt on the DE or fails the request)."""
        with self._lock:
            xfer.error = reason

    # -- receives and the merge ------------------------------------------------------------------------------------
    def add_recv(self, spec: RecvSpec) -> None:
        """Take a request's receive; a second request on a transfer id that has one fails at once (vLLM then
        recomputes it or fails it): two requests must never read one lease's rows."""
        xfer_id = spec.xfer.xfer_id
        with self._lock:
            taken = xfer_id in self._recvs
            if not taken:
                self._recvs[xfer_id] = spec
                self._recv_since[xfer_id] = time.monotonic()
        if taken:
            log.warning("DualPath: request %s refused: transfer id %r is already in use here", spec.req_id, xfer_id)
            if spec.report:
                self.counters.failures += 1
                self.failed_recving.add(spec.req_id)
                self.finished_recving.add(spec.req_id)

    def complete_recvs(self, drains_only: bool = False) -> None:
        """End every receive whose rows all arrived (merge), failed or timed out; then expire orphan plans.

        ``drains_only``: only the receives vLLM waits for nothing from (``report`` False: nothing to merge or
        report), which ``status`` settles too: vLLM may have no step left to run (the request already ended)."""
        now = time.monotonic()
        with self._lock:  # a step and status both end receives: each looks at what the other left
            recvs = [(xfer_id, spec) for xfer_id, spec in self._recvs.items() if not (drains_only and spec.report)]
        for xfer_id, spec in recvs:
            self._complete_recv(xfer_id, spec, now)
        self.expire_plans()

    def _complete_recv(self, xfer_id: str, spec: RecvSpec, now: float) -> None:
        """End one receive if its plans (one per source PE rank) all received their rows (merge), or one failed or
        timed out, or no plan came within ``timeout_s``."""
        with self._lock:
            if self._recvs.get(xfer_id) is not spec:
                return  # the other thread ended it meanwhile
            xfers, since = self._group(xfer_id), self._recv_since[xfer_id]
        if not xfers:
            if now - since > self.settings.timeout_s:
                self._end_recv(xfer_id, spec, [], failed=True)
            return
        for xfer in xfers:
            if xfer.plan.prompt_tokens != spec.prompt_tokens:
                xfer.error = (
                    f"the plan is for {xfer.plan.prompt_tokens} prompt tokens, the request has {spec.prompt_tokens}"
                )
        if any(xfer.error is not None or self._overdue(xfer, now) for xfer in xfers):
            self._end_recv(xfer_id, spec, xfers, failed=True)
        elif len(xfers) == xfers[0].sources and all(xfer.reads_ok and self._rows_ended(xfer) for xfer in xfers):
            if spec.report:
                self._merge(spec, xfers)
            self._end_recv(xfer_id, spec, xfers, failed=False)

    def _group(self, xfer_id: str) -> list[_DeXfer]:
        """The plans (one per source PE rank) of the request ``xfer_id``; under the lock."""
        return [xfer for xfer in self._xfers.values() if xfer.base == xfer_id]

    def _overdue(self, xfer: _DeXfer, now: float) -> bool:
        """A plan the PE's step has not taken within ``hold_s`` of its arrival, or a started one not received within
        ``timeout_s`` of its start."""
        limit = self.settings.timeout_s if xfer.started.is_set() else self.settings.hold_s
        return now - xfer.created > limit

    def expire_plans(self) -> int:
        """Let go of plans no request took in time (:meth:`_overdue`: the DE refused the request, or the client
        went away before vLLM scheduled it); returns how many. Called each step and on ``status``, so an idle DE
        gives their leases back too."""
        now = time.monotonic()
        with self._lock:
            expired = [x for x in self._xfers.values() if x.base not in self._recvs and self._overdue(x, now)]
            for xfer in expired:
                del self._xfers[xfer.plan.xfer_id]
        for xfer in expired:
            log.warning("DualPath: plan of request %s expired: no request took it", xfer.plan.xfer_id)
            self.counters.expired_plans += 1
            xfer.stop.set()
            self._let_go(xfer, xfer.lease, self._rows_ended(xfer), "no request took it: the PE may still write")
        return len(expired)

    @staticmethod
    def _rows_ended(xfer: _DeXfer) -> bool:
        """Every row the PE sends has arrived: it writes nothing more into the lease."""
        return xfer.error is None and xfer.hits_ok and xfer.received_end >= xfer.plan.prompt_tokens

    def _end_recv(self, xfer_id: str, spec: RecvSpec, xfers: list[_DeXfer], *, failed: bool) -> None:
        with self._lock:
            if self._recvs.get(xfer_id) is not spec:
                return  # the other thread (a step, or status settling a drain) ended it first
            self._recvs.pop(xfer_id)
            self._recv_since.pop(xfer_id)
            for xfer in xfers:
                self._xfers.pop(xfer.plan.xfer_id, None)
        for xfer in xfers:
            xfer.stop.set()
            self._let_go(xfer, xfer.lease, not failed, "its receive failed: the PE may still write into it")
        if not spec.report:
            return  # vLLM waits for nothing here
        if failed:
            why = next((x.error for x in xfers if x.error), "timed out") if xfers else "no plan from the PE"
            log.warning("DualPath: receive of request %s failed: %s", spec.req_id, why)
            self.counters.failures += 1
            self.failed_recving.add(spec.req_id)
        self.finished_recving.add(spec.req_id)

    def _merge(self, spec: RecvSpec, xfers: list[_DeXfer]) -> None:
        """Write the request's rows ``[spec.computed, spec.end)`` into the DE's paged blocks, in token order: each
        source PE rank's pair (``xfers``) brings its heads' bytes of every row (:meth:`KVShard.overlap`), or one
        brings them all."""
        start, end = spec.computed, spec.end
        if start >= end:
            return
        for layer, cache in enumerate(self.caches):
            parts = [(xfer, self._lease_rows(xfer, layer, start, end)) for xfer in xfers]
            if len(parts) == 1 and parts[0][0].shard == self.shard:
                rows = parts[0][1]
            else:
                rows = parts[0][1].new_empty((end - start, self.layout.token_bytes))
                for xfer, got in parts:
                    for mine, theirs, nbytes in self.shard.overlap(xfer.shard):
                        rows[:, mine : mine + nbytes] = got[:, theirs : theirs + nbytes]
            self.adapter.write_tokens(cache, spec.block_ids, start, rows)

    def _lease_rows(self, xfer: _DeXfer, layer: int, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of ``layer`` in a pair's lease, ``uint8 [end - start, C_pair]``.

        The lease holds the rows of all ``P`` prompt tokens: ``[L, P, C]`` (complete layers from the PE), or the
        hit Full Blocks ``[H / T, L, T, C]`` (read by the DE, or on a split partly by the PE) then the PE's new
        rows ``[L, P - H, C]``.
        """
        data = xfer.lease.tensor
        lease = LeaseLayout.complete(xfer.layout, xfer.plan.prompt_tokens) if xfer.full_rows else self._hit_lease(xfer)
        H, parts = lease.hit_tokens, []
        if start < min(H, end):
            parts.append(lease.hit_rows(data, layer)[start : min(H, end)])
        if max(start, H) < end:
            parts.append(lease.new_rows(data, layer, max(start, H), end))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def close(self) -> None:
        with self._lock:
            xfers = list(self._xfers.values())
            self._xfers.clear()
        for xfer in xfers:
            xfer.stop.set()
            if xfer.pusher is not None:
                xfer.pusher.join(self.settings.timeout_s)
            self._let_go(xfer, xfer.lease, False, "unfinished at shutdown: the PE may still write into it")
