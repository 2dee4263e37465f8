"""Experiments on the cluster simulator: offline JCT, the ablation, online SLO capacity, metrics, figures."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ascend_dualpath.errors import ConfigError
from ascend_dualpath.sim.cluster import PAPER_MODES, ClusterConfig, ClusterSim, Mode, RequestRecord, SimResult
from ascend_dualpath.sim.traces import Round, generate_trajectories, replay

TTFT_SLO_S = 4.0
TPOT_SLO_S = 0.050


def agentic_agents(
    count: int, max_len: int = 65536, rounds_per_agent: int | None = None, seed: int = 0, block_tokens: int = 64
) -> list[list[Round]]:
    """``count`` Table-2 agents. With ``rounds_per_agent`` each agent replays a random window of that
    many consecutive rounds of its trajectory (contexts and hits as deep as in the full run), which keeps
    the per-round mix of the full workload at a fraction of the cost."""
    rng = random.Random(seed + 1)
    agents = []
    for trajectory in generate_trajectories(max_len, count, seed=seed):
        rounds = replay(trajectory, block_tokens)
        if rounds_per_agent is not None and len(rounds) > rounds_per_agent:
            start = rng.randrange(0, len(rounds) - rounds_per_agent + 1)
            rounds = rounds[start : start + rounds_per_agent]
        agents.append(rounds)
    return agents


def run_offline(
    config: ClusterConfig,
    mode: Mode,
    agents: Sequence[Sequence[Round]],
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """All agents start at t=0; the result's ``jct_s`` is the job completion time."""
    return ClusterSim(config, mode, agents).run(progress=progress)


def run_ablation(
    config: ClusterConfig,
    agents: Sequence[Sequence[Round]],
    modes: Sequence[Mode] = PAPER_MODES,
    progress: Callable[[Mode, int, int], None] | None = None,
) -> dict[Mode, SimResult]:
    results = {}
    for mode in modes:
        callback = (lambda done, total, mode=mode: progress(mode, done, total)) if progress else None
        results[mode] = run_offline(config, mode, agents, callback)
    return results


def reductions_vs_basic(results: dict[Mode, SimResult]) -> dict[Mode, float]:
    """Cumulative JCT reduction of each mode relative to Basic (the paper's ablation metric)."""
    basic = results[Mode.BASIC].jct_s
    return {mode: 1.0 - result.jct_s / basic for mode, result in results.items()}


def snic_utilisation(result: SimResult, window_s: float = 5.0) -> tuple[list[float], dict[int, list[float]]]:
    """Storage-NIC utilisation per node in windows of ``window_s``: ``(window_starts, {node: [0..1]})``.

    Read intervals are split exactly across window boundaries (each node serves one read at a time)."""
    if window_s <= 0:
        raise ConfigError(f"window must be > 0 s, got {window_s}")
    end = max((stop for reads in result.snic_reads.values() for _, stop, _ in reads), default=0.0)
    windows = int(end // window_s) + 1
    busy = {node: [0.0] * windows for node in result.snic_reads}
    for node, reads in result.snic_reads.items():
        for start, stop, _ in reads:
            index = int(start // window_s)
            while start < stop:
                boundary = min(stop, (index + 1) * window_s)
                busy[node][index] += boundary - start
                start, index = boundary, index + 1
    utilisation = {node: [b / window_s for b in series] for node, series in busy.items()}
    return [i * window_s for i in range(windows)], utilisation


def snic_max_over_avg(result: SimResult, window_s: float = 5.0, middle_bytes: float = 0.8) -> float:
    """Mean over windows of (max node traffic / mean node traffic) across all storage NICs.

    Only the steady state counts: windows between the moments when ``(1 - middle_bytes) / 2`` and
    ``(1 + middle_bytes) / 2`` of all storage bytes had been read (ramp-up and drain excluded)."""
    starts, util = snic_utilisation(result, window_s)
    per_window = [sum(series[i] for series in util.values()) for i in range(len(starts))]
    total = sum(per_window)
    if total <= 0:
        raise ConfigError("no storage-NIC traffic to measure")
    low_mark, high_mark = (1 - middle_bytes) / 2 * total, (1 + middle_bytes) / 2 * total
    ratios, done = [], 0.0
    for index, window_total in enumerate(per_window):
        done += window_total
        if done < low_mark or done - window_total > high_mark or window_total <= 0:
            continue
        values = [series[index] for series in util.values()]
        ratios.append(max(values) / (sum(values) / len(values)))
    return sum(ratios) / len(ratios)


# the resources a run can be bound by. Not listed: prefill_compute and prefill_submit (parts of prefill_pass),
# decode_steps (a lock-step decode instance steps whenever it holds a sequence, so it reads ~100% at any load;
# decode capacity is its KV HBM)
BINDING_CANDIDATES = ("storage_nic", "prefill_pass", "decode_hbm", "pe_cnic_in", "pe_cnic_out", "de_cnic_in")
SUBMIT_SHARE_LIMIT = 0.05  # the seed's stop condition: submission under 5% of the critical path keeps the host path


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank ``q``-th percentile (``0 < q <= 100``) of ``values``; NaN when empty."""
    if not 0 < q <= 100:
        raise ConfigError(f"percentile must be in (0, 100], got {q}")
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _spread(values: Sequence[float]) -> dict[str, float]:
    mean = sum(values) / len(values) if values else float("nan")
    return {"mean": mean, "p50": percentile(values, 50), "p99": percentile(values, 99)}


def summarise(result: SimResult, ttft_slo_s: float = TTFT_SLO_S, tpot_slo_s: float = TPOT_SLO_S) -> dict:
    """The operator's figures of one run (JSON-ready; times in s, rates per s of the run's length).

    ``slo_attainment`` is the fraction of requests whose own TTFT and TPOT (when it generated more than one
    token) meet the SLOs; ``utilisation[resource]`` its busy resource-seconds over its count times the run's
    length (``prefill_pass`` counts every rank of a lock-step pass, ``prefill_compute`` only the FLOPs);
    ``decode_hbm`` is the time-average share of DE KV HBM reserved; ``snic_utilisation_by_node`` each node's
    storage-NIC busy share over the run (its mean is ``utilisation["storage_nic"]``), ``read_bytes_by_path``
    the storage bytes read on each side (``"pe"``, ``"de"``); ``binding_resource`` the busiest of
    :data:`BINDING_CANDIDATES`. ``submit_share`` (with a transfer kind): ``mean``/``p50``/``p99`` of the share
    of each request's critical path (arrival to decode start) its own passes and P->D copy spent on layer-block
    submissions, ``prefill_pass`` the share of all prefill pass time they took, ``share`` the larger of the
    mean and that, with the Amdahl bound ``1 / (1 - share)`` of removing them and whether it is under
    :data:`SUBMIT_SHARE_LIMIT` (:func:`host_path_verdict` turns that into the seed's verdict).
    """
    records = result.requests
    length = _run_length(result)
    utilisation = {name: busy / (result.units[name] * length) for name, busy in result.busy_s.items()}
    summary = {
        "jct_s": result.jct_s,
        "completed_requests": result.completed_requests,
        "agent_finish_s": _spread(result.agent_finish_s),
        "ttft_s": _spread([r.ttft_s for r in records]),
        "tpot_s": _spread([r.tpot_s for r in records if r.tpot_s is not None]),
        "throughput": {
            "rounds_per_s": len(records) / length,
            "generated_tokens_per_s": sum(r.gen_tokens for r in records) / length,
            "prompt_tokens_per_s": sum(r.prompt_tokens for r in records) / length,
        },
        "slo": {
            "ttft_s": ttft_slo_s,
            "tpot_s": tpot_slo_s,
            "attainment": _slo_attainment(records, ttft_slo_s, tpot_slo_s),
        },
        "snic_max_over_avg": _snic_balance(result),
        "snic_utilisation_by_node": {
            str(node): sum(end - start for start, end, _ in reads) / length for node, reads in result.snic_reads.items()
        },
        "read_bytes_by_path": dict(result.read_bytes_by_path),
        "utilisation": utilisation,
        "binding_resource": max(BINDING_CANDIDATES, key=lambda name: utilisation.get(name, 0.0)),
    }
    if result.transfer_kind is not None:
        summary["submit_share"] = _submit_share(result)
    return summary


def _run_length(result: SimResult) -> float:
    """The run's length in s: its JCT, or its last agent's finish when some agent never finished (JCT inf);
    NaN for an empty run, so that rates come out NaN rather than dividing by zero."""
    length = max(result.agent_finish_s, default=0.0) if math.isinf(result.jct_s) else result.jct_s
    return length if length > 0 else float("nan")


def _slo_attainment(records: Sequence[RequestRecord], ttft_slo_s: float, tpot_slo_s: float) -> float:
    """The fraction of ``records`` whose TTFT and TPOT (None with one output token) meet the SLOs; 0 if none."""
    met = sum(1 for r in records if r.ttft_s <= ttft_slo_s and (r.tpot_s is None or r.tpot_s <= tpot_slo_s))
    return met / len(records) if records else 0.0


def _snic_balance(result: SimResult) -> float | None:
    """:func:`snic_max_over_avg`, None where there was no storage traffic (oracle, or no hits)."""
    try:
        return snic_max_over_avg(result)
    except ConfigError:
        return None


def _submit_share(result: SimResult) -> dict:
    """``summarise``'s ``submit_share`` of a run with a transfer kind."""
    shares = [r.submit_share for r in result.requests]
    per_request = sum(shares) / len(shares)
    pass_busy = result.busy_s["prefill_pass"]
    prefill_share = result.busy_s["prefill_submit"] / pass_busy if pass_busy > 0 else 0.0
    # under load a pass that submissions lengthened delays every request queued behind it, which no
    # request's own passes show: where prefill binds, its time share is the larger and the one that counts
    share = max(per_request, prefill_share)
    return {
        "kind": result.transfer_kind.value,
        **_spread(shares),
        "prefill_pass": prefill_share,
        "share": share,
        "amdahl_bound": 1 / (1 - share),
        "below_limit": share < SUBMIT_SHARE_LIMIT,
    }


def host_path_verdict(host_share: float) -> str:
    """The seed's stop condition on the host path's mean submission share of the critical path."""
    if host_share < SUBMIT_SHARE_LIMIT:
        return (
            f"keep the host path: its submissions are {100 * host_share:.1f}% of the critical path "
            f"(< {100 * SUBMIT_SHARE_LIMIT:.0f}%), at most {1 / (1 - host_share):.3f}x to gain"
        )
    return (
        f"device-side submission pays: the host path's submissions are {100 * host_share:.1f}% of the "
        f"critical path (>= {100 * SUBMIT_SHARE_LIMIT:.0f}%), up to {1 / (1 - host_share):.2f}x"
    )


@dataclass(frozen=True)
class OnlinePoint:
    aps: float
    mean_ttft_s: float
    mean_tpot_s: float
    meets_slo: bool


def run_online(
    config: ClusterConfig, mode: Mode, aps: float, duration_s: float, max_len: int = 65536, seed: int = 0
) -> OnlinePoint:
    """Agents arrive as a Poisson process at ``aps`` per second for ``duration_s`` and replay their
    trajectories from round 0; the SLO is mean TTFT <= 4 s and mean TPOT <= 50 ms over requests that
    start in the second half (the first half is warm-up)."""
    if aps <= 0 or duration_s <= 0:
        raise ConfigError(f"aps and duration must be > 0, got {aps} and {duration_s}")
    rng = random.Random(seed)
    starts, time = [], 0.0
    while True:
        time += rng.expovariate(aps)
        if time > duration_s:
            break
        starts.append(time)
    if not starts:
        raise ConfigError(f"no agent arrives in {duration_s} s at {aps} APS")
    agents = agentic_agents(len(starts), max_len, seed=seed)
    sim = ClusterSim(config, mode, agents, agent_start_s=starts)
    result = sim.run(max_sim_s=duration_s)
    ttft = [t for t, arrival in zip(result.ttft_s, sim.ttft_arrivals, strict=True) if arrival >= duration_s / 2]
    tpot = result.tpot_s[len(result.tpot_s) // 2 :]
    mean_ttft = sum(ttft) / len(ttft) if ttft else float("inf")
    mean_tpot = sum(tpot) / len(tpot) if tpot else float("inf")
    return OnlinePoint(aps, mean_ttft, mean_tpot, mean_ttft <= TTFT_SLO_S and mean_tpot <= TPOT_SLO_S)


def online_capacity(
    config: ClusterConfig,
    mode: Mode,
    duration_s: float,
    low: float,
    high: float,
    iterations: int = 6,
    seed: int = 0,
    max_len: int = 65536,
) -> float:
    """Largest APS (bisection between ``low`` and ``high``) whose run meets the SLO; 0 if ``low`` fails.

    Assumes SLO attainment is monotone in APS; the answer is within ``(high - low) / 2**iterations`` of
    the boundary (``high`` itself is never run, so a capacity at or above it reads as just below it)."""
    if not 0 < low < high:
        raise ConfigError(f"need 0 < low < high APS, got low={low}, high={high}")
    if not run_online(config, mode, low, duration_s, max_len, seed).meets_slo:
        return 0.0
    for _ in range(iterations):
        middle = (low + high) / 2
        if run_online(config, mode, middle, duration_s, max_len, seed).meets_slo:
            low = middle
        else:
            high = middle
    return low


def plot_figures(
    out_dir, sweep: dict[Mode, list[tuple[int, float]]], ablation: dict[Mode, SimResult], window_s: float = 5.0
) -> list[str]:
    """Write jct_vs_agents.png, ablation.png and snic_utilisation.png under ``out_dir`` (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    from pathlib import Path

    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, points in sweep.items():
        ax.plot([n for n, _ in points], [jct for _, jct in points], marker="o", label=mode.value)
    ax.set_xlabel("agents (started together)")
    ax.set_ylabel("job completion time (s)")
    ax.set_title("Offline JCT against agent count")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "jct_vs_agents.png", dpi=120)
    written.append(str(out / "jct_vs_agents.png"))
    plt.close(fig)

    reductions = reductions_vs_basic(ablation)
    fig, ax = plt.subplots(figsize=(6, 4))
    names = [mode.value for mode in ablation]
    ax.bar(names, [100 * reductions[mode] for mode in ablation])
    ax.set_ylabel("JCT reduction vs basic (%)")
    ax.set_title("Ablation (cumulative)")
    fig.tight_layout()
    fig.savefig(out / "ablation.png", dpi=120)
    written.append(str(out / "ablation.png"))
    plt.close(fig)

    compare = [mode for mode in (Mode.DUALPATH, Mode.SCHEDULER) if mode in ablation]
    fig, axes = plt.subplots(len(compare), 1, figsize=(7, 2.6 * len(compare)), sharex=True, squeeze=False)
    for ax, mode in zip(axes[:, 0], compare, strict=True):
        starts, util = snic_utilisation(ablation[mode], window_s)
        for node, series in util.items():
            role = "P" if node in ablation[mode].prefill_nodes else "D"
            ax.plot(starts, series, linewidth=0.8, label=f"node {node} ({role})")
        ax.set_ylabel("SNIC util.")
        balance = snic_max_over_avg(ablation[mode], window_s)
        ax.set_title(f"{mode.value}: storage-NIC utilisation, max/avg {balance:.2f}")
        ax.legend(fontsize=6, ncol=3)
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(out / "snic_utilisation.png", dpi=120)
    written.append(str(out / "snic_utilisation.png"))
    plt.close(fig)
    return written
