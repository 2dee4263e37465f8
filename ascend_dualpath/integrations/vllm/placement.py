"""Where the proxy sends a request: its PE, its DE and its read path, over a cluster of N PEs and M DEs.

Two placements:

- ``"scheduler"``: the library's :class:`~ascend_dualpath.dualpath.scheduler.Scheduler` (paper §6) driven by live
  state. Each *round* queries every instance's connector status (side channel) and every DE's vLLM ``/metrics``
  (``vllm:cache_config_info`` ``num_gpu_blocks`` and ``vllm:kv_cache_usage_perc``: its free KV blocks, the DE's
  HBM), all concurrently and bounded, builds one :class:`GroupReport` per DE group and per PE node, submits the
  requests that arrived since the last round, pulls every DE group (DE phase 1 by group total tokens, phase 2 by
  HBM fit and the ``Z`` threshold), then every PE group (category 2/3 against alpha, never over beta, the read
  path on the shorter read queue). A request no engine can take stays in the scheduler's queues and is tried
  again every ``poll_s`` and whenever a request of this proxy finishes, until its ``timeout_s``: then it is taken
  back out (:meth:`Scheduler.withdraw`) and fails with :class:`PlacementTimeout` naming what it waited for.
- ``"round-robin"``: PE ``k mod N`` and DE ``k mod M`` for the ``k``-th request (the benchmark's baseline),
  never waiting; its read path follows the same shorter-queue rule.

Engine state in a report: an engine's tokens and sequences are the larger of what its connector reports
unfinished and what this proxy has sent it and not seen finish (the proxy's own requests are most of what the
connector counts, and the connector learns of a request only once vLLM schedules it); a node's read queue is the
sum of its instances' reported queues plus the hit tokens of requests this proxy sent there whose reads no instance
has reported yet (a status names the transfers whose reads are queued or running, ``reading``: from the first
round that shows one, its read is in the instance's queue, and once it ends in no queue, so the proxy's estimate of
it goes; a read that starts and ends between two rounds stays in the estimate until its prefill finishes); a DE's free HBM is, in KV blocks, ``num_gpu_blocks - max(used, blocks of this proxy's requests in
flight there)``, unknown (never a limit) while its ``/metrics`` does not answer. A request's needs are estimated
from its prompt tokens (the proxy counts them with a PE's tokenizer, else :func:`estimated_tokens`): the storage hits
(``cached`` tokens) are the prompt's leading blocks that requests this proxy had answered in full left in the store
(:class:`~.cached_prefixes.CachedPrefixes`; every prompt token when the proxy has no token ids), its read is those
hits, and its DE holds ``ceil((prompt + max_tokens) / block_size)`` KV blocks.

Compute quota (``compute_quota_s > 0``): a request placed on a PE is held at the proxy until
:func:`~ascend_dualpath.dualpath.scheduler.plan_prefill_batch` over the PE's in-flight prefills (FIFO) and this
request would put this request into the PE's next forward pass within the quota of predicted attention time
(docs/vllm.md says what vLLM's own scheduler keeps).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import math
import time
import uuid
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from ascend_dualpath.dualpath.scheduler import (
    BETA_WINDOW_S,
    EngineProfile,
    EngineState,
    GroupReport,
    PrefillWork,
    ReadPath,
    Request,
    Scheduler,
    choose_read_path,
    decode_token_threshold,
    plan_prefill_batch,
)
from ascend_dualpath.errors import ConfigError
from ascend_dualpath.integrations.vllm.cached_prefixes import DEFAULT_CAPACITY_BLOCKS, CachedPrefixes
from ascend_dualpath.integrations.vllm.cluster import Cluster, Instance

PLACEMENTS = ("scheduler", "round-robin")
READ_PATHS = ("dual", "pe", "de")
UNBOUNDED = 2**62  # a threshold or a free-block count that never binds
DEFAULT_BLOCK_SIZE = 16  # vLLM's default, until a DE's /metrics says otherwise
DEFAULT_MAX_TOKENS = 16  # vLLM's default max_tokens of a completion


class PlacementTimeout(Exception):
    """A request waited ``timeout_s`` for an engine; ``str()`` names what it waited for."""


@dataclasses.dataclass(frozen=True)
class KvBlocks:
    """A DE's KV cache as its vLLM ``/metrics`` shows it: ``total`` usable blocks of ``block_size`` tokens (vLLM's
    ``num_gpu_blocks`` less the null block it keeps per engine, the base of its ``kv_cache_usage_perc``), ``usage``
    in [0, 1]."""

    total: int
    usage: float
    block_size: int

    @property
    def used(self) -> int:
        return math.ceil(self.usage * self.total)


def parse_kv_blocks(text: str, engine: int | None = None) -> KvBlocks | None:
    """:class:`KvBlocks` from vLLM 0.32's Prometheus text (summed over its engines; ``engine``: that data-parallel
    engine's only, by vLLM's ``engine`` label), None when it lacks them."""
    total = block_size = 0
    usages: list[float] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if engine is not None and sample.labels.get("engine") != str(engine):
                continue
            if sample.name == "vllm:cache_config_info" and str(sample.labels.get("num_gpu_blocks", "")).isdigit():
                total += max(0, int(sample.labels["num_gpu_blocks"]) - 1)  # the null block holds no KV
                block_size = int(sample.labels.get("block_size") or DEFAULT_BLOCK_SIZE)
            elif sample.name == "vllm:kv_cache_usage_perc":
                usages.append(float(sample.value))
    if not total or not usages:
        return None
    return KvBlocks(total, min(1.0, max(0.0, sum(usages) / len(usages))), block_size)


def tokenize_request(body: dict, chat: bool) -> dict | None:
    """The body of vLLM's ``/tokenize`` that counts the request's prompt tokens as its engine will (the model's
    tokenizer; for chat its template and the template options the request carries), or None where the proxy
    counts them itself (:func:`estimated_tokens`: a prompt of token ids, or a batch of prompts)."""
    request = {"model": body["model"]} if isinstance(body.get("model"), str) else {}
    if chat:
        if not isinstance(body.get("messages"), list):
            return None
        keys = (
            "messages",
            "chat_template",
            "chat_template_kwargs",
            "add_generation_prompt",
            "continue_final_message",
            "tools",
        )
        return {**request, **{k: body[k] for k in keys if k in body}}
    if not isinstance(body.get("prompt"), str):
        return None
    return {**request, "prompt": body["prompt"]}


def estimated_tokens(body: dict) -> int:
    """Prompt tokens of a request as the proxy can count them without a tokenizer: the ids of a token-id prompt, else
    its words (a constant factor off for subword tokenizers, the same for every engine, so comparisons hold)."""
    prompt = body.get("prompt")
    if prompt is None:
        prompt = " ".join(str(m.get("content", "")) for m in body.get("messages") or [] if isinstance(m, dict))
    if isinstance(prompt, list):
        return len(prompt) if prompt and isinstance(prompt[0], int) else sum(len(str(p).split()) for p in prompt)
    return len(str(prompt).split())


def max_new_tokens(body: dict) -> int:
    """The request's ``max_tokens`` (chat: ``max_completion_tokens`` first), else vLLM's default of 16."""
    for key in ("max_completion_tokens", "max_tokens"):
        if isinstance(body.get(key), int) and body[key] > 0:
            return body[key]
    return DEFAULT_MAX_TOKENS


def profile_from_thresholds(alpha: int, beta: int) -> EngineProfile:
    """An :class:`EngineProfile` whose thresholds are ``alpha`` / ``beta`` and whose attention time is quadratic
    in the chunk, fitted through (``beta`` tokens, 5 s): the whole prefill time is taken as attention time (the
    predictor the compute quota needs; the paper fits it per model)."""
    prefill_rate = beta / BETA_WINDOW_S
    flops_at_beta = beta * (beta + 1) / 2  # attention_flops(0, beta) with one FLOP per pair
    return EngineProfile(
        read_tokens_per_s=alpha / 3.0,
        prefill_tokens_per_s=prefill_rate,
        attn_flops_per_pair=1.0,
        seconds_per_flop=BETA_WINDOW_S / max(flops_at_beta, 1.0),
    )


@dataclasses.dataclass
class Ledger:
    """What this proxy sent and has not seen finish, per instance name (tokens, sequences, DE blocks, the PE's
    prefills in FIFO order as ``(cached, remaining)`` tokens), and the reads no instance has reported yet: ``reads``
    maps a transfer's xfer id to ``(node, hit tokens)``."""

    tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    seqs: dict[str, int] = dataclasses.field(default_factory=dict)
    blocks: dict[str, int] = dataclasses.field(default_factory=dict)
    reads: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    prefills: dict[str, dict[int, tuple[int, int]]] = dataclasses.field(default_factory=dict)

    def add(self, name: str, tokens: int, blocks: int = 0, seqs: int = 1) -> None:
        """Count one more request (``seqs=-1`` with negative figures: one fewer) on instance ``name``."""
        self.tokens[name] = self.tokens.get(name, 0) + tokens
        self.seqs[name] = self.seqs.get(name, 0) + seqs
        self.blocks[name] = self.blocks.get(name, 0) + blocks

    def remove(self, name: str, tokens: int, blocks: int = 0) -> None:
        self.add(name, -tokens, -blocks, seqs=-1)

    def drop_reported_reads(self, status: dict[str, dict | None]) -> None:
        """Forget the reads the status replies name in ``reading``: each is in its instance's read queue now
        (and counted there) or, later, read; counting it here as well would count it twice."""
        for reply in status.values():
            for xfer_id in (reply or {}).get("reading", ()):
                self.reads.pop(xfer_id, None)


@dataclasses.dataclass
class Snapshot:
    """One round's live state: status replies (None: no answer) and DE KV blocks (None: unknown) by name."""

    status: dict[str, dict | None]
    kv: dict[str, KvBlocks | None]


@dataclasses.dataclass
class Placement:
    """One request's place: its prompt ``tokens`` of which ``cached`` hit the store, its DE ``blocks``, its PE and
    DE (which know it by ``xfer_id``), read path, the queues the path was chosen on, and the reasons, each ``"<rule> <detail>"`` (the rule, before
    the first space, labels ``adp_proxy_placements_total``)."""

    request_id: int
    tokens: int
    cached: int
    blocks: int
    pe: Instance
    de: Instance
    path: str
    path_rule: str
    pe_queue_tokens: int | None
    de_queue_tokens: int | None
    rules: list[str]
    waited_s: float = 0.0
    xfer_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)  # both instances know it by this


@dataclasses.dataclass
class _Waiter:
    """A request waiting in the scheduler: its needs, its future (resolves to a Placement), its reasons so far."""

    request: Request | None
    tokens: int
    cached: int
    max_tokens: int
    future: asyncio.Future
    since: float
    rules: list[str] = dataclasses.field(default_factory=list)
    decode: str = ""  # the DE the scheduler gave it, while it waits for a PE


@dataclasses.dataclass
class _Reports:
    """A round's reports: DE groups and PE groups (one per PE node), the engine ids' instances, node queues."""

    decode: dict[int, GroupReport]
    prefill: dict[int, GroupReport]
    queues: dict[str, int]


def node_queues(cluster: Cluster, snap: Snapshot, ledger: Ledger) -> dict[str, int]:
    """Each node's read queue in tokens: its instances' reported queues plus the reads this proxy sent there that no
    instance has reported yet (:meth:`Ledger.drop_reported_reads`), scaled to the fastest node's storage NIC (:func:`node_rate_scales`), so that a longer queue is one that
    takes longer to drain and alpha (tokens the fastest node reads in 3 s) means 3 s of backlog on every node."""
    queues = dict.fromkeys(cluster.nodes, 0)
    for node, tokens in ledger.reads.values():
        queues[node] += tokens
    for instance in cluster.instances:
        status = snap.status.get(instance.name)
        if status is not None:
            queues[instance.node] += int(status["read_queue_tokens"])
    scales = node_rate_scales(cluster, snap)
    return {node: round(tokens * scales.get(node, 1.0)) for node, tokens in queues.items()}


def node_rate_scales(cluster: Cluster, snap: Snapshot) -> dict[str, float]:
    """``fastest cap / node cap`` per node from the instances' ``snic_bytes_per_s`` (a node's cap is the sum of its
    instances'); empty (no scaling) while any instance's cap is unknown. The paper's nodes are alike; with unequal
    caps, tokens queued on a slower NIC take proportionally longer to read."""
    caps: dict[str, float] = {}
    for instance in cluster.instances:
        rate = (snap.status.get(instance.name) or {}).get("snic_bytes_per_s")
        if not isinstance(rate, int | float) or not math.isfinite(rate) or rate <= 0:
            return {}
        caps[instance.node] = caps.get(instance.node, 0.0) + rate
    fastest = max(caps.values(), default=0.0)
    return {node: fastest / cap for node, cap in caps.items()}


def engine_state(engine_id: int, node_id: int, instance: Instance, snap: Snapshot, ledger: Ledger) -> EngineState:
    """One engine's report entry (see the module docstring); ``free_hbm_bytes`` holds free KV *blocks*."""
    status = snap.status.get(instance.name) or {}
    tokens = max(int(status.get("unfinished_tokens", 0)), ledger.tokens.get(instance.name, 0))
    seqs = max(int(status.get("unfinished_requests", 0)), ledger.seqs.get(instance.name, 0))
    free = 0
    if instance.role == "decode":
        kv = snap.kv.get(instance.name)
        held = ledger.blocks.get(instance.name, 0)
        free = UNBOUNDED if kv is None else max(0, kv.total - max(kv.used, held))
    return EngineState(engine_id, node_id, seqs=seqs, tokens=tokens, free_hbm_bytes=free)


def build_reports(cluster: Cluster, snap: Snapshot, ledger: Ledger) -> _Reports:
    """The scheduler's reports for one round: engine ids are PEs 0..N-1 then DEs, node ids the nodes' order."""
    node_id = {node: index for index, node in enumerate(cluster.nodes)}
    queues = node_queues(cluster, snap, ledger)
    by_id = {node_id[node]: tokens for node, tokens in queues.items()}
    engines: dict[tuple[str, int], list[EngineState]] = {}
    for engine_id, instance in enumerate(cluster.instances):
        key = ("decode", instance.group) if instance.role == "decode" else ("prefill", node_id[instance.node])
        state = engine_state(engine_id, node_id[instance.node], instance, snap, ledger)
        engines.setdefault(key, []).append(state)
    reports: dict[str, dict[int, GroupReport]] = {"decode": {}, "prefill": {}}
    for (role, group), states in engines.items():
        reports[role][group] = GroupReport(group, states, dict(by_id))
    return _Reports(reports["decode"], reports["prefill"], queues)


def decode_rules(
    request: Request, chosen: int, group: int, engines: list[EngineState], totals: dict[int, int], names: list[str]
) -> list[str]:
    """Why DE ``chosen`` of ``group`` (engine id) got ``request``: the group totals, the HBM fit, the Z rule."""
    rules = [f"de-group {group} of fewest total tokens {dict(sorted(totals.items()))}"]
    no_room = [names[e.engine_id] for e in engines if e.free_hbm_bytes < request.decode_hbm_bytes]
    if no_room:
        rules.append(f"hbm-fit excluded {no_room}: fewer than {request.decode_hbm_bytes} free KV blocks")
    z = decode_token_threshold([request], engines)
    state = next(e for e in engines if e.engine_id == chosen)
    if state.tokens + request.prompt_tokens <= z:
        rules.append(
            f"z-low {names[chosen]}: tokens {state.tokens} + {request.prompt_tokens} <= Z {z:.0f}, fewest seqs"
        )
    else:
        rules.append(f"z-high {names[chosen]}: every fitting DE over Z {z:.0f}, fewest tokens")
    return rules


def prefill_rules(
    chosen: int, tokens: dict[int, int], node_of: dict[int, int], queues: dict[int, int], alpha: int, beta: int,
    names: list[str],
) -> list[str]:  # fmt: skip
    """Why PE ``chosen`` (engine id): its category against alpha, the PEs over beta, nodes avoided for alpha."""
    over = [names[e] for e, t in tokens.items() if t > beta]
    queue = queues.get(node_of[chosen], 0)
    category = 2 if queue <= alpha else 3
    sign = "<=" if category == 2 else ">"
    rules = [f"pe-category-{category} {names[chosen]}: node read queue {queue} {sign} alpha {alpha}, fewest tokens"]
    if over:
        rules.append(f"pe-over-beta excluded {over}: unfinished tokens > beta {beta}")
    avoided = [names[e] for e, t in tokens.items() if t <= beta and queues.get(node_of[e], 0) > alpha]
    if category == 2 and avoided:
        rules.append(f"pe-alpha-avoided {avoided}: node read queue > alpha {alpha}")
    return rules


def decide(policy: str, pe_status: dict | None, de_status: dict | None) -> tuple[str, str]:
    """``(path, rule)`` for one request from the PE's and the DE's status (None: no answer), each with its node's
    read queue as ``read_queue_tokens`` (round robin passes the node sums of :func:`node_queues`).

    ``dual`` applies the scheduler rule to the read-queue lengths (tokens); its tie-break compares the blocks each
    side has read so far. ``pe`` / ``de`` force the path; a missing status falls back to the PE path.
    """
    if policy in ("pe", "de"):
        return policy, f"forced:{policy}"
    if pe_status is None or de_status is None:
        return "pe", "fallback:side-channel"
    pe_queue, de_queue = int(pe_status["read_queue_tokens"]), int(de_status["read_queue_tokens"])
    pe_read, de_read = int(pe_status["snic_read_blocks"]), int(de_status["snic_read_blocks"])
    path = choose_read_path(pe_queue, de_queue, pe_read, de_read).value
    if pe_queue != de_queue:
        return path, "shorter-queue"
    return path, "tie:fewer-reads" if pe_read != de_read else "tie:pe"


def path_rule(pe_queue: int, de_queue: int) -> str:
    """The read-path rule's name for the two node queues the path was chosen on."""
    return "shorter-queue" if pe_queue != de_queue else "tie"


class Placer:
    """Places requests (``placement``, ``read_path``, ``split``: see the module docstring) on ``cluster``.

    ``status(instance)`` and ``kv_blocks(instance)`` are the proxy's live queries (None: no answer); both are
    awaited at most ``concurrency`` at a time. ``alpha`` / ``beta`` in tokens; ``timeout_s`` bounds a request's
    wait for an engine and for the compute quota; ``cached_capacity_blocks`` the blocks the hit estimate
    (:class:`~.cached_prefixes.CachedPrefixes`) remembers.
    """

    def __init__(
        self,
        cluster: Cluster,
        status: Callable[[Instance], Awaitable[dict | None]],
        kv_blocks: Callable[[Instance], Awaitable[KvBlocks | None]],
        registry: CollectorRegistry,
        *,
        placement: str = "scheduler",
        read_path: str = "dual",
        split: bool = False,
        alpha: int = UNBOUNDED,
        beta: int = UNBOUNDED,
        compute_quota_s: float = 0.0,
        timeout_s: float = 30.0,
        poll_s: float = 0.25,
        concurrency: int = 16,
        cached_capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
    ) -> None:
        if placement not in PLACEMENTS:
            raise ConfigError(f"placement={placement!r} is not one of {PLACEMENTS}")
        if read_path not in READ_PATHS:
            raise ConfigError(f"read path policy={read_path!r} is not one of {READ_PATHS}")
        if compute_quota_s < 0 or poll_s <= 0 or concurrency < 1:
            raise ConfigError(
                f"compute_quota_s={compute_quota_s} must be >= 0, poll_s={poll_s} > 0, concurrency={concurrency} >= 1"
            )
        self.cluster, self.placement, self.read_path, self.split = cluster, placement, read_path, split
        self.alpha, self.beta, self.compute_quota_s = alpha, beta, compute_quota_s
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self._status_fn, self._kv_fn = status, kv_blocks
        self._limit = asyncio.Semaphore(concurrency)
        self.scheduler = Scheduler(alpha, beta)
        # the quota's attention predictor; an unbounded beta gives one under which every prefill fits the quota
        self.profile = profile_from_thresholds(min(alpha, 2**40), min(beta, 2**40))
        self.ledger = Ledger()
        self.names = [i.name for i in cluster.instances]
        self._ids = itertools.count()
        self._rr = itertools.count()
        self._new: list[_Waiter] = []
        self._waiting: dict[int, _Waiter] = {}
        self._changed = asyncio.Event()
        self._released = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._last: _Reports | None = None
        self._block_size = DEFAULT_BLOCK_SIZE
        self.prefixes = CachedPrefixes(DEFAULT_BLOCK_SIZE, cached_capacity_blocks)
        self._init_metrics(registry)

    def _init_metrics(self, reg: CollectorRegistry) -> None:
        self.placements = Counter(
            "adp_proxy_placements", "placement decisions by deciding rule", ["rule"], registry=reg
        )
        self.waiting = Gauge("adp_proxy_waiting_requests", "requests waiting for an engine or the quota", registry=reg)
        self.quota_holds = Counter("adp_proxy_quota_holds", "requests held for a PE's compute quota", registry=reg)
        # an unbounded threshold is +Inf, the value Prometheus gives "never binds"
        for name, value, what in (("alpha", self.alpha, "node read-queue"), ("beta", self.beta, "PE unfinished-token")):
            gauge = Gauge(f"adp_proxy_{name}_tokens", f"{name}: {what} threshold in tokens (+Inf: none)", registry=reg)
            gauge.set(math.inf if value >= UNBOUNDED else value)

    # ------------------------------------------------------------------------------------------ live state

    async def _bounded(self, awaitable: Awaitable):
        async with self._limit:
            return await awaitable

    async def snapshot(self, with_kv: bool = True) -> Snapshot:
        """Every instance's status and (``with_kv``) every DE's KV blocks, concurrently, at most ``concurrency``
        queries at a time; each query bounded by the proxy's own timeouts."""
        instances = self.cluster.instances
        decode = self.cluster.decode if with_kv else ()
        results = await asyncio.gather(
            *(self._bounded(self._status_fn(i)) for i in instances),
            *(self._bounded(self._kv_fn(i)) for i in decode),
        )
        status = {i.name: r for i, r in zip(instances, results[: len(instances)], strict=True)}
        kv = {i.name: r for i, r in zip(decode, results[len(instances) :], strict=True)}
        self.ledger.drop_reported_reads(status)
        for blocks in kv.values():
            if blocks is not None:
                self._block_size = blocks.block_size
        if self.prefixes.block_size != self._block_size:  # blocks of another size key nothing the store has
            self.prefixes = CachedPrefixes(self._block_size, self.prefixes.capacity_blocks)
        return Snapshot(status, kv)

    # ------------------------------------------------------------------------------------------ placing

    async def place(self, body: dict, prompt_ids: list[int] | None = None) -> Placement:
        """The request's :class:`Placement`, its resources counted in the ledger (give them back with
        :meth:`prefill_done` and :meth:`decode_done`). ``prompt_ids``: the prompt's token ids as its engines see
        them, whose leading stored blocks are its hits (None: :func:`estimated_tokens`, all taken as hits). Raises
        :class:`PlacementTimeout`."""
        if prompt_ids is None:
            tokens = max(1, estimated_tokens(body))
            cached = tokens
        else:
            tokens, cached = max(1, len(prompt_ids)), self.prefixes.cached_tokens(prompt_ids)
        max_tokens = max_new_tokens(body)
        if self.placement == "round-robin":
            placement = await self._round_robin(tokens, cached, max_tokens)
        else:
            placement = await self._scheduled(tokens, cached, max_tokens)
        for rule in placement.rules:
            self.placements.labels(rule=rule.split(" ", 1)[0]).inc()
        if self.compute_quota_s > 0:
            await self._hold_for_quota(placement)
        return placement

    def _count(self, placement: Placement) -> None:
        """Enter a placed request's PE tokens and reads into the ledger (its DE's went in when it was chosen)."""
        self.ledger.add(placement.pe.name, placement.tokens)
        # every token a hit is the guess without token ids: for the compute quota, take them all as computed
        hit_all = placement.cached >= placement.tokens
        work = (0, placement.tokens) if hit_all else (placement.cached, placement.tokens - placement.cached)
        self.ledger.prefills.setdefault(placement.pe.name, {})[placement.request_id] = work
        read_node = placement.pe.node if placement.path == "pe" else placement.de.node
        if placement.cached:
            self.ledger.reads[placement.xfer_id] = (read_node, placement.cached)

    def prefill_done(self, placement: Placement) -> None:
        """The PE answered (or failed): its tokens and the request's read, if no instance reported it, leave the
        ledger."""
        self.ledger.remove(placement.pe.name, placement.tokens)
        self.ledger.prefills.get(placement.pe.name, {}).pop(placement.request_id, None)
        self.ledger.reads.pop(placement.xfer_id, None)
        self._notify()

    def decode_done(self, placement: Placement) -> None:
        """The DE's answer ended (or failed): its tokens and blocks leave the ledger."""
        self.ledger.remove(placement.de.name, placement.tokens, placement.blocks)
        self._notify()

    def stored(self, prompt_ids: list[int]) -> None:
        """A request's DE answered in full: its connector stores the prompt's full blocks (and the answer's, whose
        token ids the proxy does not see), which later prompts may hit."""
        self.prefixes.store(prompt_ids)

    def _notify(self) -> None:
        """Wake the rounds and the quota holds: resources came back."""
        self._changed.set()
        self._released.set()

    def _choose_path(self, pe: Instance, de: Instance, snap: Snapshot, queues: dict[str, int], scheduled: str):
        """``(path, rule)``: forced, the side-channel fallback, or ``scheduled`` (the shorter-queue rule's)."""
        if self.read_path in ("pe", "de"):
            return self.read_path, f"forced:{self.read_path}"
        if snap.status.get(pe.name) is None or snap.status.get(de.name) is None:
            return "pe", "fallback:side-channel"
        return scheduled, path_rule(queues[pe.node], queues[de.node])

    async def _round_robin(self, tokens: int, cached: int, max_tokens: int) -> Placement:
        k = next(self._rr)
        pe, de = self.cluster.prefill[k % len(self.cluster.prefill)], self.cluster.decode[k % len(self.cluster.decode)]
        snap = await self.snapshot(with_kv=False)
        queues = node_queues(self.cluster, snap, self.ledger)

        def node_view(instance: Instance) -> dict | None:  # the instance's status with its node's read queue
            status = snap.status.get(instance.name)
            return None if status is None else {**status, "read_queue_tokens": queues[instance.node]}

        path, rule = decide(self.read_path, node_view(pe), node_view(de))
        blocks = math.ceil((tokens + max_tokens) / self._block_size)
        placement = self._placement(next(self._ids), (tokens, cached, blocks), pe, de, path, rule, snap, queues)
        placement.rules.insert(0, f"round-robin request {k}: {pe.name}, {de.name}")
        self.ledger.add(de.name, tokens, blocks)
        self._count(placement)
        return placement

    def _placement(self, rid, needs: tuple[int, int, int], pe, de, path, rule, snap, queues) -> Placement:
        """``needs``: the request's prompt tokens, cached tokens and DE blocks."""
        pe_q = None if snap.status.get(pe.name) is None else queues[pe.node]
        de_q = None if snap.status.get(de.name) is None else queues[de.node]
        return Placement(rid, *needs, pe, de, path, rule, pe_q, de_q, [f"path-{rule} {path}"])

    async def _scheduled(self, tokens: int, cached: int, max_tokens: int) -> Placement:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(None, tokens, cached, max_tokens, loop.create_future(), time.monotonic())
        self._new.append(waiter)
        self.waiting.inc()
        self._changed.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.create_task(self._rounds())
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), self.timeout_s)
        except asyncio.TimeoutError:
            if waiter.future.done():
                return waiter.future.result()
            raise PlacementTimeout(self._withdraw(waiter)) from None
        except asyncio.CancelledError:  # the client went away: nothing of it may stay queued or counted
            if waiter.future.done() and waiter.future.exception() is None:
                self.release(waiter.future.result())
            elif not waiter.future.done():
                self._withdraw(waiter)
            raise
        finally:
            self.waiting.dec()

    def release(self, placement: Placement) -> None:
        """Give back everything of a placed request that was never sent."""
        self.prefill_done(placement)
        self.decode_done(placement)

    def _withdraw(self, waiter: _Waiter) -> str:
        """Take a timed-out request out of every queue; the message names what it waited for."""
        if waiter in self._new:
            self._new.remove(waiter)
            stage = "decode"
        else:
            self._waiting.pop(waiter.request.request_id, None)
            stage = self.scheduler.withdraw(waiter.request.request_id) or "decode"
        waited = f"request waited {self.timeout_s} s for"
        if stage == "prefill":  # it held its DE's blocks in the ledger
            self.ledger.remove(waiter.decode, waiter.request.prompt_tokens, waiter.request.decode_hbm_bytes)
            pe_tokens = self._last_tokens("prefill")
            return f"{waited} a PE with unfinished tokens <= beta {self.beta} (now {pe_tokens})"
        need = waiter.request.decode_hbm_bytes if waiter.request else "its"
        return f"{waited} a DE with {need} free KV blocks (free now {self._last_free()})"

    def _last_tokens(self, role: str) -> dict[str, int]:
        reports = {} if self._last is None else getattr(self._last, role)
        return {self.names[e.engine_id]: e.tokens for r in reports.values() for e in r.engines}

    def _last_free(self) -> dict[str, int | str]:
        reports = {} if self._last is None else self._last.decode
        return {
            self.names[e.engine_id]: "unknown" if e.free_hbm_bytes >= UNBOUNDED else e.free_hbm_bytes
            for r in reports.values()
            for e in r.engines
        }

    # ------------------------------------------------------------------------------------------ rounds

    async def _rounds(self) -> None:
        """Run rounds while requests wait: at once after a change (a new or finished request), else every
        ``poll_s`` (the engines' state also changes on its own)."""
        while self._new or self._waiting:
            self._changed.clear()
            try:
                await self._round()
            except (ValueError, TypeError, KeyError) as exc:  # a malformed status reply: fail now, not at timeout
                self._fail_waiting(exc)
                return
            if self._new or self._waiting:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), self.poll_s)

    async def _round(self) -> None:
        snap = await self.snapshot()
        scales = node_rate_scales(self.cluster, snap)  # the reports' queues are in these units too
        self.scheduler.set_read_scales({i: scales[n] for i, n in enumerate(self.cluster.nodes) if n in scales})
        for group_id in sorted(self._reports(snap).decode):  # fresh totals, earlier waiters' DEs first
            self._pull_decode(snap, group_id)
        for waiter in self._new:
            blocks = math.ceil((waiter.tokens + waiter.max_tokens) / self._block_size)
            waiter.request = Request(next(self._ids), waiter.tokens, waiter.cached, blocks)
            self._waiting[waiter.request.request_id] = waiter
            self.scheduler.submit(waiter.request)
        self._new.clear()
        for group_id in sorted(self._reports(snap).decode):
            self._pull_decode(snap, group_id)
        reports = self._reports(snap)
        for report in reports.prefill.values():
            self.scheduler.register_prefill_group(report)
        for group_id in sorted(reports.prefill):
            self._deliver(snap, self.scheduler.pull_prefill(self._reports(snap).prefill[group_id]))
        self._last = self._reports(snap)

    def _fail_waiting(self, exc: Exception) -> None:
        """Fail every waiting request with ``exc`` (they leave the scheduler's queues)."""
        for waiter in [*self._new, *self._waiting.values()]:
            if waiter.request is not None:
                self.scheduler.withdraw(waiter.request.request_id)
            if waiter.decode:
                self.ledger.remove(waiter.decode, waiter.request.prompt_tokens, waiter.request.decode_hbm_bytes)
            if not waiter.future.done():
                waiter.future.set_exception(exc)
        self._new.clear()
        self._waiting.clear()

    def _reports(self, snap: Snapshot) -> _Reports:
        return build_reports(self.cluster, snap, self.ledger)

    def _pull_decode(self, snap: Snapshot, group_id: int) -> None:
        reports = self._reports(snap)
        report = reports.decode[group_id]
        totals = {g: sum(e.tokens for e in r.engines) for g, r in reports.decode.items()}
        for request, engine_id in self.scheduler.pull_decode(report):
            waiter = self._waiting.get(request.request_id)
            if waiter is None:
                continue
            name = self.names[engine_id]  # plan_decode itself counts the blocks of the requests it placed before
            waiter.rules += decode_rules(request, engine_id, group_id, report.engines, totals, self.names)
            waiter.decode = name
            self.ledger.add(name, request.prompt_tokens, request.decode_hbm_bytes)

    def _deliver(self, snap: Snapshot, assignments) -> None:
        for assignment in assignments:
            waiter = self._waiting.pop(assignment.request.request_id, None)
            if waiter is None:
                continue
            reports = self._reports(snap)
            pe = self.cluster.instances[assignment.prefill_engine]
            de = self.cluster.instances[assignment.decode_engine]
            pe_engines = [e for r in reports.prefill.values() for e in r.engines]
            tokens = {e.engine_id: e.tokens for e in pe_engines}
            node_of = {e.engine_id: e.node_id for e in pe_engines}
            queues = {self.cluster.nodes.index(n): q for n, q in reports.queues.items()}
            rules = prefill_rules(assignment.prefill_engine, tokens, node_of, queues, self.alpha, self.beta, self.names)
            scheduled = "pe" if assignment.read_path is ReadPath.PE else "de"
            path, rule = self._choose_path(pe, de, snap, reports.queues, scheduled)
            request = assignment.request
            needs = (request.prompt_tokens, request.cached_tokens, request.decode_hbm_bytes)
            placement = self._placement(request.request_id, needs, pe, de, path, rule, snap, reports.queues)
            placement.rules[:0] = waiter.rules + rules
            placement.waited_s = time.monotonic() - waiter.since
            self._count(placement)
            if not waiter.future.done():
                waiter.future.set_result(placement)

    # ------------------------------------------------------------------------------------------ compute quota

    def _fits_quota(self, placement: Placement) -> bool:
        """Whether the request joins its PE's next forward pass under the quota: in-flight prefills first."""
        queue = []  # FIFO: the PE's prefills placed before this one (dispatched or held), then this one
        for rid, (cached, remaining) in self.ledger.prefills.get(placement.pe.name, {}).items():
            queue.append(PrefillWork(rid, cached, remaining))
            if rid == placement.request_id:
                break
        batch = plan_prefill_batch(queue, self.profile.attention_time, self.compute_quota_s)
        return any(work.request_id == placement.request_id for work, _ in batch)

    async def _hold_for_quota(self, placement: Placement) -> None:
        """Wait (bounded by ``timeout_s``) until :meth:`_fits_quota`, re-checking whenever a request of this proxy
        finishes and every ``poll_s``; a timeout gives the request's resources back."""
        if self._fits_quota(placement):
            return
        self.quota_holds.inc()
        self.waiting.inc()
        start = time.monotonic()
        try:
            while not self._fits_quota(placement):
                remaining = start + self.timeout_s - time.monotonic()
                if remaining <= 0:
                    self.release(placement)
                    raise PlacementTimeout(
                        f"request waited {self.timeout_s} s for {placement.pe.name}'s compute quota of "
                        f"{self.compute_quota_s} s (its in-flight prefills as (cached, computed) tokens: "
                        f"{list(self.ledger.prefills.get(placement.pe.name, {}).values())})"
                    )
                self._released.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._released.wait(), min(remaining, self.poll_s))
        except asyncio.CancelledError:
            self.release(placement)
            raise
        finally:
            self.waiting.dec()
        placement.rules.append(f"compute-quota held {time.monotonic() - start:.3f} s on {placement.pe.name}")
