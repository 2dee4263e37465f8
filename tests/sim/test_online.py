"""Online capacity search (Poisson agent arrivals, TTFT <= 4 s and TPOT <= 50 ms) on the paper's
DS-660B 2P4D cluster, scaled in time: 120 s of arrivals instead of the paper's steady state, so the
capacities are those of a short burst (docs/simulator.md reports a longer run)."""

from __future__ import annotations

import pytest

from ascend_dualpath.errors import ConfigError
from ascend_dualpath.sim.cluster import ClusterConfig, Mode
from ascend_dualpath.sim.experiments import TPOT_SLO_S, TTFT_SLO_S, online_capacity, run_online
from ascend_dualpath.sim.models import DS_660B

DURATION_S, LOW, HIGH, ITERATIONS = 120.0, 0.5, 12.5, 4
RESOLUTION = (HIGH - LOW) / 2**ITERATIONS


@pytest.fixture(scope="module")
def capacities():
    config = ClusterConfig(DS_660B)
    return {
        mode: online_capacity(config, mode, DURATION_S, LOW, HIGH, ITERATIONS) for mode in (Mode.BASIC, Mode.SCHEDULER)
    }


def test_basic_capacity_brackets_the_slo_boundary(capacities):
    aps = capacities[Mode.BASIC]
    assert LOW <= aps < HIGH - RESOLUTION  # found inside the search interval, not at its ends
    config = ClusterConfig(DS_660B)
    meets = run_online(config, Mode.BASIC, aps, DURATION_S)
    assert meets.meets_slo and meets.mean_ttft_s <= TTFT_SLO_S and meets.mean_tpot_s <= TPOT_SLO_S
    assert not run_online(config, Mode.BASIC, aps + RESOLUTION, DURATION_S).meets_slo


def test_scheduler_serves_more_agents_per_second_than_basic(capacities):
    assert capacities[Mode.SCHEDULER] < HIGH - RESOLUTION
    assert capacities[Mode.SCHEDULER] >= 1.5 * capacities[Mode.BASIC]


def test_capacity_search_rejects_a_bad_interval():
    with pytest.raises(ConfigError, match="low=2"):
        online_capacity(ClusterConfig(DS_660B), Mode.BASIC, DURATION_S, low=2.0, high=1.0)
