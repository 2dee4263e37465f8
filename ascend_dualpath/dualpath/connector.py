"""Engine-facing API of the prefill engine, called per layer by an inference stack (vLLM KV-connector shape).

An inference stack prefilling one request calls::

    conn.start_load_kv(plan)                       # hit KV starts flowing (PE SNIC read or DE push)
    for layer in range(L):
        rows = conn.wait_for_layer_load(layer)     # uint8 [T_hit, C] in PE HBM; next layer already in flight
        hidden, miss = model.layer_forward(layer, hidden, layout.field_view(rows, "kv"))
        conn.save_kv_layer(layer, layout.encode_rows(kv=miss))   # miss (or complete) layer -> DE buffer
    conn.wait_for_save()
    conn.finish()                                  # always, also after an error (releases the pe_buffer lease)

``abort()`` after an error drains the queued transfers and raises the DE's abort flag, so the DE never waits
for a layer that will not come and no transfer lands in its buffer after the abort. See docs/engine_api.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ascend_dualpath.dualpath.lease import LeaseLayout
from ascend_dualpath.dualpath.read_paths import DE_RANK, PE_RANK, LoadPlan, abort_peer
from ascend_dualpath.dualpath.scheduler import ReadPath
from ascend_dualpath.dualpath.transfer_leg import LayerTransferLeg, Segment, TransferTicket, wait_notify
from ascend_dualpath.errors import CapacityError, ProtocolError
from ascend_dualpath.kv.buffers import HostBuffer, Lease
from ascend_dualpath.kv.read_queue import ReadQueue, ReadTicket


@dataclasses.dataclass
class HbmSlot:
    """One PE HBM layer slot: registered address and ``uint8`` view of ``nbytes`` bytes."""

    addr: int
    tensor: torch.Tensor


@dataclasses.dataclass
class PrefetchedRead:
    lease: Lease
    tickets: list[ReadTicket]


@dataclasses.dataclass
class LoadStats:
    """What one attempt read through the PE SNIC, when, and the transfers' virtual completion time."""

    pe_read_bytes: int = 0
    read_started: float | None = None
    read_finished: float | None = None
    vtime_ns: float = 0.0


def wait_reads(tickets: list[ReadTicket], timeout_s: float) -> None:
    """Wait for every read (all of them, so none still writes into the lease), then raise the first error."""
    first_error: BaseException | None = None
    for ticket in tickets:
        try:
            ticket.wait(timeout_s)
        except Exception as error:  # keep draining; report the first
            first_error = first_error or error
    if first_error is not None:
        raise first_error


class PrefillConnector:
    """Per-layer KV loading and saving on the PE for one request at a time.

    Parameters
    ----------
    layout : KVLayout
        KV layout of the model.
    comm : HcclComm
        The PE's communicator (rank ``PE_RANK``).
    leg : LayerTransferLeg
        Moves layer bytes (local copies into HBM slots, and PE -> DE).
    read_queue : ReadQueue
        The PE node's storage NIC.
    pe_buf : HostBuffer
        ``pe_buffer`` over registered host memory.
    slots : list of HbmSlot
        Two PE HBM slots of at least ``T_all * C`` bytes each.
    timeout_s : float
        Bound of every wait.
    """

    def __init__(
        self,
        layout: Any,
        comm: Any,
        leg: LayerTransferLeg,
        read_queue: ReadQueue,
        pe_buf: HostBuffer,
        slots: list[HbmSlot],
        timeout_s: float,
    ) -> None:
        if len(slots) != 2:
            raise ProtocolError(f"the PE needs 2 HBM layer slots, got {len(slots)}")
        self.layout, self.comm, self.leg, self.read_queue = layout, comm, leg, read_queue
        self.pe_buf, self.slots, self.timeout_s = pe_buf, slots, timeout_s
        self._prefetched: dict[int, PrefetchedRead | BaseException] = {}
        self._plan: LoadPlan | None = None
        self._read: PrefetchedRead | None = None
        self._copies: dict[int, TransferTicket] = {}
        self._saves: dict[int, TransferTicket] = {}
        self.stats = LoadStats()

    # -- PE SNIC reads ----------------------------------------------------------------------------------------------
    def prefetch(self, request_id: int, block_ids: list[bytes]) -> None:
        """Start the PE SNIC reads of a PE-path request early (at admission); never blocks.

        A full ``pe_buffer`` is remembered and reported when the request starts, so the DE falls back.
        """
        self._sync_index(block_ids)
        try:
            self._prefetched[request_id] = self._submit_reads(request_id, block_ids, timeout_s=0)
        except Exception as error:
            self._prefetched[request_id] = error

    def _sync_index(self, block_ids: list[bytes] | tuple) -> None:
        # Blocks the DE persisted after this PE opened the shared store: adopted from their on-disk headers.
        self.read_queue.store.refresh(block_ids)

    def _submit_reads(self, request_id: int, block_ids: list[bytes] | tuple, timeout_s: float) -> PrefetchedRead:
        fb, hits = self.layout.full_block_bytes, LeaseLayout.blocks(self.layout, len(block_ids))
        lease = self.pe_buf.allocate(request_id, len(block_ids) * fb, timeout_s=timeout_s)
        try:
            tickets = [
                self.read_queue.submit(block_id, lease.slice(hits.block_offset(b), fb).view)
                for b, block_id in enumerate(block_ids)
            ]
        except BaseException:
            lease.release()
            raise
        return PrefetchedRead(lease, tickets)

    def drop_prefetched(self, request_id: int | None = None) -> None:
        """Wait out and release the prefetched reads of ``request_id`` (all of them when None: shutdown)."""
        for rid in [request_id] if request_id is not None else list(self._prefetched):
            entry = self._prefetched.pop(rid, None)
            if isinstance(entry, PrefetchedRead):
                try:
                    wait_reads(entry.tickets, self.timeout_s)
                except Exception:  # the request is gone; only the lease matters
                    pass
                entry.lease.release()

    # -- the per-layer API ------------------------------------------------------------------------------------------
    def start_load_kv(self, plan: LoadPlan) -> None:
        """Begin loading ``plan``'s hit KV: wait for the PE SNIC reads (PE path), start copying layer 0."""
        if self._plan is not None:
            raise ProtocolError(f"request {self._plan.request_id} is still loading; finish() it first")
        self._plan, self._copies, self._saves, self.stats = plan, {}, {}, LoadStats()
        total = self.hit_tokens + len(plan.new_tokens)
        need = total * self.layout.token_bytes
        if need > self.slots[0].tensor.numel():
            raise CapacityError(
                f"request {plan.request_id}: {total} tokens need {need} bytes per HBM layer slot, "
                f"slots hold {self.slots[0].tensor.numel()}"
            )
        if plan.path is not ReadPath.PE or not plan.hit_block_ids:
            return
        self._sync_index(plan.hit_block_ids)
        entry = self._prefetched.pop(plan.request_id, None)
        if isinstance(entry, BaseException):
            raise entry
        self._read = entry or self._submit_reads(plan.request_id, plan.hit_block_ids, self.timeout_s)
        wait_reads(self._read.tickets, self.timeout_s)
        self.stats.pe_read_bytes = len(self._read.tickets) * self.layout.full_block_bytes
        self.stats.read_started = min(t.started_at for t in self._read.tickets)
        self.stats.read_finished = max(t.finished_at for t in self._read.tickets)
        self._copy(0)

    @property
    def hit_tokens(self) -> int:
        assert self._plan is not None
        return len(self._plan.hit_block_ids) * self.layout.block_tokens

    def _copy(self, layer: int) -> None:
        assert self._read is not None and self._plan is not None
        segments = LeaseLayout.blocks(self.layout, len(self._plan.hit_block_ids)).hit_layer_segments(
            self._read.lease.addr, layer
        )
        self._copies[layer] = self.leg.submit(layer, segments, PE_RANK, self.slots[layer % 2].addr)

    def wait_for_layer_load(self, layer: int) -> torch.Tensor:
        """Block until layer ``layer``'s hit KV is in its HBM slot; returns ``uint8 [T_hit, C]`` (a view).

        On the PE path this also starts the copy of layer ``layer + 1`` into the other slot, to overlap with
        this layer's compute; on the DE path the DE pushes ahead on its own.
        """
        plan = self._require_plan()
        if self.hit_tokens:
            if plan.path is ReadPath.PE:
                self.stats.vtime_ns = max(self.stats.vtime_ns, self.leg.wait(self._copies.pop(layer), self.timeout_s))
                if layer + 1 < self.layout.num_layers:
                    self._copy(layer + 1)
            else:
                wait_notify(
                    self.comm,
                    layer,
                    plan.hit_magics[layer],
                    f"hit layer {layer} of request {plan.request_id} from the DE",
                    abort_magic=plan.abort_to_pe,
                    timeout_s=self.timeout_s,
                    check=self._check_saves,
                )
        C = self.layout.token_bytes
        return self.slots[layer % 2].tensor[: self.hit_tokens * C].view(self.hit_tokens, C)

    def save_kv_layer(self, layer: int, miss_rows: torch.Tensor) -> None:
        """Queue layer ``layer``'s new rows ``uint8 [T_miss, C]`` for the DE buffer (with the hit rows: PE path)."""
        plan = self._require_plan()
        C, hit, lease = self.layout.token_bytes, self.hit_tokens, plan.lease(self.layout)
        miss = len(plan.new_tokens)
        if tuple(miss_rows.shape) != (miss, C) or miss_rows.dtype != torch.uint8:
            raise ProtocolError(
                f"layer {layer}: miss rows must be uint8 [{miss}, {C}], got {miss_rows.dtype} {list(miss_rows.shape)}"
            )
        if layer >= 2:  # the slot's previous save (layer - 2) must have left before its bytes are overwritten
            self.stats.vtime_ns = max(self.stats.vtime_ns, self.leg.wait(self._saves[layer - 2], self.timeout_s))
        slot = self.slots[layer % 2]
        slot.tensor[hit * C : (hit + miss) * C].copy_(miss_rows.reshape(-1))  # complete layer = hit ++ miss rows
        # the rows the DE's lease takes from this PE: the complete layer (PE path) or its new rows (DE path)
        first = lease.hit_tokens
        segments = [Segment(slot.addr + first * C, (hit + miss - first) * C, 0)]
        dst = plan.de_lease_addr + lease.rows_offset(layer, first)
        self._saves[layer] = self.leg.submit(layer, segments, DE_RANK, dst, layer, plan.save_magics[layer])

    def _check_saves(self) -> None:
        # A failed save means the DE will never push the next layer: stop waiting for it.
        for ticket in self._saves.values():
            self.leg.raise_if_failed(ticket)

    def wait_for_save(self) -> None:
        """Block until every saved layer is in the DE buffer (and its notify set)."""
        self._require_plan()
        for layer in sorted(self._saves):
            self.stats.vtime_ns = max(self.stats.vtime_ns, self.leg.wait(self._saves[layer], self.timeout_s))
        self._saves = {}

    def abort(self) -> str | None:
        """After an error: drain queued transfers, then raise the DE's abort flag. Returns why the flag failed."""
        plan = self._require_plan()
        for ticket in [*self._copies.values(), *self._saves.values()]:
            try:
                self.leg.wait(ticket, self.timeout_s)
            except Exception:  # draining only: the request already failed
                pass
        self._copies, self._saves = {}, {}
        return abort_peer(self.leg, DE_RANK, plan.abort_to_de)

    def finish(self) -> None:
        """End the request: release its ``pe_buffer`` lease (reads waited out first)."""
        if self._read is not None:
            try:
                wait_reads(self._read.tickets, self.timeout_s)
            except Exception:  # failures were reported by start_load_kv
                pass
            self._read.lease.release()
        self._plan, self._read = None, None

    def _require_plan(self) -> LoadPlan:
        if self._plan is None:
            raise ProtocolError("no request is loading: call start_load_kv(plan) first")
        return self._plan
