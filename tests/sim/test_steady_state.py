"""Online capacity at steady state (sim.online) on a small cluster: Qwen2.5-32B 1P1D (tp=2), agents replaying
4 rounds each, 60 s warm-up, 120 s measured, 60 s drain; bisection on [0.25, 4] APS in 5 steps (tolerance
0.117 APS). Basic 0.953, scheduler 1.422 APS (docs/simulator.md §3)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ascend_dualpath.errors import ConfigError
from ascend_dualpath.sim.cluster import ClusterConfig, Mode
from ascend_dualpath.sim.models import QWEN_32B
from ascend_dualpath.sim.online import SteadyState, poisson_starts, steady_capacity, steady_point

LOW, HIGH, ITERATIONS = 0.25, 4.0, 5
SHAPE = SteadyState(warmup_s=60, measure_s=120, drain_s=60, rounds_per_agent=4)
CONFIG = ClusterConfig(QWEN_32B, prefill_nodes=1, decode_nodes=1, tp=2)


@pytest.fixture(scope="module")
def basic():
    return steady_capacity(CONFIG, Mode.BASIC, LOW, HIGH, SHAPE, ITERATIONS)


def test_the_search_brackets_the_slo_boundary(basic):
    assert basic.tolerance == pytest.approx((HIGH - LOW) / 2**ITERATIONS)
    assert basic.run_s == 240
    assert LOW < basic.aps < HIGH - basic.tolerance
    by_rate = {point.aps: point for point in basic.points}
    assert by_rate[basic.aps].meets_slo and by_rate[basic.aps].attainment >= SHAPE.target
    assert not by_rate[basic.aps + basic.tolerance].meets_slo  # one tolerance step higher was run and failed


def test_the_capacity_does_not_depend_on_the_warm_up_length(basic):
    """Warm-up twice as long (the window starts 60 s later, the run is 60 s longer): same capacity within
    the tolerance. (At 240 s on this short window the scheduler's capacity moves by 0.35 APS: near the
    boundary the queue is a random walk; docs/simulator.md.)"""
    longer = steady_capacity(CONFIG, Mode.BASIC, LOW, HIGH, replace(SHAPE, warmup_s=120), ITERATIONS)
    assert abs(longer.aps - basic.aps) <= basic.tolerance


def test_only_the_windows_arrivals_count():
    """Agents whose first round arrives during the warm-up still issue requests in the window, so the window
    counts at least the window's first rounds and fewer requests than the whole run issued."""
    point = steady_point(CONFIG, Mode.BASIC, 0.5, SHAPE)
    starts = poisson_starts(0.5, SHAPE.run_s, SHAPE.seed)
    in_window = sum(1 for s in starts if SHAPE.warmup_s <= s < SHAPE.warmup_s + SHAPE.measure_s)
    assert in_window <= point.requests < len(starts) * SHAPE.rounds_per_agent
    assert point.attainment == 1.0


def test_the_scheduler_serves_more_agents_per_second(basic):
    scheduler = steady_capacity(CONFIG, Mode.SCHEDULER, LOW, HIGH, SHAPE, ITERATIONS)
    assert scheduler.aps >= 1.3 * basic.aps


def test_bad_shapes_and_intervals():
    with pytest.raises(ConfigError, match="measure_s > 0"):
        SteadyState(measure_s=0)
    with pytest.raises(ConfigError, match="target must be in"):
        SteadyState(target=1.5)
    with pytest.raises(ConfigError, match="low=2"):
        steady_capacity(CONFIG, Mode.BASIC, 2.0, 1.0, SHAPE)


def test_cli_prints_the_tolerance_and_run_length_and_writes_the_figure(tmp_path, capsys):
    from ascend_dualpath.cli import main

    argv = ["simulate", "--online", "--steady-state", "--cluster", "qwen32b_1p1d", "--rounds", "2"]
    argv += ["--warmup-s", "10", "--measure-s", "20", "--drain-s", "10", "--online-min-aps", "0.5"]
    argv += [
        "--online-max-aps",
        "2",
        "--online-iterations",
        "1",
        "--out",
        str(tmp_path),
        "--json",
        str(tmp_path / "s.json"),
    ]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "run 40 s per point" in out and "tolerance" in out
    assert (tmp_path / "online_slo_attainment_qwen32b_1p1d.png").is_file() and (tmp_path / "s.json").is_file()
    assert main(["simulate", "--steady-state"]) == 2  # needs --online
