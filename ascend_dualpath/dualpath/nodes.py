"""The tiny-Llama demo's prefill and decode engines: two thin hosts of DualPath's PE and DE halves.

Each engine is an instance as the vLLM connector's are: a dataplane (an emulated NPU on a shared fabric, its
registered host buffer, one pair link per peer), a side channel, a storage NIC (a :class:`ReadQueue` with a
bandwidth cap over the shared :class:`LocalBlockStore`) and a paged KV cache of token rows. The PE hosts
:class:`~ascend_dualpath.dualpath.prefill_side.PrefillSide` and the DE
:class:`~ascend_dualpath.dualpath.decode_side.DecodeSide`, the same halves the vLLM worker hosts, so the demo reads,
pushes, splits, takes over, recomputes and quarantines exactly as a served model does. The tiny Llama stands in for
vLLM's model runner: one step of the PE prefills a wave of turns layer by layer.

The decode engine drives the job over a :class:`~ascend_dualpath.dualpath.channels.Channel` to the PE: it admits
each wave (its leases and cache blocks, all-or-nothing per turn), picks each turn's read path with the scheduler's
rule, sends the wave to the PE (the PE plans each turn with the DE over the side channel: the PE plans, the DE
answers), takes the rows the PE sends into its cache, decodes greedily and persists the new Full Blocks. A failed
half is read by the other storage NIC, a failed load is recomputed; only a receive that fails whole is recomputed
on the DE, and every error is named.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ascend_dualpath._checks import check_bound, check_type
from ascend_dualpath.backends.emulator import new_fabric_name
from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.channels import Channel
from ascend_dualpath.dualpath.counters import Counters
from ascend_dualpath.dualpath.dataplane import DE_RANK, PE_RANK, EngineFactory, open_dataplane
from ascend_dualpath.dualpath.decode_side import DecodeSide
from ascend_dualpath.dualpath.lease import LeaseLayout
from ascend_dualpath.dualpath.prefill_side import PrefillSide
from ascend_dualpath.dualpath.quarantine import Quarantine
from ascend_dualpath.dualpath.scheduler import ReadPath, choose_read_path
from ascend_dualpath.dualpath.settings import ConnectorSettings
from ascend_dualpath.dualpath.side_channel import SideChannel, XferParams
from ascend_dualpath.dualpath.specs import LoadSpec, RecvSpec, SaveSpec
from ascend_dualpath.dualpath.workload import Conversation
from ascend_dualpath.errors import AdmissionDeferred, AdpError, CapacityError, ProtocolError, WaitTimeout
from ascend_dualpath.kv.faults import FaultInjector
from ascend_dualpath.kv.layout import block_hashes
from ascend_dualpath.kv.read_queue import ReadQueue
from ascend_dualpath.kv.store import LocalBlockStore
from ascend_dualpath.models.tiny_llama import TinyLlama, TinyLlamaConfig

KV_BF16_ATOL = 0.125  # |KV - float64 full recompute| bound for bf16 KV (observed worst reported by the demo)
KV_FP32_ATOL = 1e-4
MODES = ("dual", "pe", "de", "split")
RECV_POLL_S = 0.001  # the DE's look at its receives after the PE answered (every row has landed by then)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes and caps shared by both engines (both must use the same values).

    Checked at construction: a wrong type raises :class:`~ascend_dualpath.errors.ArgumentTypeError`, a NaN,
    infinite or non-positive size, bandwidth or timeout :class:`ConfigError`, each naming the field.
    ``max_tokens`` bounds one turn (prompt and generated tokens); ``cache_tokens`` each engine's KV cache, so a
    wave holds at most that many tokens; the host buffers are rounded up to whole MiB.
    """

    store_root: str
    model: TinyLlamaConfig = TinyLlamaConfig()
    dtype: str = "bfloat16"
    block_tokens: int = 64
    max_tokens: int = 2048
    cache_tokens: int = 16384
    pe_snic_bytes_per_s: float = 4e6
    de_snic_bytes_per_s: float = 4e6
    pe_buffer_bytes: int = 16 << 20
    de_buffer_bytes: int = 32 << 20
    timeout_s: float = 30.0
    idle_timeout_s: float = 600.0
    verify: bool = True
    fabric: str = ""  # the emulated fabric both engines join ("": one of this process's own)

    def __post_init__(self) -> None:
        where = "EngineConfig"
        check_type("store_root", self.store_root, (str, os.PathLike), where=where)
        check_type("model", self.model, TinyLlamaConfig, where=where)
        check_type("dtype", self.dtype, str, where=where)
        check_type("verify", self.verify, bool, where=where)
        check_type("fabric", self.fabric, str, where=where)
        for name in ("block_tokens", "max_tokens", "cache_tokens", "pe_buffer_bytes", "de_buffer_bytes"):
            check_bound(name, getattr(self, name), integer=True, where=where)
        for name in ("pe_snic_bytes_per_s", "de_snic_bytes_per_s", "timeout_s", "idle_timeout_s"):
            check_bound(name, getattr(self, name), where=where)
        if not self.fabric:  # a fabric of this process's own (the demo's fabrics are reaped by their pid)
            object.__setattr__(self, "fabric", new_fabric_name("demo"))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def layout(self):
        return self.model.kv_layout(self.torch_dtype, self.block_tokens)

    @property
    def hccl_buffer_mb(self) -> int:
        """The PE's window: two layer slots and one layer's send buffer per turn of a full cache, every layer."""
        nbytes = (2 + self.layout.num_layers) * self.cache_tokens * self.layout.token_bytes
        return max(1, -(-nbytes // (1 << 20)))

    def namespace(self) -> bytes:
        return self.layout.fingerprint() + f"tiny-llama:{self.model}".encode()

    def settings(self, role: str) -> ConnectorSettings:
        """The instance settings of the ``prefill`` or ``decode`` engine."""
        pe = role == "prefill"
        return ConnectorSettings(
            role=role,
            store=str(self.store_root),
            node="pe" if pe else "de",
            snic_bytes_per_s=self.pe_snic_bytes_per_s if pe else self.de_snic_bytes_per_s,
            side_port=0,
            fabric=self.fabric,
            timeout_s=self.timeout_s,
            device_id=PE_RANK if pe else DE_RANK,
            hccl_buffer_mb=self.hccl_buffer_mb,
            host_buffer_mb=max(1, -(-(self.pe_buffer_bytes if pe else self.de_buffer_bytes) // (1 << 20))),
        )


class PagedRows:
    """The demo's cache adapter: a layer's cache is ``uint8 [num_blocks, T, C]`` token rows; a request's token ``t``
    lives in block ``block_ids[t // T]`` at offset ``t % T`` (the interface of the vLLM adapters)."""

    def __init__(self, block_tokens: int, token_bytes: int) -> None:
        self.block_tokens, self.token_bytes = block_tokens, token_bytes

    def _slots(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        tokens = torch.arange(start, end)
        if end > len(block_ids) * self.block_tokens or start < 0:
            raise CapacityError(f"tokens [{start}, {end}) need more than the request's {len(block_ids)} blocks")
        return torch.as_tensor(block_ids, dtype=torch.int64)[tokens // self.block_tokens] * self.block_tokens + (
            tokens % self.block_tokens
        )

    def read_tokens(self, cache: torch.Tensor, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Rows of tokens ``[start, end)``: ``uint8 [end - start, C]`` (a copy)."""
        return cache.view(-1, self.token_bytes)[self._slots(block_ids, start, end)]

    def write_tokens(self, cache: torch.Tensor, block_ids: Sequence[int], start: int, rows: torch.Tensor) -> None:
        """``rows`` (``uint8 [n, C]``) into tokens ``[start, start + n)``."""
        cache.view(-1, self.token_bytes)[self._slots(block_ids, start, start + rows.shape[0])] = rows


class BlockPool:
    """Free cache blocks of one engine."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise CapacityError(f"{count} cache blocks asked, {len(self._free)} of {self.num_blocks} free")
        return [self._free.pop() for _ in range(count)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class _Engine:
    """What both engines are: an instance of DualPath (dataplane, side channel, storage NIC, cache) and the model."""

    def __init__(
        self, config: EngineConfig, channel: Channel, role: str, faults: FaultInjector | None, engines: Any
    ) -> None:
        self.config, self.channel, self.layout = config, channel, config.layout
        self.settings = config.settings(role)
        self.model = TinyLlama(config.model, config.torch_dtype)
        self.namespace = config.namespace()
        self.store = LocalBlockStore(config.store_root, self.layout, faults=faults)
        self.read_queue = ReadQueue(self.store, self.settings.snic_bytes_per_s, node=self.settings.node)
        self.counters = Counters()
        self.quarantine = Quarantine(self.counters)
        L, T, C = self.layout.num_layers, self.layout.block_tokens, self.layout.token_bytes
        self.blocks = BlockPool(-(-config.cache_tokens // T))
        self.caches = [torch.zeros(self.blocks.num_blocks, T, C, dtype=torch.uint8) for _ in range(L)]
        self.adapter = PagedRows(T, C)
        self.dataplane = self.side = self.half = None
        try:
            self.dataplane = open_dataplane(self.settings, PE_RANK if role == "prefill" else DE_RANK, engines=engines)
            self.side = SideChannel(
                0,
                self._handle,
                counters=self.counters,
                name=f"adp-demo-{self.settings.node}",
                **self.settings.side_framing,
            )
            self.half = self._make_half()
        except BaseException:
            self.close()
            raise

    def _make_half(self) -> Any:
        """The engine's DualPath half, bound to its cache, dataplane and side channel."""
        raise NotImplementedError

    def _handle(self, message: m.Request) -> m.Reply:
        raise NotImplementedError

    def status(self) -> m.Status:
        stats = self.read_queue.stats()
        return m.Status(
            role=self.settings.role,
            node=self.settings.node,
            device_id=self.settings.device_id,
            snic_bytes_per_s=self.settings.snic_bytes_per_s,
            read_queue_tokens=stats.bytes // self.layout.kv_bytes(1),
            read_queue_bytes=stats.bytes,
            snic_read_bytes=stats.completed_bytes,
            snic_read_blocks=stats.completed_blocks,
        )

    def rows(self, block_ids: Sequence[int], end: int) -> torch.Tensor:
        """Tokens ``[0, end)`` of a request in the cache: ``uint8 [L, end, C]``."""
        return torch.stack([self.adapter.read_tokens(cache, block_ids, 0, end) for cache in self.caches])

    def close(self) -> None:
        if self.side is not None:
            self.side.close()
        self.quarantine.close(self.config.timeout_s)
        if self.half is not None:
            self.half.close()
        self.read_queue.close()
        if self.dataplane is not None:
            self.dataplane.close()
        self.store.close()


@dataclasses.dataclass
class _Prefill:
    """One turn in a PE step: its specs' fields, cache blocks, the prefix already in the cache, the first token."""

    turn: m.Turn
    xfer: XferParams
    blocks: list[int]
    hit_tokens: int
    computed: int
    first_token: int | None = None
    recomputed_from: int | None = None
    prefill_s: float = 0.0  # from the wave's arrival at the PE to this turn's first token

    @property
    def prompt(self) -> int:
        return len(self.turn.tokens)


class PrefillEngine(_Engine):
    """The PE: prefills the DE's waves with the tiny Llama, loading and saving each layer through its PE half.

    ``engines(comm, rank)`` makes the TransferEngine its links write with (None: the emulator's).
    """

    def __init__(
        self,
        config: EngineConfig,
        channel: Channel,
        faults: FaultInjector | None = None,
        engines: EngineFactory | None = None,
    ) -> None:
        super().__init__(config, channel, "prefill", faults, engines)
        self.de_address: str | None = None
        self.served = 0

    def _make_half(self) -> PrefillSide:
        half = PrefillSide(
            self.settings, self.layout.shard(1, 0), self.store, self.read_queue, self.counters, self.quarantine
        )
        half.bind(self.caches, self.adapter, self.dataplane, self.side.address)
        return half

    def _handle(self, message: m.Request) -> m.Reply:
        if isinstance(message, m.StatusQuery):
            return self.status()
        if isinstance(message, m.WritesEnded):
            return self.half.on_writes_ended(message)
        raise ProtocolError(f"side-channel op {type(message).__struct_config__.tag!r} is not one a PE answers")

    def serve(self) -> None:
        """Handle the DE's messages until ``stop``: ``setup``, then ``prefill`` waves."""
        while True:
            message = self.channel.recv(self.config.idle_timeout_s, "control message")
            if isinstance(message, m.Stop):
                return
            if isinstance(message, m.Setup):
                self._setup(message.de)
            elif isinstance(message, m.Prefill):
                before = self.read_queue.stats().completed_bytes
                turns = self.prefill(message.turns)
                read = self.read_queue.stats().completed_bytes - before
                self.channel.send(m.Prefilled(turns=turns, pe_read_bytes=read))
            else:
                raise ProtocolError(f"prefill engine: {type(message).__struct_config__.tag!r} is not a PE's message")

    def _setup(self, de: str) -> None:
        """Say hello to the DE's side channel now (refused: it hears why, and this engine stops)."""
        try:
            self.half.connect_peer(de)
        except Exception as error:
            self.channel.send(m.Error(error=f"{type(error).__name__}: {error}"))
            raise
        self.de_address = de
        self.channel.send(m.Ok())

    def prefill(self, turns: list[m.Turn]) -> list[m.TurnPrefilled]:
        """Prefill ``turns`` in one step; a load that fails is computed again from its first bad block."""
        if self.de_address is None:
            raise ProtocolError("prefill before setup: the PE has no DE to send to")
        T, work, start = self.layout.block_tokens, [], time.monotonic()
        try:
            for turn in turns:
                hit = len(turn.hit_block_ids) * T
                xfer = XferParams(turn.xfer_id, "prefill", ReadPath(turn.path), self.de_address, turn.split)
                blocks = self.blocks.allocate(-(-len(turn.tokens) // T))
                work.append(_Prefill(turn, xfer, blocks, hit, hit))
            # every turn's reads (both storage NICs) start now; then one step per turn, in order, so a turn computes
            # while the later ones still read
            self.half.prefetch([self._load_spec(p) for p in work])
            for p in work:
                self._step([p], load=True)
                bad = self.half.block_ids_with_load_errors()
                if bad.intersection(p.blocks):  # vLLM's recompute: from the first block whose load failed
                    p.computed = p.recomputed_from = min(i for i, b in enumerate(p.blocks) if b in bad) * T
                    self._step([p], load=False)
                p.prefill_s = time.monotonic() - start
            self.served += len(work)
            return [self._answer(p) for p in work]
        except Exception as error:
            detail = f"{type(error).__name__}: {error}"
            return [m.TurnPrefilled(turn.xfer_id, ok=False, detail=detail) for turn in turns]
        finally:
            self.half.finish({p.turn.xfer_id for p in work})
            for p in work:
                self.blocks.release(p.blocks)

    @staticmethod
    def _load_spec(p: _Prefill) -> LoadSpec:
        return LoadSpec(p.turn.xfer_id, p.xfer, 0, p.hit_tokens, p.prompt, list(p.turn.hit_block_ids), p.blocks)

    def _answer(self, p: _Prefill) -> m.TurnPrefilled:
        return m.TurnPrefilled(
            p.turn.xfer_id,
            ok=True,
            first_token=p.first_token,
            pe_read_blocks=self.half.blocks_read.get(p.turn.xfer_id, 0),
            recomputed_from=p.recomputed_from,
            prefill_s=p.prefill_s,
        )

    def _step(self, work: list[_Prefill], load: bool) -> None:
        """One forward over ``work``: per layer, the hit rows arrive (the PE half), the new rows are computed into
        the cache and sent to the DE (the PE half); the first token of each turn from its last hidden state."""
        loads = [self._load_spec(p) for p in work if load]  # hits or none: the plan tells the DE what comes
        saves = [SaveSpec(p.turn.xfer_id, p.xfer, p.computed, p.prompt, p.blocks) for p in work]
        self.half.start(loads, saves)
        hidden = [self.model.embed(p.turn.tokens[p.computed :]) for p in work]
        for layer, cache in enumerate(self.caches):
            self.half.wait_for_layer_load(layer)
            for i, p in enumerate(work):
                prefix = self.adapter.read_tokens(cache, p.blocks, 0, p.computed)
                hidden[i], new = self.model.layer_forward(layer, hidden[i], self.layout.field_view(prefix, "kv"))
                self.adapter.write_tokens(cache, p.blocks, p.computed, self.layout.encode_rows(kv=new))
            self.half.save_kv_layer(layer, cache)
        self.half.wait_for_save()
        for i, p in enumerate(work):
            p.first_token = int(torch.argmax(self.model.logits(hidden[i][-1:])[-1]))


@dataclasses.dataclass
class TurnResult:
    """One served turn, as the demo prints it."""

    agent_id: int
    turn: int
    path: str  # "pe", "de", "split", "recompute" (computed again from a failed load) or "failed"
    prompt_tokens: int
    hit_tokens: int
    pe_read_bytes: int
    de_read_bytes: int
    ttft_s: float
    generated: list[int]
    fallbacks: list[str]
    kv: torch.Tensor | None = None  # uint8 [L, T_kv, C] copy of the DE's cache rows (for verification)
    sequence: list[int] | None = None
    error: str | None = None  # set when the turn failed ("failed" path); the agent stops there


@dataclasses.dataclass
class _Admitted:
    """A turn of a wave that holds its DE cache blocks and lease room."""

    agent: int
    turn: int
    prompt: list[int]
    gen: int
    hit_ids: list[bytes]
    path: ReadPath
    split: bool
    blocks: list[int]
    xfer_id: str


class TurnFailed(AdpError):
    """A turn could be neither loaded nor computed; the message names why."""


class DecodeEngine(_Engine):
    """The DE: drives the job (admission, read-path choice, waves to the PE, decode, persistence) and receives the
    KV through its DE half.

    ``engines(comm, rank)`` makes the TransferEngine its links write with (None: the emulator's).
    """

    def __init__(
        self,
        config: EngineConfig,
        channel: Channel,
        faults: FaultInjector | None = None,
        engines: EngineFactory | None = None,
    ) -> None:
        super().__init__(config, channel, "decode", faults, engines)
        self._xfer_ids = itertools.count()
        self.channel.send(m.Setup(de=self.side.address))
        reply = self.channel.recv(config.timeout_s * 2, "setup reply")
        if isinstance(reply, m.Error):
            self.close()
            raise ProtocolError(f"the prefill engine refused this decode engine: {reply.error}")
        if not isinstance(reply, m.Ok):
            self.close()
            raise ProtocolError(f"expected the prefill engine's set-up reply, got {reply!r}")

    def _make_half(self) -> DecodeSide:
        half = DecodeSide(
            self.settings, self.layout.shard(1, 0), self.store, self.read_queue, self.counters, self.quarantine
        )
        half.bind(self.caches, self.adapter, self.dataplane)
        return half

    def _handle(self, message: m.Request) -> m.Reply:
        if isinstance(message, m.StatusQuery):
            return self.status()
        handler = self.half.handlers().get(type(message))
        if handler is None:
            raise ProtocolError(f"side-channel op {type(message).__struct_config__.tag!r} is not one a DE answers")
        return handler(message)

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

        The turns that fit (cache blocks and lease room) are admitted and prefilled in one step of the PE, so both
        storage NICs read at once; then each is decoded. ``mode`` is ``"dual"`` (the scheduler's rule per turn),
        ``"pe"``, ``"de"`` or ``"split"`` (every turn read through both storage NICs).

        Returns the results, the indices of turns deferred for lack of room, and the wave's timing.
        """
        if mode not in MODES:
            raise ProtocolError(f"mode must be one of {MODES}, got {mode!r}")
        start = time.monotonic()
        admitted, deferred = self._admit(turns, mode)
        de_read = self.read_queue.stats().completed_bytes
        results, pe_read = [], 0
        try:
            sent = time.monotonic()
            reply = self._prefill(admitted) if admitted else m.Prefilled(turns=[])
            replies, pe_read = {r.xfer_id: r for r in reply.turns}, reply.pe_read_bytes
            for t in admitted:
                ttft = sent - start + replies[t.xfer_id].prefill_s
                try:
                    result = self._finish_turn(t, replies[t.xfer_id], ttft)
                except TurnFailed as error:  # this turn ends with a clear error; the wave goes on
                    result = TurnResult(
                        t.agent, t.turn, "failed", len(t.prompt), 0, 0, 0, ttft, [], [], error=str(error)
                    )
                results.append(result)
                if on_turn is not None:
                    on_turn(result)
        finally:
            for t in admitted:
                self.blocks.release(t.blocks)
        timing = {
            "wave_s": time.monotonic() - start,
            "pe_read_bytes": pe_read,
            "de_read_bytes": self.read_queue.stats().completed_bytes - de_read,
        }
        return results, deferred, timing

    def _pe_address(self) -> str:
        links = list(self.dataplane.links)
        if not links:
            raise ProtocolError("the prefill engine has not said hello to this decode engine")
        return links[0]

    def _admit(self, turns: list[tuple[int, int, list[int], int]], mode: str) -> tuple[list[_Admitted], list[int]]:
        """The turns whose cache blocks and lease fit, with their read paths; the indices of the others."""
        T, cfg = self.layout.block_tokens, self.config
        room = self.dataplane.host.capacity_bytes
        admitted, deferred = [], []
        queued = {ReadPath.PE: 0, ReadPath.DE: 0}
        for index, (agent, turn, prompt, gen) in enumerate(turns):
            total_kv = len(prompt) + gen - 1
            if total_kv > cfg.max_tokens:
                raise ProtocolError(
                    f"agent {agent} turn {turn}: {total_kv} KV tokens exceed max_tokens={cfg.max_tokens}"
                )
            nbytes = LeaseLayout.complete(self.layout, len(prompt)).nbytes
            need = -(-total_kv // T)
            if nbytes > room or need > self.blocks.free:
                deferred.append(index)
                continue
            ids = block_hashes(prompt, T, self.namespace)
            hit = min(self.store.longest_prefix(ids), (len(prompt) - 1) // T)  # >= 1 token left to prefill
            path = self._path(mode, hit, queued)
            queued[path] += hit * T
            room -= nbytes
            xfer_id = f"t{next(self._xfer_ids)}"
            admitted.append(
                _Admitted(
                    agent, turn, prompt, gen, ids[:hit], path, mode == "split", self.blocks.allocate(need), xfer_id
                )
            )
        return admitted, deferred

    @staticmethod
    def _path(mode: str, hit: int, queued: dict) -> ReadPath:
        if hit == 0 or mode == "pe":
            return ReadPath.PE
        if mode == "dual":
            return choose_read_path(queued[ReadPath.PE], queued[ReadPath.DE])
        return ReadPath.DE  # "de", and "split" (the PE sizes the halves; the path is ignored)

    def _prefill(self, admitted: list[_Admitted]) -> m.Prefilled:
        """Expect every turn's rows, send the wave to the PE, wait for its answer and for the rows' receives."""
        pe = self._pe_address()
        for t in admitted:
            xfer = XferParams(t.xfer_id, "decode", t.path, pe, t.split)
            self.half.add_recv(RecvSpec(t.xfer_id, xfer, 0, len(t.prompt), t.blocks, len(t.prompt)))
        wire = [m.Turn(t.xfer_id, t.path.value, t.split, list(t.prompt), list(t.hit_ids)) for t in admitted]
        self.channel.send(m.Prefill(turns=wire))
        reply = self.channel.recv(self.config.timeout_s * 4, f"prefill reply for {len(wire)} turns")
        if not isinstance(reply, m.Prefilled) or [r.xfer_id for r in reply.turns] != [t.xfer_id for t in wire]:
            raise ProtocolError(f"expected the prefill reply to turns {[t.xfer_id for t in wire]}, got {reply!r}")
        self._await_recvs({t.xfer_id for t in admitted})
        return reply

    def _await_recvs(self, req_ids: set[str]) -> None:
        """Until every receive of ``req_ids`` ended (bounded: a receive times out by itself within the bound)."""
        pending, deadline = set(req_ids), time.monotonic() + 2 * self.config.timeout_s
        while pending:
            self.half.complete_recvs()
            pending -= self.half.finished_recving
            if not pending:
                break
            if time.monotonic() > deadline:
                raise WaitTimeout(f"receives of {sorted(pending)} still open after {2 * self.config.timeout_s} s")
            time.sleep(RECV_POLL_S)

    def _finish_turn(self, t: _Admitted, reply: m.TurnPrefilled, ttft: float) -> TurnResult:
        """Take the turn's KV (received, or computed here when the receive failed), decode and persist."""
        failed = t.xfer_id in self.half.failed_recving or not reply.ok
        self.half.finished_recving.discard(t.xfer_id)
        self.half.failed_recving.discard(t.xfer_id)
        T, fb = self.layout.block_tokens, self.layout.full_block_bytes
        hit_tokens, fallbacks = len(t.hit_ids) * T, []
        label = "split" if t.split and t.hit_ids else t.path.value
        pe_blocks = reply.pe_read_blocks if reply.ok else 0
        if t.path is ReadPath.DE and not t.split and pe_blocks:
            fallbacks.append(f"de: the DE's half failed, the PE read {pe_blocks} blocks instead")
        if reply.recomputed_from is not None:
            fallbacks.append(f"load failed, computed again from token {reply.recomputed_from}")
            label, hit_tokens = "recompute", reply.recomputed_from
        if failed:
            fallbacks.append(f"receive failed ({reply.detail or 'see the log'}): the DE computes the prompt itself")
            first_token, label, hit_tokens = self._compute_prompt(t), "recompute", 0
        else:
            first_token = reply.first_token
        generated = self._decode(t, first_token)
        kv_tokens = len(t.prompt) + t.gen - 1
        sequence = list(t.prompt) + generated
        self._persist(t, sequence, kv_tokens)
        de_blocks = 0 if failed or t.path is ReadPath.PE else max(0, len(t.hit_ids) - pe_blocks)
        return TurnResult(
            t.agent,
            t.turn,
            label,
            len(t.prompt),
            hit_tokens,
            pe_blocks * fb,
            de_blocks * fb,
            ttft,
            generated,
            fallbacks,
            self.rows(t.blocks, kv_tokens).clone() if self.config.verify else None,
            sequence,
        )

    def _compute_prompt(self, t: _Admitted) -> int:
        """The whole prompt computed on the DE (its receive failed): its rows into the cache; the first token."""
        hidden = self.model.embed(t.prompt)
        for layer, cache in enumerate(self.caches):
            hidden, kv = self.model.layer_forward(layer, hidden)
            self.adapter.write_tokens(cache, t.blocks, 0, self.layout.encode_rows(kv=kv))
        return int(torch.argmax(self.model.logits(hidden[-1:])[-1]))

    def _decode(self, t: _Admitted, first_token: int) -> list[int]:
        """Greedy decode from the KV in the cache, appending each step's KV rows to the turn's blocks."""
        model, layout = self.model, self.layout
        generated = [first_token]
        for position in range(len(t.prompt), len(t.prompt) + t.gen - 1):
            hidden = model.embed([generated[-1]])
            for layer, cache in enumerate(self.caches):
                prefix = layout.field_view(self.adapter.read_tokens(cache, t.blocks, 0, position), "kv")
                hidden, new_kv = model.layer_forward(layer, hidden, prefix)
                self.adapter.write_tokens(cache, t.blocks, position, layout.encode_rows(kv=new_kv))
            generated.append(int(torch.argmax(model.logits(hidden)[-1])))
        return generated

    def _persist(self, t: _Admitted, sequence: list[int], kv_tokens: int) -> None:
        """Write the Full Blocks the KV now covers that the store lacks (chained, atomic): the new ones, and those a
        failed load removed (a corrupted block goes with its descendants)."""
        T = self.layout.block_tokens
        ids = block_hashes(sequence[: (kv_tokens // T) * T], T, self.namespace)
        for b in range(len(ids)):
            if not self.store.contains(ids[b]):
                rows = torch.stack([self.adapter.read_tokens(c, t.blocks, b * T, (b + 1) * T) for c in self.caches])
                self.store.write_block(ids[b], ids[b - 1] if b else None, rows.contiguous())

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
                    f"the decode engine cannot admit any turn of this wave ({len(batch)} turns): its de_buffer "
                    f"holds {self.dataplane.host.capacity_bytes} bytes, its cache {self.blocks.num_blocks} blocks"
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
        nic = self.dataplane.device.nic
        return {
            "results": results,
            "waves": waves,
            "deferred": deferred_total,
            "failed": sum(r.error is not None for r in results),
            "jct_s": time.monotonic() - job_start,
            "nic_vtime_ns": nic.virtual_time_ns,
            "nic_bytes": nic.bytes_moved,
            "transfer_kinds": self.transfer_kinds(),
        }

    def transfer_kinds(self) -> dict[str, int]:
        """How many transfer requests of each kind this DE's pair links sent (its hit-layer pushes)."""
        kinds: dict[str, int] = {}
        for link in self.dataplane.links.values():
            for kind, n in getattr(link.leg, "kinds_used", {}).items():
                kinds[kind] = kinds.get(kind, 0) + n
        return kinds


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

    Loaded bytes (the hit rows in the DE's cache) must equal the stored blocks bit for bit; every KV row must be
    within ``atol`` of the float64 full recompute; greedy tokens must equal those of a no-cache run. With
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
