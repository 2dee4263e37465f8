"""The planner: ``simulate --cluster --trace`` end to end, its JSON figures, the one-line errors, and the
transfer-kind submission costs (zero cost equals the wire-only transfer; the verdict flips at 5 %)."""

from __future__ import annotations

import json

import pytest

from ascend_dualpath.cli import main
from ascend_dualpath.sim.cluster import ClusterSim, Mode
from ascend_dualpath.sim.cluster_file import load_cluster
from ascend_dualpath.sim.experiments import SUBMIT_SHARE_LIMIT, agentic_agents, host_path_verdict, summarise
from ascend_dualpath.sim.plan import run_transfer_kinds
from ascend_dualpath.sim.trace_file import AgentTrace, Turn, table2_trace, write_agent_trace
from ascend_dualpath.sim.transfer import SubmissionCosts, TransferKind

SUMMARY_KEYS = {
    "jct_s",
    "agent_finish_s",
    "ttft_s",
    "tpot_s",
    "throughput",
    "slo",
    "snic_max_over_avg",
    "utilisation",
    "binding_resource",
    "completed_requests",
}


def test_paper_setting_from_the_example_file_gives_the_built_in_figures(tmp_path):
    """The shipped DS-660B 2P4D file and a Table-2 trace file reproduce the built-in path exactly (16 agents
    here for speed; docs/simulator.md has the 2,048-agent run)."""
    trace = write_agent_trace(tmp_path / "t.jsonl", table2_trace(16, 65536, seed=0))
    out = tmp_path / "o.json"
    argv = [
        "simulate",
        "--cluster",
        "ds660b_2p4d",
        "--trace",
        str(trace),
        "--modes",
        "basic,scheduler",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    results = json.loads(out.read_text())
    assert set(results["modes"]) == {"basic", "scheduler"}
    assert all(SUMMARY_KEYS <= set(summary) for summary in results["modes"].values())
    config = load_cluster("ds660b_2p4d").config
    for mode in (Mode.BASIC, Mode.SCHEDULER):
        built_in = ClusterSim(config, mode, agentic_agents(16, seed=0)).run()
        assert results["modes"][mode.value]["jct_s"] == built_in.jct_s
    assert results["modes"]["scheduler"]["jct_s"] < results["modes"]["basic"]["jct_s"]
    assert results["warnings"] == []


def test_summary_figures_are_consistent():
    spec = load_cluster("ds660b_2p4d")
    result = ClusterSim(spec.config, Mode.SCHEDULER, agentic_agents(64, rounds_per_agent=4, seed=2)).run()
    summary = summarise(result, spec.slo.ttft_s, spec.slo.tpot_s)
    assert summary["completed_requests"] == len(result.requests) == 256
    assert summary["ttft_s"]["p50"] <= summary["ttft_s"]["p99"]
    assert summary["agent_finish_s"]["p99"] <= summary["jct_s"]
    assert summary["throughput"]["rounds_per_s"] == pytest.approx(256 / result.jct_s)
    assert all(0 <= value <= 1 + 1e-9 for value in summary["utilisation"].values())
    assert summary["utilisation"]["prefill_compute"] <= summary["utilisation"]["prefill_pass"] + 1e-12
    assert summary["binding_resource"] == max(
        ("storage_nic", "prefill_pass", "decode_hbm", "pe_cnic_in", "pe_cnic_out", "de_cnic_in"),
        key=summary["utilisation"].get,
    )
    loose = summarise(result, ttft_slo_s=1e9, tpot_slo_s=1e9)["slo"]["attainment"]
    strict = summarise(result, ttft_slo_s=1e-9, tpot_slo_s=1e-9)["slo"]["attainment"]
    assert (loose, strict) == (1.0, 0.0)


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_bad_files_end_with_one_line_and_status_2(tmp_path, capsys):
    good = _write(tmp_path, "t.jsonl", json.dumps({"agent": "a", "turns": [{"input": 10, "output": 2}]}) + "\n")
    bad_trace = _write(tmp_path, "b.jsonl", json.dumps({"agent": "a", "turns": [{"input": 10, "output": 0}]}) + "\n")
    bad_cluster = _write(tmp_path, "c.toml", "[nodes]\nprefill = 2\ndecode = 4\n[hardware]\nhbm_gb = -1\n")
    for argv, message in (
        (["--trace", bad_trace], "turns[0].output must be an integer >= 1, got 0"),
        (["--cluster", bad_cluster, "--trace", good], "[hardware].hbm_gb must be a number > 0, got -1"),
        (["--trace", good, "--modes", "fast"], "unknown mode 'fast'"),
        (["--trace", good, "--transfer-kinds", "rdma"], "unknown transfer kind 'rdma'"),
    ):
        assert main(["simulate", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err


def test_a_request_that_never_fits_is_reported_as_such(tmp_path, capsys):
    trace = write_agent_trace(tmp_path / "t.jsonl", [AgentTrace("long", (Turn(60_000, 100),))])
    cluster = _write(tmp_path, "q.toml", '[nodes]\nprefill = 1\ndecode = 1\n[model]\nname = "qwen32b"\n')
    assert main(["simulate", "--cluster", cluster, "--trace", str(trace), "--modes", "scheduler"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("simulate: agent 'long' turn 0: 60000+100 tokens need") and "a larger tp" in err


def test_pd_outside_the_interval_warns_in_the_output(tmp_path, capsys):
    trace = write_agent_trace(tmp_path / "t.jsonl", [AgentTrace("a", (Turn(500, 3),))])
    cluster = _write(tmp_path, "c.toml", '[nodes]\nprefill = 2\ndecode = 16\n[model]\nname = "ds660b"\n')
    assert main(["simulate", "--cluster", cluster, "--trace", str(trace), "--modes", "oracle"]) == 0
    assert "outside the bottleneck-free" in capsys.readouterr().out.replace("\n", " ")


# 25 turns of 4 agents: contexts up to ~15K tokens, enough layer blocks for the host path to show
AGENTS = [AgentTrace(agent.agent, agent.turns[:25]) for agent in table2_trace(4, 65536, seed=3)]


def _kinds(costs: SubmissionCosts, kinds=(TransferKind.HOST,)):
    spec = load_cluster("ds660b_2p4d")
    spec = type(spec)(spec.config, spec.slo, costs, spec.source)
    return run_transfer_kinds(spec, AGENTS, kinds)


def test_each_kind_at_zero_cost_equals_free_and_free_equals_no_kind():
    costs = SubmissionCosts(
        aiv_submit_s=0, aicpu_issue_s=0, aicpu_wqe_s=0, host_submit_s=0, staging_copy_bytes_per_s=1e300
    )
    kinds = (TransferKind.AIV, TransferKind.AICPU, TransferKind.HOST, TransferKind.HOST_BATCHED, TransferKind.STAGING)
    report = _kinds(costs, kinds)
    free = report["kinds"]["free"]
    spec = load_cluster("ds660b_2p4d")
    plain = ClusterSim(spec.config, Mode.SCHEDULER, [agent.rounds() for agent in AGENTS]).run()
    assert free["jct_s"] == plain.jct_s
    for kind in kinds:
        assert report["kinds"][kind.value]["jct_s"] == free["jct_s"]
        assert report["kinds"][kind.value]["submit_share"]["share"] == 0.0


def test_verdict_flips_where_the_host_share_crosses_five_percent():
    assert host_path_verdict(SUBMIT_SHARE_LIMIT - 1e-6).startswith("keep the host path")
    assert host_path_verdict(SUBMIT_SHARE_LIMIT).startswith("device-side submission pays")
    cheap = _kinds(SubmissionCosts(host_submit_s=0.9e-6))  # ~1% (just above the 0.84 us wire time per segment)
    costly = _kinds(SubmissionCosts())
    cheap_share = cheap["kinds"]["host"]["submit_share"]["share"]
    costly_share = costly["kinds"]["host"]["submit_share"]["share"]
    assert 0 < cheap_share < SUBMIT_SHARE_LIMIT < costly_share
    assert cheap["verdict"]["host"].startswith("keep the host path")
    assert costly["verdict"]["host"].startswith("device-side submission pays")
    assert costly["kinds"]["host"]["jct_s"] > costly["kinds"]["free"]["jct_s"]
    assert costly["kinds"]["host"]["submit_share"]["amdahl_bound"] == pytest.approx(1 / (1 - costly_share))


def test_online_replays_start_times_and_offline_starts_every_agent_at_zero():
    from ascend_dualpath.sim.plan import simulate_trace

    spec = load_cluster("qwen32b_1p1d")
    agents = [AgentTrace("a", (Turn(500, 3),), start_s=0.0), AgentTrace("b", (Turn(500, 3),), start_s=100.0)]
    online = simulate_trace(spec, agents, Mode.ORACLE, online=True)
    offline = simulate_trace(spec, agents, Mode.ORACLE)
    assert online.agent_finish_s[1] > 100.0 > offline.agent_finish_s[1]
    assert [r.arrival_s for r in online.requests] == [0.0, 100.0]
