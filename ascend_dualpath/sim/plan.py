"""The planner behind ``simulate --cluster CLUSTER.toml --trace TRACE.jsonl``: an operator's cluster and trace
through the chosen modes and transfer kinds, summarised (:func:`~ascend_dualpath.sim.experiments.summarise`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ascend_dualpath.errors import ConfigError
from ascend_dualpath.sim.cluster import ClusterSim, Mode, SimResult, pd_ratio_warning
from ascend_dualpath.sim.cluster_file import ClusterSpec
from ascend_dualpath.sim.experiments import host_path_verdict, summarise
from ascend_dualpath.sim.trace_file import AgentTrace, agents_rounds
from ascend_dualpath.sim.transfer import TransferKind

Progress = Callable[[str, int, int], None]


def parse_modes(text: str) -> list[Mode]:
    """``"basic,scheduler"`` as modes; an unknown name is a ConfigError listing the known ones."""
    modes = []
    for name in (part.strip() for part in text.split(",") if part.strip()):
        try:
            modes.append(Mode(name))
        except ValueError:
            raise ConfigError(f"unknown mode {name!r}; known: {[mode.value for mode in Mode]}") from None
    if not modes:
        raise ConfigError(f"--modes names no mode: {text!r}")
    return modes


def cluster_warnings(spec: ClusterSpec) -> list[str]:
    """What the operator should know before trusting the figures (P/D outside the bandwidth model's interval)."""
    warning = pd_ratio_warning(spec.config)
    return [warning] if warning else []


def simulate_trace(
    spec: ClusterSpec,
    agents: Sequence[AgentTrace],
    mode: Mode,
    online: bool = False,
    transfer_kind: TransferKind | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """One run of ``agents`` on the cluster: offline (all agents at t=0) or ``online`` (each at its ``start_s``)."""
    config = spec.config
    starts = [agent.start_s or 0.0 for agent in agents] if online else None
    sim = ClusterSim(
        config,
        mode,
        agents_rounds(agents, config.block_tokens),
        agent_start_s=starts,
        transfer_kind=transfer_kind,
        costs=spec.costs,
        agent_names=[agent.agent for agent in agents],
    )
    return sim.run(progress=progress)


def run_modes(
    spec: ClusterSpec,
    agents: Sequence[AgentTrace],
    modes: Sequence[Mode],
    online: bool = False,
    progress: Progress | None = None,
) -> dict[str, dict]:
    """Every mode's summary, by mode name; ``progress(label, done, total)`` as the runs advance."""
    summaries = {}
    for mode in modes:
        callback = (lambda done, total, mode=mode: progress(mode.value, done, total)) if progress else None
        result = simulate_trace(spec, agents, mode, online, progress=callback)
        summaries[mode.value] = summarise(result, spec.slo.ttft_s, spec.slo.tpot_s)
    return summaries


def run_transfer_kinds(
    spec: ClusterSpec,
    agents: Sequence[AgentTrace],
    kinds: Sequence[TransferKind],
    mode: Mode = Mode.SCHEDULER,
    online: bool = False,
    progress: Progress | None = None,
) -> dict:
    """``mode`` once per transfer kind plus the ``free`` reference (wire only), summarised; ``verdict`` is the
    seed's stop condition on each host kind run (``host``: a submission per segment; ``host-batched``: one per
    layer block), by kind.

    Raises
    ------
    ConfigError
        ``mode`` moves no layer blocks (basic: whole-prompt copies; oracle: I/O free).
    """
    if not mode.layerwise or mode.io_free:
        raise ConfigError(
            f"transfer kinds apply to the layerwise modes (layerwise, dualpath, scheduler, split), not {mode.value}"
        )
    runs = {}
    for kind in [TransferKind.FREE, *[k for k in kinds if k is not TransferKind.FREE]]:
        callback = (lambda done, total, kind=kind: progress(kind.value, done, total)) if progress else None
        result = simulate_trace(spec, agents, mode, online, transfer_kind=kind, progress=callback)
        runs[kind.value] = summarise(result, spec.slo.ttft_s, spec.slo.tpot_s)
    reference = runs[TransferKind.FREE.value]["jct_s"]
    for summary in runs.values():
        summary["submit_share"]["jct_over_free"] = summary["jct_s"] / reference
    verdicts = {
        kind.value: host_path_verdict(runs[kind.value]["submit_share"]["share"])
        for kind in (TransferKind.HOST, TransferKind.HOST_BATCHED)
        if kind.value in runs
    }
    return {"mode": mode.value, "kinds": runs, "verdict": verdicts}
