"""The cluster file: the shipped examples, one error per bad field, custom models, TP for Qwen2.5-32B, the P/D
warning and a request that can never fit."""

from __future__ import annotations

import pytest

from ascend_dualpath.errors import CapacityError, ConfigError
from ascend_dualpath.sim.cluster import ClusterConfig, ClusterSim, Mode, pd_ratio_warning
from ascend_dualpath.sim.cluster_file import example_names, load_cluster, parse_cluster
from ascend_dualpath.sim.experiments import agentic_agents
from ascend_dualpath.sim.models import DS_27B, DS_660B, QWEN_32B
from ascend_dualpath.sim.traces import Round


def test_examples_ship_and_the_paper_file_is_the_built_in_setting():
    assert example_names() == ["ds27b_1p1d", "ds660b_2p4d", "ds660b_2p8d", "qwen32b_1p1d"]
    spec = load_cluster("ds660b_2p4d")
    assert spec.config == ClusterConfig(DS_660B, prefill_ep=16, decode_ep=32)
    assert (spec.slo.ttft_s, spec.slo.tpot_s) == (4.0, 0.050)
    agents = agentic_agents(32, rounds_per_agent=3, seed=1)
    from_file = ClusterSim(spec.config, Mode.SCHEDULER, agents).run()
    built_in = ClusterSim(ClusterConfig(DS_660B), Mode.SCHEDULER, agents).run()
    assert from_file.jct_s == built_in.jct_s and from_file.ttft_s == built_in.ttft_s
    assert load_cluster("ds27b_1p1d").config.model == DS_27B


def test_qwen_needs_tp_to_hold_one_64k_request():
    """A Qwen2.5-32B DE of one accelerator holds 26.7K tokens of KV; tp=2 gives 301K."""
    one = ClusterConfig(QWEN_32B, prefill_nodes=1, decode_nodes=1)
    assert one.kv_hbm_bytes("de") / QWEN_32B.kv_bytes_per_token == pytest.approx(26_703, rel=1e-3)
    request = [[Round(prompt_tokens=60_000, cached_tokens=59_968, gen_tokens=100)]]
    with pytest.raises(CapacityError, match=r"agent 0 turn 0: 60000\+100 tokens need .*at most 26702 tokens"):
        ClusterSim(one, Mode.SCHEDULER, request)
    spec = load_cluster("qwen32b_1p1d")
    assert spec.config.tp == 2 and spec.config.kv_hbm_bytes("de") / QWEN_32B.kv_bytes_per_token > 300_000
    result = ClusterSim(spec.config, Mode.SCHEDULER, request * 4).run()
    assert result.completed_requests == 4


def test_tp_engine_adds_up_its_accelerators():
    config = ClusterConfig(QWEN_32B, tp=4)
    hw = config.engine_hardware
    assert hw.gpus_per_node == 2 and hw.hbm_bytes == 4 * config.hardware.hbm_bytes
    assert (
        hw.peak_flops == 4 * config.hardware.peak_flops and hw.cnic_bytes_per_s == 4 * config.hardware.cnic_bytes_per_s
    )


def test_custom_model_from_parameters():
    spec = parse_cluster(
        {
            "nodes": {"prefill": 1, "decode": 1},
            "model": {
                "name": "mine",
                "layers": 32,
                "active_params_b": 8,
                "weight_gb": 16,
                "kv_bytes_per_token": 131072,
                "heads": 32,
                "head_dim": 128,
            },
        }
    )
    model = spec.config.model
    assert model.name == "mine" and model.active_params == 8e9 and model.weight_bytes == 16e9
    assert model.attn_flops_per_pair == 4 * 32 * 128 * 32
    assert model.decode_read_bytes_per_attended == 131072
    overridden = parse_cluster({"nodes": {"prefill": 2, "decode": 4}, "model": {"name": "ds660b", "layers": 60}})
    assert overridden.config.model.layers == 60 and overridden.config.model.active_params == DS_660B.active_params


NODES = {"prefill": 2, "decode": 4}
DS = {"name": "ds660b"}


@pytest.mark.parametrize(
    "data,message",
    [
        ({"nodes": NODES, "model": DS, "nodez": {}}, r"unknown table \[nodez\]"),
        ({"nodes": {"prefill": 2}}, r"\[nodes\]\.decode is required \(an integer >= 1\)"),
        ({"nodes": {"prefill": 0, "decode": 4}}, r"\[nodes\]\.prefill must be an integer >= 1, got 0"),
        ({"nodes": {"prefill": 2.0, "decode": 4}}, r"\[nodes\]\.prefill must be an integer >= 1, got 2.0"),
        ({"nodes": {**NODES, "gpus": 8}}, r"unknown key \[nodes\]\.gpus"),
        (
            {"nodes": NODES, "model": DS, "hardware": {"hbm_gb": -80}},
            r"\[hardware\]\.hbm_gb must be a number > 0, got -80",
        ),
        (
            {"nodes": NODES, "model": DS, "hardware": {"storage_nic_gbps": "400"}},
            r"\[hardware\]\.storage_nic_gbps must be a number",
        ),
        (
            {"nodes": NODES, "model": DS, "hardware": {"prefill_mfu": 1.5}},
            r"\[hardware\]\.prefill_mfu must be <= 1, got 1.5",
        ),
        ({"nodes": NODES}, r"\[model\]\.name is required"),
        ({"nodes": NODES, "model": {"name": "gpt5"}}, r"\[model\]\.name 'gpt5' is not built in"),
        ({"nodes": NODES, "model": {"name": "x", "layers": 4}}, r"\[model\] x needs weight_gb, kv_bytes_per_token"),
        ({"nodes": NODES, "model": {"name": "ds660b", "experts": 8, "top_k": 9}}, r"top_k=9 exceeds experts=8"),
        ({"nodes": NODES, "model": {"name": "ds660b", "routed_expert_fraction": 1.0}}, r"routed_expert_fraction"),
        ({"nodes": NODES, "model": DS, "parallelism": {"tp": 3}}, r"tp=3 must divide the 8 accelerators per node"),
        ({"nodes": NODES, "model": DS, "parallelism": {"prefill_ep": 5}}, r"pe_ep=5 must divide the role's 16 engines"),
        ({"nodes": NODES, "model": DS, "slo": {"ttft_s": 0}}, r"\[slo\]\.ttft_s must be a number > 0, got 0"),
        (
            {"nodes": NODES, "model": DS, "scheduler": {"block_tokens": 0}},
            r"\[scheduler\]\.block_tokens must be an integer >= 1",
        ),
        (
            {"nodes": NODES, "model": DS, "transfer": {"host_submit_us": -1}},
            r"\[transfer\]\.host_submit_us must be a number >= 0",
        ),
        (
            {"nodes": NODES, "model": DS, "transfer": {"aiv_cores": 0}},
            r"\[transfer\]\.aiv_cores must be an integer >= 1",
        ),
    ],
)
def test_each_bad_field_is_one_error_naming_table_key_and_limit(data, message):
    with pytest.raises(ConfigError, match=message):
        parse_cluster(data, "c.toml")


def test_weights_that_leave_no_hbm_are_a_capacity_error():
    with pytest.raises(CapacityError, match=r"DE: weights of ds660b \(690 GB over ep=8\) leave no HBM"):
        parse_cluster({"nodes": NODES, "model": DS, "parallelism": {"decode_ep": 8}})


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found .*ds660b_2p4d"):
        load_cluster(tmp_path / "nowhere.toml")
    path = tmp_path / "c.toml"
    path.write_text("[nodes\nprefill = 2\n")
    with pytest.raises(ConfigError, match="c.toml: not TOML"):
        load_cluster(path)


def test_pd_ratio_outside_the_bandwidth_interval_warns():
    assert pd_ratio_warning(ClusterConfig(DS_660B)) is None
    assert pd_ratio_warning(ClusterConfig(DS_660B, prefill_nodes=8, decode_nodes=2)) is not None
    warning = pd_ratio_warning(ClusterConfig(DS_660B, prefill_nodes=2, decode_nodes=16))
    assert "P/D = 2/16 = 0.125 is outside" in warning and "[0.143, 3.500]" in warning
    assert "pe_cnic_write" in warning
