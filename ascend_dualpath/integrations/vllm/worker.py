"""The worker half of the DualPath connector (runs in each vLLM worker: one per tensor-parallel rank): a thin host
of the two DualPath halves.

It adapts vLLM to them and keeps vLLM's bookkeeping: the step's metadata goes to the PE half
(:class:`~ascend_dualpath.dualpath.prefill_side.PrefillSide`: loads before each layer's attention, saves after
it) and the DE half (:class:`~ascend_dualpath.dualpath.decode_side.DecodeSide`: receives and the merge into the
paged cache); vLLM's layer names become layer indices; finished requests are persisted
(:mod:`~ascend_dualpath.integrations.vllm.persisting`) and reported through ``get_finished``; a failed load's
blocks through ``get_block_ids_with_load_errors``; the counters through vLLM's metrics (``stats_since_last``). The
side channel serves both halves' ops and ``status``. The read paths, split, fallback and quarantine are the halves'
(their module docstrings; docs/vllm.md has the sequence diagrams).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from ascend_dualpath._platform import request_amx_state
from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.counters import Counters
from ascend_dualpath.dualpath.dataplane import DE_RANK, PE_RANK, Dataplane, open_dataplane
from ascend_dualpath.dualpath.decode_side import DecodeSide
from ascend_dualpath.dualpath.prefill_side import PrefillSide
from ascend_dualpath.dualpath.quarantine import Quarantine
from ascend_dualpath.dualpath.replicas import RankGroup, Replicas
from ascend_dualpath.dualpath.settings import ConnectorSettings
from ascend_dualpath.dualpath.side_channel import SideChannel
from ascend_dualpath.errors import ProtocolError
from ascend_dualpath.integrations.vllm.metadata import DualPathMetadata, DualPathWorkerMeta, PersistSpec
from ascend_dualpath.integrations.vllm.persisting import PersistAnnouncements, Persister
from ascend_dualpath.kv.layout import KVLayout
from ascend_dualpath.kv.parts import PartStore
from ascend_dualpath.kv.read_queue import ReadQueue
from ascend_dualpath.kv.store import LocalBlockStore, ShardStore

log = logging.getLogger(__name__)
IDLE_STEP_S = 0.005  # a step with only reads ahead or writes pending polls them at most ~200 times a second


class DualPathWorker:
    """Worker-side state of one instance.

    Parameters
    ----------
    settings : ConnectorSettings
        The instance's connector settings.
    layout : KVLayout
        Token rows of the whole model (all heads); the worker holds ``layout.shard(settings.tp_size,
        settings.tp_rank)`` of them (its :attr:`shard`; the adapter's rows are the shard's ``local`` layout).
    store : LocalBlockStore
        The shared block store of full blocks (``layout``); a rank holding some heads reads through a
        :class:`~ascend_dualpath.kv.store.ShardStore` of its byte ranges only; a rank of a tensor-parallel size
        above 1 persists through a :class:`~ascend_dualpath.kv.parts.PartStore` (its part of each block; the full
        block is visible once every owner's part is there).
    adapter_factory : callable
        ``(layer_name, cache) -> adapter``: the paged-layout adapter of the model's attention backend
        (``write_tokens(cache, block_ids, start, rows)``, ``read_tokens(cache, block_ids, start, end)``).
    group : RankGroup, optional
        The instance's tensor-parallel ranks (vLLM's tensor-parallel group); required where ranks share units (MLA,
        replicated GQA heads): one of them reads and moves each request's rows, the others take them from it
        (:mod:`~ascend_dualpath.dualpath.replicas`).
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        layout: KVLayout,
        store: LocalBlockStore,
        adapter_factory,
        group: RankGroup | None = None,
    ) -> None:
        self.shard = layout.shard(settings.tp_size, settings.tp_rank)
        self.replicas = Replicas(self.shard, group)
        # a rank persists its part of each block (the units it is the lowest holder of); the last part publishes it
        writer = PartStore(store, self.shard) if settings.tp_size > 1 else store
        if not self.shard.whole:
            store = ShardStore(store, self.shard)
        self.settings, self.layout, self.store = settings, self.shard.local, store
        self._adapter_factory = adapter_factory
        self.read_queue = ReadQueue(store, settings.snic_bytes_per_s, node=settings.node)
        self.announcements = PersistAnnouncements(settings.store, settings.persist_wait_s)
        self.counters = Counters()
        self.persister = Persister(writer, self.announcements, self.counters)
        self.quarantine = Quarantine(self.counters)
        self.caches: list[torch.Tensor] = []
        self._layer_of: dict[str, int] = {}
        self.adapter = None
        self.dataplane: Dataplane | None = None
        self.side: SideChannel | None = None
        self.prefill = PrefillSide(settings, self.shard, store, self.read_queue, self.counters, self.quarantine)
        self.decode = DecodeSide(settings, self.shard, store, self.read_queue, self.counters, self.quarantine)
        self._finished_sending: set[str] = set()
        self._step_idle = True  # the last step had nothing but reads ahead
        # vLLM's metrics (stats_since_last): the counters as last handed over, and layer waits not yet handed over
        self._reported: dict[str, int] = {}
        self._reported_quarantine: int | None = None

    # -- set-up ---------------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any], layer_index) -> None:
        """Take vLLM's per-layer caches (``layer_index(name) -> int`` orders them), open the device on the
        fabric (PE and DE) and the side channel."""
        request_amx_state()  # before the connector's threads exist
        names = sorted(kv_caches, key=layer_index)
        self.caches = [kv_caches[name] for name in names]
        self._layer_of = {name: i for i, name in enumerate(names)}
        self.adapter = self._adapter_factory(names[0], self.caches[0])
        if self.settings.role in ("prefill", "decode"):
            self.dataplane = open_dataplane(self.settings, PE_RANK if self.settings.role == "prefill" else DE_RANK)
            self.decode.bind(self.caches, self.adapter, self.dataplane)
        if self.settings.side_port is not None:
            s = self.settings
            self.side = SideChannel(
                s.side_port, self._handle, host=s.side_host, advertise=s.side_advertise, token=s.side_token,
                max_bytes=s.side_max_bytes, counters=self.counters, name=f"adp-{s.node}",
            )  # fmt: skip
        self.prefill.bind(self.caches, self.adapter, self.dataplane, self.side.address if self.side else "")

    def shutdown(self) -> None:
        if self.side is not None:
            self.side.close()
        self.quarantine.close(self.settings.timeout_s)  # nothing is given back into a closing dataplane
        self.prefill.close()
        self.persister.close()
        self.read_queue.close()
        self.decode.close()
        if self.dataplane is not None:
            self.dataplane.close()
        self.store.close()

    # -- the step ------------------------------------------------------------------------------------------------------
    def start_step(self, meta: DualPathMetadata) -> None:
        """Everything of one step that must precede its forward: vLLM calls ``start_load_kv`` after the forward
        when no request of the step loads synchronously, but binds the metadata before it. Reads ahead start here
        and are not waited for."""
        self._step_idle = not (meta.loads or meta.saves or meta.recvs or meta.persists)
        peer_size = self._peer_size
        self.prefill.prefetch(self.replicas.read_ahead(meta.prefetches, peer_size))
        self.prefill.start(self.replicas.start(meta.loads, peer_size), self.replicas.mine(meta.saves, peer_size))
        for spec in meta.recvs:
            if self.replicas.add_recv(spec):
                self.decode.add_recv(spec)
        for spec in meta.persists:
            self._persist(spec)
        self.decode.complete_recvs()

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_of.get(layer_name)
        if layer is not None:
            self.prefill.wait_for_layer_load(layer)
            self.replicas.copy_layer(layer, self.caches[layer], self.adapter)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        layer = self._layer_of.get(layer_name)
        if layer is not None:
            self.prefill.save_kv_layer(layer, kv_layer)

    def wait_for_save(self) -> None:
        self.prefill.wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.prefill.block_ids_with_load_errors()

    def build_worker_meta(self) -> DualPathWorkerMeta | None:
        """The reads ahead that ended since the last call (None: none).

        While only reads ahead or persists are pending, vLLM steps with nothing to compute back to back; each such
        step waits up to ``IDLE_STEP_S`` here (a persist's end cuts it short), so the loop does not spin a core.
        The spin is not only waste: with tensor parallelism, vLLM's workers wait for each step in a ``sched_yield``
        loop, and two of them spinning on one core were seen to starve the kernel's block-I/O worker there, leaving a
        persist's fsync unanswered for minutes."""
        ready = self.prefill.ready() | self.replicas.ready()
        if not ready and self._step_idle:
            if self.persister.writing():
                self.persister.wait(IDLE_STEP_S)
            elif self.prefill.pending_prefetches():
                time.sleep(IDLE_STEP_S)
        return DualPathWorkerMeta(ready) if ready else None

    # -- the side channel --------------------------------------------------------------------------------------------
    def _handle(self, message: m.Request) -> m.Reply:
        if isinstance(message, m.StatusQuery):
            return self.status()
        if isinstance(message, m.WritesEnded):
            return self.prefill.on_writes_ended(message)
        handler = self.decode.handlers().get(type(message))
        if handler is None:
            raise ProtocolError(f"side-channel op {type(message).__struct_config__.tag!r} is not one a "
                                f"{self.settings.role} instance answers")  # fmt: skip
        return handler(message)

    def status(self) -> m.Status:
        """This rank's share of its instance's live state (:class:`~ascend_dualpath.dualpath.messages.Status`): its
        read queue and storage NIC, what it holds unfinished and now (the counters go to vLLM's metrics:
        :meth:`stats_since_last`)."""
        self.decode.complete_recvs(drains_only=True)  # also expires orphan plans, even on an idle engine
        stats = self.read_queue.stats()
        token_bytes = self.shard.full.kv_bytes(1)  # the whole model's, so that the ranks' queues in tokens add up
        unfinished = (
            self.decode.unfinished_tokens() + self.prefill.unfinished_tokens() if self.shard.counts_requests else []
        )
        return m.Status(
            role=self.settings.role,
            node=self.settings.node,
            device_id=self.settings.device_id,
            snic_bytes_per_s=self.settings.snic_bytes_per_s,
            read_queue_tokens=stats.bytes // token_bytes,
            read_queue_bytes=stats.bytes,
            snic_read_bytes=stats.completed_bytes,
            snic_read_blocks=stats.completed_blocks if self.shard.counts_requests else 0,
            unfinished_requests=len(unfinished),
            unfinished_tokens=sum(unfinished),
            quarantined_bytes=self.quarantine.held_bytes,
            host_leases=self.dataplane.host.stats().live_leases if self.dataplane is not None else 0,
            reading=self.prefill.reading() + self.decode.reading(),
            tp_size=self.settings.tp_size,
            tp_rank=self.settings.tp_rank,
        )

    def stats_since_last(self) -> tuple[dict[str, int], list[float], int] | None:
        """What changed since the last call, for vLLM's metrics: each counter's increment (``Counters`` fields,
        ``snic_read_bytes``, ``snic_read_blocks``), the layer waits (s) and the quarantined bytes now; None when
        nothing changed. vLLM's model runner calls it once per step (``get_kv_connector_stats``)."""
        queue = self.read_queue.stats()
        now = {
            **dataclasses.asdict(self.counters),
            "snic_read_bytes": queue.completed_bytes,
            "snic_read_blocks": queue.completed_blocks if self.shard.counts_requests else 0,
        }
        increments = {k: v - self._reported.get(k, 0) for k, v in now.items() if v != self._reported.get(k, 0)}
        waits, self.prefill.layer_waits = self.prefill.layer_waits, []  # the forward's thread, the only one appending
        held = self.quarantine.held_bytes
        if not increments and not waits and held == self._reported_quarantine:
            return None
        self._reported, self._reported_quarantine = now, held
        return increments, waits, held

    # -- DE and standalone: persist ------------------------------------------------------------------------------------
    def _persist(self, spec: PersistSpec) -> None:
        """Copy a finished request's new full blocks out of the cache now; write them to the store behind."""
        T = self.layout.block_tokens
        if not getattr(self.persister.store, "owns", True):  # another rank writes these heads (or the latent)
            self.persister.persist(dataclasses.replace(spec, first_block=len(spec.store_ids)), None)
            return

        def block(i: int) -> torch.Tensor:
            layers = [self.adapter.read_tokens(cache, spec.block_ids, i * T, (i + 1) * T) for cache in self.caches]
            return torch.stack(layers).contiguous()

        self.persister.persist(spec, block)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call."""
        self.decode.complete_recvs()
        # a persisted request is reported once its blocks are stored, so its next turn finds them
        self._finished_sending.update(self.persister.finished())
        self.prefill.finish(finished_req_ids)
        sending, self._finished_sending = self._finished_sending, set()
        de = self.decode
        recving, de.finished_recving = de.finished_recving, set()
        failed, de.failed_recving = de.failed_recving, set()
        self.replicas.end_recvs(recving, failed, self.caches, self.adapter)
        return sending, recving, failed

    def _peer_size(self, address: str) -> int:
        """The tensor-parallel size of the DE at ``address``; 0 where it cannot be asked (the load then fails on
        its own rank, as any load whose DE is unreachable)."""
        try:
            return self.prefill.peer_size(address)
        except Exception as error:
            log.warning("DualPath: the DE at %s did not tell its tensor-parallel size: %s", address, error)
            return 0
