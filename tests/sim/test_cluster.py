"""Shape claims of the paper on a scaled-down but faithful DS-660B 2P4D 64K offline run.

Faithful: the paper's cluster (2 prefill + 4 decode nodes of 8 GPUs, one 400 Gbps SNIC per node), model,
2048 agents and the Table-2 64K workload; scaled: each agent replays a random window of 24 consecutive
rounds of its trajectory instead of all ~100, so contexts and hit rates are those of the full run
(docs/simulator.md compares the two).
These are properties of the model (orderings, ratios), not timings.
"""

from __future__ import annotations

import pytest

from ascend_dualpath.errors import CapacityError, ConfigError
from ascend_dualpath.sim.cluster import ClusterConfig, ClusterSim, Mode
from ascend_dualpath.sim.experiments import agentic_agents, reductions_vs_basic, run_ablation, snic_max_over_avg
from ascend_dualpath.sim.models import DS_27B, DS_660B, QWEN_32B
from ascend_dualpath.sim.traces import Round

AGENTS, ROUNDS = 2048, 24


@pytest.fixture(scope="module")
def ablation():
    agents = agentic_agents(AGENTS, rounds_per_agent=ROUNDS, seed=0)
    return run_ablation(ClusterConfig(DS_660B), agents)


def test_every_mode_completes_every_request(ablation):
    counts = {result.completed_requests for result in ablation.values()}
    assert counts == {AGENTS * ROUNDS}


def test_cumulative_reductions_are_ordered(ablation):
    reductions = reductions_vs_basic(ablation)
    assert 0 < reductions[Mode.LAYERWISE] < reductions[Mode.DUALPATH] < reductions[Mode.SCHEDULER]


def test_scheduler_within_ten_percent_of_oracle(ablation):
    assert ablation[Mode.SCHEDULER].jct_s <= 1.10 * ablation[Mode.ORACLE].jct_s


def test_round_robin_unbalances_storage_nics_and_the_scheduler_much_less(ablation):
    round_robin = snic_max_over_avg(ablation[Mode.DUALPATH])
    assert round_robin >= 1.4
    assert snic_max_over_avg(ablation[Mode.SCHEDULER]) <= round_robin - 0.20


@pytest.mark.xfail(
    strict=True,
    reason="1.18 on the full 2048-agent run, 1.278 on this window, which runs at "
    "50-60% SNIC load where 'shorter queue' still favours the 2 PE nodes (see docs/simulator.md)",
)
def test_scheduler_storage_nic_balance_reaches_the_papers_1_25(ablation):
    assert snic_max_over_avg(ablation[Mode.SCHEDULER]) <= 1.25


# this window's JCTs before the EP all-to-all was charged on the compute NICs (docs/simulator.md §3)
BEFORE_MODEL_TRAFFIC_S = {
    Mode.BASIC: 773.9,
    Mode.LAYERWISE: 689.2,
    Mode.DUALPATH: 535.8,
    Mode.SCHEDULER: 433.0,
    Mode.ORACLE: 433.2,
}


def test_model_traffic_on_the_cnics_moves_the_paper_cluster_under_one_percent(ablation):
    """2P4D is inside the bandwidth model's interval: the all-to-all hides behind compute (now 773.9, 687.4,
    540.4, 433.1, 433.2 s; the order of passes shifts a little)."""
    for mode, before in BEFORE_MODEL_TRAFFIC_S.items():
        assert ablation[mode].jct_s == pytest.approx(before, rel=0.01)


def test_dual_path_uses_both_sides_and_basic_only_the_prefill_side(ablation):
    assert ablation[Mode.BASIC].read_bytes_by_path["de"] == 0
    scheduled = ablation[Mode.SCHEDULER].read_bytes_by_path
    assert scheduled["de"] > 0 and scheduled["pe"] > 0
    assert sum(ablation[Mode.ORACLE].read_bytes_by_path.values()) == 0


def test_speedup_over_basic_near_the_papers_1_8x(ablation):
    """1.79x on this window, 1.82x on the full 2,048-agent run (docs/simulator.md); before expert GEMMs were
    spread over the EP ranks, 1.89x and 1.86x: each lock-step pass was charged its slowest rank's whole MoE,
    which cost Basic more than the scheduler (spreading them: Basic -10%, scheduler -5% on this window)."""
    assert ablation[Mode.BASIC].jct_s / ablation[Mode.SCHEDULER].jct_s >= 1.75


@pytest.mark.xfail(strict=True, reason="1.79x on this 24-round window; the full run reaches 1.82x (docs/simulator.md)")
def test_speedup_over_basic_reaches_the_papers_1_8x_on_the_window(ablation):
    assert ablation[Mode.BASIC].jct_s / ablation[Mode.SCHEDULER].jct_s >= 1.8


def test_layerwise_gain_comes_from_basics_hbm_and_h2d_costs(ablation):
    """Same PE-only read path and round robin: what layerwise removes is basic's whole-KV HBM residency
    and its H2D before the pass, worth >10% here (paper: 17.2%)."""
    assert reductions_vs_basic(ablation)[Mode.LAYERWISE] >= 0.10


def test_scheduler_is_no_slower_than_basic_at_low_load():
    """256 agents: the I/O is no bottleneck, so the adaptive placement must cost nothing (it once did:
    every request went to the PE group that pulled first)."""
    agents = agentic_agents(256, rounds_per_agent=ROUNDS, seed=0)
    basic = ClusterSim(ClusterConfig(DS_660B), Mode.BASIC, agents).run()
    scheduled = ClusterSim(ClusterConfig(DS_660B), Mode.SCHEDULER, agents).run()
    assert scheduled.jct_s <= basic.jct_s
    assert scheduled.mean_ttft_s <= basic.mean_ttft_s


def test_simulation_is_deterministic():
    agents = agentic_agents(64, rounds_per_agent=3, seed=5)
    first = ClusterSim(ClusterConfig(DS_660B), Mode.SCHEDULER, agents).run()
    second = ClusterSim(ClusterConfig(DS_660B), Mode.SCHEDULER, agents).run()
    assert first.jct_s == second.jct_s and first.ttft_s == second.ttft_s


def test_single_request_timeline_matches_hand_computation():
    """One uncached request in oracle mode: TTFT = placement + one prefill pass, then gen-1 decode steps."""
    config = ClusterConfig(QWEN_32B, prefill_nodes=1, decode_nodes=1)
    sim = ClusterSim(config, Mode.ORACLE, [[Round(prompt_tokens=1000, cached_tokens=0, gen_tokens=3)]])
    result = sim.run()
    flops = QWEN_32B.gemm_flops(1000) + QWEN_32B.attention_flops(0, 1000)
    prefill = flops / config.hardware.prefill_flops_per_s
    pe_pull = config.tick_s / 2  # groups pull staggered: the DE group at t=0, the PE group half a tick later
    assert result.ttft_s[0] == pytest.approx(pe_pull + prefill, rel=1e-12)
    per_token_s = QWEN_32B.decode_read_bytes_per_attended / config.hardware.hbm_bytes_per_s
    step = QWEN_32B.decode_step_fixed_s + 1001 * per_token_s  # context 1000 prompt + 1 first token
    step2 = QWEN_32B.decode_step_fixed_s + 1002 * per_token_s
    assert result.jct_s == pytest.approx(pe_pull + prefill + step + step2, rel=1e-9)
    assert result.tpot_s == [pytest.approx((step + step2) / 2, rel=1e-9)]


def test_oversized_request_is_rejected_with_the_limits():
    huge = [[Round(prompt_tokens=10**7, cached_tokens=0, gen_tokens=1)]]
    with pytest.raises(CapacityError, match="decode HBM"):
        ClusterSim(ClusterConfig(DS_660B), Mode.SCHEDULER, huge).run()


def test_bad_configs():
    with pytest.raises(ConfigError, match="0P4D"):
        ClusterConfig(DS_660B, prefill_nodes=0)
    with pytest.raises(ConfigError, match="no agents"):
        ClusterSim(ClusterConfig(DS_660B), Mode.BASIC, [])


@pytest.mark.parametrize("ep", [1, 8])
def test_ep_prefill_spreads_expert_gemms_over_the_ranks(ep):
    """One uncached request on an EP instance of ``ep`` ranks: its rank pays its attention and non-expert
    GEMMs, and the routed-expert GEMMs are shared by all ``ep`` ranks (the pass waits for that rank)."""
    config = ClusterConfig(DS_27B, prefill_nodes=1, decode_nodes=1, prefill_ep=ep, decode_ep=1)
    result = ClusterSim(config, Mode.ORACLE, [[Round(prompt_tokens=4000, cached_tokens=0, gen_tokens=1)]]).run()
    flops = DS_27B.attention_flops(0, 4000) + DS_27B.dense_gemm_flops(4000) + DS_27B.routed_gemm_flops(4000) / ep
    assert result.ttft_s[0] == pytest.approx(config.tick_s / 2 + flops / config.hardware.prefill_flops_per_s, rel=1e-12)
    assert DS_27B.dense_gemm_flops(4000) + DS_27B.routed_gemm_flops(4000) == pytest.approx(DS_27B.gemm_flops(4000))
