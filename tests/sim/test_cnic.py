"""Compute-NIC sharing between KV traffic and the EP all-to-all under the traffic-class weights.

A rank's CNIC carries its layer blocks (KV class) and, when its EP instance spans nodes, its share of the
all-to-all (model class); both must pass within the pass, and the KV holds the all-to-all up by
``min(model_s * w_kv / w_model, kv_s)``, which the expert GEMMs wait for (docs/simulator.md §2).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from ascend_dualpath.dualpath.traffic import QosPolicy
from ascend_dualpath.errors import ConfigError
from ascend_dualpath.sim.cluster import ClusterConfig, ClusterSim, Mode
from ascend_dualpath.sim.cluster_file import parse_cluster
from ascend_dualpath.sim.experiments import agentic_agents, summarise
from ascend_dualpath.sim.models import DS_27B, DS_660B, HardwareConfig
from ascend_dualpath.sim.traces import Round

FAST = HardwareConfig(peak_flops=8 * 989e12)  # compute 8x faster: KV and model traffic matter more


def _qos(model_weight: int, kv_weight: int) -> QosPolicy:
    policy = QosPolicy()
    return QosPolicy(model=replace(policy.model, weight=model_weight), kv=replace(policy.kv, weight=kv_weight))


@pytest.mark.parametrize("weights", [(99, 1), (1, 1), (1, 99)])
def test_one_pass_matches_the_hand_computation(weights):
    """One uncached 4000-token request on an EP16 instance over 2 nodes (layerwise, round robin: its pass
    starts at t=0): the pass lasts max(compute + all-to-all delay, KV out + model traffic)."""
    model = replace(DS_27B, ep_cnic_bytes_per_token=2e6)
    config = ClusterConfig(model, prefill_nodes=2, decode_nodes=1, prefill_ep=16, decode_ep=1, qos=_qos(*weights))
    result = ClusterSim(config, Mode.LAYERWISE, [[Round(prompt_tokens=4000, cached_tokens=0, gen_tokens=1)]]).run()
    hw, tokens = config.hardware, 4000
    compute = (
        model.attention_flops(0, tokens) + model.dense_gemm_flops(tokens) + model.routed_gemm_flops(tokens) / 16
    ) / hw.prefill_flops_per_s
    model_s = 2e6 / 2 * (tokens + tokens / 16) / hw.cnic_bytes_per_s
    kv_out = tokens * model.kv_bytes_per_token / hw.cnic_bytes_per_s
    delay = min(model_s * weights[1] / weights[0], kv_out)
    assert result.ttft_s[0] == pytest.approx(max(compute + delay, kv_out + model_s), rel=1e-12)


def _jct(config: ClusterConfig, mode: Mode, agents) -> float:
    return ClusterSim(config, mode, agents).run().jct_s


@pytest.fixture(scope="module")
def fast_runs():
    """Scheduler runs of DS-660B on 8x faster compute at 2P4D (inside [1/7, 7/2]) and 2P16D (outside: PE CNIC
    write), with and without the all-to-all on the CNICs (1,024 agents x 6 rounds)."""
    agents = agentic_agents(1024, rounds_per_agent=6, seed=0)
    without = replace(DS_660B, ep_cnic_bytes_per_token=0.0)
    runs = {}
    for decode_nodes in (4, 16):
        for name, model in (("charged", DS_660B), ("without", without)):
            config = ClusterConfig(model, FAST, prefill_nodes=2, decode_nodes=decode_nodes)
            runs[decode_nodes, name] = summarise(ClusterSim(config, Mode.SCHEDULER, agents).run())
    return agents, runs


def test_out_of_interval_cluster_pays_more_for_the_shared_cnic(fast_runs):
    """2P16D sends most reads over the DE path into the two PE nodes' CNICs, where they meet the all-to-all:
    it slows by >= 1% (89.98 -> 91.55 s), the in-interval 2P4D by under 0.5% (93.23 -> 93.36 s)."""
    _, runs = fast_runs
    slowdown = {d: runs[d, "charged"]["jct_s"] / runs[d, "without"]["jct_s"] - 1 for d in (4, 16)}
    assert slowdown[16] >= 0.01 and slowdown[16] > slowdown[4]
    assert abs(slowdown[4]) < 0.005
    charged, without = runs[16, "charged"]["utilisation"], runs[16, "without"]["utilisation"]
    assert charged["pe_cnic_in"] >= without["pe_cnic_in"] + 0.04
    assert charged["pe_cnic_out"] >= without["pe_cnic_out"] + 0.04


def test_a_heavier_kv_weight_slows_the_passes(fast_runs):
    """Giving KV more of the NIC delays the all-to-all the expert GEMMs wait for: JCT grows with w_kv / w_model
    (2P16D: 91.55, 91.69, 92.43 s at 99:1, 1:1, 1:99)."""
    agents, runs = fast_runs
    jct = {
        weights: _jct(ClusterConfig(DS_660B, FAST, 2, 16, qos=_qos(*weights)), Mode.SCHEDULER, agents)
        for weights in ((1, 1), (1, 99))
    }
    assert runs[16, "charged"]["jct_s"] <= jct[(1, 1)] < jct[(1, 99)]
    assert jct[(1, 99)] >= 1.005 * runs[16, "charged"]["jct_s"]


def test_cluster_file_sets_the_weights():
    data = {"nodes": {"prefill": 2, "decode": 4}, "model": {"name": "ds660b"}, "qos": {"kv_weight": 3}}
    qos = parse_cluster(data, "c.toml").config.qos
    assert (qos.model.weight, qos.kv.weight) == (99, 3)
    with pytest.raises(ConfigError, match=r"\[qos\].model_weight must be an integer >= 1, got 0"):
        parse_cluster({**data, "qos": {"model_weight": 0}}, "c.toml")
