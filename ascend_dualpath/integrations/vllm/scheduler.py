"""The scheduler half of the DualPath connector (runs in vLLM's engine core).

It decides, per request, how many prompt tokens come from outside the forward pass and how:

- **prefill** (the PE, ``kv_transfer_params.dualpath.role == "prefill"``) and **standalone** requests: the
  longest stored prefix of the prompt's full blocks, block-aligned and strictly below the prompt length (one
  token is always computed), read from storage *before* the request enters a batch and loaded *synchronously*,
  layer by layer from host memory inside the forward pass. At its first sight the prefix is frozen and read ahead
  (a ``prefetch`` in the step's metadata); the request is skipped (``None``) until the worker reports the reads
  ended (``DualPathWorkerMeta.ready``, through ``update_connector_output``) with the good prefix, which it then
  takes (a failed or corrupt block shortens it: vLLM computes the rest). A preempted request is looked up again;
- **decode** (the DE): the whole prompt beyond the local prefix-cache hit, received *asynchronously* (the
  request waits in ``WAITING_FOR_REMOTE_KVS`` until the worker reports it in ``finished_recving``);

and, when a decode or standalone request finishes, which of its full blocks to persist (its blocks stay
allocated until the worker reports the request in ``finished_sending``).
"""

from __future__ import annotations

from typing import Any

from vllm.v1.request import RequestStatus

from ascend_dualpath.dualpath.side_channel import XferParams
from ascend_dualpath.dualpath.specs import LoadSpec, RecvSpec, SaveSpec
from ascend_dualpath.integrations.vllm.metadata import DualPathMetadata, DualPathWorkerMeta, PersistSpec
from ascend_dualpath.integrations.vllm.persisting import PersistAnnouncements
from ascend_dualpath.integrations.vllm.settings import ConnectorSettings, store_ids
from ascend_dualpath.kv.store import LocalBlockStore

_PERSISTED_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class DualPathScheduler:
    """Scheduler-side state of one instance.

    Parameters
    ----------
    settings : ConnectorSettings
        The instance's connector settings.
    block_size : int
        vLLM's block size (tokens per block, = the store's tokens per Full Block).
    store : LocalBlockStore
        The shared block store (this process only reads its index).
    namespace : bytes
        Salt of the store ids (:func:`~ascend_dualpath.integrations.vllm.settings.store_namespace`).
    """

    def __init__(self, settings: ConnectorSettings, block_size: int, store: LocalBlockStore, namespace: bytes):
        self.settings = settings
        self.block_size = block_size
        self.store = store
        self.namespace = namespace
        self.announcements = PersistAnnouncements(settings.store, settings.persist_wait_s)
        self._pending_loads: dict[str, LoadSpec] = {}
        self._pending_recvs: dict[str, RecvSpec] = {}
        self._pending_persists: list[PersistSpec] = []
        self._prefill: dict[str, tuple[XferParams, list[int], int]] = {}  # req_id -> (xfer, block table, prompt)
        self._hits: dict[str, tuple[int, list[bytes]]] = {}  # req_id -> (hit tokens, store ids)
        self._pending_prefetches: list[LoadSpec] = []
        self._prefetches: dict[str, LoadSpec] = {}  # req_id -> its read ahead (computed and hit frozen)
        self._ready: dict[str, int] = {}  # req_id -> good hit tokens, once every worker reported its read ahead
        # req_id -> (shortest good prefix, workers that reported) while some tensor-parallel ranks have not
        self._partly_ready: dict[str, tuple[int, int]] = {}
        self._persisting: set[str] = set()  # finished requests whose blocks are being written
        self._receiving: set[str] = set()  # decode requests vLLM waits for (WAITING_FOR_REMOTE_KVS)
        # ... of them, those vLLM finished meanwhile (aborted, or ended by an error): vLLM frees them only when the
        # worker reports the receive, which its steps do, so it must keep stepping until then
        self._ended_receiving: set[str] = set()
        self._received: set[str] = set()  # decode requests that had their one receive

    # -- admission ------------------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` (block-aligned local hit) that the connector provides."""
        xfer = XferParams.from_request(request.kv_transfer_params)
        prompt = request.num_prompt_tokens
        if xfer is not None and xfer.role == "decode":
            if request.request_id in self._received:
                return 0, False  # its receive failed and vLLM recomputes it (kv_load_failure_policy=recompute)
            missing = self.received_end(prompt) - num_computed_tokens
            return (missing, True) if missing > 0 else (0, False)
        rid = request.request_id
        if rid in self._prefetches:
            return self._after_prefetch(rid, num_computed_tokens)
        hit = self.stored_prefix_tokens(request, num_computed_tokens)
        if hit is None:
            return None, False  # vLLM asks again at its next step
        if hit <= num_computed_tokens:
            return 0, False
        _, ids = self._hits.pop(rid)
        spec = LoadSpec(rid, xfer, num_computed_tokens, hit, prompt, ids, [])
        self._prefetches[rid] = spec
        self._pending_prefetches.append(spec)
        return None, False  # read before the batch: skipped until the worker reports the reads ended

    def _after_prefetch(self, rid: str, num_computed_tokens: int) -> tuple[int | None, bool]:
        """A request read ahead: skipped (None) until its reads ended; then the good prefix beyond the local hit.
        A local hit that shrank below the frozen one meanwhile (evicted blocks) takes nothing from the read."""
        if rid not in self._ready:
            return None, False
        spec = self._prefetches[rid]
        good = self._ready[rid] if num_computed_tokens >= spec.computed else num_computed_tokens
        self._hits[rid] = (max(good, num_computed_tokens), spec.store_ids)
        return max(0, good - num_computed_tokens), False

    def received_end(self, prompt_tokens: int) -> int:
        """End of the rows a DE takes from its PE: the full blocks below the last prompt token. The DE computes
        the partial tail itself (at most ``block_size`` tokens): vLLM's CPU attention dies with SIGILL on a
        one-token prefill after a receive that ends inside a block (vLLM 0.32.0, docs/vllm.md)."""
        return (prompt_tokens - 1) // self.block_size * self.block_size

    def stored_prefix_tokens(self, request: Any, num_computed_tokens: int = 0) -> int | None:
        """Tokens of the request's longest stored prefix, block-aligned, leaving >= 1 prompt token to compute;
        None while the prefix stops, above the ``num_computed_tokens`` vLLM has locally, at a block that another
        request is persisting (typically the previous turn of the same conversation)."""
        ids = store_ids(self.namespace, request.block_hashes[: request.num_prompt_tokens // self.block_size])
        self.store.refresh(ids)  # adopt what other instances persisted since
        cap = (request.num_prompt_tokens - 1) // self.block_size
        stored = self.store.longest_prefix(ids)
        if (
            stored < cap
            and (stored + 1) * self.block_size > num_computed_tokens
            and self.announcements.pending(ids[stored])
        ):
            return None
        hit_blocks = min(stored, cap)
        self._hits[request.request_id] = (hit_blocks * self.block_size, ids)
        return hit_blocks * self.block_size

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        xfer = XferParams.from_request(request.kv_transfer_params)
        block_ids = list(blocks.get_block_ids()[0])
        computed = request.num_computed_tokens
        if xfer is not None and xfer.role == "prefill":
            self._prefill[request.request_id] = (xfer, block_ids, request.num_prompt_tokens)
        if xfer is not None and xfer.role == "decode":
            if request.request_id in self._received:
                return  # its receive failed and vLLM recomputes it: the transfer is over
            self._received.add(request.request_id)
            prompt, report = request.num_prompt_tokens, num_external_tokens > 0
            end = self.received_end(prompt) if report else computed
            if report:
                self._receiving.add(request.request_id)
            self._pending_recvs[request.request_id] = RecvSpec(
                request.request_id, xfer, computed, end, block_ids, prompt, report
            )
            return
        hit, ids = self._hits.pop(request.request_id, (0, []))
        read_ahead = self._prefetches.pop(request.request_id, None) is not None
        self._ready.pop(request.request_id, None)
        self._partly_ready.pop(request.request_id, None)
        if num_external_tokens > 0 or read_ahead or (xfer is not None and xfer.role == "prefill"):
            # a prefill request always gets a plan, so its DE learns the hit length even when it is 0
            self._pending_loads[request.request_id] = LoadSpec(
                request.request_id, xfer, computed, max(hit, computed), request.num_prompt_tokens, ids, block_ids
            )

    # -- each step ------------------------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> DualPathMetadata:
        meta = DualPathMetadata(
            prefetches=self._pending_prefetches,
            loads=list(self._pending_loads.values()),
            recvs=list(self._pending_recvs.values()),
            persists=self._pending_persists,
        )
        self._pending_loads, self._pending_recvs, self._pending_persists = {}, {}, []
        self._pending_prefetches = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._prefill:
                self._add_save(meta, new.req_id, new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self._prefill:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                xfer, table, prompt = self._prefill[req_id]
                table = list(new_blocks[0]) if req_id in cached.resumed_req_ids else table + list(new_blocks[0])
                self._prefill[req_id] = (xfer, table, prompt)
            self._add_save(meta, req_id, cached.num_computed_tokens[i], scheduled.get(req_id, 0))
        return meta

    def _add_save(self, meta: DualPathMetadata, req_id: str, start: int, count: int) -> None:
        xfer, table, prompt = self._prefill[req_id]
        end = min(start + count, prompt)
        if end > start:
            meta.saves.append(SaveSpec(req_id, xfer, start, end, list(table)))

    # -- the end of a request ---------------------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Persist a finished decode/standalone request's new full blocks; True keeps its blocks until written."""
        self._hits.pop(request.request_id, None)
        self._prefetches.pop(request.request_id, None)  # the worker drops its read ahead (finished_req_ids)
        self._ready.pop(request.request_id, None)
        self._partly_ready.pop(request.request_id, None)
        self._received.discard(request.request_id)
        if request.request_id in self._receiving:
            self._ended_receiving.add(request.request_id)
        xfer = XferParams.from_request(request.kv_transfer_params)
        if self._prefill.pop(request.request_id, None) is not None or xfer is not None and xfer.role == "prefill":
            return False, None
        if request.status not in _PERSISTED_STATUSES:
            return False, None  # aborted or failed: its KV may be incomplete
        full = request.num_computed_tokens // self.block_size
        ids = store_ids(self.namespace, request.block_hashes[:full])
        self.store.refresh(ids)
        first = self.store.longest_prefix(ids)
        if first >= full:
            return False, None
        self.announcements.announce(ids[first:])  # before vLLM sends the answer: the next turn waits for them
        self._pending_persists.append(PersistSpec(request.request_id, first, ids, list(block_ids)))
        self._persisting.add(request.request_id)
        return True, None

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, DualPathWorkerMeta):  # reads ahead that ended: their requests are scheduled next
            self._take_reports(meta)
        self._persisting.difference_update(connector_output.finished_sending or ())
        received = connector_output.finished_recving or ()
        self._receiving.difference_update(received)
        self._ended_receiving.difference_update(received)

    def _take_reports(self, meta: DualPathWorkerMeta) -> None:
        """A read ahead is ready once every tensor-parallel worker reported it (in one step or over several), with
        the shortest good prefix any reported: each rank loads its heads of the same tokens."""
        for rid, tokens in meta.ready.items():
            if rid not in self._prefetches:
                continue  # finished or aborted meanwhile
            shortest, count = self._partly_ready.pop(rid, (tokens, 0))
            shortest, count = min(shortest, tokens), count + meta.reports.get(rid, 1)
            if count >= self.settings.tp_size:
                self._ready[rid] = shortest
            else:
                self._partly_ready[rid] = (shortest, count)

    def has_pending_push_work(self) -> bool:
        """True while finished requests' blocks are being persisted (vLLM keeps stepping until they are stored, so a
        conversation's next turn finds its previous turn's KV), or a request vLLM finished is still receiving (its
        receive ends, completed or timed out, only in a step; vLLM frees it only then)."""
        return bool(self._persisting or self._ended_receiving)
