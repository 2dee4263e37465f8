"""Prefill and decode engines for DualPath KV loading, over the emulated device runtime.

Each engine is a node: an emulated NPU with its HCCL communicator, a storage NIC (a :class:`ReadQueue` with
a bandwidth cap over the shared :class:`LocalBlockStore`), a registered host buffer (``pe_buffer`` or
``de_buffer``) and HBM. Control messages (load plans, replies) go over a
:class:`~ascend_dualpath.dualpath.channels.Channel`; KV bytes go only through the transfer leg, whose transfer
engines are the emulator's unless the caller gives engines (a factory ``rank -> TransferEngine``).

The decode engine drives the job: it admits each turn (``de_buffer`` lease, all-or-nothing), picks the read
path with the scheduler's rule, starts the reads, streams the layers, does the final H2D into its HBM,
decodes greedily with the tiny Llama and persists the new Full Blocks. A failed path falls back to the other
one, then to a recompute with no cache; only then does the turn fail, with every error named.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from ascend_dualpath._checks import check_bound, check_type
from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.channels import Channel
from ascend_dualpath.dualpath.connector import HbmSlot, PrefillConnector, wait_reads
from ascend_dualpath.dualpath.read_paths import (
    DE_RANK,
    PE_RANK,
    LoadPlan,
    PathTimes,
    abort_peer,
    de_side_de_path,
    de_side_pe_path,
    make_plan,
)
from ascend_dualpath.dualpath.scheduler import ReadPath, choose_read_path
from ascend_dualpath.dualpath.transfer_leg import (
    FaultInjectingLeg,
    PeerAborted,
    TransferFailed,
    TransportTransferLeg,
)
from ascend_dualpath.dualpath.workload import Conversation
from ascend_dualpath.errors import (
    AdmissionDeferred,
    AdpError,
    ProtocolError,
    StorageReadError,
)
from ascend_dualpath.kv.buffers import HostBuffer, de_buffer, pe_buffer
from ascend_dualpath.kv.faults import FaultInjector
from ascend_dualpath.kv.layout import block_hashes
from ascend_dualpath.kv.read_queue import ReadQueue
from ascend_dualpath.kv.store import LocalBlockStore
from ascend_dualpath.models.tiny_llama import TinyLlama, TinyLlamaConfig

FALLBACK_ERRORS = (StorageReadError, TransferFailed, PeerAborted, AdmissionDeferred)
KV_BF16_ATOL = 0.125  # |KV - float64 full recompute| bound for bf16 KV (observed worst reported by the demo)
KV_FP32_ATOL = 1e-4


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes and caps shared by both engines (both must use the same values).

    Checked at construction: a wrong type raises :class:`~ascend_dualpath.errors.ArgumentTypeError`, a NaN,
    infinite or non-positive size, bandwidth or timeout :class:`ConfigError`, each naming the field.
    """

    store_root: str
    model: TinyLlamaConfig = TinyLlamaConfig()
    dtype: str = "bfloat16"
    block_tokens: int = 64
    max_tokens: int = 2048  # KV tokens one request may hold (prompt + generated)
    pe_snic_bytes_per_s: float = 4e6
    de_snic_bytes_per_s: float = 4e6
    pe_buffer_bytes: int = 16 << 20
    de_buffer_bytes: int = 32 << 20
    timeout_s: float = 30.0
    idle_timeout_s: float = 600.0
    verify: bool = True

    def __post_init__(self) -> None:
        where = "EngineConfig"
        check_type("store_root", self.store_root, (str, os.PathLike), where=where)
        check_type("model", self.model, TinyLlamaConfig, where=where)
        check_type("dtype", self.dtype, str, where=where)
        check_type("verify", self.verify, bool, where=where)
        for name in ("block_tokens", "max_tokens", "pe_buffer_bytes", "de_buffer_bytes"):
            check_bound(name, getattr(self, name), integer=True, where=where)
        for name in ("pe_snic_bytes_per_s", "de_snic_bytes_per_s", "timeout_s", "idle_timeout_s"):
            check_bound(name, getattr(self, name), where=where)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def layout(self):
        return self.model.kv_layout(self.torch_dtype, self.block_tokens)

    @property
    def slot_bytes(self) -> int:
        return self.max_tokens * self.layout.token_bytes

    @property
    def hccl_buffer_mb(self) -> int:
        return max(1, -(-2 * self.slot_bytes // (1 << 20)))

    def namespace(self) -> bytes:
        return self.layout.fingerprint() + f"tiny-llama:{self.model}".encode()

    @property
    def compat(self) -> m.Compat:
        """What both engines must share for the bytes between them to mean the same (checked at set-up)."""
        return m.Compat.of(self.layout, ENGINE_KIND)


ENGINE_KIND = "emulator"  # the engines' devices and transfer engines (their communicators are emulated)
EngineFactory = Callable[[int], Any]  # rank -> the TransferEngine writing to that rank


class _Node:
    def __init__(
        self,
        config: EngineConfig,
        comm: Any,
        channel: Channel,
        role: str,
        snic_bytes_per_s: float,
        buffer_bytes: int,
        faults: FaultInjector | None,
        engines: EngineFactory | None,
    ) -> None:
        from ascend_dualpath import _ext

        C = _ext.load()
        self.C, self.config, self.comm, self.channel = C, config, comm, channel
        self.layout = config.layout
        self.model = TinyLlama(config.model, config.torch_dtype)
        self.store = LocalBlockStore(config.store_root, self.layout, faults=faults)
        self.read_queue = ReadQueue(self.store, snic_bytes_per_s, node=role)
        self.leg = FaultInjectingLeg(TransportTransferLeg(comm, config.timeout_s, engines=engines))
        self.buffer_region = comm.device.alloc_region(buffer_bytes, C.MemKind.HOST_DRAM, 7)
        self._register(self.buffer_region)
        make = pe_buffer if role == "pe" else de_buffer
        self.buffer: HostBuffer = make(backing=self.buffer_region, timeout_s=config.timeout_s)

    def _register(self, region: Any) -> None:
        """``region`` as a source of the node's own HcclBatchPut (the final H2D) and of the leg's transfers."""
        self.comm.register_local(region)
        self.leg.register_local(region)

    def close(self) -> None:
        self.read_queue.close()
        self.leg.close()
        self.store.close()
        for region in self._regions():  # explicitly: an exception's traceback may keep the objects alive
            region.close()

    def _regions(self) -> list:
        return [self.buffer_region]


class PrefillEngine(_Node):
    """The PE: serves load plans from the DE, prefilling layer by layer through a :class:`PrefillConnector`.

    ``engines`` (a factory ``rank -> TransferEngine``) moves its layers; None: the emulator's engines of ``comm``.
    """

    def __init__(
        self,
        config: EngineConfig,
        comm: Any,
        channel: Channel,
        faults: FaultInjector | None = None,
        engines: EngineFactory | None = None,
    ):
        super().__init__(
            config, comm, channel, "pe", config.pe_snic_bytes_per_s, config.pe_buffer_bytes, faults, engines
        )
        window = comm.windows_in
        hbm = torch.frombuffer(memoryview(window), dtype=torch.uint8)
        slots = [
            HbmSlot(window.addr + k * config.slot_bytes, hbm[k * config.slot_bytes : (k + 1) * config.slot_bytes])
            for k in range(2)
        ]
        self.connector = PrefillConnector(
            self.layout, comm, self.leg, self.read_queue, self.buffer, slots, config.timeout_s
        )
        self.served = 0

    def serve(self) -> None:
        """Handle messages until ``stop``: ``setup``, ``prefetch``, ``prefill``."""
        try:
            while True:
                message = self.channel.recv(self.config.idle_timeout_s, "control message")
                if isinstance(message, m.Stop):
                    return
                if isinstance(message, m.Setup):  # the DE buffer, writable by this PE, once the DE speaks this protocol
                    self._setup(message.host_mem, message.speaks)
                elif isinstance(message, m.Prefetch):
                    self.connector.prefetch(message.request_id, message.hit_block_ids)
                elif isinstance(message, m.Drop):
                    self.connector.drop_prefetched(message.request_id)
                elif isinstance(message, m.Prefill):
                    self.channel.send(self._prefill(message.plan))
                else:
                    raise ProtocolError(
                        f"prefill engine: {type(message).__struct_config__.tag!r} is not a PE's message"
                    )
        finally:
            self.connector.drop_prefetched()

    def _setup(self, host_mem: tuple[int, int, int], speaks: m.Speaks) -> None:
        """Check what the DE speaks (refused: it hears why, and this engine stops), then take its buffer."""
        try:
            m.check_peer(self.config.compat, speaks, "the prefill engine", "the decode engine")
        except ProtocolError as error:
            self.channel.send(m.Error(error=str(error)))
            raise
        self.comm.add_remote_mem(DE_RANK, self.C.RemoteMem(*host_mem))
        self.channel.send(m.Ok())

    def _prefill(self, plan: LoadPlan) -> m.Prefilled:
        conn, model, layout = self.connector, self.model, self.layout
        try:
            conn.start_load_kv(plan)
            hidden = model.embed(list(plan.new_tokens))
            for layer in range(layout.num_layers):
                rows = conn.wait_for_layer_load(layer)
                hidden, miss = model.layer_forward(layer, hidden, layout.field_view(rows, "kv"))
                conn.save_kv_layer(layer, layout.encode_rows(kv=miss))
            conn.wait_for_save()
            first_token = int(torch.argmax(model.logits(hidden[-1:])[-1]))
            self.served += 1
            s = conn.stats
            return m.Prefilled(
                *plan.key,
                ok=True,
                first_token=first_token,
                pe_read_bytes=s.pe_read_bytes,
                read_started=s.read_started,
                read_finished=s.read_finished,
                vtime_ns=s.vtime_ns,
            )
        except Exception as error:
            flag_error = conn.abort() if conn._plan is not None else None
            detail = f"{type(error).__name__}: {error}" + (f" (abort flag failed: {flag_error})" if flag_error else "")
            return m.Prefilled(*plan.key, ok=False, detail=detail, pe_read_bytes=conn.stats.pe_read_bytes)
        finally:
            conn.finish()


@dataclasses.dataclass
class TurnResult:
    """One served turn, as the demo prints it."""

    agent_id: int
    turn: int
    path: str  # final path: "pe", "de" or "recompute"
    prompt_tokens: int
    hit_tokens: int
    pe_read_bytes: int
    de_read_bytes: int
    ttft_s: float
    vtime_ns: float
    generated: list[int]
    fallbacks: list[str]
    kv: torch.Tensor | None = None  # uint8 [L, T_kv, C] copy of DE HBM (for verification)
    sequence: list[int] | None = None
    error: str | None = None  # set when every path failed ("failed" path); the agent stops there


@dataclasses.dataclass(frozen=True)
class _AdmittedTurn:
    """A turn of a wave that holds a DE buffer lease (and, on the DE path, started storage reads)."""

    rid: int
    agent: int
    turn: int
    prompt: list[int]
    gen: int
    hit_ids: list[bytes]
    path: ReadPath
    lease: Any
    tickets: list | None


class TurnFailed(AdpError):
    """Every path (PE, DE, recompute) failed for a turn; the message lists each error."""


class DecodeEngine(_Node):
    """The DE: drives the job (admission, read-path choice, streaming, H2D, decode, persistence).

    ``engines`` (a factory ``rank -> TransferEngine``) moves its layers; None: the emulator's engines of ``comm``.
    """

    def __init__(
        self,
        config: EngineConfig,
        comm: Any,
        channel: Channel,
        faults: FaultInjector | None = None,
        engines: EngineFactory | None = None,
    ):
        super().__init__(
            config, comm, channel, "de", config.de_snic_bytes_per_s, config.de_buffer_bytes, faults, engines
        )
        L, C = self.layout.num_layers, self.layout.token_bytes
        self.hbm_region = comm.device.alloc_region(L * config.max_tokens * C, self.C.MemKind.DEVICE_GM, 7)
        self._register(self.hbm_region)
        comm.add_remote_mem(DE_RANK, self.C.RemoteMem(self.hbm_region.addr, self.hbm_region.size, self.hbm_region.rkey))
        self.hbm = torch.frombuffer(memoryview(self.hbm_region), dtype=torch.uint8).view(L, config.max_tokens, C)
        pe_window = comm.peer_info(PE_RANK).windows_in.addr
        self.pe_slot_addrs = [pe_window + k * config.slot_bytes for k in range(2)]
        self.namespace = config.namespace()
        self._request_ids = iter(range(1 << 62))
        region = self.buffer_region
        self.channel.send(m.Setup(host_mem=(region.addr, region.size, region.rkey), speaks=m.Speaks.of(config.compat)))
        reply = self.channel.recv(config.timeout_s, "setup reply")
        if isinstance(reply, m.Error):
            raise ProtocolError(f"the prefill engine refused this decode engine: {reply.error}")
        if not isinstance(reply, m.Ok):
            raise ProtocolError(f"expected the prefill engine's set-up reply, got {reply!r}")

    def _regions(self) -> list:
        return [self.buffer_region, self.hbm_region]

    def stop_peer(self) -> None:
        self.channel.send(m.Stop())

    # -- one wave of turns ------------------------------------------------------------------------------------------
    def serve_wave(
        self,
        turns: list[tuple[int, int, list[int], int]],
        mode: str = "dual",
        on_turn: Callable[[TurnResult], None] | None = None,
    ) -> tuple[list[TurnResult], list[int], dict]:
        """Serve turns that arrive together: ``(agent_id, turn, prompt_tokens, gen_tokens)`` each.

        All turns are admitted and their reads started at once (so both SNICs work in parallel); then they are
        prefilled and decoded in order. ``mode`` is ``"dual"`` (scheduler rule), ``"pe"`` or ``"de"``.

        Returns the results, the indices of turns deferred for lack of ``de_buffer`` space, and read timing.
        """
        T, L, C = self.layout.block_tokens, self.layout.num_layers, self.layout.token_bytes
        start = time.monotonic()
        admitted, deferred = [], []
        queued = {ReadPath.PE: 0, ReadPath.DE: 0}
        for index, (agent, turn, prompt, gen) in enumerate(turns):
            total_kv = len(prompt) + gen - 1
            if total_kv > self.config.max_tokens:
                raise ProtocolError(
                    f"agent {agent} turn {turn}: {total_kv} KV tokens exceed max_tokens={self.config.max_tokens}"
                )
            ids = block_hashes(prompt, T, self.namespace)
            hit = min(self.store.longest_prefix(ids), (len(prompt) - 1) // T)  # >= 1 token left to prefill
            rid = next(self._request_ids)
            try:
                lease = self.buffer.allocate(rid, L * len(prompt) * C, timeout_s=0)
            except AdmissionDeferred:
                deferred.append(index)
                continue
            if hit == 0:
                path = ReadPath.PE
            elif mode == "dual":
                path = choose_read_path(queued[ReadPath.PE], queued[ReadPath.DE])
            else:
                path = ReadPath(mode)
            queued[path] += hit * T
            hit_ids = ids[:hit]
            tickets = None
            if path is ReadPath.DE:
                tickets = self._submit_reads(hit_ids, lease)
            elif hit:
                self.channel.send(m.Prefetch(request_id=rid, hit_block_ids=hit_ids))
            admitted.append(_AdmittedTurn(rid, agent, turn, prompt, gen, hit_ids, path, lease, tickets))
        results, read_spans = [], []
        pending = collections.deque(admitted)
        try:
            while pending:
                t = pending[0]
                try:
                    result = self._serve(
                        t.rid,
                        t.agent,
                        t.turn,
                        t.prompt,
                        t.gen,
                        t.hit_ids,
                        t.path,
                        t.lease,
                        t.tickets,
                        start,
                        read_spans,
                    )
                except TurnFailed as error:  # this turn ends with a clear error; the wave goes on
                    result = TurnResult(
                        t.agent,
                        t.turn,
                        "failed",
                        len(t.prompt),
                        0,
                        0,
                        0,
                        time.monotonic() - start,
                        0.0,
                        [],
                        [],
                        error=str(error),
                    )
                # any other error leaves the turn pending: the cleanup below also drops its PE prefetch
                pending.popleft()
                self._release(t.lease, t.tickets)
                results.append(result)
                if on_turn is not None:
                    on_turn(result)
        finally:  # the wave ended early: give back what its unfinished turns hold, here and on the PE
            for t in pending:
                self._release(t.lease, t.tickets)
                if t.path is ReadPath.PE and t.hit_ids:
                    self.channel.send(m.Drop(request_id=t.rid))
        return results, deferred, {"read_spans": read_spans, "wave_s": time.monotonic() - start}

    def _release(self, lease, tickets) -> None:
        if tickets is not None:  # no read may still land in the lease once it is free
            with contextlib.suppress(Exception):
                wait_reads(tickets, self.config.timeout_s)
        lease.release()

    def _submit_reads(self, hit_ids: list[bytes], lease) -> list:
        fb = self.layout.full_block_bytes
        return [self.read_queue.submit(block_id, lease.slice(b * fb, fb).view) for b, block_id in enumerate(hit_ids)]

    def _serve(self, rid, agent, turn, prompt, gen, hit_ids, path, lease, tickets, start, read_spans):
        other = ReadPath.DE if path is ReadPath.PE else ReadPath.PE
        attempts = [(path, hit_ids), (other, hit_ids)] if hit_ids else []
        attempts.append((ReadPath.PE, []))  # recompute: no cached prefix
        errors: list[str] = []
        read_bytes = {ReadPath.PE: 0, ReadPath.DE: 0}
        for attempt, (attempt_path, ids) in enumerate(attempts):
            label = "recompute" if attempt and not ids else attempt_path.value
            try:
                return self._attempt(
                    rid,
                    attempt,
                    agent,
                    turn,
                    prompt,
                    gen,
                    ids,
                    attempt_path,
                    lease,
                    tickets if attempt == 0 else None,
                    start,
                    read_spans,
                    read_bytes,
                    errors,
                    label,
                )
            except FALLBACK_ERRORS as error:
                errors.append(f"{label}: {type(error).__name__}: {error}")
                lease.tensor.zero_()  # no half-written layer survives the failed attempt
        raise TurnFailed(f"agent {agent} turn {turn}: every path failed: " + "; ".join(errors))

    def _attempt(
        self,
        rid,
        attempt,
        agent,
        turn,
        prompt,
        gen,
        hit_ids,
        path,
        lease,
        tickets,
        start,
        read_spans,
        read_bytes,
        errors,
        label,
    ) -> TurnResult:
        cfg, layout = self.config, self.layout
        hit_tokens = len(hit_ids) * layout.block_tokens
        if path is ReadPath.DE and hit_ids:
            tickets = tickets or self._submit_reads(hit_ids, lease)
            wait_reads(tickets, cfg.timeout_s)
            read_bytes[ReadPath.DE] += len(hit_ids) * layout.full_block_bytes
            read_spans.append((min(t.started_at for t in tickets), max(t.finished_at for t in tickets)))
        plan = make_plan(self.comm, rid, attempt, path, prompt[hit_tokens:], hit_ids, lease.addr, layout.num_layers)
        self.channel.send(m.Prefill(plan=plan))
        times = PathTimes()
        try:
            if path is ReadPath.DE and hit_ids:
                de_side_de_path(plan, layout, self.comm, self.leg, self.pe_slot_addrs, cfg.timeout_s, times)
            else:
                de_side_pe_path(plan, layout, self.comm, cfg.timeout_s, times)
        except FALLBACK_ERRORS as error:
            flag_error = abort_peer(self.leg, PE_RANK, plan.abort_to_pe)
            reply = self._reply(plan)
            raise type(error)(
                f"{error}; PE said: {reply.detail}" + (f"; abort flag failed: {flag_error}" if flag_error else "")
            ) from error
        reply = self._reply(plan)
        read_bytes[ReadPath.PE] += reply.pe_read_bytes
        if reply.read_started is not None:
            read_spans.append((reply.read_started, reply.read_finished))
        if not reply.ok:
            raise PeerAborted(f"prefill engine failed request {rid}: {reply.detail}")
        first_token, pe_vtime = reply.first_token, reply.vtime_ns
        ttft = time.monotonic() - start
        total = len(prompt)
        copies = plan.lease(layout).layer_copies(plan.de_lease_addr, self.hbm_region.addr, cfg.max_tokens)
        vtime = self.comm.batch_put(
            DE_RANK, [self.C.OneSideDesc(src, dst, n, 0) for src, dst, n in copies], cfg.timeout_s
        )
        generated = self._decode(total, first_token, gen)
        kv_tokens = total + gen - 1
        sequence = list(prompt) + generated
        self._persist(sequence, kv_tokens, len(hit_ids))
        kv = self.hbm[:, :kv_tokens].clone() if cfg.verify else None
        return TurnResult(
            agent,
            turn,
            label,
            total,
            hit_tokens,
            read_bytes[ReadPath.PE],
            read_bytes[ReadPath.DE],
            ttft,
            max(vtime, pe_vtime, times.vtime_ns),
            generated,
            list(errors),
            kv,
            sequence,
        )

    def _reply(self, plan: LoadPlan) -> m.Prefilled:
        reply = self.channel.recv(self.config.timeout_s * 4, f"prefill reply for request {plan.request_id}")
        if not isinstance(reply, m.Prefilled) or reply.key != plan.key:
            raise ProtocolError(f"expected the reply to request/attempt {plan.key}, got {reply!r}")
        return reply

    def _decode(self, total: int, first_token: int, gen: int) -> list[int]:
        """Greedy decode from the KV in HBM, appending each step's KV rows in place."""
        model, layout = self.model, self.layout
        generated = [first_token]
        for position in range(total, total + gen - 1):
            hidden = model.embed([generated[-1]])
            for layer in range(layout.num_layers):
                hit = layout.field_view(self.hbm[layer, :position], "kv")
                hidden, new_kv = model.layer_forward(layer, hidden, hit)
                self.hbm[layer, position] = layout.encode_rows(kv=new_kv)[0]
            generated.append(int(torch.argmax(model.logits(hidden)[-1])))
        return generated

    def _persist(self, sequence: list[int], kv_tokens: int, first_new_block: int) -> None:
        """Write the Full Blocks the KV in HBM now covers beyond the cached prefix (chained, atomic)."""
        T = self.layout.block_tokens
        ids = block_hashes(sequence[: (kv_tokens // T) * T], T, self.namespace)
        for b in range(first_new_block, len(ids)):
            if not self.store.contains(ids[b]):
                self.store.write_block(ids[b], ids[b - 1] if b else None, self.hbm[:, b * T : (b + 1) * T].contiguous())

    # -- whole job ----------------------------------------------------------------------------------------------------
    def run_conversations(
        self, conversations: list[Conversation], mode: str = "dual", on_turn: Callable[[TurnResult], None] | None = None
    ) -> dict:
        """Replay conversations in lock-step waves (turn k of every agent arrives together)."""
        history = {c.agent_id: [] for c in conversations}
        next_turn = {c.agent_id: 0 for c in conversations}
        by_agent = {c.agent_id: c for c in conversations}
        job_start = time.monotonic()
        waves, results, deferred_total = [], [], 0
        while any(next_turn[a] < len(by_agent[a].turns) for a in by_agent):
            batch = []
            for agent, conv in by_agent.items():
                k = next_turn[agent]
                if k < len(conv.turns):
                    batch.append((agent, k, history[agent] + list(conv.turns[k].append), conv.turns[k].gen_tokens))
            served, deferred, timing = self.serve_wave(batch, mode, on_turn)
            if len(deferred) == len(batch):
                raise AdmissionDeferred(
                    f"de_buffer of {self.buffer.capacity_bytes} bytes cannot admit any turn of "
                    f"this wave ({len(batch)} turns)"
                )
            deferred_total += len(deferred)
            for result in served:
                if result.error is not None:
                    next_turn[result.agent_id] = len(by_agent[result.agent_id].turns)
                    continue
                history[result.agent_id] = result.sequence
                next_turn[result.agent_id] += 1
                if not self.config.verify:
                    result.sequence = None
            waves.append(timing)
            results.extend(served)
        return {
            "results": results,
            "waves": waves,
            "deferred": deferred_total,
            "failed": sum(r.error is not None for r in results),
            "jct_s": time.monotonic() - job_start,
            "nic_vtime_ns": self.comm.device.nic.virtual_time_ns,
            "nic_bytes": self.comm.device.nic.bytes_moved,
            "transfer_kinds": dict(getattr(self.leg, "kinds_used", {})),
        }


def verify_turn(
    result: TurnResult,
    prompt: list[int],
    model: TinyLlama,
    reference: TinyLlama,
    store: LocalBlockStore,
    namespace: bytes,
    atol: float,
    teacher_forced: bool = False,
) -> dict:
    """Check one served turn against a no-cache run.

    Loaded bytes (the hit rows in DE HBM) must equal the stored blocks bit for bit; every KV row must be within
    ``atol`` of the float64 full recompute; greedy tokens must equal those of a no-cache run. With
    ``teacher_forced`` (the demo) the no-cache run is one forward over prompt + generated tokens whose argmax at
    each generating position must give the next token: by causality the same as recomputing step by step
    (``model.generate_greedy_recompute``, the default), at one forward instead of one per token.
    """
    layout = store.layout
    T = layout.block_tokens
    kv = result.kv
    assert kv is not None, "run with verify=True to keep the decoded KV"
    ids = block_hashes(prompt, T, namespace)[: result.hit_tokens // T]
    loaded_exact = True
    for b, block_id in enumerate(ids):
        stored = layout.empty_full_blocks(1)[0]
        store.read_into(block_id, stored)
        loaded_exact &= torch.equal(kv[:, b * T : (b + 1) * T], stored)
    _, reference_kv = reference.forward(prompt + result.generated[:-1])
    worst = 0.0
    for layer, ref in enumerate(reference_kv):
        got = layout.field_view(kv[layer], "kv").double()
        worst = max(worst, float((got - ref).abs().max()))
    if teacher_forced:
        logits, _ = model.forward(prompt + result.generated[:-1])
        tokens = [int(t) for t in torch.argmax(logits[len(prompt) - 1 :], dim=-1)]
    else:
        tokens = model.generate_greedy_recompute(prompt, len(result.generated))
    return {
        "loaded_exact": loaded_exact,
        "kv_max_err": worst,
        "kv_ok": worst <= atol,
        "tokens_equal": tokens == result.generated,
    }
