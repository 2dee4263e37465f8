"""Online capacity at steady state: Poisson agent arrivals, warm-up and drain excluded.

Agents arrive as a Poisson process for the whole run (``warmup_s + measure_s + drain_s``), so the load is
the same before, during and after the measured window; only requests that *arrive* inside
``[warmup_s, warmup_s + measure_s)`` count, and the drain lets most of them finish. A request of the window
that has not finished when the run stops counts as missing the SLO. SLO attainment is the share of the
window's requests whose own TTFT and TPOT meet the SLOs; a rate meets the SLO when its attainment reaches
``target``. The capacity search bisects on the arrival rate (assumed monotone) and reports its tolerance.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from ascend_dualpath.errors import ConfigError
from ascend_dualpath.sim.cluster import ClusterConfig, ClusterSim, Mode, RequestRecord
from ascend_dualpath.sim.experiments import TPOT_SLO_S, TTFT_SLO_S, agentic_agents, percentile


@dataclass(frozen=True)
class SteadyState:
    """One steady-state measurement's shape: ``warmup_s``, ``measure_s`` and ``drain_s`` of simulated time
    (s), the SLOs (s), the attainment ``target`` (0..1), and the agents (Table-2 at ``max_len`` tokens, each
    replaying ``rounds_per_agent`` rounds of its trajectory, None: all of them)."""

    warmup_s: float = 600.0
    measure_s: float = 1200.0
    drain_s: float = 300.0
    ttft_slo_s: float = TTFT_SLO_S
    tpot_slo_s: float = TPOT_SLO_S
    target: float = 0.9
    max_len: int = 65536
    rounds_per_agent: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.warmup_s < 0 or self.measure_s <= 0 or self.drain_s < 0:
            raise ConfigError(
                f"need warmup_s >= 0, measure_s > 0, drain_s >= 0, got {self.warmup_s}, {self.measure_s}, "
                f"{self.drain_s}"
            )
        if not 0 < self.target <= 1:
            raise ConfigError(f"SLO attainment target must be in (0, 1], got {self.target}")

    @property
    def run_s(self) -> float:
        """Simulated seconds per point: warm-up + measured window + drain."""
        return self.warmup_s + self.measure_s + self.drain_s


@dataclass(frozen=True)
class SteadyPoint:
    """One arrival rate's result over the measured window: ``aps`` (agents/s), ``requests`` that arrived in
    it, SLO ``attainment`` (0..1, unfinished ones missed), TTFT mean/p99 and TPOT mean (s) of the finished
    ones, and whether ``attainment`` reached the target."""

    aps: float
    requests: int
    attainment: float
    mean_ttft_s: float
    p99_ttft_s: float
    mean_tpot_s: float
    meets_slo: bool


def poisson_starts(aps: float, until_s: float, seed: int) -> list[float]:
    """Arrival times (s) of a Poisson process at ``aps`` per second on ``(0, until_s]``."""
    if aps <= 0 or until_s <= 0:
        raise ConfigError(f"aps and the run length must be > 0, got {aps} and {until_s}")
    rng, starts, time = random.Random(seed), [], 0.0
    while True:
        time += rng.expovariate(aps)
        if time > until_s:
            return starts
        starts.append(time)


def steady_point(config: ClusterConfig, mode: Mode, aps: float, shape: SteadyState) -> SteadyPoint:
    """Run ``aps`` agents/s for ``shape.run_s`` and measure the window's requests (module docstring)."""
    starts = poisson_starts(aps, shape.run_s, shape.seed)
    if not starts:
        raise ConfigError(f"no agent arrives in {shape.run_s} s at {aps} APS")
    agents = agentic_agents(len(starts), shape.max_len, shape.rounds_per_agent, seed=shape.seed)
    sim = ClusterSim(config, mode, agents, agent_start_s=starts)
    result = sim.run(max_sim_s=shape.run_s)
    low, high = shape.warmup_s, shape.warmup_s + shape.measure_s
    finished = [r for r in result.requests if low <= r.arrival_s < high]
    unfinished = sum(1 for arrival in sim.unfinished_arrivals() if low <= arrival < high)
    return _window_point(aps, finished, unfinished, shape)


def _window_point(aps: float, finished: Sequence[RequestRecord], unfinished: int, shape: SteadyState) -> SteadyPoint:
    """The :class:`SteadyPoint` of a window's ``finished`` records and ``unfinished`` count (those miss)."""
    total = len(finished) + unfinished
    met = sum(
        1 for r in finished if r.ttft_s <= shape.ttft_slo_s and (r.tpot_s is None or r.tpot_s <= shape.tpot_slo_s)
    )
    attainment = met / total if total else 0.0
    ttft = [r.ttft_s for r in finished]
    tpot = [r.tpot_s for r in finished if r.tpot_s is not None]
    return SteadyPoint(
        aps,
        total,
        attainment,
        sum(ttft) / len(ttft) if ttft else float("inf"),
        percentile(ttft, 99) if ttft else float("inf"),
        sum(tpot) / len(tpot) if tpot else float("inf"),
        total > 0 and attainment >= shape.target,
    )


@dataclass(frozen=True)
class Capacity:
    """A capacity search's answer: ``aps`` (the highest rate that met the SLO, 0 if ``low`` failed), its
    ``tolerance`` (APS: the boundary lies in ``[aps, aps + tolerance)``), the run length per point (s) and
    every point measured, in the order run."""

    aps: float
    tolerance: float
    run_s: float
    points: tuple[SteadyPoint, ...]


def steady_capacity(
    config: ClusterConfig, mode: Mode, low: float, high: float, shape: SteadyState, iterations: int = 6
) -> Capacity:
    """Bisect the arrival rate on ``[low, high]`` for ``iterations`` steps (SLO attainment assumed monotone
    in it); ``high`` is run first, so a capacity above it is reported as ``high`` with tolerance 0."""
    if not 0 < low < high or iterations < 1:
        raise ConfigError(f"need 0 < low < high APS and iterations >= 1, got low={low}, high={high}, {iterations}")
    points = [steady_point(config, mode, high, shape)]
    if points[-1].meets_slo:
        return Capacity(high, 0.0, shape.run_s, tuple(points))
    points.append(steady_point(config, mode, low, shape))
    if not points[-1].meets_slo:
        return Capacity(0.0, low, shape.run_s, tuple(points))
    for _ in range(iterations):
        middle = (low + high) / 2
        points.append(steady_point(config, mode, middle, shape))
        low, high = (middle, high) if points[-1].meets_slo else (low, middle)
    return Capacity(low, high - low, shape.run_s, tuple(points))


def plot_slo_attainment(path, curves: dict[Mode, Sequence[SteadyPoint]], shape: SteadyState, title: str) -> str:
    """Write a PNG of SLO attainment (%) against arrival rate (APS) per mode to ``path`` (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, points in curves.items():
        ordered = sorted(points, key=lambda p: p.aps)
        ax.plot([p.aps for p in ordered], [100 * p.attainment for p in ordered], marker="o", label=mode.value)
    ax.axhline(100 * shape.target, color="grey", linestyle="--", linewidth=0.8, label=f"target {shape.target:.0%}")
    ax.set_xlabel("agent arrival rate (agents/s)")
    ax.set_ylabel("requests meeting TTFT and TPOT SLO (%)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)
