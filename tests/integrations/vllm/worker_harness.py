"""PE and DE connector workers in one process, without a model: fake paged caches, a scripted forward.

Each :class:`Instance` is a :class:`~ascend_dualpath.integrations.vllm.worker.DualPathWorker` with its own
emulated device on one fabric, its own side channel and store handle (the store directory is shared), and
per-layer FLASH_ATTN-layout caches. :meth:`Deployment.prefill` drives one PE request the way vLLM's forward does
(``start_step``, per layer ``wait_for_layer_load`` -> the layer's new rows -> ``save_kv_layer``, ``wait_for_save``)
and, when the load reports bad blocks, the recompute step vLLM runs next (``kv_load_failure_policy=recompute``).
The KV of every request is known in advance (:meth:`Deployment.true_rows`), so the DE's caches can be checked
bit for bit.

Tensor parallelism: a :class:`Model` names the KV geometry (GQA with some KV heads, or MLA) and the rank whose share
an instance's worker holds; a :class:`TpDeployment` is one deployment whose instances have tensor-parallel ranks, each
rank's side channel at the instance's base port + its rank, driven as vLLM drives them: every rank of an instance gets
the same step metadata, which names the peer instance by its rank-0 address; the workers find their peer ranks. Every
worker holds its rank's heads and reads only its byte ranges of the stored full blocks
(:class:`~ascend_dualpath.kv.store.ShardStore`).
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import itertools
import os
import random
import secrets
import socket
import threading
import time

import msgspec
import torch
import torch.distributed as dist

from ascend_dualpath.dualpath.replicas import LEAD_WAITS, RankGroup
from ascend_dualpath.dualpath.scheduler import ReadPath
from ascend_dualpath.dualpath.settings import UNCAPPED_BYTES_PER_S, ConnectorSettings, rank_port
from ascend_dualpath.dualpath.side_channel import XferParams
from ascend_dualpath.dualpath.specs import LoadSpec, RecvSpec, SaveSpec
from ascend_dualpath.integrations.vllm.layouts import FlashAttnAdapter, MlaAdapter, PagedKVAdapter
from ascend_dualpath.integrations.vllm.metadata import DualPathMetadata
from ascend_dualpath.integrations.vllm.serve import ephemeral_port_start
from ascend_dualpath.integrations.vllm.worker import DualPathWorker
from ascend_dualpath.kv.layout import KVLayout, KVShard
from ascend_dualpath.kv.store import LocalBlockStore

LAYERS, KV_HEADS, HEAD, BLOCK = 3, 2, 8, 4
NUM_BLOCKS = 256
POISON = 0x5A  # every DE cache byte starts as this; bytes no request writes must keep it
TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_ports(count: int, attempts: int = 200) -> int:
    """A base port with ``count`` consecutive ports free now (a tensor-parallel instance's side channels), below
    the ephemeral range: the ranks bind them one after another, and a port from that range could meanwhile become a
    client socket's (the first ranks' connections)."""
    top = ephemeral_port_start() - count
    for _ in range(attempts):
        base = random.randint(max(1024, top - 10_000), top)
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise AssertionError(f"no {count} consecutive free ports in {attempts} attempts")


def on_ranks(calls: list, timeout_s: float = 3 * TIMEOUT_S) -> list:
    """Run ``calls`` (one per tensor-parallel rank) at once, as vLLM's workers run a step, each in its own thread:
    their results by rank; the first error any raised (AssertionError naming the ranks that did not end in time)."""
    results, errors = [None] * len(calls), [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as error:  # re-raised below, in the test's thread
            errors[i] = error

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    stuck = [i for i, thread in enumerate(threads) if thread.is_alive()]
    assert not stuck, f"ranks {stuck} did not end within {timeout_s} s"
    for error in errors:
        if error is not None:
            raise error
    return results


def rank_groups(size: int) -> list[RankGroup | None]:
    """One instance's ranks as ``size`` gloo process groups of this process, by rank (as vLLM's tensor-parallel
    group; made together: they meet through one in-memory store); None at size 1."""
    if size == 1:
        return [None]
    store, limit = dist.HashStore(), datetime.timedelta(seconds=LEAD_WAITS * TIMEOUT_S)
    groups = on_ranks([lambda rank=rank: dist.ProcessGroupGloo(store, rank, size, limit) for rank in range(size)])
    return [RankGroup(group, LEAD_WAITS * TIMEOUT_S) for group in groups]


def remove_fabric_shm(fabric: str) -> None:
    for path in glob.glob(f"/dev/shm/adp.{fabric}*"):
        os.unlink(path)


def new_cache(fill: int = 0, device: str = "cpu", heads: int = KV_HEADS) -> torch.Tensor:
    """One layer's FLASH_ATTN cache ``float16 [NUM_BLOCKS, heads, BLOCK, 2 * HEAD]``, every byte ``fill``. On a
    GPU it is laid out as vLLM's CUDA FLASH_ATTN cache is by default (NHD): the logical view is the transpose of a
    contiguous ``[NUM_BLOCKS, BLOCK, heads, 2 * HEAD]`` tensor."""
    if device == "cpu":
        cache = torch.empty((NUM_BLOCKS, heads, BLOCK, 2 * HEAD), dtype=torch.float16)
    else:
        cache = torch.empty((NUM_BLOCKS, BLOCK, heads, 2 * HEAD), dtype=torch.float16, device=device)
    cache.view(torch.uint8).fill_(fill)
    return cache if device == "cpu" else cache.transpose(1, 2)


ADAPTER = FlashAttnAdapter.from_cache(new_cache())
LAYOUT = ADAPTER.kv_layout(LAYERS)
LATENT = 24  # MLA's latent elements per token in the harness (float16)


@dataclasses.dataclass(frozen=True)
class Model:
    """The KV geometry served (``kind`` ``gqa`` with ``kv_heads`` heads of ``HEAD`` elements, or ``mla`` with a
    ``LATENT`` latent; float16) and tensor-parallel rank ``rank`` of ``tp``, whose share a worker holds."""

    kind: str = "gqa"
    kv_heads: int = KV_HEADS
    tp: int = 1
    rank: int = 0

    @property
    def full(self) -> KVLayout:
        """The stored layout: every head."""
        if self.kind == "mla":
            return KVLayout.mla(LAYERS, LATENT, torch.float16, BLOCK)
        return KVLayout.gqa(LAYERS, self.kv_heads, HEAD, torch.float16, BLOCK)

    @property
    def shard(self) -> KVShard:
        return self.full.shard(self.tp, self.rank)

    def new_cache(self, fill: int = 0, device: str = "cpu") -> torch.Tensor:
        """One layer's cache of the rank on ``device``, every byte ``fill``: FLASH_ATTN (:func:`new_cache`) with the
        rank's heads, or MLA ``float16 [NUM_BLOCKS, BLOCK, LATENT]``."""
        if self.kind != "mla":
            return new_cache(fill, device, len(self.shard.units))
        cache = torch.empty((NUM_BLOCKS, BLOCK, LATENT), dtype=torch.float16, device=device)
        cache.view(torch.uint8).fill_(fill)
        return cache

    @property
    def adapter(self) -> PagedKVAdapter:
        kind = MlaAdapter if self.kind == "mla" else FlashAttnAdapter
        adapter = kind.from_cache(self.new_cache())
        assert adapter.kv_layout(LAYERS) == self.shard.local, "the rank's cache rows are not its shard's rows"
        return adapter


@dataclasses.dataclass
class Instance:
    worker: DualPathWorker
    caches: list[torch.Tensor]
    address: str
    role: str
    adapter: PagedKVAdapter
    _blocks: itertools.count = dataclasses.field(default_factory=itertools.count)
    # vLLM drives a DE's worker from one thread: test threads take turns, and keep every receive's outcome
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    finished: set[str] = dataclasses.field(default_factory=set)
    failed: set[str] = dataclasses.field(default_factory=set)

    def layer_names(self) -> list[str]:
        return [f"layers.{i}.attn" for i in range(LAYERS)]

    def take_blocks(self, n: int) -> list[int]:
        ids = [next(self._blocks) for _ in range(n)]
        assert ids[-1] < NUM_BLOCKS, "the harness ran out of cache blocks"
        return ids

    def status(self) -> dict:
        """The side channel's status and the worker's counters (what vLLM's metrics get), as one dict."""
        return {**msgspec.to_builtins(self.worker.status()), **dataclasses.asdict(self.worker.counters)}


class Deployment:
    """``num_pe`` PEs and ``num_de`` DEs on one fabric and one store; ``snic`` caps by instance name
    (``pe0``, ``de1``, ...; bytes/s); ``engine`` moves the KV (``emulator`` or ``mooncake``; a dict by instance
    name, ``emulator`` for the instances it leaves out). ``device``: where the caches live; ``hccl_buffer_mb``,
    ``host_buffer_mb``: each instance's window and host buffer."""

    device = "cpu"
    hccl_buffer_mb, host_buffer_mb = 2, 4

    def __init__(
        self,
        root,
        num_pe: int,
        num_de: int,
        snic: dict[str, float] | None = None,
        engine: str | dict[str, str] = "emulator",
        model: Model | None = None,
        fabric: str | None = None,
    ) -> None:
        self.root = str(root)
        self.engine = engine
        self.model = model or Model()
        self.adapter = self.model.adapter
        self.fabric = fabric or f"t{os.getpid()}x{secrets.token_hex(4)}"
        self.instances: dict[str, Instance] = {}
        self._ids = itertools.count()
        self.layer_waits: list[float] = []  # every wait_for_layer_load of prefill(), in seconds
        snic = snic or {}
        try:
            for i, role in enumerate(["prefill"] * num_pe + ["decode"] * num_de):
                name = f"pe{i}" if role == "prefill" else f"de{i - num_pe}"
                device = self.model.rank * (num_pe + num_de) + i  # unique on a fabric the ranks share
                self.instances[name] = self._start(name, role, device, snic.get(name, UNCAPPED_BYTES_PER_S))
        except BaseException:
            self.close()
            raise
        self.store = LocalBlockStore(self.root, self.model.full)

    def _start(
        self,
        name: str,
        role: str,
        device_id: int,
        snic: float,
        model: Model | None = None,
        port: int | None = None,
        group: RankGroup | None = None,
    ) -> Instance:
        """Instance ``name``'s worker of ``model``'s rank (default: the deployment's), its side channel at ``port``
        (default: a free one), ``group`` its instance's ranks."""
        model = model or self.model
        settings = ConnectorSettings(
            role=role,
            store=self.root,
            node=name if model.tp == 1 else f"{name}.tp{model.rank}",
            snic_bytes_per_s=snic,
            side_port=port or free_port(),
            fabric=self.fabric,
            timeout_s=TIMEOUT_S,
            device_id=device_id,
            hccl_buffer_mb=self.hccl_buffer_mb,
            host_buffer_mb=self.host_buffer_mb,
            engine=self.engine if isinstance(self.engine, str) else self.engine.get(name, "emulator"),
            tp_size=model.tp,
            tp_rank=model.rank,
        )
        store = LocalBlockStore(self.root, model.full)
        adapter = model.adapter
        worker = DualPathWorker(settings, model.full, store, lambda _n, c: adapter, group=group)
        caches = [model.new_cache(POISON if role == "decode" else 0, self.device) for _ in range(LAYERS)]
        names = [f"layers.{i}.attn" for i in range(LAYERS)]
        worker.register_kv_caches(dict(zip(names, caches, strict=True)), lambda n: int(n.split(".")[1]))
        return Instance(worker, caches, worker.side.address, role, adapter)

    def close(self) -> None:
        for instance in self.instances.values():
            instance.worker.shutdown()
        self.instances.clear()
        if hasattr(self, "store"):
            self.store.close()
        remove_fabric_shm(self.fabric)

    # -- requests ---------------------------------------------------------------------------------------------
    @staticmethod
    def true_rows(seed: int, prompt: int, layout: KVLayout = LAYOUT) -> torch.Tensor:
        """``uint8 [L, prompt, C]``: the request's KV (finite float16 values, so every copy keeps the bits)."""
        gen = torch.Generator().manual_seed(seed)
        values = torch.randn((LAYERS, prompt, layout.token_bytes // 2), generator=gen).to(torch.float16)
        return values.view(torch.uint8)

    def store_prefix(self, rows: torch.Tensor, hit_blocks: int, tag: int) -> list[bytes]:
        """Persist the first ``hit_blocks`` blocks of ``rows``; returns every full prompt block's store id."""
        full = rows.shape[1] // BLOCK
        ids = [bytes([tag % 256, tag // 256]) + secrets.token_bytes(14) for _ in range(full)]
        for b in range(hit_blocks):
            payload = rows[:, b * BLOCK : (b + 1) * BLOCK].contiguous()
            assert self.store.write_block(ids[b], ids[b - 1] if b else None, payload)
        return ids

    def request(self, pe: str, de: str, rows: torch.Tensor, hit_blocks: int, path: str, split: bool = False):
        """Everything one request needs on both sides (``rows``'s first ``hit_blocks`` blocks stored): returns
        ``(pe_request, de_request)``."""
        n = next(self._ids)
        xfer_id = f"x{n}"
        prompt = rows.shape[1]
        ids = self.store_prefix(rows, hit_blocks, n)
        pe_inst, de_inst = self.instances[pe], self.instances[de]
        pe_xfer = XferParams(xfer_id, "prefill", ReadPath(path), de_inst.address, split)
        de_xfer = XferParams(xfer_id, "decode", ReadPath(path), pe_inst.address, split)
        blocks = -(-prompt // BLOCK)
        pe_req = PeRequest(f"p{n}", pe_xfer, prompt, hit_blocks * BLOCK, ids, pe_inst.take_blocks(blocks), rows)
        de_end = (prompt - 1) // BLOCK * BLOCK
        de_req = RecvSpec(f"d{n}", de_xfer, 0, de_end, de_inst.take_blocks(blocks), prompt, de_end > 0)
        return pe_req, de_req

    def expect_recv(self, de: str, spec: RecvSpec) -> None:
        inst = self.instances[de]
        with inst.lock:
            inst.worker.start_step(DualPathMetadata(recvs=[spec]))

    def read_ahead(self, pe: str, reqs: list[PeRequest]) -> float:
        """One step that reads ``reqs``' hits ahead of their steps (as the scheduler half asks at first sight, with
        no block table yet); returns how long the step took (s)."""
        specs = [LoadSpec(r.req_id, r.xfer, 0, r.hit_tokens, r.prompt, r.store_ids, []) for r in reqs]
        start = time.monotonic()
        self.instances[pe].worker.start_step(DualPathMetadata(prefetches=specs))
        return time.monotonic() - start

    def await_ready(self, pe: str, req_ids: set[str], timeout_s: float = TIMEOUT_S) -> dict[str, int]:
        """Poll the PE (as vLLM's steps do) until every read ahead of ``req_ids`` ended: request id -> good tokens."""
        worker, ready = self.instances[pe].worker, {}
        deadline = time.monotonic() + timeout_s
        while not req_ids <= ready.keys():
            assert time.monotonic() < deadline, f"reads ahead of {sorted(req_ids - ready.keys())} did not end"
            meta = worker.build_worker_meta()
            ready |= meta.ready if meta is not None else {}
            time.sleep(0.002)
        return ready

    def prefill(self, pe: str, req: PeRequest, *, check_layers: bool = True, hit_tokens: int | None = None) -> set[int]:
        """One PE request's forward (and the recompute step after a failed load); returns the blocks reported bad.

        ``hit_tokens``: what the step takes of the hit (default: all of it; after a read ahead, what it reported).
        With ``check_layers``, asserts after each ``wait_for_layer_load(l)`` of a load that did not fail that the
        PE cache holds layer ``l``'s hit rows (the layer order: rows are there before the layer's attention).
        """
        inst = self.instances[pe]
        worker, names = inst.worker, inst.layer_names()
        if hit_tokens is not None:
            req = dataclasses.replace(req, hit_tokens=hit_tokens)
        load = LoadSpec(req.req_id, req.xfer, 0, req.hit_tokens, req.prompt, req.store_ids, req.block_ids)
        save = SaveSpec(req.req_id, req.xfer, req.hit_tokens, req.prompt, req.block_ids)
        worker.start_step(DualPathMetadata(loads=[load], saves=[save]))
        for layer, name in enumerate(names):
            started = time.monotonic()
            worker.wait_for_layer_load(name)
            self.layer_waits.append(time.monotonic() - started)
            cache = inst.caches[layer]
            if check_layers and not worker.prefill._invalid_blocks and req.hit_tokens:
                got = inst.adapter.read_tokens(cache, req.block_ids, 0, req.hit_tokens)
                assert torch.equal(got, req.rows[layer, : req.hit_tokens]), f"hit rows of layer {layer} missing"
            inst.adapter.write_tokens(cache, req.block_ids, req.hit_tokens, req.rows[layer, req.hit_tokens :])
            worker.save_kv_layer(name, cache)
        worker.wait_for_save()
        bad = worker.get_block_ids_with_load_errors()
        if bad:  # vLLM recomputes from the first bad block: the rows before it must be in the cache already
            start = min(req.block_ids.index(b) for b in bad) * BLOCK
            recompute = SaveSpec(req.req_id, req.xfer, start, req.prompt, req.block_ids)
            worker.start_step(DualPathMetadata(saves=[recompute]))
            for layer, name in enumerate(names):
                cache = inst.caches[layer]
                inst.adapter.write_tokens(cache, req.block_ids, start, req.rows[layer, start:])
                worker.save_kv_layer(name, cache)
            worker.wait_for_save()
        return bad

    def finish(self, de: str, req_ids: set[str], timeout_s: float = TIMEOUT_S) -> tuple[set[str], set[str]]:
        """Poll the DE (as vLLM's steps do) until every receive in ``req_ids`` ended: ``(finished, failed)``."""
        inst = self.instances[de]
        deadline = time.monotonic() + timeout_s
        while True:
            with inst.lock:
                _, recving, failed = inst.worker.get_finished(set())
                inst.finished |= recving
                inst.failed |= failed
                if req_ids <= inst.finished:
                    return req_ids & inst.finished, req_ids & inst.failed
            assert time.monotonic() < deadline, f"receives {sorted(req_ids - inst.finished)} on {de} did not end"
            time.sleep(0.005)

    def drain(self, de: str, spec: RecvSpec, timeout_s: float = TIMEOUT_S) -> None:
        """Poll the DE (as vLLM's steps do) until a receive that vLLM does not wait for (``report`` False) let go of
        its plan; asserts vLLM is never told of it."""
        inst = self.instances[de]
        deadline = time.monotonic() + timeout_s
        while True:
            with inst.lock:
                _, recving, failed = inst.worker.get_finished(set())
                assert spec.req_id not in recving | failed, f"{spec.req_id} was reported to vLLM"
                if spec.xfer.xfer_id not in inst.worker.decode._recvs:
                    return
            assert time.monotonic() < deadline, f"the plan of {spec.req_id} on {de} was not let go"
            time.sleep(0.005)

    def done(self, pe: str, req: PeRequest) -> None:
        self.instances[pe].worker.get_finished({req.req_id})


def run_request(d: Deployment, pe: str, de: str, prompt: int, hit_blocks: int, path: str, split: bool, seed: int):
    """One request PE -> DE; returns ``(de_request, rows, bad blocks)`` once the DE's receive ended."""
    rows = Deployment.true_rows(seed, prompt, d.model.full)
    pe_req, de_req = d.request(pe, de, rows, hit_blocks, path, split)
    d.expect_recv(de, de_req)
    bad = d.prefill(pe, pe_req)
    if de_req.report:
        _, failed = d.finish(de, {de_req.req_id})
        assert failed == set(), f"the DE's receive of {de_req.req_id} failed"
    else:  # the prompt ends inside the first block: the DE computes it, vLLM waits for nothing
        d.drain(de, de_req)
    d.done(pe, pe_req)
    return de_req, rows, bad


@dataclasses.dataclass
class PeRequest:
    req_id: str
    xfer: XferParams
    prompt: int
    hit_tokens: int
    store_ids: list[bytes]
    block_ids: list[int]
    rows: torch.Tensor


def expected_de_caches(written: list[tuple[RecvSpec, torch.Tensor]], model: Model | None = None) -> list[torch.Tensor]:
    """The DE caches (of ``model``'s rank) after ``written`` receives: poison everywhere but each receive's rows."""
    model = model or Model()
    caches = [model.new_cache(POISON) for _ in range(LAYERS)]
    for spec, rows in written:
        for layer in range(LAYERS):
            model.adapter.write_tokens(caches[layer], spec.block_ids, 0, rows[layer, : spec.end])
    return caches


def assert_caches_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for layer, (a, b) in enumerate(zip(got, expected, strict=True)):
        diff = (a.view(torch.uint8) != b.view(torch.uint8)).nonzero()
        assert diff.numel() == 0, f"layer {layer}: {diff.shape[0]} bytes differ, first at {diff[0].tolist()}"


class TpDeployment(Deployment):
    """One PE ``pe0`` of ``pe_tp`` tensor-parallel ranks and one DE ``de0`` of ``de_tp`` ranks serving ``kind``
    (``gqa`` with ``kv_heads`` heads, or ``mla``), on one fabric and one store. Rank ``r`` of instance ``name`` is
    ``instances[f"{name}/{r}"]``; its side channel listens at the instance's base port + ``r``."""

    def __init__(self, root, pe_tp: int, de_tp: int, kind: str = "gqa", kv_heads: int = KV_HEADS) -> None:
        self.root, self.engine = str(root), "emulator"
        self.model = Model(kind, kv_heads, 1, 0)  # the stored layout; each rank's is its own Model
        self.adapter = None  # each rank's instance has its own
        self.fabric = f"t{os.getpid()}x{secrets.token_hex(4)}"
        self.instances, self._ids, self.layer_waits = {}, itertools.count(), []
        self.tp = {"pe0": pe_tp, "de0": de_tp}
        self.store = LocalBlockStore(self.root, self.model.full)
        devices = itertools.count()
        try:
            for name, tp in self.tp.items():
                base, groups = free_ports(tp), rank_groups(tp)
                for rank in range(tp):
                    model, role = Model(kind, kv_heads, tp, rank), "prefill" if name == "pe0" else "decode"
                    port = rank_port(base, rank)
                    inst = self._start(name, role, next(devices), UNCAPPED_BYTES_PER_S, model, port, groups[rank])
                    self.instances[f"{name}/{rank}"] = inst
        except BaseException:
            self.close()
            raise

    def shard(self, name: str, rank: int) -> KVShard:
        return self.model.full.shard(self.tp[name], rank)

    def ranks(self, name: str) -> list[str]:
        return [f"{name}/{rank}" for rank in range(self.tp[name])]

    def run(
        self,
        pe: str,
        de: str,
        prompt: int,
        hit_blocks: int,
        path: str,
        split: bool,
        seed: int,
        ids=None,
        ahead=False,
        before_step=None,
    ):
        """One request PE -> DE, its prefix stored once (whole; ``ids``: the store ids of one stored already):
        every rank of an instance gets the same step metadata (the peer named by its rank-0 address) and computes
        its own share of the rows (``ahead``: every PE rank reads the hits ahead of its step first, then
        ``before_step()`` is called, and the steps take what the ranks reported ready). Returns
        ``[(de_request, the DE rank's rows)]`` by DE rank once every rank's receive ended."""
        rows = Deployment.true_rows(seed, prompt, self.model.full)
        n = next(self._ids)
        ids = self.store_prefix(rows, hit_blocks, 1000 + n) if ids is None else ids
        pe0, de0 = self.instances[f"{pe}/0"], self.instances[f"{de}/0"]
        blocks = -(-prompt // BLOCK)
        pe_xfer = XferParams(f"x{n}", "prefill", ReadPath(path), de0.address, split)
        pe_blocks = pe0.take_blocks(blocks)
        de_end = (prompt - 1) // BLOCK * BLOCK
        de_xfer = XferParams(f"x{n}", "decode", ReadPath(path), pe0.address, split)
        de_req = RecvSpec(f"d{n}", de_xfer, 0, de_end, de0.take_blocks(blocks), prompt, de_end > 0)
        for name in self.ranks(de):
            self.expect_recv(name, de_req)

        reqs = [
            PeRequest(f"p{n}", pe_xfer, prompt, hit_blocks * BLOCK, ids, pe_blocks, self.shard(pe, rank).take(rows))
            for rank in range(self.tp[pe])
        ]

        def read_ahead(req: PeRequest, name: str) -> None:
            self.read_ahead(name, [req])
            assert self.await_ready(name, {req.req_id}) == {req.req_id: req.hit_tokens}, f"{name}: not all ready"

        def prefill(req: PeRequest, name: str) -> None:
            assert self.prefill(name, req) == set(), f"{name}: hit blocks failed to load"

        def finish(name: str) -> None:
            if de_req.report:
                assert self.finish(name, {de_req.req_id})[1] == set(), f"the receive of {name} failed"
            else:
                self.drain(name, de_req)

        if ahead:
            on_ranks([lambda r=req, x=name: read_ahead(r, x) for req, name in zip(reqs, self.ranks(pe), strict=True)])
            if before_step is not None:
                before_step()
        on_ranks([lambda r=req, x=name: prefill(r, x) for req, name in zip(reqs, self.ranks(pe), strict=True)])
        on_ranks([lambda x=name: finish(x) for name in self.ranks(de)])
        for name in self.ranks(pe):
            self.instances[name].worker.get_finished({f"p{n}"})
        return [(de_req, self.shard(de, rank).take(rows)) for rank in range(self.tp[de])]

    def bytes_read(self, name: str) -> int:
        """Payload bytes instance ``name``'s ranks read from the store (their storage-NIC accounting)."""
        return sum(self.instances[r].worker.read_queue.stats().completed_bytes for r in self.ranks(name))
