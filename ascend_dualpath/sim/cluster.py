"""A discrete-event simulator of a P/D-disaggregated cluster with DualPath KV loading.

What is modelled (each figure physically motivated, see docs/simulator.md):

* nodes of ``g`` engines (an engine is ``tp`` accelerators); a prefill (PE) or decode (DE) role per node;
  one storage NIC per node that serves its read queue FIFO at full rate (3FS saturates it) into the node's
  DRAM buffer; a compute NIC per engine (bandwidth ``B``) that carries the PE<->DE layer blocks and P->D KV,
  and a PCIe link per engine for DRAM -> HBM copies;
* forward passes in lock-step per expert-parallel instance (ranks wait for the slowest at every layer's
  all-to-all); per rank, its own tokens' attention (pair counts of
  :class:`~ascend_dualpath.dualpath.scheduler.EngineProfile`) and non-expert GEMMs, plus an even share of
  the routed-expert GEMMs of all the instance's tokens;
* DE decode steps in lock-step per instance: a fixed part (weights, EP latency) plus the HBM bytes the
  batch's attention reads; HBM admission per DE; a request no DE can ever hold is refused before the run;
* compute-NIC sharing between KV and model traffic in a prefill pass: each rank's CNIC carries its layer
  blocks (KV class) and, where an EP instance spans nodes, its share of the EP all-to-all (model class,
  ``ModelConfig.ep_cnic_bytes_per_token``); the two share each direction by the traffic-class weights of
  :class:`~ascend_dualpath.dualpath.traffic.QosPolicy` (:meth:`ClusterSim._all_to_all_delay`);
* layer-block submission cost per transfer kind (:mod:`ascend_dualpath.sim.transfer`), tool latency between
  an agent's turns;
* modes: ``basic`` (the baseline the PE read path was derived from, §4.1: storage -> PE buffer, then all
  layers' KV copied into PE HBM before the pass, which therefore waits for that H2D; the whole prompt KV
  stays in PE HBM until it has been sent PE HBM -> DE HBM after the pass, so PE HBM bounds the batch),
  ``layerwise`` (PE read path with layer blocks: H2D and PE->DE streaming overlap the pass, the DE copies
  its buffer to HBM), ``dualpath`` (both read paths, round-robin placement, alternating path),
  ``scheduler`` (the adaptive scheduler of :mod:`ascend_dualpath.dualpath.scheduler`), ``split`` (the
  scheduler, with each request's hit blocks read through both the PE's and the DE's storage NIC, sized by
  :func:`~ascend_dualpath.dualpath.scheduler.split_hit_blocks` so that both halves finish together: the
  paper's future work, §8), ``oracle`` (the scheduler with every storage read, H2D and P->D transfer free).

What is not: storage writes (they use the SNIC's other direction), model traffic outside prefill passes (the
decode all-to-all is in ``decode_step_fixed_s``; whole-prompt transfers after a pass run at the full CNIC
rate, each engine's serialised), the DE-read-path KV leaving the DE's CNIC, DRAM buffer capacity, TP
collectives, expert-load imbalance, failures. :func:`pd_ratio_warning` flags P/D ratios outside the bandwidth
model's bottleneck-free interval.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ascend_dualpath.dualpath.model import pd_ratio_bounds
from ascend_dualpath.dualpath.scheduler import (
    DEFAULT_COMPUTE_QUOTA_S,
    Assignment,
    EngineProfile,
    EngineState,
    GroupReport,
    PrefillWork,
    ReadPath,
    Request,
    Scheduler,
    plan_prefill_batch,
    split_hit_blocks,
)
from ascend_dualpath.dualpath.traffic import QosPolicy
from ascend_dualpath.errors import CapacityError, ConfigError
from ascend_dualpath.sim.models import GB, HardwareConfig, ModelConfig, engine_profile
from ascend_dualpath.sim.traces import Round
from ascend_dualpath.sim.transfer import SubmissionCosts, TransferKind

# busy_s keys; decode_hbm is in byte-seconds of DE KV HBM reserved, the rest in resource-seconds
RESOURCES = (
    "storage_nic",
    "prefill_compute",
    "prefill_pass",
    "prefill_submit",
    "decode_steps",
    "decode_hbm",
    "pe_cnic_in",
    "pe_cnic_out",
    "de_cnic_in",
)


class Mode(enum.Enum):
    BASIC = "basic"
    LAYERWISE = "layerwise"
    DUALPATH = "dualpath"
    SCHEDULER = "scheduler"
    SPLIT = "split"
    ORACLE = "oracle"

    @property
    def layerwise(self) -> bool:
        return self is not Mode.BASIC

    @property
    def adaptive(self) -> bool:
        return self in (Mode.SCHEDULER, Mode.SPLIT, Mode.ORACLE)

    @property
    def split(self) -> bool:
        """Whether one request's hit blocks are read through both its PE's and its DE's storage NIC."""
        return self is Mode.SPLIT

    @property
    def io_free(self) -> bool:
        return self is Mode.ORACLE


# the paper's ablation (§7.2), in its order; ``split`` is ours and runs when asked for
PAPER_MODES = (Mode.BASIC, Mode.LAYERWISE, Mode.DUALPATH, Mode.SCHEDULER, Mode.ORACLE)


@dataclass(frozen=True)
class ClusterConfig:
    """Cluster shape and the few runtime knobs.

    ``workspace_bytes`` is HBM kept for activations and communication buffers on every accelerator;
    ``max_batch_tokens`` is the chunked-prefill token budget of the non-adaptive modes (the adaptive one uses
    the compute quota). ``tp`` accelerators form one engine (tensor parallel: their HBM, HBM bandwidth,
    compute, CNICs and PCIe links add up; the TP collectives are not charged). ``prefill_ep`` / ``decode_ep``
    are the engines of one expert-parallel instance (lock-step, weights sharded over it); ``None`` picks all of
    the role's engines when the weights do not fit one engine, else 1 (data parallel). ``qos`` gives the
    model and KV traffic classes' compute-NIC arbitration weights (the library's policy, 99:1).
    ``snic_bytes_per_s_by_node`` caps each node's storage NIC (bytes/s, prefill nodes first); empty gives
    every node the hardware's (alpha stays the hardware's: the scheduler's profile is one node's)."""

    model: ModelConfig
    hardware: HardwareConfig = HardwareConfig()
    prefill_nodes: int = 2
    decode_nodes: int = 4
    block_tokens: int = 64
    tick_s: float = 0.02
    compute_quota_s: float = DEFAULT_COMPUTE_QUOTA_S
    max_batch_tokens: int = 16384
    workspace_bytes: float = 8 * GB
    tp: int = 1
    prefill_ep: int | None = None
    decode_ep: int | None = None
    qos: QosPolicy = QosPolicy()
    snic_bytes_per_s_by_node: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.prefill_nodes < 1 or self.decode_nodes < 1:
            raise ConfigError(f"need >= 1 prefill and decode node, got {self.prefill_nodes}P{self.decode_nodes}D")
        caps, nodes = self.snic_bytes_per_s_by_node, self.prefill_nodes + self.decode_nodes
        if caps and (len(caps) != nodes or not all(cap > 0 for cap in caps)):
            raise ConfigError(f"snic_bytes_per_s_by_node needs {nodes} caps > 0 (one per node), got {caps!r}")
        if self.tp < 1 or self.hardware.gpus_per_node % self.tp:
            raise ConfigError(f"tp={self.tp} must divide the {self.hardware.gpus_per_node} accelerators per node")
        for role in ("pe", "de"):
            engines = self.role_engines(role)
            ep = self.ep_size(role)
            if ep < 1 or engines % ep:
                raise ConfigError(f"{role}_ep={ep} must divide the role's {engines} engines")
            if self.kv_hbm_bytes(role) <= 0:
                raise CapacityError(
                    f"{role.upper()}: weights of {self.model.name} ({self.model.weight_bytes / GB:.0f} GB over ep={ep}) "
                    f"leave no HBM for KV in an engine of {self.engine_hardware.hbm_bytes / GB:.0f} GB (tp={self.tp})"
                )

    @property
    def engine_hardware(self) -> HardwareConfig:
        """The hardware of one engine of ``tp`` accelerators, as the simulator sees it (per-node figures kept)."""
        hw, tp = self.hardware, self.tp
        return replace(
            hw,
            gpus_per_node=hw.gpus_per_node // tp,
            cnic_bytes_per_s=hw.cnic_bytes_per_s * tp,
            pcie_bytes_per_s=hw.pcie_bytes_per_s * tp,
            hbm_bytes=hw.hbm_bytes * tp,
            hbm_bytes_per_s=hw.hbm_bytes_per_s * tp,
            peak_flops=hw.peak_flops * tp,
        )

    def snic_bytes_per_s(self, node: int) -> float:
        """Storage-NIC cap of node ``node`` (prefill nodes first) in bytes/s."""
        caps = self.snic_bytes_per_s_by_node
        return caps[node] if caps else self.hardware.snic_bytes_per_s

    def role_engines(self, role: str) -> int:
        """Engines of the ``"pe"`` or ``"de"`` role."""
        nodes = self.prefill_nodes if role == "pe" else self.decode_nodes
        return nodes * self.engine_hardware.gpus_per_node

    def ep_size(self, role: str) -> int:
        """Engines per expert-parallel instance of the ``"pe"`` or ``"de"`` role."""
        explicit = self.prefill_ep if role == "pe" else self.decode_ep
        if explicit is not None:
            return explicit
        return self.role_engines(role) if self.model.weight_bytes > self.engine_hardware.hbm_bytes else 1

    @property
    def model_traffic_share(self) -> float:
        """The model class's share of a compute NIC while KV traffic also wants it: ``w_model / (w_model + w_kv)``."""
        return self.qos.model.weight / (self.qos.model.weight + self.qos.kv.weight)

    def ep_crosses_nodes(self, role: str) -> bool:
        """Whether an EP instance of the role spans nodes, so that its all-to-all uses the compute NICs."""
        return self.ep_size(role) > self.engine_hardware.gpus_per_node

    def kv_hbm_bytes(self, role: str) -> float:
        """HBM per engine left for KV when the weights are sharded over the role's EP instance (a model that
        fits one engine and runs with ep=1 is replicated, DP)."""
        return (
            self.engine_hardware.hbm_bytes
            - self.model.weight_bytes / self.ep_size(role)
            - self.workspace_bytes * self.tp
        )


def pd_ratio_warning(config: ClusterConfig) -> str | None:
    """A warning when the cluster's P/D node ratio is outside the bandwidth model's bottleneck-free interval
    (paper eq. 9, :func:`~ascend_dualpath.dualpath.model.pd_ratio_bounds`), else None. Outside it some NIC or
    DRAM carries more than its bandwidth in the paper's model when every storage NIC reads at full rate. The
    simulator charges each rank's CNIC its KV and model traffic, so whether a run gets there shows in its
    ``pe_cnic_in`` / ``pe_cnic_out`` / ``de_cnic_in`` utilisation; the DE-path KV leaving a DE's CNIC is
    not charged."""
    hw = config.hardware
    s = hw.snic_bytes_per_s / hw.cnic_bytes_per_s
    if not 0 < s < hw.gpus_per_node:
        return (
            f"the storage NIC ({hw.snic_bytes_per_s / GB:.0f} GB/s) must be slower than the node's "
            f"{hw.gpus_per_node} compute NICs together for the P/D bandwidth model; it was not checked"
        )
    bounds = pd_ratio_bounds(hw.gpus_per_node, s, hw.dram_bytes_per_s, hw.snic_bytes_per_s)
    ratio = config.prefill_nodes / config.decode_nodes
    if bounds.lower <= ratio <= bounds.upper:
        return None
    limit = "pe_cnic_write" if ratio < bounds.lower else bounds.binding  # the lower end is s/(g-s), PE CNIC write
    return (
        f"P/D = {config.prefill_nodes}/{config.decode_nodes} = {ratio:.3f} is outside the bottleneck-free "
        f"interval [{float(bounds.lower):.3f}, {float(bounds.upper):.3f}] (exceeded: {limit}); "
        "the paper's model oversubscribes that NIC when the storage NICs run at full rate (see the CNIC "
        "utilisation; the DE-path KV leaving a DE's CNIC is not charged)"
    )


@dataclass
class _Req:
    """Runtime state of one request."""

    agent: int
    round: Round
    request: Request
    arrival: float
    pe: int = -1
    de: int = -1
    path: ReadPath = ReadPath.PE
    pe_hit_tokens: int = 0  # hit tokens read by the PE's storage NIC; the rest by the DE's
    reads_left: int = 0  # storage reads of this request not yet landed (two when split)
    first_token: float = 0.0
    decode_start: float = 0.0
    finish_step: int = 0
    ctx: int = 0
    attended: int = 0
    exposed_submit_s: float = 0.0  # time the kind's layer-block submissions added to this request's passes


@dataclass
class _Engine:
    engine_id: int
    node: int
    seqs: int = 0
    tokens: int = 0
    free_hbm: float = 0.0
    link_free_at: float = 0.0  # when this engine's CNIC is free for the next whole-prompt KV transfer
    # PE side
    ready: deque = field(default_factory=deque)  # of (PrefillWork, _Req, first_pass: bool)
    # DE side
    active: int = 0
    sum_ctx: int = 0
    sum_attended: int = 0
    finishing: list = field(default_factory=list)  # heap of (finish_step, seq, _Req)
    joining: list = field(default_factory=list)


@dataclass
class _Node:
    node_id: int
    engines: list[int]
    snic_bytes_per_s: float
    read_fifo: deque = field(default_factory=deque)  # of (_Req, tokens, ReadPath)
    read_queue_tokens: int = 0
    read_busy: bool = False
    read_end: float = 0.0  # when the read in flight lands
    reads: list = field(default_factory=list)  # (start, end, bytes): storage-NIC activity


@dataclass
class _Domain:
    """Engines that run forward passes in lock-step: an expert-parallel instance (its ranks meet in every
    layer's all-to-all, so a pass lasts as long as its slowest rank), or one engine of a replicated model."""

    engines: list[int]
    step_busy: bool = False
    completed_steps: int = 0


@dataclass(frozen=True)
class RequestRecord:
    """One finished request: arrival, TTFT, TPOT (None with a single output token), tokens, and the share of
    its critical path (arrival to decode start) that layer-block submissions added."""

    arrival_s: float
    ttft_s: float
    tpot_s: float | None
    prompt_tokens: int
    gen_tokens: int
    submit_share: float


@dataclass
class SimResult:
    """What one run measured. Times in seconds; ``snic_reads[node]`` lists (start, end, bytes);
    ``busy_s[resource]`` is the resource-seconds a resource worked and ``units[resource]`` how many of it
    there are (their ratio over the run's length is its utilisation)."""

    mode: Mode
    jct_s: float
    completed_requests: int
    ttft_s: list[float]
    tpot_s: list[float]
    agent_finish_s: list[float]
    snic_reads: dict[int, list[tuple[float, float, float]]]
    prefill_nodes: list[int]
    decode_nodes: list[int]
    read_bytes_by_path: dict[str, float]
    requests: list[RequestRecord] = field(default_factory=list)
    busy_s: dict[str, float] = field(default_factory=dict)
    units: dict[str, float] = field(default_factory=dict)
    transfer_kind: TransferKind | None = None

    @property
    def mean_ttft_s(self) -> float:
        return sum(self.ttft_s) / max(1, len(self.ttft_s))

    @property
    def mean_tpot_s(self) -> float:
        return sum(self.tpot_s) / max(1, len(self.tpot_s))


class ClusterSim:
    """One simulated cluster running a set of agents (each a list of :class:`Round`).

    ``agent_start_s[i]`` is when agent ``i`` issues its first round (0 for offline runs); every later
    round is issued ``tool_s`` after the previous one finishes decoding. ``transfer_kind`` charges the
    layer-block transfers of the layerwise modes the submission cost of that kind (``costs``, default the
    emulator's); None moves them at wire speed only. ``agent_names`` name agents in errors.

    Raises
    ------
    CapacityError
        A request can never fit: its KV exceeds a DE's HBM for KV or a node's DRAM.
    """

    def __init__(
        self,
        config: ClusterConfig,
        mode: Mode,
        agents: Sequence[Sequence[Round]],
        agent_start_s: Sequence[float] | None = None,
        transfer_kind: TransferKind | None = None,
        costs: SubmissionCosts | None = None,
        agent_names: Sequence[str] | None = None,
    ):
        if not agents:
            raise ConfigError("no agents to simulate")
        self.config, self.mode = config, mode
        self.model, self.hw = config.model, config.engine_hardware
        self.transfer_kind = transfer_kind if mode.layerwise and not mode.io_free else None
        self.costs = costs or SubmissionCosts()
        self.agents = [list(rounds) for rounds in agents]
        if any(not rounds for rounds in self.agents):
            raise ConfigError("every agent needs at least one round")
        self.pe_kv_hbm = config.kv_hbm_bytes("pe")
        self.de_kv_hbm = config.kv_hbm_bytes("de")
        # bytes per prefill token of the EP all-to-all on the CNICs (model class), 0 inside one node
        self.ep_bytes_per_token = self.model.ep_cnic_bytes_per_token if config.ep_crosses_nodes("pe") else 0.0
        self._check_fits(agent_names)
        self.profile = self._mean_request_profile()
        self.agent_start = list(agent_start_s) if agent_start_s is not None else [0.0] * len(self.agents)
        if len(self.agent_start) != len(self.agents):
            raise ConfigError(f"{len(self.agent_start)} start times for {len(self.agents)} agents")
        self._build_topology()
        self.scheduler = self._adaptive_scheduler() if mode.adaptive else None
        self._init_run_state()

    def _mean_request_profile(self) -> EngineProfile:
        """alpha/beta are "profiled in advance" (§A.4): here on the workload's mean request."""
        requests = [r for rounds in self.agents for r in rounds]
        mean_cached = sum(r.cached_tokens for r in requests) // len(requests)
        mean_new = max(1, sum(r.prompt_tokens - r.cached_tokens for r in requests) // len(requests))
        return engine_profile(self.model, self.hw, profiled_context=mean_cached, profiled_append=mean_new)

    def _build_topology(self) -> None:
        """Nodes, engines (each with its role's KV HBM free) and lock-step domains: prefill nodes first."""
        g = self.hw.gpus_per_node
        node_count = self.config.prefill_nodes + self.config.decode_nodes
        self.nodes = [
            _Node(n, list(range(n * g, (n + 1) * g)), self.config.snic_bytes_per_s(n)) for n in range(node_count)
        ]
        self.pe_nodes = list(range(self.config.prefill_nodes))
        self.de_nodes = list(range(self.config.prefill_nodes, len(self.nodes)))
        self.engines = [_Engine(e, e // g) for e in range(len(self.nodes) * g)]
        self.domains = [domain for role in (self.pe_nodes, self.de_nodes) for domain in self._lockstep_domains(role)]
        self._domain_of = {e: domain for domain in self.domains for e in domain.engines}
        self.pe_ids = [e for n in self.pe_nodes for e in self.nodes[n].engines]
        self.de_ids = [e for n in self.de_nodes for e in self.nodes[n].engines]
        for e in self.pe_ids:
            self.engines[e].free_hbm = self.pe_kv_hbm
        for e in self.de_ids:
            self.engines[e].free_hbm = self.de_kv_hbm

    def _adaptive_scheduler(self) -> Scheduler:
        """The adaptive scheduler with every DE and PE node registered as a group."""
        scheduler = Scheduler.from_profile(self.profile)
        for n in self.de_nodes:
            scheduler.register_decode_group(n)
        for n in self.pe_nodes:
            scheduler.register_prefill_group(self._report(self.nodes[n]))
        return scheduler

    def _init_run_state(self) -> None:
        """Placement cursors, the event queue, the clock and the measurements, as at the run's start."""
        self._rr_queue: deque[_Req] = deque()
        self._rr_pe = itertools.cycle(self.pe_ids)
        self._rr_de = 0
        self._rr_path = itertools.cycle((ReadPath.PE, ReadPath.DE) if self.mode is Mode.DUALPATH else (ReadPath.PE,))
        self._by_id: dict[int, _Req] = {}
        self._events: list = []
        self._seq = itertools.count()
        self.now = 0.0
        self._remaining_agents = len(self.agents)
        self._next_round = [0] * len(self.agents)
        self._ttft: list[float] = []
        self.ttft_arrivals: list[float] = []  # arrival time of the request behind each TTFT sample
        self._tpot: list[float] = []
        self._finish = [0.0] * len(self.agents)
        self._read_bytes = {"pe": 0.0, "de": 0.0}
        self._completed = 0
        self._request_ids = itertools.count()
        self._total_rounds = sum(len(rounds) for rounds in self.agents)
        self._records: list[RequestRecord] = []
        self._busy = dict.fromkeys(RESOURCES, 0.0)
        self._hbm_reserved, self._hbm_since = 0.0, 0.0  # DE KV HBM reserved in all, and since when

    def _check_fits(self, agent_names: Sequence[str] | None) -> None:
        """Refuse, before the run, a request that no DE's HBM (prompt + output KV) or node DRAM (prompt KV)
        can ever hold: it would wait for admission forever."""
        kv = self.model.kv_bytes_per_token
        for agent, rounds in enumerate(self.agents):
            for index, rnd in enumerate(rounds):
                name = repr(agent_names[agent]) if agent_names else str(agent)
                hbm = (rnd.prompt_tokens + rnd.gen_tokens) * kv
                if hbm > self.de_kv_hbm:
                    raise CapacityError(
                        f"agent {name} turn {index}: {rnd.prompt_tokens}+{rnd.gen_tokens} tokens need "
                        f"{hbm / GB:.1f} GB of decode HBM, a DE has {self.de_kv_hbm / GB:.1f} GB for KV "
                        f"(at most {int(self.de_kv_hbm // kv)} tokens; a larger tp or ep gives more)"
                    )
                if rnd.prompt_tokens * kv > self.hw.dram_bytes:
                    raise CapacityError(
                        f"agent {name} turn {index}: prompt KV {rnd.prompt_tokens * kv / GB:.1f} GB "
                        f"exceeds a node's DRAM of {self.hw.dram_bytes / GB:.1f} GB"
                    )

    def _lockstep_domains(self, role_nodes: list[int]) -> list[_Domain]:
        """The role's EP instances of :meth:`ClusterConfig.ep_size` consecutive engines (all of the role for
        DS-660B, whose 690 GB do not fit a node's 640 GB; one engine each for a replicated model, DP)."""
        engines = [e for n in role_nodes for e in self.nodes[n].engines]
        size = self.config.ep_size("pe" if role_nodes is self.pe_nodes else "de")
        return [_Domain(engines[start : start + size]) for start in range(0, len(engines), size)]

    # ------------------------------------------------------------------------------------------ events

    def _at(self, time: float, callback: Callable, *args) -> None:
        heapq.heappush(self._events, (time, next(self._seq), callback, args))

    def run(self, progress: Callable[[int, int], None] | None = None, max_sim_s: float = 1e7) -> SimResult:
        """Run to completion (or ``max_sim_s``); ``progress(done, total)`` is called every ~1% of rounds."""
        for agent, start in enumerate(self.agent_start):
            self._at(start, self._issue, agent)
        self._at(0.0, self._tick)
        step = max(1, self._total_rounds // 100)
        last_report = 0
        while self._events and self._remaining_agents:
            time, _, callback, args = heapq.heappop(self._events)
            if time > max_sim_s:
                break
            self.now = time
            callback(*args)
            if progress is not None and self._completed - last_report >= step:
                last_report = self._completed
                progress(self._completed, self._total_rounds)
        if progress is not None:
            progress(self._completed, self._total_rounds)
        self._busy["storage_nic"] = sum(end - start for n in self.nodes for start, end, _ in n.reads)
        self._reserve_hbm(0.0)
        units = {
            "storage_nic": len(self.nodes),
            "prefill_compute": len(self.pe_ids),
            "prefill_pass": len(self.pe_ids),
            "prefill_submit": len(self.pe_ids),
            "decode_steps": len(self.de_ids),
            "decode_hbm": self.de_kv_hbm * len(self.de_ids),
            "pe_cnic_in": len(self.pe_ids),
            "pe_cnic_out": len(self.pe_ids),
            "de_cnic_in": len(self.de_ids),
        }
        return SimResult(
            mode=self.mode,
            jct_s=max(self._finish) if not self._remaining_agents else float("inf"),
            completed_requests=self._completed,
            ttft_s=self._ttft,
            tpot_s=self._tpot,
            agent_finish_s=self._finish,
            snic_reads={n.node_id: n.reads for n in self.nodes},
            prefill_nodes=self.pe_nodes,
            decode_nodes=self.de_nodes,
            read_bytes_by_path=self._read_bytes,
            requests=self._records,
            busy_s=dict(self._busy),
            units=units,
            transfer_kind=self.transfer_kind,
        )

    def unfinished_arrivals(self) -> list[float]:
        """Arrival times (s) of the requests issued and not finished when the run stopped (``max_sim_s``)."""
        return [req.arrival for req in self._by_id.values()]

    # ------------------------------------------------------------------------------------------ arrivals

    def _issue(self, agent: int) -> None:
        rnd = self.agents[agent][self._next_round[agent]]
        self._next_round[agent] += 1
        hbm = (rnd.prompt_tokens + rnd.gen_tokens) * self.model.kv_bytes_per_token
        request = Request(next(self._request_ids), rnd.prompt_tokens, rnd.cached_tokens, int(hbm))
        req = _Req(agent, rnd, request, self.now)
        self._by_id[request.request_id] = req
        if self.scheduler is not None:
            self.scheduler.submit(request)
        else:
            self._rr_queue.append(req)

    # ------------------------------------------------------------------------------------------ placement

    def _report(self, node: _Node) -> GroupReport:
        # the node's read queue in tokens (alpha's unit): every read given to it and not finished, the one
        # its SNIC is serving included (a read handed to storage stays in the node's queue until it lands)
        engines = [
            EngineState(e.engine_id, e.node, e.seqs, e.tokens, int(e.free_hbm))
            for e in (self.engines[i] for i in node.engines)
        ]
        return GroupReport(node.node_id, engines, {node.node_id: node.read_queue_tokens})

    def _tick(self) -> None:
        """Round-robin placement runs once per tick; under the adaptive scheduler each group pulls on its
        own period, phase-shifted so that pulls are spread evenly over the tick (as independent group
        leaders would), never letting one group always pull first."""
        if self.scheduler is None:
            self._round_robin()
            if self._remaining_agents:
                self._at(self.now + self.config.tick_s, self._tick)
            return
        groups = self.de_nodes + self.pe_nodes
        for index, node in enumerate(groups):
            self._at(self.now + index * self.config.tick_s / len(groups), self._pull, node)

    def _pull(self, node_id: int) -> None:
        node = self.nodes[node_id]
        if node_id in self.de_nodes:
            for request, de in self.scheduler.pull_decode(self._report(node)):
                self._admit_decode(self._by_id[request.request_id], de)
        else:
            for assignment in self.scheduler.pull_prefill(self._report(node)):
                self._place(assignment)
        if self._remaining_agents:
            self._at(self.now + self.config.tick_s, self._pull, node_id)

    def _round_robin(self) -> None:
        """Baseline placement: next DE in a fixed cycle (waits while it lacks HBM), next PE in a cycle,
        read path alternating (dualpath) or always PE."""
        while self._rr_queue:
            req = self._rr_queue[0]
            de = self.de_ids[self._rr_de]
            if self.engines[de].free_hbm < req.request.decode_hbm_bytes:
                return
            self._rr_queue.popleft()
            self._rr_de = (self._rr_de + 1) % len(self.de_ids)
            self._admit_decode(req, de)
            self._place(Assignment(req.request, next(self._rr_pe), de, next(self._rr_path)))

    def _reserve_hbm(self, delta: float) -> None:
        """Account the DE KV HBM reserved so far (its time integral is decode_hbm) and change it by ``delta``."""
        self._busy["decode_hbm"] += self._hbm_reserved * (self.now - self._hbm_since)
        self._hbm_reserved += delta
        self._hbm_since = self.now

    def _admit_decode(self, req: _Req, de: int) -> None:
        engine = self.engines[de]
        engine.free_hbm -= req.request.decode_hbm_bytes
        self._reserve_hbm(req.request.decode_hbm_bytes)
        engine.tokens += req.request.prompt_tokens
        engine.seqs += 1
        req.de = de

    def _place(self, assignment: Assignment) -> None:
        req = self._by_id[assignment.request.request_id]
        req.pe, req.path = assignment.prefill_engine, assignment.read_path
        pe = self.engines[req.pe]
        pe.tokens += req.request.prompt_tokens
        pe.seqs += 1
        req.pe_hit_tokens = self._pe_hit_tokens(req)
        self._read(req)

    def _pe_hit_tokens(self, req: _Req) -> int:
        """The hit tokens the PE's storage NIC reads: all or none by the chosen path, or (split) the PE's share of
        :func:`split_hit_blocks` over the two nodes' live backlogs and caps, in whole blocks (the request's
        last block may be partial)."""
        cached = req.request.cached_tokens
        if not self.mode.split:
            return cached if req.path is ReadPath.PE else 0
        pe_node = self.nodes[self.engines[req.pe].node]
        de_node = self.nodes[self.engines[req.de].node]
        block = self.config.block_tokens
        pe_blocks = split_hit_blocks(
            -(-cached // block),
            block * self.model.kv_bytes_per_token,
            self._read_backlog_bytes(pe_node),
            pe_node.snic_bytes_per_s,
            self._read_backlog_bytes(de_node),
            de_node.snic_bytes_per_s,
        )
        return min(cached, pe_blocks * block)

    def _read_backlog_bytes(self, node: _Node) -> float:
        """Bytes the node's storage NIC still has to read: the queued reads and what is left of the one in flight."""
        if not node.read_busy:
            return 0.0
        in_flight = node.read_fifo[0][1]
        queued = (node.read_queue_tokens - in_flight) * self.model.kv_bytes_per_token
        return queued + (node.read_end - self.now) * node.snic_bytes_per_s

    def _prompt_kv_bytes(self, req: _Req) -> float:
        return req.request.prompt_tokens * self.model.kv_bytes_per_token

    # ------------------------------------------------------------------------------------------ storage

    def _read(self, req: _Req) -> None:
        """Queue the request's hit reads on their nodes' storage NICs (one per side that reads any); it is
        ready for prefill when the last of them has landed."""
        pe_hit = req.pe_hit_tokens
        halves = [
            (self.engines[req.pe].node, pe_hit, ReadPath.PE),
            (self.engines[req.de].node, req.request.cached_tokens - pe_hit, ReadPath.DE),
        ]
        halves = [half for half in halves if half[1] > 0]
        if not halves or self.mode.io_free:
            self._ready(req)
            return
        req.reads_left = len(halves)
        for node_id, tokens, path in halves:
            node = self.nodes[node_id]
            node.read_fifo.append((req, tokens, path))
            node.read_queue_tokens += tokens
            if not node.read_busy:
                self._serve_read(node)

    def _serve_read(self, node: _Node) -> None:
        _, tokens, path = node.read_fifo[0]
        nbytes = tokens * self.model.kv_bytes_per_token
        end = self.now + nbytes / node.snic_bytes_per_s
        node.read_busy, node.read_end = True, end
        node.reads.append((self.now, end, nbytes))
        self._read_bytes[path.value] += nbytes
        self._at(end, self._read_done, node)

    def _read_done(self, node: _Node) -> None:
        req, tokens, _ = node.read_fifo.popleft()
        node.read_queue_tokens -= tokens
        node.read_busy = False
        req.reads_left -= 1
        if not req.reads_left:
            self._ready(req)
        if node.read_fifo:
            self._serve_read(node)

    # ------------------------------------------------------------------------------------------ prefill

    def _ready(self, req: _Req) -> None:
        pe = self.engines[req.pe]
        work = PrefillWork(
            req.request.request_id, req.request.cached_tokens, req.request.prompt_tokens - req.request.cached_tokens
        )
        pe.ready.append((work, req, True))
        domain = self._domain_of[pe.engine_id]
        if not domain.step_busy:
            self._prefill_step(domain)

    def _batch(self, pe: _Engine) -> list[tuple[PrefillWork, int]]:
        works = [item[0] for item in pe.ready]
        if self.mode.adaptive:
            return plan_prefill_batch(works, self.profile.attention_time, self.config.compute_quota_s)
        batch, budget, free_hbm = [], self.config.max_batch_tokens, pe.free_hbm
        for work, req, first_pass in pe.ready:
            if self.mode is Mode.BASIC and first_pass:
                # basic: the pass needs the whole prompt KV of every request in PE HBM (FIFO); a prompt
                # larger than all of it runs alone
                need = self._prompt_kv_bytes(req)
                if need > free_hbm and (batch or free_hbm < self.pe_kv_hbm):
                    break
                free_hbm -= need
            take = min(work.remaining, budget)
            batch.append((work, take))
            budget -= take
            if budget == 0:
                break
        return batch

    def _engine_pass(
        self, pe: _Engine, batch: list[tuple[PrefillWork, int]], routed_s: float, share_tokens: float
    ) -> tuple[float, float, float]:
        """``(time, time at zero submission cost, compute time)`` of one engine's share of a pass: compute
        (its tokens' attention and non-expert GEMMs, plus ``routed_s``, its share of the instance's routed-expert
        GEMMs) plus, per mode, the KV movement that cannot hide behind it (see the module docstring).
        Layerwise modes move every request's KV as one layer block per layer, posted by the transfer kind.
        ``share_tokens`` is the instance's tokens per rank (the EP all-to-all's received half,
        :meth:`_model_traffic_s`)."""
        kv = self.model.kv_bytes_per_token
        compute, load_h2d, load_rdma, write, posting, serial = routed_s, 0.0, 0.0, 0.0, 0.0, 0.0
        for index, (work, take) in enumerate(batch):
            compute += self.profile.attention_flops(work.cached, take) * self.profile.seconds_per_flop
            compute += self.model.dense_gemm_flops(take) / self.hw.prefill_flops_per_s
            _, req, first_pass = pe.ready[index]
            # the PE-read hit comes over PCIe and also goes on to the DE; the DE-read hit over the CNIC
            pe_hit = req.pe_hit_tokens if first_pass else 0
            de_hit = req.request.cached_tokens - req.pe_hit_tokens if first_pass else 0
            load_h2d += pe_hit * kv
            load_rdma += de_hit * kv
            if self.mode is Mode.BASIC and first_pass:
                pe.free_hbm -= self._prompt_kv_bytes(req)  # held until the P->D transfer has sent it
            sent = take + pe_hit
            write += sent * kv
            for tokens in (pe_hit, de_hit, sent):
                post, copy = self._layer_blocks(tokens)
                posting, serial = posting + post, serial + copy
        model_s = self._model_traffic_s(sum(take for _, take in batch), share_tokens)
        if self.mode.io_free:
            overlapped = max(compute, model_s)  # the all-to-all overlaps compute (two micro-batches)
            return overlapped, overlapped, compute
        if self.mode is Mode.BASIC:
            # all layers' hit KV is copied PE buffer -> HBM before the pass starts (no layer blocks to
            # overlap it with compute, §4.1); the prompt KV leaves for the DE after the pass
            engine_time = load_h2d / self.hw.pcie_bytes_per_s + max(compute, model_s)
            self._busy["pe_cnic_in"] += load_h2d / self.hw.pcie_bytes_per_s + model_s
            self._busy["pe_cnic_out"] += model_s
            return engine_time, engine_time, compute
        wire_in = load_h2d / self.hw.pcie_bytes_per_s + load_rdma / self.hw.cnic_bytes_per_s
        wire_out = write / self.hw.cnic_bytes_per_s
        self._busy["pe_cnic_in"] += wire_in + model_s
        self._busy["pe_cnic_out"] += wire_out + model_s
        delay = max(self._all_to_all_delay(wire_in, model_s), self._all_to_all_delay(wire_out, model_s))
        free = max(compute + delay, wire_in + model_s, wire_out + model_s)
        # one poster serves both directions; posting overlaps the wire, staging's copy does not
        return max(free, posting) + serial, free, compute

    def _model_traffic_s(self, own_tokens: int, share_tokens: float) -> float:
        """Seconds of EP all-to-all on one direction of a rank's CNIC at its full rate, in a pass where the rank
        holds ``own_tokens`` and the instance ``share_tokens`` per rank. Each direction carries half of the
        per-token bytes for the rank's own tokens (dispatch out, combine in) and half for the tokens its
        experts receive (expert load balanced: ``share_tokens``)."""
        return self.ep_bytes_per_token / 2 * (own_tokens + share_tokens) / self.hw.cnic_bytes_per_s

    def _all_to_all_delay(self, kv_s: float, model_s: float) -> float:
        """Seconds the KV traffic holds up the EP all-to-all on one CNIC direction in a pass, for ``kv_s`` of KV
        and ``model_s`` of model traffic (each at the full rate), both queued from the pass's start and served
        weighted-fair by the traffic-class weights: the model class gets ``w_model / (w_model + w_kv)`` of the
        NIC until the KV is through, so it finishes ``min(model_s * w_kv / w_model, kv_s)`` later than alone.
        The all-to-all itself overlaps compute (two micro-batches, as DeepSeek's prefill runs); that delay
        does not, because the expert GEMMs wait for their dispatch (:meth:`_engine_pass` adds it to compute)."""
        share = self.config.model_traffic_share
        return min(model_s * (1 - share) / share, kv_s)

    def _layer_blocks(self, tokens: int) -> tuple[float, float]:
        """Posting and serial time of moving ``tokens`` tokens of one request as one layer block per layer."""
        if self.transfer_kind is None or tokens <= 0:
            return 0.0, 0.0
        layers = self.model.layers
        segments = -(-tokens // self.config.block_tokens)
        post, copy = self.costs.layer_block(
            self.transfer_kind, segments, tokens * self.model.kv_bytes_per_token / layers
        )
        return layers * post, layers * copy

    def _prefill_step(self, domain: _Domain) -> None:
        """One lock-step pass of a domain: it lasts as long as its slowest engine (:meth:`_engine_pass`).
        Expert parallelism spreads the routed-expert GEMMs of every token in the pass evenly over the
        instance's ranks (expert load balanced); attention, the other GEMMs and the KV movement stay with the
        rank that holds the tokens, and the ranks still wait for the slowest one at every layer. What the
        submissions added to the pass is charged to every request in it."""
        plan = []
        for engine_id in domain.engines:
            pe = self.engines[engine_id]
            batch = self._batch(pe) if pe.ready else []
            if batch:
                plan.append((pe, batch))
        if not plan:
            domain.step_busy = False
            return
        tokens = sum(take for _, batch in plan for _, take in batch)
        routed_s = self.model.routed_gemm_flops(tokens) / len(domain.engines) / self.hw.prefill_flops_per_s
        share_tokens = tokens / len(domain.engines)
        # a rank without tokens still runs its experts and receives their all-to-all
        idle_rank_s = max(routed_s, self._model_traffic_s(0, share_tokens)) if len(plan) < len(domain.engines) else 0.0
        step_time = step_free = idle_rank_s
        for pe, batch in plan:
            engine_time, engine_free, compute = self._engine_pass(pe, batch, routed_s, share_tokens)
            step_time, step_free = max(step_time, engine_time), max(step_free, engine_free)
            self._busy["prefill_compute"] += compute
        # every rank takes part in the pass (an idle one still runs its experts for the others)
        self._busy["prefill_pass"] += step_time * len(domain.engines)
        if len(plan) < len(domain.engines):
            idle = len(domain.engines) - len(plan)
            self._busy["prefill_compute"] += routed_s * idle
            for direction in ("pe_cnic_in", "pe_cnic_out"):
                self._busy[direction] += self._model_traffic_s(0, share_tokens) * idle
        self._busy["prefill_submit"] += (step_time - step_free) * len(domain.engines)
        if step_time > step_free:
            for pe, batch in plan:
                for index in range(len(batch)):
                    pe.ready[index][1].exposed_submit_s += step_time - step_free
        domain.step_busy = True
        self._at(self.now + step_time, self._prefill_step_done, domain, plan)

    def _prefill_step_done(self, domain: _Domain, plan) -> None:
        for pe, batch in plan:
            for work, take in batch:
                work.cached += take
                work.remaining -= take
                _, req, _ = pe.ready.popleft()
                if work.remaining:
                    pe.ready.appendleft((work, req, False))  # chunked: the rest leads the next pass
                    break
                self._prefill_done(pe, req)
        self._prefill_step(domain)

    def _prefill_done(self, pe: _Engine, req: _Req) -> None:
        pe.tokens -= req.request.prompt_tokens
        pe.seqs -= 1
        req.first_token = self.now
        self._ttft.append(self.now - req.arrival)
        self.ttft_arrivals.append(req.arrival)
        de = self.engines[req.de]
        if self.mode.io_free:
            self._join_decode(req)
            return
        # The prompt KV reaches DE HBM over CNICs, one transfer at a time per NIC direction: basic sends it
        # PE HBM -> DE HBM after the pass (PE egress and DE ingress busy); the layerwise modes already
        # streamed it into the DE buffer during the pass and copy it DE buffer -> DE HBM (DE ingress, §4.1).
        links = (pe, de) if self.mode is Mode.BASIC else (de,)
        start = max([self.now] + [engine.link_free_at for engine in links])
        rate = self.hw.cnic_bytes_per_s if self.mode is Mode.BASIC else self.hw.pcie_bytes_per_s
        wire = self._prompt_kv_bytes(req) / rate
        posting, serial = self._layer_blocks(req.request.prompt_tokens)
        duration = max(wire, posting) + serial
        req.exposed_submit_s += duration - wire
        end = start + duration
        for engine in links:
            engine.link_free_at = end
        self._busy["de_cnic_in"] += wire
        if self.mode is Mode.BASIC:
            self._busy["pe_cnic_out"] += wire
        self._at(end, self._kv_on_decode, pe, req)

    def _kv_on_decode(self, pe: _Engine, req: _Req) -> None:
        if self.mode is Mode.BASIC:  # the PE's copy is sent: its HBM can take the next batch
            pe.free_hbm += self._prompt_kv_bytes(req)
            domain = self._domain_of[pe.engine_id]
            if pe.ready and not domain.step_busy:
                self._prefill_step(domain)
        self._join_decode(req)

    # ------------------------------------------------------------------------------------------ decode

    def _join_decode(self, req: _Req) -> None:
        de = self.engines[req.de]
        req.decode_start = self.now
        if req.round.gen_tokens <= 1:
            self._decode_done(de, req, steps=0)
            return
        de.joining.append(req)
        domain = self._domain_of[de.engine_id]
        if not domain.step_busy:
            self._decode_step(domain)

    def _decode_step(self, domain: _Domain) -> None:
        topk = self.model.sparse_topk
        step_bytes = 0.0
        busy = False
        for engine_id in domain.engines:
            de = self.engines[engine_id]
            for req in de.joining:
                req.ctx = req.request.prompt_tokens + 1
                req.attended = min(req.ctx, topk) if topk else req.ctx
                req.finish_step = domain.completed_steps + req.round.gen_tokens - 1
                heapq.heappush(de.finishing, (req.finish_step, req.request.request_id, req))
                de.active += 1
                de.sum_ctx += req.ctx
                de.sum_attended += req.attended
            de.joining.clear()
            if de.active:
                busy = True
                engine_bytes = (
                    de.sum_ctx * self.model.decode_read_bytes_per_ctx_token
                    + de.sum_attended * self.model.decode_read_bytes_per_attended
                )
                step_bytes = max(step_bytes, engine_bytes)
        if not busy:
            domain.step_busy = False
            return
        domain.step_busy = True
        duration = self.model.decode_step_fixed_s + step_bytes / self.hw.hbm_bytes_per_s
        self._busy["decode_steps"] += duration * len(domain.engines)
        self._at(self.now + duration, self._decode_step_done, domain)

    def _decode_step_done(self, domain: _Domain) -> None:
        domain.completed_steps += 1
        dense = self.model.sparse_topk is None
        for engine_id in domain.engines:
            de = self.engines[engine_id]
            de.tokens += de.active
            de.sum_ctx += de.active
            if dense:
                de.sum_attended += de.active
            while de.finishing and de.finishing[0][0] <= domain.completed_steps:
                _, _, req = heapq.heappop(de.finishing)
                steps = req.round.gen_tokens - 1
                de.active -= 1
                de.sum_ctx -= req.ctx + steps
                de.sum_attended -= req.attended + (steps if dense else 0)
                self._decode_done(de, req, steps)
        self._decode_step(domain)

    def _decode_done(self, de: _Engine, req: _Req, steps: int) -> None:
        tpot = (self.now - req.decode_start) / steps if steps else None
        if tpot is not None:
            self._tpot.append(tpot)
        critical = req.decode_start - req.arrival
        self._records.append(
            RequestRecord(
                req.arrival,
                req.first_token - req.arrival,
                tpot,
                req.round.prompt_tokens,
                req.round.gen_tokens,
                req.exposed_submit_s / critical if critical > 0 else 0.0,
            )
        )
        de.tokens -= req.request.prompt_tokens + steps
        de.seqs -= 1
        de.free_hbm += req.request.decode_hbm_bytes
        self._reserve_hbm(-req.request.decode_hbm_bytes)
        del self._by_id[req.request.request_id]
        self._completed += 1
        agent = req.agent
        if self._next_round[agent] >= len(self.agents[agent]):
            self._finish[agent] = self.now
            self._remaining_agents -= 1
        elif req.round.tool_s > 0:  # the tool runs before the agent's next request
            self._at(self.now + req.round.tool_s, self._issue, agent)
        else:
            self._issue(agent)
