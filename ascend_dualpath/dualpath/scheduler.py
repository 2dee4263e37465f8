"""The DualPath two-level request scheduler (paper §6, §A.4).

Engine groups *pull* work. On each pull a group reports, per engine, its unfinished sequences
``seqs``, their unfinished tokens ``tokens`` (the load proxy for compute, disk and network) and, for
DEs, free HBM; and each node's storage read-queue length in tokens. The scheduler then

1. admits requests to decode engines (DE phase 1 across groups by smallest total tokens, phase 2
   within the group with the HBM fit and the ``Z`` threshold),
2. places admitted requests on prefill engines from a global FIFO (category 2: node read queue
   <= alpha and tokens <= beta; else category 3: read queue > alpha and tokens <= beta; engines with
   tokens > beta never), minimum tokens within a category,
3. reads each request's hit KV on the side (PE or DE node) with the shorter read queue (a tie, which
   the paper does not treat, goes to the side whose node was given fewer hit tokens to read so far),

and inside a PE, :func:`plan_prefill_batch` fills one forward pass up to a compute quota, splitting
the request that overflows by binary search.

Read queue: a node's storage read queue is measured in tokens (the paper compares it with
alpha, "tokens readable in 3 s") and counts every read the node was given and has not finished: waiting,
in flight, and, in this scheduler's view, assigned but not yet delivered to the PE group that starts it.

Order of the two levels: a request is admitted by a DE first (HBM is the admission limit, and the
DE read path needs its DE before any byte is read), then joins the PE FIFO; the read path is chosen
when the PE is. The paper leaves this order implicit.

Split: ``plan_*`` functions are pure (inputs are not mutated; ties break on engine id, so every
decision is deterministic); :class:`Scheduler` runs them against its queues and its read-queue view.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ascend_dualpath.errors import ConfigError

ALPHA_WINDOW_S = 3.0  # alpha = tokens a node can read from storage in 3 s (§A.4)
BETA_WINDOW_S = 5.0  # beta = tokens one engine prefills in 5 s (§A.4)
DEFAULT_COMPUTE_QUOTA_S = 0.300  # intra-PE batch budget (§A.4)
Z_SLACK = 1.05  # DE phase-2 high-token threshold multiplier (§6.1)


class ReadPath(enum.Enum):
    PE = "pe"  # storage -> PE buffer -> PE HBM (layerwise) ; hit+miss KV -> DE buffer
    DE = "de"  # storage -> DE buffer -> PE HBM (layerwise) ; miss KV -> DE buffer


@dataclass
class Request:
    """One prefill+decode request as the scheduler sees it.

    ``prompt_tokens`` is ``len(r)``; ``cached_tokens`` of them hit in storage (a multiple of the block
    size, <= prompt_tokens); ``decode_hbm_bytes`` is what its DE must hold for it.
    """

    request_id: int
    prompt_tokens: int
    cached_tokens: int = 0
    decode_hbm_bytes: int = 0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ConfigError(f"request {self.request_id}: prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if not 0 <= self.cached_tokens <= self.prompt_tokens:
            raise ConfigError(
                f"request {self.request_id}: cached_tokens={self.cached_tokens} outside [0, {self.prompt_tokens}]"
            )
        if self.decode_hbm_bytes < 0:
            raise ConfigError(f"request {self.request_id}: decode_hbm_bytes must be >= 0, got {self.decode_hbm_bytes}")


@dataclass
class EngineState:
    """One engine's report: unfinished sequences and tokens, free HBM (DEs), and its node."""

    engine_id: int
    node_id: int
    seqs: int = 0
    tokens: int = 0
    free_hbm_bytes: int = 0


@dataclass
class GroupReport:
    """What a group leader sends on a pull: its engines and its nodes' read-queue lengths (tokens)."""

    group_id: int
    engines: list[EngineState]
    read_queue_tokens: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.engines:
            raise ConfigError(f"group {self.group_id} reported no engines")


@dataclass(frozen=True)
class EngineProfile:
    """The profiled engine/node figures the thresholds and the batch predictor come from.

    Attention time of a chunk of ``bsz`` new tokens after ``cached`` tokens is predicted from FLOPs
    with a fitted line ``overhead_s + flops * seconds_per_flop``; each new token attends (causally) to
    ``min(context, sparse_topk)`` keys at ``attn_flops_per_pair`` and, with a sparse indexer, scans all
    context keys at ``index_flops_per_pair``.
    """

    read_tokens_per_s: float  # one node's storage read bandwidth / KV bytes per token
    prefill_tokens_per_s: float  # tokens one engine prefills per second at the profiled context
    attn_flops_per_pair: float
    seconds_per_flop: float
    index_flops_per_pair: float = 0.0
    sparse_topk: int | None = None
    overhead_s: float = 0.0

    @property
    def alpha_tokens(self) -> int:
        return int(self.read_tokens_per_s * ALPHA_WINDOW_S)

    @property
    def beta_tokens(self) -> int:
        return int(self.prefill_tokens_per_s * BETA_WINDOW_S)

    def attention_flops(self, cached: int, bsz: int) -> float:
        """FLOPs of attention for new tokens ``cached+1 .. cached+bsz`` (causal)."""
        pairs_all = bsz * cached + bsz * (bsz + 1) / 2  # sum of context lengths seen by the new tokens
        if self.sparse_topk is None:
            attended = pairs_all
        else:  # each token attends to min(context, topk) keys
            k = self.sparse_topk
            dense_part = max(0, min(cached + bsz, k) - cached)  # new tokens whose context is still <= k
            dense_pairs = dense_part * cached + dense_part * (dense_part + 1) / 2
            attended = dense_pairs + (bsz - dense_part) * k
        return attended * self.attn_flops_per_pair + pairs_all * self.index_flops_per_pair

    def attention_time(self, cached: int, bsz: int) -> float:
        return self.overhead_s + self.attention_flops(cached, bsz) * self.seconds_per_flop


@dataclass(frozen=True)
class Assignment:
    """A placed request: its PE, its DE and the side its hit KV is read on."""

    request: Request
    prefill_engine: int
    decode_engine: int
    read_path: ReadPath


# ----------------------------------------------------------------------------------------- plan (pure)


def plan_prefill(
    waiting: Iterable[Request],
    engines: Sequence[EngineState],
    read_queue_tokens: dict[int, int],
    alpha: int,
    beta: int,
) -> list[tuple[Request, int]]:
    """Place FIFO-ordered requests on a PE group's engines (paper §6, PE scheduling).

    Returns ``(request, engine_id)`` pairs for the head of ``waiting`` that could be placed; stops at the
    first request for which no engine has ``tokens <= beta``. Inputs are not mutated.
    """
    tokens = {e.engine_id: e.tokens for e in engines}
    node_of = {e.engine_id: e.node_id for e in engines}
    placed: list[tuple[Request, int]] = []
    for request in waiting:
        best: tuple[int, int, int] | None = None  # (category, tokens, engine_id)
        for engine_id, engine_tokens in tokens.items():
            if engine_tokens > beta:
                continue  # overloaded: never assigned
            category = 2 if read_queue_tokens.get(node_of[engine_id], 0) <= alpha else 3
            key = (category, engine_tokens, engine_id)
            if best is None or key < best:
                best = key
        if best is None:
            break
        placed.append((request, best[2]))
        tokens[best[2]] += request.prompt_tokens
    return placed


def plan_decode_groups(requests: Iterable[Request], group_tokens: dict[int, int]) -> list[tuple[Request, int]]:
    """DE phase 1: send each request to the group with the smallest total tokens (ties: lowest id),
    counting requests already sent in this call. Returns ``(request, group_id)``."""
    if not group_tokens:
        raise ConfigError("no decode group has reported yet")
    heap = [(total, group_id) for group_id, total in group_tokens.items()]
    heapq.heapify(heap)
    placed = []
    for request in requests:
        total, group_id = heapq.heappop(heap)
        placed.append((request, group_id))
        heapq.heappush(heap, (total + request.prompt_tokens, group_id))
    return placed


def decode_token_threshold(private_queue: Sequence[Request], engines: Sequence[EngineState]) -> float:
    """``Z = 1.05 * (sum of len(r) over the queue head that fits the group's free HBM + sum tok_e) / |E|``."""
    free = sum(e.free_hbm_bytes for e in engines)
    fitting_tokens = 0
    for request in private_queue:
        if request.decode_hbm_bytes > free:
            break
        free -= request.decode_hbm_bytes
        fitting_tokens += request.prompt_tokens
    return Z_SLACK * (fitting_tokens + sum(e.tokens for e in engines)) / len(engines)


def plan_decode(private_queue: Sequence[Request], engines: Sequence[EngineState]) -> list[tuple[Request, int]]:
    """DE phase 2: place a group's private queue from its head (paper §6.1).

    Among engines with enough free HBM, those with ``tokens + len(r) <= Z`` are preferred and the one
    with the fewest sequences wins; if all are high-token, the one with the fewest tokens. Stops at the
    first request no engine can hold. Returns ``(request, engine_id)``; inputs are not mutated.
    """
    if not engines:
        raise ConfigError("decode group has no engines")
    z = decode_token_threshold(private_queue, engines)
    state = {e.engine_id: [e.free_hbm_bytes, e.tokens, e.seqs] for e in engines}
    placed = []
    for request in private_queue:
        low_best = high_best = None
        for engine_id, (free, tokens, seqs) in state.items():
            if free < request.decode_hbm_bytes:
                continue
            if tokens + request.prompt_tokens <= z:
                key = (seqs, tokens, engine_id)
                low_best = key if low_best is None or key < low_best else low_best
            else:
                key = (tokens, seqs, engine_id)
                high_best = key if high_best is None or key < high_best else high_best
        chosen = low_best or high_best
        if chosen is None:
            break  # no DE has the HBM: stop, keep the rest queued
        engine = state[chosen[2]]
        engine[0] -= request.decode_hbm_bytes
        engine[1] += request.prompt_tokens
        engine[2] += 1
        placed.append((request, chosen[2]))
    return placed


def choose_read_path(
    pe_node_queue_tokens: int, de_node_queue_tokens: int, pe_node_read_tokens: int = 0, de_node_read_tokens: int = 0
) -> ReadPath:
    """Read on the side with the shorter storage read queue (paper §6: "the side with the shorter read
    queue"); queues in tokens, waiting plus in flight.

    A tie (in practice both SNICs idle) is not treated by the paper; ours: the side whose node has been
    given fewer hit tokens to read so far (``*_read_tokens``), then the PE (no DE-CNIC hop). The seed's
    sketch sends every tie to the PE (``<=``); with 2 PE nodes each taking part in half of all decisions
    and 4 DE nodes in a quarter, that piles the idle-time reads on the PE nodes.
    """
    if pe_node_queue_tokens != de_node_queue_tokens:
        return ReadPath.DE if de_node_queue_tokens < pe_node_queue_tokens else ReadPath.PE
    return ReadPath.DE if de_node_read_tokens < pe_node_read_tokens else ReadPath.PE


def split_hit_blocks(
    blocks: int,
    block_bytes: int,
    pe_backlog_bytes: float,
    pe_bytes_per_s: float,
    de_backlog_bytes: float,
    de_bytes_per_s: float,
) -> int:
    """How many of a request's ``blocks`` hit blocks the PE's storage NIC reads when one request is read
    through both (the rest go to the DE's), sized so that both reads finish together.

    Each side drains its backlog (bytes queued or in flight) first, at its cap; the PE's share ``k`` solves
    ``(pe_backlog + k b) / pe_rate = (de_backlog + (blocks - k) b) / de_rate``, rounded to the nearest whole
    block and clamped to ``[0, blocks]`` (a side whose backlog alone outlasts the other's whole read gets
    nothing). The paper picks one side per request (:func:`choose_read_path`); it names this split as future
    work (§8).
    """
    if not (isinstance(blocks, int) and blocks >= 0):
        raise ConfigError(f"blocks must be an int >= 0, got {blocks!r}")
    if not (isinstance(block_bytes, int) and block_bytes > 0):
        raise ConfigError(f"block_bytes must be an int > 0, got {block_bytes!r}")
    for name, value in (("pe_backlog_bytes", pe_backlog_bytes), ("de_backlog_bytes", de_backlog_bytes)):
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"{name} must be finite and >= 0, got {value!r}")
    for name, value in (("pe_bytes_per_s", pe_bytes_per_s), ("de_bytes_per_s", de_bytes_per_s)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{name} must be finite and > 0, got {value!r}")
    total = pe_bytes_per_s + de_bytes_per_s
    exact = (pe_bytes_per_s * (de_backlog_bytes + blocks * block_bytes) - de_bytes_per_s * pe_backlog_bytes) / (
        block_bytes * total
    )
    return min(blocks, max(0, math.floor(exact + 0.5)))


@dataclass
class PrefillWork:
    """A request (or its unfinished remainder) waiting in one PE: ``cached`` tokens of context are
    already available, ``remaining`` new tokens still need computing."""

    request_id: int
    cached: int
    remaining: int


def plan_prefill_batch(
    queue: Iterable[PrefillWork],
    attention_time: Callable[[int, int], float],
    quota_s: float = DEFAULT_COMPUTE_QUOTA_S,
) -> list[tuple[PrefillWork, int]]:
    """Fill one forward pass in FIFO order up to ``quota_s`` of predicted attention time (paper §6.2).

    Returns ``(work, tokens)`` pairs; the last may be a chunk (``tokens < work.remaining``), the
    longest prefix that still fits, found by binary search. A head request that does not fit even as a
    one-token chunk is taken whole, so that every pass makes progress.
    """
    if quota_s <= 0:
        raise ConfigError(f"compute quota must be > 0 s, got {quota_s}")
    batch: list[tuple[PrefillWork, int]] = []
    used = 0.0
    for work in queue:
        cost = attention_time(work.cached, work.remaining)
        if used + cost <= quota_s:
            batch.append((work, work.remaining))
            used += cost
            continue
        low, high = 0, work.remaining - 1  # largest chunk in [1, remaining-1] that fits; 0 = none
        while low < high:
            mid = (low + high + 1) // 2
            if used + attention_time(work.cached, mid) <= quota_s:
                low = mid
            else:
                high = mid - 1
        if low > 0:
            batch.append((work, low))
        elif not batch:
            batch.append((work, work.remaining))
        break
    return batch


# ----------------------------------------------------------------------------------------- run (stateful)


@dataclass
class _PrefillEngineView:
    """The scheduler's view of one PE: its last report plus what was assigned to it since."""

    node_id: int
    group_id: int
    tokens: int
    version: int = 0
    pushed_key: tuple[bool, int, int] | None = None  # the key of its live heap entry


class Scheduler:
    """The central scheduler: queues, pulls and the read-queue view it decides paths with.

    PE choice is global: on any PE group's pull the FIFO head goes to the best engine of *all* PEs the
    scheduler knows (categories and minimum tokens as in :func:`plan_prefill`, which it equals), and each
    group receives, when it pulls, what was assigned to its engines since its last pull. Choosing only
    among the pulling group's engines would hand every request to whichever group happens to pull
    first, leaving the others idle at low load.

    Parameters
    ----------
    alpha, beta : int
        Read-queue and engine-token thresholds in tokens (see :meth:`from_profile`).
    """

    def __init__(self, alpha: int, beta: int):
        if alpha < 0 or beta < 0:
            raise ConfigError(f"alpha and beta must be >= 0 tokens, got {alpha} and {beta}")
        self.alpha, self.beta = alpha, beta
        self._decode_global: deque[Request] = deque()
        self._decode_private: dict[int, deque[Request]] = {}
        self._group_tokens: dict[int, int] = {}  # latest sum(tok_e) per DE group, plus queued since
        self._prefill_waiting: deque[tuple[Request, int, int]] = deque()  # (request, de engine, de node)
        self._decode_node: dict[int, int] = {}  # DE engine -> its node
        self._read_queue: dict[int, int] = {}  # node -> tokens, reported then advanced by our own reads
        self._prefill_engines: dict[int, _PrefillEngineView] = {}
        self._prefill_engines_of_node: dict[int, list[int]] = {}
        # (excluded, category, tokens, engine_id, version): the best PE on top; entries whose version or
        # key is stale are dropped or re-pushed when they surface
        self._prefill_heap: list[tuple[bool, int, int, int, int]] = []
        self._undelivered: dict[int, list[Assignment]] = {}  # PE group -> assigned, not yet pulled
        self._undelivered_reads: dict[int, int] = {}  # node -> hit tokens of undelivered assignments read there
        self._read_assigned: dict[int, int] = {}  # node -> hit tokens ever sent there to read (the path tie rule)
        self._undelivered_cost: dict[int, tuple[int, int]] = {}  # request id -> (read node, its read cost there)
        self._read_scale: dict[int, float] = {}  # node -> cost of one hit token read there (set_read_scales)

    @classmethod
    def from_profile(cls, profile: EngineProfile) -> Scheduler:
        """alpha = tokens a node reads in 3 s, beta = tokens an engine prefills in 5 s."""
        return cls(alpha=profile.alpha_tokens, beta=profile.beta_tokens)

    def submit(self, request: Request) -> None:
        self._decode_global.append(request)

    @property
    def queued(self) -> int:
        """Requests not yet handed to a PE group (waiting for a DE, a PE, or their PE group's pull)."""
        return (
            len(self._decode_global)
            + sum(map(len, self._decode_private.values()))
            + len(self._prefill_waiting)
            + sum(map(len, self._undelivered.values()))
        )

    def withdraw(self, request_id: int) -> str | None:
        """Take a request that is still queued out of the scheduler (its client gave up): ``"decode"`` when it
        was waiting for a DE, ``"prefill"`` when it had a DE and was waiting for a PE, None when it was not
        queued (already placed, or never submitted). A withdrawn request no longer holds up those behind it."""
        for index, request in enumerate(self._decode_global):
            if request.request_id == request_id:
                del self._decode_global[index]
                return "decode"
        for group_id, private in self._decode_private.items():
            for index, request in enumerate(private):
                if request.request_id == request_id:
                    del private[index]
                    self._group_tokens[group_id] -= request.prompt_tokens
                    return "decode"
        for index, (request, _, _) in enumerate(self._prefill_waiting):
            if request.request_id == request_id:
                del self._prefill_waiting[index]
                return "prefill"
        return None

    def register_decode_group(self, group_id: int, total_tokens: int = 0) -> None:
        """Make a DE group eligible for phase 1 before its first pull."""
        self._group_tokens.setdefault(group_id, total_tokens)
        self._decode_private.setdefault(group_id, deque())

    def register_prefill_group(self, report: GroupReport) -> None:
        """Make a PE group's engines eligible before its first pull (a pull does this too)."""
        self._update_read_queues(report.read_queue_tokens)
        assigned_to: dict[int, int] = {}
        for assignment in self._undelivered.setdefault(report.group_id, []):
            engine_id = assignment.prefill_engine
            assigned_to[engine_id] = assigned_to.get(engine_id, 0) + assignment.request.prompt_tokens
        for engine in report.engines:
            assigned = assigned_to.get(engine.engine_id, 0)
            view = self._prefill_engines.get(engine.engine_id)
            if view is None:
                view = self._prefill_engines[engine.engine_id] = _PrefillEngineView(
                    engine.node_id, report.group_id, engine.tokens + assigned
                )
                self._prefill_engines_of_node.setdefault(engine.node_id, []).append(engine.engine_id)
            view.tokens = engine.tokens + assigned
            self._push_prefill(engine.engine_id)

    def pull_decode(self, report: GroupReport) -> list[tuple[Request, int]]:
        """A DE group's pull: phase 1 drains the global queue over all groups, phase 2 places this
        group's private queue. Returns ``(request, decode_engine_id)``; those requests join the PE FIFO."""
        self._update_read_queues(report.read_queue_tokens)
        private = self._decode_private.setdefault(report.group_id, deque())
        queued_here = sum(r.prompt_tokens for r in private)
        self._group_tokens[report.group_id] = sum(e.tokens for e in report.engines) + queued_here
        if self._decode_global:
            for request, group_id in plan_decode_groups(self._decode_global, self._group_tokens):
                self._decode_private[group_id].append(request)
                self._group_tokens[group_id] += request.prompt_tokens
            self._decode_global.clear()
        placed = plan_decode(private, report.engines)
        node_of = {e.engine_id: e.node_id for e in report.engines}
        self._decode_node.update(node_of)
        for request, engine_id in placed:
            private.popleft()
            self._prefill_waiting.append((request, engine_id, node_of[engine_id]))
        return placed

    def pull_prefill(self, report: GroupReport) -> list[Assignment]:
        """A PE group's pull: place the FIFO head on the best PEs of all groups, choose each read path,
        and return what is assigned to this group's engines (now or since its last pull)."""
        self.register_prefill_group(report)
        while self._prefill_waiting:
            engine_id = self._best_prefill_engine()
            if engine_id is None:
                break  # every PE is over beta
            request, de, de_node = self._prefill_waiting.popleft()
            view = self._prefill_engines[engine_id]
            view.tokens += request.prompt_tokens
            path = choose_read_path(
                self._read_queue.get(view.node_id, 0),
                self._read_queue.get(de_node, 0),
                self._read_assigned.get(view.node_id, 0),
                self._read_assigned.get(de_node, 0),
            )
            read_node = view.node_id if path is ReadPath.PE else de_node
            cost = round(request.cached_tokens * self._read_scale.get(read_node, 1.0))
            self._read_queue[read_node] = self._read_queue.get(read_node, 0) + cost
            self._read_assigned[read_node] = self._read_assigned.get(read_node, 0) + cost
            self._undelivered_reads[read_node] = self._undelivered_reads.get(read_node, 0) + cost
            self._undelivered_cost[request.request_id] = (read_node, cost)
            self._push_prefill(engine_id)
            self._undelivered.setdefault(view.group_id, []).append(Assignment(request, engine_id, de, path))
        delivered = self._undelivered.get(report.group_id, [])
        self._undelivered[report.group_id] = []
        for assignment in delivered:  # their reads start now: from here on the nodes' reports count them
            read_node, cost = self._undelivered_cost.pop(assignment.request.request_id)
            self._undelivered_reads[read_node] -= cost
        return delivered

    def set_read_scales(self, scales: dict[int, float]) -> None:
        """Read costs per node for storage NICs of unequal speed: a hit token read on node ``n`` counts
        ``scales[n]`` tokens (``fastest rate / n's rate``) in its read queue and in the path tie rule, so both
        compare time to drain; the reported queues must be in the same units. Default 1 (the paper's nodes are
        alike). Raises ConfigError for a scale that is not finite and > 0."""
        for node, scale in scales.items():
            if not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
                raise ConfigError(f"read scale of node {node} must be finite and > 0, got {scale!r}")
        self._read_scale = dict(scales)

    # --------------------------------------------------------------------------- PE choice (global)

    def _prefill_key(self, engine_id: int) -> tuple[bool, int, int]:
        view = self._prefill_engines[engine_id]
        category = 2 if self._read_queue.get(view.node_id, 0) <= self.alpha else 3
        return view.tokens > self.beta, category, view.tokens

    def _push_prefill(self, engine_id: int) -> None:
        """Give the engine a heap entry with its current key, unless its live entry already has that key (a
        pull that changes nothing for an engine then costs no heap operation: at 10,000 engines most pulls)."""
        view = self._prefill_engines[engine_id]
        key = self._prefill_key(engine_id)
        if key == view.pushed_key:
            return
        view.version += 1
        view.pushed_key = key
        heapq.heappush(self._prefill_heap, (*key, engine_id, view.version))
        if len(self._prefill_heap) > 4 * len(self._prefill_engines) + 64:  # drop the stale entries
            self._prefill_heap = [(*v.pushed_key, e, v.version) for e, v in self._prefill_engines.items()]
            heapq.heapify(self._prefill_heap)

    def _best_prefill_engine(self) -> int | None:
        """The engine :func:`plan_prefill` would pick among all known PEs, or None if all exceed beta."""
        heap = self._prefill_heap
        while heap:
            excluded, category, tokens, engine_id, version = heap[0]
            if version != self._prefill_engines[engine_id].version:
                heapq.heappop(heap)
            elif (excluded, category, tokens) != self._prefill_key(engine_id):
                heapq.heappop(heap)  # its node's read queue grew past alpha since the push
                self._prefill_engines[engine_id].pushed_key = None  # its entry is gone: push even an equal key
                self._push_prefill(engine_id)
            else:
                return None if excluded else engine_id
        return None

    def _update_read_queues(self, reported: dict[int, int]) -> None:
        """Take a report's read queues, plus the reads assigned there that no group has pulled yet."""
        for node, tokens in reported.items():
            tokens += self._undelivered_reads.get(node, 0)
            shrank = tokens < self._read_queue.get(node, 0)
            self._read_queue[node] = tokens
            if shrank:  # a better category than the heap entries of this node's PEs say
                for engine_id in self._prefill_engines_of_node.get(node, ()):
                    self._push_prefill(engine_id)
