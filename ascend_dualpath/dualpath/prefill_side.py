"""The PE half of DualPath: each load's hit rows into the paged cache before its layer's attention, the computed
rows to the DE after it.

A deployment has any number of PEs and DEs; the proxy names each request's peer, and a PE keeps one peer (side-
channel client and pair link, :mod:`~ascend_dualpath.dualpath.dataplane`) per DE it has worked with.
Per request and path (docs/vllm.md has the sequence diagrams):

- **PE read path** (the PE): the step's start queues the hit full blocks on the PE node's storage read queue
  into a host lease; ``wait_for_layer_load(l)`` puts layer ``l``'s hit rows into the paged cache before layer
  ``l``'s attention; ``save_kv_layer(l)`` sends the complete layer (hit and new rows) to the DE's lease while
  layer ``l + 1`` computes.
- **DE read path**: the DE reads the hit blocks through its own storage NIC into its lease and pushes hit
  layer ``l`` into one of two slots in the PE's HCCL window (notify after the last byte); the PE consumes it
  in ``wait_for_layer_load(l)`` and returns only the new rows of each layer; the DE pushes layer ``l + 2``
  once the PE has consumed layer ``l``.
- **Split** (``kv_transfer_params.dualpath.split``): at plan time the PE asks the DE for its read backlog and
  cap and sizes its share ``k`` with :func:`~ascend_dualpath.dualpath.scheduler.split_hit_blocks`; it reads
  hit blocks ``[first, first + k)`` itself (and writes them once into the DE lease's hit-block area), the DE
  reads and pushes the rest as on the DE path; ``wait_for_layer_load(l)`` writes both halves' rows of layer
  ``l``. ``k == n`` and ``k == 0`` are the PE and DE read paths.
- **The DE** (:mod:`~ascend_dualpath.dualpath.decode_side`) merges hit and new rows in token order into
  its paged blocks when every row has arrived, then reports the request received (or failed).

A failure falls back to the other path, then to recompute. When the DE's half fails (its read or push breaks and
it aborts, or its notify times out), the PE takes it over: the DE stops pushing (``fallback``) and gets complete
layers, the PE reads the DE's half through its own storage NIC and writes it from the failed layer on, and sends
the DE again the layers of this step that went into the old lease. A load that fails on the PE (its own storage
read, a checksum mismatch, a takeover whose read fails too) reports the request's hit blocks from the first failed
one in :meth:`PrefillSide.block_ids_with_load_errors` (the blocks before a corrupted one are written first), so vLLM
recomputes them or fails the request (``kv_load_failure_policy``); the DE stops pushing and the PE then sends it
complete layers. A corrupted block is removed from the store (it is persisted again when its request finishes).

A host lease is released only once nothing may write into it or read from it: a PE load's lease after its storage
reads and its split half's send to the DE ended (bounded waits), else it is quarantined
(:mod:`~ascend_dualpath.dualpath.quarantine`: ``quarantined_leases`` in ``status``) until they did.
Before a fallback the PE lets its writes into the DE's lease end and tells the DE whether they did (``settled``),
so the DE can release or quarantine that lease
(:mod:`~ascend_dualpath.dualpath.decode_side` states the DE's rule). The same holds the other way for the
PE's window slots, which the DE pushes into: a failed load frees them only when the DE's fallback reply says its
pushes ended (``pushes_ended``), else they are quarantined (``quarantined_slots``) until the DE answers
``pushes_ended`` for the request. The PE answers the DE's ``writes_ended`` from the writes into its lease it has
not yet seen end.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from typing import Any

import torch

from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.counters import Counters
from ascend_dualpath.dualpath.dataplane import DE_RANK, Dataplane, PairLink
from ascend_dualpath.dualpath.lease import LeaseLayout
from ascend_dualpath.dualpath.quarantine import Quarantine, tickets_ended
from ascend_dualpath.dualpath.scheduler import ReadPath, split_hit_blocks
from ascend_dualpath.dualpath.settings import ConnectorSettings, rank_address
from ascend_dualpath.dualpath.side_channel import PeerClient, XferParams, expect, request_once
from ascend_dualpath.dualpath.specs import LoadSpec, SaveSpec
from ascend_dualpath.dualpath.transfer_leg import Segment, wait_notify
from ascend_dualpath.errors import AdmissionDeferred, ChecksumMismatch, ConfigError, ProtocolError
from ascend_dualpath.kv.buffers import HostBuffer
from ascend_dualpath.kv.layout import KVLayout, KVShard
from ascend_dualpath.kv.read_queue import ReadQueue
from ascend_dualpath.kv.store import LocalBlockStore

NOTIFY_POLL_S = 0.0002
log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Peer:
    """A PE's connection to one DE: the side-channel client, the pair's link and the DE rank's shard."""

    client: PeerClient
    link: PairLink
    de: KVShard


@dataclasses.dataclass
class _Reads:
    """Hit blocks ``[first, first + count)`` of a load read through this PE's storage NIC into ``lease``."""

    first: int
    count: int
    lease: Any
    tickets: list
    waited: bool = False  # every read completed (the first layer written from them waits for them)


@dataclasses.dataclass
class _Load:
    """One request's hit rows arriving during this step's forward (PE or standalone).

    Hit blocks ``[first, last)`` of the request: the PE reads ``[first, first + own_blocks)`` (``reads[0]``), the
    DE pushes the rest into the two window ``slots``; when the DE's half fails, the PE reads that half too
    (``reads[1]``, the other storage NIC's share taken over).
    """

    spec: LoadSpec
    first: int
    last: int
    own_blocks: int
    peer: _Peer | None = None
    reads: list[_Reads] = dataclasses.field(default_factory=list)
    slots: list[int] = dataclasses.field(default_factory=list)
    notify_base: int = -1
    magics: list[int] = dataclasses.field(default_factory=list)
    abort_magic: int = 0
    ready_magic: int = 0
    de_half: bool = False  # the DE reads and pushes blocks [first + own_blocks, last) (until a takeover)
    since: float = 0.0  # when its reads started (a read ahead of its step is held at most hold_s)
    planned: bool = False  # this load made the transfer's plan (a preempted prefill taken again did not)
    usable_last: int | None = None  # read ahead: once every read ended, the end of the good prefix (a block)
    hits_ticket: Any = None  # a split's own half going to the DE lease
    error: BaseException | None = None
    bad_blocks: list[int] = dataclasses.field(default_factory=list)  # after a failure: what the host recomputes
    slots_settled: bool = False  # after a failure: the DE said none of its pushes into the slots is in flight
    xfer_id: str = ""  # the request's transfer id (the spec's is its pair's, :meth:`PrefillSide._paired`)

    @property
    def full_rows(self) -> bool:
        """The DE gets complete layers from this PE (PE read path, or no hit to read)."""
        return self.own_blocks == self.last - self.first

    @property
    def peer_blocks(self) -> int:
        return self.last - self.first - self.own_blocks


@dataclasses.dataclass
class _PeXfer:
    """PE-side state of one request across the steps of its prefill."""

    peer: _Peer
    lease_addr: int
    full_rows: bool
    hit_tokens: int
    prompt_tokens: int
    first_save: bool = True
    resend_below: int = 0  # after a takeover at layer l: layers [0, l) went to the DE's old lease, send them again

    def lease(self, layout: KVLayout) -> LeaseLayout:
        """The DE's lease: complete layers when this PE sends every row, else hit blocks then new rows."""
        return LeaseLayout(layout, self.prompt_tokens, 0 if self.full_rows else self.hit_tokens)


@dataclasses.dataclass(frozen=True)
class _Columns:
    """A paged cache's adapter narrowed to some bytes of each token row: a leg's view of the rank's cache.

    ``segments``: ``(offset in the cache's row, offset in the narrow row, nbytes)``, as
    :meth:`~ascend_dualpath.kv.layout.KVShard.overlap` gives them; rows in and out are ``uint8 [n, C_leg]``.
    """

    adapter: Any
    segments: tuple[tuple[int, int, int], ...]
    token_bytes: int  # C_leg

    def read_tokens(self, cache: torch.Tensor, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        rows = self.adapter.read_tokens(cache, block_ids, start, end)
        narrow = rows.new_empty((end - start, self.token_bytes))
        for wide, mine, nbytes in self.segments:
            narrow[:, mine : mine + nbytes] = rows[:, wide : wide + nbytes]
        return narrow

    def write_tokens(self, cache: torch.Tensor, block_ids: list[int], start: int, rows: torch.Tensor) -> None:
        """Only the leg's bytes of rows ``[start, start + len(rows))`` change (the other legs write theirs)."""
        wide = self.adapter.read_tokens(cache, block_ids, start, start + rows.shape[0]).clone()
        for at, mine, nbytes in self.segments:
            wide[:, at : at + nbytes] = rows[:, mine : mine + nbytes]
        self.adapter.write_tokens(cache, block_ids, start, wide)


class PrefillSide:
    """The PE's loads and saves (also a standalone instance's loads, which have no peer).

    Parameters
    ----------
    settings, store, read_queue :
        The instance's (the read queue is the PE node's storage NIC; the store reads the shard's bytes only).
    shard : KVShard
        What this tensor-parallel rank holds of the model's rows (``shard.full``: every head, what the hello's
        compatibility digest is over; ``shard.local``: the rank's own rows, :attr:`layout`).
    counters, quarantine :
        The instance's; this half counts its loads, fallbacks, takeovers and failures there.
    rows : KVShard, optional
        A *leg*: the rows it moves are DE rank ``rows``'s share of this rank's (its reads take only those bytes, its
        cache writes only those columns). A rank that is the source of several ranks of a DE (a DE of a larger
        tensor-parallel size) runs each request to that DE through one leg per DE rank, each a pair as at equal
        sizes; the rank's layer is loaded once every leg loaded it.

    A host calls :meth:`bind` once its caches exist, then per step :meth:`start`, for each layer
    :meth:`wait_for_layer_load` before its attention and :meth:`save_kv_layer` after it, and :meth:`wait_for_save`
    at the step's end; :meth:`block_ids_with_load_errors` says which hit blocks must be recomputed.
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        shard: KVShard,
        store: LocalBlockStore,
        read_queue: ReadQueue,
        counters: Counters,
        quarantine: Quarantine,
        rows: KVShard | None = None,
    ) -> None:
        self.settings, self.shard, self.store = settings, shard, store
        self.rows, self.layout = rows, (rows or shard).local
        self.read_queue, self.counters, self.quarantine = read_queue, counters, quarantine
        self.caches: list[torch.Tensor] = []
        self.adapter = None
        self.dataplane: Dataplane | None = None
        self.address = ""  # this instance's side channel, which the DE answers writes_ended on
        self._private_host: HostBuffer | None = None
        self._peers: dict[str, _Peer] = {}  # DE side channel -> its peer
        self._loads: list[_Load] = []
        self._prefetched: dict[str, _Load] = {}  # req_id -> a load started ahead of its step
        self._deferred: dict[str, LoadSpec] = {}  # req_id -> a load to read ahead once there is room (in order)
        self._saves: list[tuple[SaveSpec, _PeXfer, list]] = []
        self._invalid_blocks: set[int] = set()
        self._pe_xfers: dict[str, _PeXfer] = {}
        self._pe_xfer_of: dict[str, str] = {}  # PE req_id -> xfer_id
        self._lease_writes: dict[str, list] = {}  # xfer_id -> its RDMA writes into the DE's lease not seen ended
        self._lease_writes_lock = threading.Lock()  # the side channel's thread answers writes_ended
        self.layer_waits: list[float] = []  # seconds each wait for a DE push took (the host drains it)
        self.blocks_read: dict[str, int] = {}  # req_id -> hit blocks this PE's storage NIC read for it, until finish
        self._peer_sizes: dict[str, int] = {}  # DE side channel -> its tensor-parallel size
        self._legs: dict[str, tuple[PrefillSide, ...]] = {}  # DE side channel -> its legs (none: one pair)
        self._leg_of: dict[KVShard, PrefillSide] = {}  # DE rank -> the leg to it
        self._leg_reqs: dict[str, tuple[PrefillSide, ...]] = {}  # req_id -> the legs it runs through
        self._leg_ready: dict[str, dict[int, int]] = {}  # req_id -> what each of its legs' ready() said so far

    def bind(self, caches: list[torch.Tensor], adapter: Any, dataplane: Dataplane | None, address: str) -> None:
        """The paged caches (one per layer, in layer order), their adapter (``read_tokens`` / ``write_tokens``), the
        instance's dataplane (None: standalone) and its side-channel address."""
        self.caches, self.adapter, self.dataplane, self.address = caches, adapter, dataplane, address
        for de, leg in self._leg_of.items():
            leg.bind(caches, _Columns(adapter, self.shard.overlap(de), de.local.token_bytes), dataplane, address)

    # -- legs: a DE of a larger tensor-parallel size -------------------------------------------------------------
    def _legs_of(self, spec: Any) -> tuple[PrefillSide, ...]:
        """The legs a request's transfer runs through: one per rank of its DE this rank is a source of, where there
        are several; none where this side moves it itself (one DE rank, no DE rank, no transfer, or a leg)."""
        if spec.xfer is None or self.rows is not None:
            return ()
        address = spec.xfer.peer
        if address not in self._legs:
            if address in self._peers:
                return ()
            try:
                size, targets = self._targets(address)
            except Exception:  # connect_peer meets the error again and fails the load with it
                return ()
            des = [self.shard.full.shard(size, rank) for rank in targets] if len(targets) > 1 else []
            self._legs[address] = tuple(self._leg(de) for de in des)
        legs = self._legs[address]
        if legs:  # only to the DE ranks that lead the request's replicas (replicas.py)
            active = self.shard.targets(legs[0].rows.size, spec.xfer.xfer_id)
            legs = tuple(leg for leg in legs if leg.rows.rank in active)
        return legs

    def _leg(self, de: KVShard) -> PrefillSide:
        leg = self._leg_of.get(de)
        if leg is None:
            parts = (self.settings, self.shard, self.store, self.read_queue, self.counters, self.quarantine)
            leg = self._leg_of[de] = PrefillSide(*parts, rows=de)
            if self.caches:
                columns = _Columns(self.adapter, self.shard.overlap(de), de.local.token_bytes)
                leg.bind(self.caches, columns, self.dataplane, self.address)
        return leg

    def _route(self, specs: list) -> tuple[list, dict[PrefillSide, list]]:
        """``specs`` split into those this side moves and those of each leg (a request through legs goes to each)."""
        mine, legs = [], {}
        for spec in specs:
            through = self._legs_of(spec)
            if through:
                self._leg_reqs[spec.req_id] = through
            for leg in through:
                legs.setdefault(leg, []).append(spec)
            if not through:
                mine.append(spec)
        return mine, legs

    def prefetch(self, loads: list[LoadSpec]) -> None:
        """Read loads ahead of the steps that take them (the read before the batch): their storage reads into host
        leases and their plans with the DE, whose own reads start too; nothing here waits for a read. A load the
        host buffer (or the DE's) has no room for, or beyond ``prefetch_max_mb`` of reads ahead, waits its turn.
        :meth:`ready` says when each load's reads ended and how many hit tokens are good; :meth:`start` takes it by
        request id (its ``block_ids`` may then be empty here); :meth:`finish` drops one no step took."""
        loads, legs = self._route(loads)
        for leg, specs in legs.items():
            leg.prefetch(specs)
        for spec in loads:
            if spec.req_id in self._prefetched or spec.req_id in self._deferred:
                raise ProtocolError(f"request {spec.req_id} is already prefetched")
            self._deferred[spec.req_id] = spec
        self._start_deferred()

    def _start_deferred(self) -> None:
        """Start waiting loads in arrival order while the cap of reads ahead and the host buffers allow."""
        if not self._deferred:
            return
        cap = int(self.settings.prefetch_max_mb * (1 << 20))
        held = sum(r.lease.nbytes for load in self._prefetched.values() for r in load.reads)
        for req_id, spec in list(self._deferred.items()):
            need = (spec.hit_tokens - spec.computed) // self.block_size * self.layout.full_block_bytes
            if held and held + need > cap:
                return
            load = self._start_load(spec, defer=True)
            if load is None:
                return  # a full host buffer: the next step tries again
            del self._deferred[req_id]
            self._prefetched[req_id] = load
            held += sum(r.lease.nbytes for r in load.reads)

    def ready(self) -> dict[str, int]:
        """Loads read ahead whose reads all ended since the last call: request id -> the hit tokens the step may
        take (the prompt's tokens up to the first block that failed or was corrupt; the load's ``computed`` when
        none is good; through legs: once every leg's ended, the fewest). Never waits for a read; drops loads held
        beyond ``hold_s``."""
        self._start_deferred()
        now, ready = time.monotonic(), self._legs_ready()
        for req_id, load in list(self._prefetched.items()):
            if load.usable_last is None and self._read_ahead_end(load, now) is not None:
                ready[req_id] = max(load.usable_last * self.block_size, load.spec.computed)
            elif load.usable_last is not None and now - load.since > self.settings.hold_s:
                log.warning("DualPath: request %s was not taken within hold_s=%s s of its reads", req_id,
                            self.settings.hold_s)  # fmt: skip
                self._drop(self._prefetched.pop(req_id), f"not taken within hold_s={self.settings.hold_s} s")
        return ready

    def _legs_ready(self) -> dict[str, int]:
        """Requests read ahead through legs whose every leg's reads ended: request id -> the fewest good tokens."""
        for leg in self._leg_of.values():
            for req_id, tokens in leg.ready().items():
                self._leg_ready.setdefault(req_id, {})[id(leg)] = tokens
        ready = {}
        for req_id, got in list(self._leg_ready.items()):
            if len(got) == len(self._leg_reqs.get(req_id, ())):
                ready[req_id] = min(got.values())
                del self._leg_ready[req_id]
        return ready

    def _read_ahead_end(self, load: _Load, now: float) -> int | None:
        """``load.usable_last`` once every read of a load read ahead ended (None before): the end of its good
        prefix, in blocks. A DE half that aborted, or is not read within ``timeout_s``, is read by this PE instead;
        a failed block shortens the prefix (a corrupt one leaves the store) and the DE then takes complete layers."""
        try:
            if load.error is None and load.de_half:
                link = load.peer.link
                if link.comm.notify_value(load.notify_base + 2) == load.abort_magic:
                    self._take_over_now(load, "the DE's hit reads failed")
                elif now - load.since > self.settings.timeout_s:
                    self._take_over_now(load, f"the DE's hit reads did not end within {self.settings.timeout_s} s")
                elif link.comm.notify_value(load.notify_base) != load.ready_magic:
                    return None
            if load.error is None and not all(t.done for r in load.reads for t in r.tickets):
                return None
            load.usable_last = load.first if load.error is not None else self._good_prefix(load)
        except Exception as error:
            self._fail_load(load, error)
            load.usable_last = load.first
        return load.usable_last

    def _good_prefix(self, load: _Load) -> int:
        """The block where the load's good prefix ends (all its reads ended): the first whose read failed, else
        ``load.last``. A corrupt block leaves the store; a DE half still pushing is told to send nothing."""
        bad = load.last
        for reads in load.reads:
            for i, ticket in enumerate(reads.tickets):
                if ticket.error is not None and reads.first + i < bad:
                    bad, error = reads.first + i, ticket.error
        if bad == load.last:
            return bad
        log.warning("DualPath: hit block %d of request %s failed, its prefix ends there: %s: %s", bad,
                    load.spec.req_id, type(error).__name__, error)  # fmt: skip
        if isinstance(error, ChecksumMismatch):
            self.counters.checksum_errors += 1
            self.store.remove(load.spec.store_ids[bad])  # and its descendants: persisted again when finished
        self.counters.fallbacks += 1
        if load.de_half:  # the DE's half lies beyond the failed block: the DE takes complete layers instead
            self._fall_back_early(load, f"{type(error).__name__}: {error}")
        return bad

    def _fall_back_early(self, load: _Load, reason: str) -> None:
        """Before the step: the DE pushes nothing and takes complete layers (nothing of this PE is in its lease)."""
        load.de_half = False
        xfer = self._pe_xfer(load.spec.req_id)
        if xfer is not None:
            xfer.full_rows, xfer.first_save, xfer.resend_below = True, True, 0
            self._peer_fallback(load, xfer, reason, settled=True)

    def _take_over_now(self, load: _Load, reason: str) -> None:
        """The DE's half failed before the step: it falls back, this PE reads that half itself."""
        log.warning("DualPath: request %s: %s; this PE reads the DE's half", load.spec.req_id, reason)
        self._fall_back_early(load, reason)
        self.counters.takeovers += 1
        self._queue_reads(load, load.first + load.own_blocks, load.peer_blocks)

    def _drop(self, load: _Load, reason: str) -> None:
        """A load read ahead that no step takes: queued reads are cancelled, the DE lets go of its plan (nothing of
        this PE is in its lease), the leases go back once their reads ended."""
        for reads in load.reads:
            self.read_queue.cancel(reads.tickets)
        if load.planned and self._pe_xfers.pop(load.spec.xfer.xfer_id, None) is not None:
            self._pe_xfer_of.pop(load.spec.req_id, None)
            try:
                self._peer_request(load.peer, m.Abort(xfer_id=load.spec.xfer.xfer_id, reason=reason, settled=True))
            except Exception as exc:  # the DE then lets go of the plan after hold_s
                log.warning("DualPath: the DE did not take the abort of request %s: %s", load.spec.req_id, exc)
        self._release_load(load)

    def pending_prefetches(self) -> int:
        """Loads read ahead that no step took yet (waiting for room, reading, or read)."""
        return (
            len(self._deferred) + len(self._prefetched) + sum(leg.pending_prefetches() for leg in self._leg_of.values())
        )

    def start(self, loads: list[LoadSpec], saves: list[SaveSpec]) -> None:
        """A step's loads and saves, before its forward: reads and plans start here (or at :meth:`prefetch`)."""
        loads, leg_loads = self._route(loads)
        saves, leg_saves = self._route(saves)
        for leg in self._leg_of.values():  # every leg's step starts, with or without work in it
            leg.start(leg_loads.get(leg, []), leg_saves.get(leg, []))
        self._invalid_blocks = set()
        self._loads = []
        for spec in loads:
            self._deferred.pop(spec.req_id, None)  # taken before it could start: it starts now, with its step
            load = self._prefetched.pop(spec.req_id, None)
            if load is None:
                load = self._start_load(spec)
            load.spec = self._paired(spec)  # the step's block table; the hit it takes may be shorter than read ahead
            if load.error is None:
                self._begin(load)
            else:  # failed before its step: the hit the step takes is recomputed (none once ready() said so)
                T = self.block_size
                self._invalid_blocks.update(spec.block_ids[spec.computed // T : spec.hit_tokens // T])
            self._loads.append(load)
        self._saves = []
        for spec in saves:
            xfer = self._pe_xfer(spec.req_id)
            if xfer is not None:
                self._saves.append((self._paired(spec), xfer, []))

    def reading(self) -> list[str]:
        """The transfers of the current step whose storage reads through this PE are queued or running."""
        # the engine thread replaces the list, never mutates it, while another thread reads it
        mine = [
            load.xfer_id
            for load in [*self._loads, *list(self._prefetched.values())]
            if load.xfer_id and not all(t.done for r in load.reads for t in r.tickets)
        ]
        return list(dict.fromkeys(mine + [xfer_id for leg in list(self._leg_of.values()) for xfer_id in leg.reading()]))

    def unfinished_tokens(self) -> list[int]:
        """Prompt tokens of each request this PE planned and has not finished (a request through legs once)."""
        return list(self._unfinished().values())

    def _unfinished(self) -> dict[str, int]:
        """Transfer id -> prompt tokens of each request this side or its legs planned and has not finished."""
        found = {xfer_id: x.prompt_tokens for xfer_id, x in list(self._pe_xfers.items())}
        for leg in list(self._leg_of.values()):
            found |= leg._unfinished()
        return found

    def finish(self, req_ids: set[str]) -> None:
        """Requests the host finished send nothing more; writes seen ended need no answer any more."""
        for leg in self._leg_of.values():
            leg.finish(req_ids)
        for req_id in req_ids:
            self._leg_reqs.pop(req_id, None)
            self._leg_ready.pop(req_id, None)
        for xfer_id in list(self._lease_writes):
            self._writes_pending(xfer_id)
        for req_id in req_ids:
            self._deferred.pop(req_id, None)
            load = self._prefetched.pop(req_id, None)
            if load is not None:  # no step took it: its reads end, the DE lets go of its plan, its memory goes back
                self._drop(load, f"request {req_id} finished before a step took its load")
            self._pe_xfers.pop(self._pe_xfer_of.pop(req_id, None), None)
            self.blocks_read.pop(req_id, None)

    def close(self) -> None:
        for leg in self._leg_of.values():
            leg.close()
        for peer in self._peers.values():
            peer.client.close()
        self._peers.clear()

    def _start_load(self, spec: LoadSpec, defer: bool = False) -> _Load | None:
        """Plan the load with its DE and queue this PE's reads; None (nothing held) when ``defer`` and a host buffer
        has no room now. A preempted prefill taken again reads its whole hit here, its transfer's plan unchanged."""
        first, last = spec.computed // self.block_size, spec.hit_tokens // self.block_size
        load = _Load(spec, first, last, own_blocks=last - first, since=time.monotonic())
        load.xfer_id = spec.xfer.xfer_id if spec.xfer is not None else ""
        try:
            if spec.xfer is not None:
                load.peer = self.connect_peer(spec.xfer.peer)
                load.spec = spec = self._paired(spec)
            again = spec.xfer is not None and self._pe_xfer_of.get(spec.req_id) == spec.xfer.xfer_id
            if spec.xfer is not None:
                load.own_blocks = load.own_blocks if again else self._own_blocks(load)
            reads = self._lease_reads(load, load.first, load.own_blocks, defer) if load.own_blocks > 0 else None
            if load.own_blocks > 0 and reads is None:
                return None
            if spec.xfer is not None and not again and not self._plan(load, defer):
                self._release_load(load)
                return None
            if reads is not None:
                self._submit_reads(load, reads)
            self._count(load)
        except Exception as error:  # a load that cannot even start fails like one that broke later
            self._fail_load(load, error)
        return load

    def _begin(self, load: _Load) -> None:
        """The step takes the load: a DE that pushes gets its two window slots (held only while the step runs),
        a planned DE learns that its receive's timeout runs from now (``start``)."""
        if not load.planned or self._pe_xfer(load.spec.req_id) is None:
            return
        link, slots = load.peer.link, []
        try:
            if load.de_half:
                slot_bytes = load.peer_blocks * self.block_size * self.layout.token_bytes
                load.slots = slots = [link.window_alloc(slot_bytes) for _ in range(2)]
            self._peer_request(load.peer, m.Start(xfer_id=load.spec.xfer.xfer_id, slots=slots))
        except Exception as error:
            if load.de_half:  # its pushes never come: this PE reads the DE's half
                self._take_over_now(load, f"start refused: {type(error).__name__}: {error}")
            else:
                log.warning("DualPath: the DE did not take the start of request %s: %s", load.spec.req_id, error)
                self._abort_peer(load.peer, load.spec.xfer, f"start refused: {error}")
                self._pe_xfers.pop(load.spec.xfer.xfer_id, None)

    def _own_blocks(self, load: _Load) -> int:
        """How many of the load's hit blocks the PE reads: all (PE path), none (DE path), or a split's share
        sized on both read queues' live backlogs and caps (the DE's from a ``status`` round trip)."""
        n, xfer = load.last - load.first, load.spec.xfer
        if not xfer.split:
            return n if xfer.path is ReadPath.PE else 0
        if n == 0:
            return 0
        de = self._peer_request(load.peer, m.StatusQuery(), reply=m.Status)
        return split_hit_blocks(
            n,
            self.layout.full_block_bytes,
            float(self.read_queue.stats().bytes),
            self.settings.snic_bytes_per_s,
            float(de.read_queue_bytes),
            de.snic_bytes_per_s,
        )

    def _count(self, load: _Load) -> None:
        """Count a started load once per instance (``KVShard.counts_requests``), on its first leg where it runs
        through legs (their blocks are the same, each leg moves other columns of them)."""
        n, c = load.last - load.first, self.counters
        if n == 0 or not self.shard.counts_requests or not self._first_leg(load):
            return
        if load.spec.xfer is not None and load.spec.xfer.split:
            c.split_blocks_pe += load.own_blocks
            c.split_blocks_de += load.peer_blocks
        if load.full_rows:
            c.loads_pe += 1
        elif load.own_blocks == 0:
            c.loads_de += 1
        else:
            c.loads_split += 1

    def _first_leg(self, load: _Load) -> bool:
        """Whether this side counts the load's blocks and the load itself: a request through legs counts them on
        its first leg (to the lowest DE rank), the others move other columns of the same blocks."""
        return self.rows is None or self.rows.rank == min(self.shard.targets(self.rows.size, load.xfer_id))

    def _queue_reads(self, load: _Load, first: int, count: int) -> _Reads:
        """Queue hit blocks ``[first, first + count)`` on this PE's storage read queue into a fresh host lease."""
        reads = self._lease_reads(load, first, count, defer=False)
        self._submit_reads(load, reads)
        return reads

    def _lease_reads(self, load: _Load, first: int, count: int, defer: bool) -> _Reads | None:
        """A host lease for hit blocks ``[first, first + count)``, kept in ``load.reads`` (so a failure later leaves
        it to :meth:`_release_load`); None when ``defer`` and the buffer has no room now (waits, bounded, else)."""
        try:
            timeout_s = 0 if defer else self.settings.timeout_s
            lease = self._host().allocate(load.spec.req_id, count * self.layout.full_block_bytes, timeout_s=timeout_s)
        except AdmissionDeferred:
            if defer:
                return None
            raise
        reads = _Reads(first, count, lease, [])
        load.reads.append(reads)
        return reads

    def _submit_reads(self, load: _Load, reads: _Reads) -> None:
        """Queue the reads of ``reads``'s blocks on this PE's storage read queue into its lease."""
        spec, fb, first, count = load.spec, self.layout.full_block_bytes, reads.first, reads.count
        self.store.refresh(spec.store_ids[: first + count])  # the scheduler half's store saw them; this may not
        own = LeaseLayout.blocks(self.layout, count)
        self.blocks_read[spec.req_id] = self.blocks_read.get(spec.req_id, 0) + count
        block = self._first_leg(load)
        for i in range(count):  # appended one by one: a failing submit leaves those queued to _release_load
            dest = reads.lease.slice(own.block_offset(i), fb).view
            reads.tickets.append(self.read_queue.submit(spec.store_ids[first + i], dest, self.rows, block))

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

    def wait_for_layer_load(self, layer: int) -> None:
        """Every load's hit rows of ``layer`` into the paged cache (a load that fails is reported, not raised); a
        request through legs once every leg wrote its columns."""
        for leg in self._leg_of.values():
            leg.wait_for_layer_load(layer)
            self.layer_waits += leg.layer_waits
            leg.layer_waits = []
        for load in self._loads:
            if load.error is None and load.last > load.first:
                try:
                    self._write_layer(load, layer)
                except Exception as error:
                    self._fail_load(load, error)

    def _write_layer(self, load: _Load, layer: int) -> None:
        """Layer ``layer``'s hit rows of both halves into the paged cache: the own half from the lease (after the
        reads), the DE's half from its window slot (after its notify). A DE half that fails is read here instead
        (:meth:`_take_over`)."""
        for reads in list(load.reads):
            self._write_reads(load, reads, layer)
            if reads is load.reads[0] and layer == 0 and load.de_half:
                self._send_own_hits(load)
        if load.slots:  # the DE pushed this layer of its half into slot layer % 2
            try:
                self._write_pushed(load, layer)
            except Exception as error:
                self._take_over(load, layer, error)

    def _write_reads(self, load: _Load, reads: _Reads, layer: int) -> None:
        """Layer ``layer``'s rows of the blocks ``reads`` holds that the step takes, once their storage reads
        completed (bounded)."""
        taken = min(reads.count, -(-load.spec.hit_tokens // self.block_size) - reads.first)
        if taken <= 0:
            return
        if not reads.waited:
            for ticket in reads.tickets[:taken]:
                ticket.wait(self.settings.timeout_s)
            reads.waited = True
        rows = LeaseLayout.blocks(self.layout, reads.count).hit_rows(reads.lease.tensor, layer)
        self._write_rows(load, layer, reads.first * self.block_size, rows)

    def _write_rows(self, load: _Load, layer: int, start: int, rows: torch.Tensor) -> None:
        """Token rows ``[start, start + len(rows))`` (``[n, C]`` uint8) of ``layer`` into the paged cache, but only
        those the step takes, ``[computed, hit_tokens)``: a read ahead may hold more (the local prefix cache grew
        meanwhile, or a later block failed), and the blocks below ``computed`` are shared prefix-cache blocks."""
        lo, hi = max(start, load.spec.computed), min(start + rows.shape[0], load.spec.hit_tokens)
        if lo < hi:
            self.adapter.write_tokens(self.caches[layer], load.spec.block_ids, lo, rows[lo - start : hi - start])

    def _write_pushed(self, load: _Load, layer: int) -> None:
        """Layer ``layer`` of the DE's half from window slot ``layer % 2``, after its notify; then tell the DE the
        slot is free for layer ``layer + 2``."""
        C, T, spec = self.layout.token_bytes, self.block_size, load.spec
        self._wait_notify(load, layer)
        rows = load.peer_blocks * T
        link = load.peer.link
        start = (load.first + load.own_blocks) * T
        self._write_rows(load, layer, start, link.window_tensor(load.slots[layer % 2], rows * C).view(rows, C))
        if layer + 2 < self.layout.num_layers:
            link.window_read_done()  # the DE's push of layer + 2 overwrites the slot
            self._peer_request(load.peer, m.Consumed(xfer_id=spec.xfer.xfer_id, layer=layer))

    def _take_over(self, load: _Load, layer: int, error: BaseException) -> None:
        """The DE's half failed at layer ``layer`` (its read or push broke, it aborted, its notify timed out): the
        other path is this PE's storage NIC. The DE stops pushing and gets complete layers (``fallback``), this PE
        reads the DE's half itself and writes it from layer ``layer`` on (the layers before came from the slots);
        the layers this step already sent to the DE's old lease are sent again at the step's end. If the takeover
        fails too, the load fails (vLLM recomputes): raises its error."""
        spec = load.spec
        log.warning(
            "DualPath: the DE's half of request %s failed at layer %d, this PE reads it itself: %s: %s",
            spec.req_id,
            layer,
            type(error).__name__,
            error,
        )
        xfer = self._pe_xfer(spec.req_id)
        if xfer is None:
            raise error
        xfer.full_rows, xfer.first_save, xfer.resend_below = True, True, layer
        load.de_half = False
        self._peer_fallback(load, xfer, f"{type(error).__name__}: {error}", self._quiesce(load))
        if self._pe_xfer(spec.req_id) is None:  # the DE refused the fallback: its receive is aborted, send it nothing
            self._saves = [save for save in self._saves if save[0].req_id != spec.req_id]
        self._retire_slots(load, load.slots_settled)
        load.slots = []
        self.counters.takeovers += 1
        self._write_reads(load, self._queue_reads(load, load.first + load.own_blocks, load.peer_blocks), layer)

    def _send_own_hits(self, load: _Load) -> None:
        """A split's own half, read, goes once into the DE lease's hit-block area (blocks ``first ..``)."""
        fb, xfer = self.layout.full_block_bytes, self._pe_xfer(load.spec.req_id)
        nbytes = load.own_blocks * fb
        dst = xfer.lease_addr + xfer.lease(self.layout).block_offset(load.first)
        src = load.reads[0].lease.addr
        load.hits_ticket = load.peer.link.leg.submit(0, [Segment(src, nbytes, 0)], DE_RANK, dst)
        self._track_write(load.spec.xfer.xfer_id, load.hits_ticket)

    def _wait_notify(self, load: _Load, layer: int) -> None:
        """Wait (bounded) for the DE's push of hit layer ``layer`` (slot ``notify_base + layer % 2``; its abort flag
        is ``notify_base + 2``); the wait's length goes to vLLM's metrics, failed waits included."""
        start = time.monotonic()
        try:
            wait_notify(
                load.peer.link.comm,
                load.notify_base + layer % 2,
                load.magics[layer],
                f"hit layer {layer} of request {load.spec.xfer.xfer_id} from the DE",
                abort_magic=load.abort_magic,
                abort_slot=load.notify_base + 2,
                timeout_s=self.settings.timeout_s,
                poll_s=NOTIFY_POLL_S,
            )
        finally:  # the histogram shows what stalled the forward
            self.layer_waits.append(time.monotonic() - start)

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
        first_bad = load.first
        if isinstance(error, ChecksumMismatch):
            self.counters.checksum_errors += 1
            first_bad = self._drop_corrupt(load, error)
        T = self.block_size
        load.bad_blocks = list(spec.block_ids[max(first_bad, spec.computed // T) : spec.hit_tokens // T])
        self._invalid_blocks.update(load.bad_blocks)
        self.counters.fallbacks += 1
        xfer = self._pe_xfer(spec.req_id)
        if xfer is not None:
            xfer.full_rows, xfer.first_save, xfer.resend_below = True, True, 0
            if load.de_half:  # the DE must stop pushing before the slots are freed
                load.de_half = False
                self._peer_fallback(load, xfer, f"{type(error).__name__}: {error}", self._quiesce(load))
        self._release_load(load)

    def _drop_corrupt(self, load: _Load, error: ChecksumMismatch) -> int:
        """Remove the corrupted block whose read raised ``error`` (and so its descendants) from the store and write
        every layer of the good blocks before it into the cache; returns the corrupted block's index.

        Reads are waited in block order, own half first, so every block before the corrupted one was read whole
        into a lease of this PE (the DE's half lies after the own one, and is read here only once taken over)."""
        spec, T = load.spec, self.block_size
        for reads in load.reads:
            for i, ticket in enumerate(reads.tickets):
                if ticket.error is error:
                    bad = reads.first + i
                    self.store.remove(spec.store_ids[bad])
                    for held in load.reads:
                        count = min(held.count, bad - held.first)
                        if count > 0:
                            good = LeaseLayout.blocks(self.layout, count)
                            for layer in range(len(self.caches)):
                                rows = good.hit_rows(held.lease.tensor, layer)
                                self._write_rows(load, layer, held.first * T, rows)
                    return bad
        return load.first

    def _quiesce(self, load: _Load) -> bool:
        """Let the load's writes into the DE's lease end (a split's own half, this step's layer sends so far);
        True if all ended within their bounded waits."""
        settled = True
        if load.hits_ticket is not None:
            settled = self._settle(load.peer.link, None, load.hits_ticket)
            load.hits_ticket = None
        for spec, xfer, sends in self._saves:
            if spec.req_id == load.spec.req_id:
                for _, addr, ticket in sends:
                    settled = self._settle(xfer.peer.link, addr, ticket) and settled
                sends.clear()
        return settled

    def _peer_fallback(self, load: _Load, xfer: _PeXfer, reason: str, settled: bool) -> None:
        """Tell the DE to stop pushing and take complete layers, in the fresh lease its reply names (``settled``:
        this PE's writes into the old lease ended). If it cannot, its receive is aborted (the DE recomputes) and
        this PE sends it nothing more."""
        xfer_id = load.spec.xfer.xfer_id
        try:
            message = m.Fallback(xfer_id=xfer_id, reason=reason, settled=settled)
            reply = self._peer_request(load.peer, message, 2 * self.settings.timeout_s, m.Planned)
            nbytes = LeaseLayout.complete(self.layout, xfer.prompt_tokens).nbytes
            xfer.lease_addr = load.peer.link.check_peer_lease(reply.lease_addr, nbytes, f"fallback of {xfer_id}")
            load.slots_settled = reply.pushes_ended
        except Exception as exc:
            log.warning("DualPath: the DE did not take the fallback of request %s: %s", load.spec.req_id, exc)
            self._abort_peer(load.peer, load.spec.xfer, f"fallback refused: {exc}")
            self._pe_xfers.pop(xfer_id, None)

    def _release_load(self, load: _Load) -> None:
        for reads in load.reads:
            for ticket in reads.tickets:  # a read still in flight writes into the lease: let it end first
                if not ticket.done:
                    try:
                        ticket.wait(self.settings.timeout_s)
                    except Exception:  # its error is already the load's error or irrelevant now
                        pass
            settled = all(ticket.done for ticket in reads.tickets)
            sends = []
            if load.hits_ticket is not None and reads is load.reads[0]:  # the own half going to the DE, from here
                sends = [load.hits_ticket]
                settled = self._settle(load.peer.link, None, load.hits_ticket) and settled
                load.hits_ticket = None
            self.quarantine.retire(
                "leases",
                f"lease of request {load.spec.req_id}",
                reads.lease.nbytes,
                reads.lease.release,
                settled,
                functools.partial(tickets_ended, list(reads.tickets), sends),
                "its storage reads or its send to the DE outlived their wait",
            )
        load.reads = []
        if load.slots:
            self._retire_slots(load, load.error is None or load.slots_settled)
            load.slots = []
        elif load.peer is not None:
            self._free_notify(load)

    def _retire_slots(self, load: _Load, settled: bool) -> None:
        """Free the load's window slots and notify group, unless a DE push may still land there (``settled``: every
        push arrived, or the DE's fallback reply said none is in flight); otherwise they are quarantined
        (``quarantined_slots``), so no later buffer gets the bytes, until the DE answers ``pushes_ended`` for the
        request."""
        link, slots, notify_base = load.peer.link, list(load.slots), load.notify_base
        load.notify_base = -1  # freed with the slots
        message, address = m.PushesEnded(xfer_id=load.spec.xfer.xfer_id), load.peer.client.address

        def release() -> None:
            link.window_read_done()  # a later request's pushes may land in these slots
            for addr in slots:
                link.window_free(addr)
            link.notify_free(notify_base)

        self.quarantine.retire(
            "slots",
            f"window slots of request {load.spec.req_id}",
            len(slots) * load.peer_blocks * self.block_size * self.layout.token_bytes,
            release,
            settled,
            lambda: (
                expect(
                    request_once(address, message, self.settings.timeout_s, **self.settings.side_framing), m.Ended
                ).ended
            ),
            "the DE's pushes may still land there",
        )

    def connect_peer(self, address: str) -> _Peer:
        """The DE whose rank 0 is at ``address`` (what the scheduler names); the first time, ask rank 0 for the DE's
        tensor-parallel size, then the rank this rank pairs with (the DE rank whose rows it is a source of,
        :meth:`~ascend_dualpath.kv.layout.KVShard.targets`, at :func:`rank_address`) for its device id, and make the
        pair's communicator (``hello``, where the DE refuses another version or digest, or a rank it does not pair
        with). ProtocolError where this rank is no DE rank's source (the DE's ranks take the rows it holds,
        replicated, from other PE ranks: the replica that leads a request moves them, :mod:`.replicas`)."""
        peer = self._peers.get(address)
        if peer is not None:
            return peer
        s = self.settings
        de = self._de_rank(address)
        client = PeerClient(rank_address(address, de.rank), s.timeout_s, **s.side_framing)
        try:
            dp = self.dataplane
            status = expect(client.request(m.StatusQuery()), m.Status)
            link = dp.new_link(client.address, status.device_id)
            hello = m.Hello(
                pe=self.address,
                device_id=dp.device_id,
                rank_info=link.local_info(),
                host_mem=dp.host_mem(),
                speaks=m.Speaks.of(dp.compat(self.shard.full)),
                tp_size=s.tp_size,
                tp_rank=s.tp_rank,
            )
            reply = expect(client.request(hello), m.Welcome)
            m.check_tp(self.shard, reply.tp_size, reply.tp_rank, f"PE {s.node}", f"DE {client.address}", decode=False)
            link.connect(reply.rank_info, reply.host_mem)
        except Exception:
            client.close()
            raise
        peer = self._peers[address] = _Peer(client, link, de)
        return peer

    def _de_rank(self, address: str) -> KVShard | None:
        """The shard of the rank of the DE at ``address`` (its rank 0) that this rank pairs with, from the DE's
        tensor-parallel size (rank 0's ``status``); ProtocolError naming both ends' ranks and sizes where there is
        none or there are several."""
        size, targets = self._targets(address)
        if self.rows is not None:  # a leg: its own DE rank
            targets = tuple(rank for rank in targets if (size, rank) == (self.rows.size, self.rows.rank))
        if len(targets) != 1:  # several: _legs_of routes these requests through legs
            raise ProtocolError(
                f"PE rank {self.settings.tp_rank} of {self.settings.tp_size} pairs with DE ranks {list(targets)} of "
                f"{size} at {address}, not with one"
            )
        return self.shard.full.shard(size, targets[0])

    def peer_size(self, address: str) -> int:
        """The tensor-parallel size of the DE at ``address`` (its rank 0's ``status``, asked once)."""
        size = self._peer_sizes.get(address)
        if size is None:
            s = self.settings
            status = expect(request_once(address, m.StatusQuery(), s.timeout_s, **s.side_framing), m.Status)
            size = self._peer_sizes[address] = status.tp_size
        return size

    def _targets(self, address: str) -> tuple[int, tuple[int, ...]]:
        """The tensor-parallel size of the DE at ``address`` and the ranks there this rank is a source of
        (:meth:`~ascend_dualpath.kv.layout.KVShard.targets`); ProtocolError naming both ends' ranks and sizes where
        the DE's size cannot shard the model."""
        s, size = self.settings, self.peer_size(address)
        try:
            return size, self.shard.targets(size)
        except ConfigError as error:
            raise ProtocolError(f"tensor-parallel rank {s.tp_rank} of {s.tp_size} at PE {s.node}, size "
                                f"{size} at DE {address}: {error}") from None  # fmt: skip

    def _paired(self, spec: Any) -> Any:
        """``spec`` (a LoadSpec or SaveSpec) with its pair's transfer id (:func:`messages.pair_id`) once its DE is
        connected."""
        peer = self._peers.get(spec.xfer.peer) if spec.xfer is not None else None
        if peer is None:
            return spec
        xfer_id = m.pair_id(spec.xfer.xfer_id, self.shard, peer.de)
        return (
            spec
            if xfer_id == spec.xfer.xfer_id
            else dataclasses.replace(spec, xfer=dataclasses.replace(spec.xfer, xfer_id=xfer_id))
        )

    @staticmethod
    def _peer_request(peer: _Peer, message: m.Message, timeout_s: float | None = None, reply: type = m.Ok) -> Any:
        """``message`` to the peer; its reply, which must be of type ``reply`` (ProtocolError otherwise)."""
        return expect(peer.client.request(message, timeout_s), reply)

    def _pe_xfer(self, req_id: str) -> _PeXfer | None:
        """The transfer this PE request planned (None: it planned none, or its plan was refused)."""
        return self._pe_xfers.get(self._pe_xfer_of.get(req_id))

    def _plan(self, load: _Load, defer: bool = False) -> bool:
        """Tell the DE what is coming (and, when it reads hit blocks, its notify values); take its lease. False (and
        nothing planned) when ``defer`` and the DE's host buffer has no room now.

        A transfer id already planned by another request is refused before anything is sent: vLLM gives every
        engine request of one HTTP request (a prompt list, ``n > 1``) the same ``kv_transfer_params``, and two
        requests on one transfer would write into one lease.
        """
        spec, link = load.spec, load.peer.link
        if spec.xfer.xfer_id in self._pe_xfers:
            owner = next((r for r, x in self._pe_xfer_of.items() if x == spec.xfer.xfer_id), "?")
            raise ProtocolError(
                f"request {spec.req_id}: transfer id {spec.xfer.xfer_id!r} is already in use by request {owner} "
                "(each engine request needs its own transfer id); it is computed here without a transfer"
            )
        message = m.Plan(
            pe=self.address,
            xfer_id=spec.xfer.xfer_id,
            path=(ReadPath.PE if load.full_rows else ReadPath.DE).value,
            pe_blocks=0 if load.full_rows else load.own_blocks,
            hit_tokens=spec.hit_tokens,
            prompt_tokens=spec.prompt_tokens,
            load_start=spec.computed,
            store_ids=spec.store_ids[: load.last],
        )
        message.defer = defer
        if load.peer_blocks > 0:
            load.notify_base = message.notify_base = link.notify_alloc()
            load.magics = message.magics = [link.comm.next_magic() for _ in range(self.layout.num_layers)]
            load.abort_magic = message.abort_magic = link.comm.next_magic()
            load.ready_magic = message.ready_magic = link.comm.next_magic()
        try:
            reply = self._peer_request(load.peer, message, reply=m.Planned)
        except Exception:
            self._free_notify(load)  # the DE planned nothing: it never writes these slots
            raise
        if reply.deferred:
            self._free_notify(load)
            return False
        nbytes = LeaseLayout.complete(self.layout, spec.prompt_tokens).nbytes
        lease_addr = link.check_peer_lease(reply.lease_addr, nbytes, f"plan of request {spec.xfer.xfer_id}")
        self._pe_xfers[spec.xfer.xfer_id] = _PeXfer(
            load.peer, lease_addr, load.full_rows, spec.hit_tokens, spec.prompt_tokens
        )
        self._pe_xfer_of[spec.req_id] = spec.xfer.xfer_id
        load.planned, load.de_half = True, load.peer_blocks > 0
        return True

    def _free_notify(self, load: _Load) -> None:
        if load.notify_base >= 0:
            load.peer.link.notify_free(load.notify_base)
            load.notify_base = -1

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        """Queue this step's computed rows of ``layer`` (from ``kv_layer``, the layer's paged cache) to each DE."""
        for leg in self._leg_of.values():
            leg.save_kv_layer(layer, kv_layer)
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
        link = xfer.peer.link
        rows = self.adapter.read_tokens(kv_layer, spec.block_ids, start, spec.end)
        nbytes = rows.numel()
        addr = link.window_alloc(nbytes)
        link.window_tensor(addr, nbytes).copy_(rows.reshape(-1))
        offset = xfer.lease(self.layout).rows_offset(layer, start)
        ticket = link.leg.submit(layer, [Segment(addr, nbytes, 0)], DE_RANK, xfer.lease_addr + offset)
        self._track_write(spec.xfer.xfer_id, ticket)
        return start, addr, ticket

    def _track_write(self, xfer_id: str, ticket: Any) -> None:
        """Keep an RDMA write into the DE's lease until it is seen ended, so ``writes_ended`` can answer."""
        with self._lease_writes_lock:
            self._lease_writes.setdefault(xfer_id, []).append(ticket)

    def _writes_pending(self, xfer_id: str) -> bool:
        """Whether a write of request ``xfer_id`` into the DE's lease may still land (forgets those that ended)."""
        with self._lease_writes_lock:
            pending = [t for t in self._lease_writes.get(xfer_id, []) if not t.done()]
            if pending:
                self._lease_writes[xfer_id] = pending
            else:
                self._lease_writes.pop(xfer_id, None)
        return bool(pending)

    def on_writes_ended(self, message: m.WritesEnded) -> m.Ended:
        """The DE asks before giving a quarantined lease back: none of this PE's writes of the request is in flight
        (a request it never wrote for, or whose writes all ended, has none), and none will start: the request that
        planned it is over here (a later chunk of its prefill would write again)."""
        xfer_id = message.xfer_id
        legs = all(leg.on_writes_ended(message).ended for leg in list(self._leg_of.values()))
        return m.Ended(ended=legs and xfer_id not in self._pe_xfers and not self._writes_pending(xfer_id))

    def wait_for_save(self) -> None:
        for leg in self._leg_of.values():
            leg.wait_for_save()
        for load in self._loads:
            if load.hits_ticket is not None and load.error is None:
                self._finish_own_hits(load)
        failed = {load.spec.req_id for load in self._loads if load.error is not None}
        for spec, xfer, sends in self._saves:
            if spec.req_id in failed:  # vLLM recomputes or fails it; the next attempt sends complete layers
                for _, addr, ticket in sends:  # nothing of them is reported
                    self._settle(xfer.peer.link, addr, ticket)
                sends = []
            elif xfer.resend_below:  # a takeover's fresh lease lacks the layers sent before it
                sends[:0] = [
                    self._send_rows(layer, self.caches[layer], spec, xfer, 0) for layer in range(xfer.resend_below)
                ]
                xfer.resend_below = 0
            self._finish_sends(spec, xfer, sends)
        self._saves = []
        for load in self._loads:
            self._release_load(load)
        self._loads = []

    def _finish_own_hits(self, load: _Load) -> None:
        """Wait for a split's own half to land in the DE lease and say so; a failure fails the DE's receive."""
        ticket, load.hits_ticket = load.hits_ticket, None
        try:
            load.peer.link.leg.wait(ticket, self.settings.timeout_s)
            self._peer_request(load.peer, m.Hits(xfer_id=load.spec.xfer.xfer_id))
        except Exception as exc:
            log.warning("DualPath: hit blocks of request %s did not reach the DE: %s", load.spec.req_id, exc)
            self.counters.failures += 1
            self._abort_peer(load.peer, load.spec.xfer, f"{type(exc).__name__}: {exc}")

    def _finish_sends(self, spec: SaveSpec, xfer: _PeXfer, sends: list) -> None:
        """Wait for one request's layer sends of this step, then tell the DE which rows landed."""
        error = None
        for _, addr, ticket in sends:
            try:
                xfer.peer.link.leg.wait(ticket, self.settings.timeout_s)
            except Exception as exc:
                error = error or exc
            xfer.peer.link.window_free(addr)
        if not sends:
            return
        try:
            if error is not None:
                raise error
            self._peer_request(
                xfer.peer, m.Rows(xfer_id=spec.xfer.xfer_id, start=sends[0][0], end=spec.end, full=xfer.full_rows)
            )
            xfer.first_save = False
        except Exception as exc:
            log.warning("DualPath: saves of request %s failed: %s: %s", spec.req_id, type(exc).__name__, exc)
            self.counters.failures += 1
            self._abort_peer(xfer.peer, spec.xfer, f"{type(exc).__name__}: {exc}")

    def _settle(self, link: PairLink, addr: int | None, ticket: Any) -> bool:
        """Let a send of a failed load end and free its buffer; returns whether it ended (its wait did not expire)."""
        try:
            link.leg.wait(ticket, self.settings.timeout_s)
        except Exception:  # the load already failed; this send's outcome changes nothing
            pass
        if addr is not None:
            link.window_free(addr)
        return ticket.done()

    def _abort_peer(self, peer: _Peer, xfer: XferParams, reason: str) -> None:
        try:
            self._peer_request(peer, m.Abort(xfer_id=xfer.xfer_id, reason=reason))
        except Exception:  # the DE then times out on this request, within its own bound
            pass

    def block_ids_with_load_errors(self) -> set[int]:
        """The hit blocks of loads that failed since the last call (the host recomputes them)."""
        bad, self._invalid_blocks = self._invalid_blocks, set()
        for leg in self._leg_of.values():
            bad |= leg.block_ids_with_load_errors()
        return bad
