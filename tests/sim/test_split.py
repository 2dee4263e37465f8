"""Request splitting in the simulator (``Mode.SPLIT``): a request's hit blocks divided between its PE's and its
DE's storage NIC as ``split_hit_blocks`` says, ready only when both halves have landed, every hit byte read
exactly once, never slower than the paper's per-request choice where one side is idle and the other
backlogged, and selectable on the command line next to the per-request choice."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ascend_dualpath.cli import main
from ascend_dualpath.dualpath.scheduler import split_hit_blocks
from ascend_dualpath.errors import ConfigError
from ascend_dualpath.sim.cluster import ClusterConfig, ClusterSim, Mode
from ascend_dualpath.sim.cluster_file import load_cluster
from ascend_dualpath.sim.experiments import agentic_agents
from ascend_dualpath.sim.trace_file import table2_trace, write_agent_trace
from ascend_dualpath.sim.traces import Round

BASE = load_cluster("ds27b_1p1d").config  # node 0 is the PE node, node 1 the DE node
KV = BASE.model.kv_bytes_per_token
BLOCK = BASE.block_tokens
SNIC = BASE.hardware.snic_bytes_per_s


def _capped(pe_bytes_per_s: float, de_bytes_per_s: float) -> ClusterConfig:
    return replace(BASE, snic_bytes_per_s_by_node=(pe_bytes_per_s, de_bytes_per_s))


def _node_bytes(result) -> tuple[float, float]:
    return tuple(sum(nbytes for _, _, nbytes in result.snic_reads[node]) for node in (0, 1))


@pytest.mark.parametrize(("pe_rate", "de_rate"), [(SNIC, SNIC / 4), (SNIC / 4, SNIC)])
def test_a_four_times_slower_storage_nic_gets_four_times_fewer_blocks(pe_rate, de_rate):
    blocks = 400
    request = Round(prompt_tokens=blocks * BLOCK + 64, cached_tokens=blocks * BLOCK, gen_tokens=2)
    result = ClusterSim(_capped(pe_rate, de_rate), Mode.SPLIT, [[request]]).run()
    pe_bytes, de_bytes = _node_bytes(result)
    pe_blocks = split_hit_blocks(blocks, BLOCK * KV, 0.0, pe_rate, 0.0, de_rate)
    assert pe_bytes == pe_blocks * BLOCK * KV
    assert de_bytes == (blocks - pe_blocks) * BLOCK * KV
    fast, slow = (pe_bytes, de_bytes) if pe_rate > de_rate else (de_bytes, pe_bytes)
    assert fast / slow == pytest.approx(4.0, rel=0.02)
    # each half is charged as its path is: the PE's over PCIe and on to the DE with the miss KV, the DE's over
    # the PE's compute NIC (ds27b's all-to-all stays inside a node, so the CNICs carry only KV)
    hw = BASE.engine_hardware
    assert result.busy_s["pe_cnic_in"] == pytest.approx(pe_bytes / hw.pcie_bytes_per_s + de_bytes / hw.cnic_bytes_per_s)
    assert result.busy_s["pe_cnic_out"] == pytest.approx((64 * KV + pe_bytes) / hw.cnic_bytes_per_s)
    # the per-request choice reads the whole hit on one side
    assert 0 in _node_bytes(ClusterSim(_capped(pe_rate, de_rate), Mode.SCHEDULER, [[request]]).run())


def test_a_request_is_ready_only_when_both_halves_are_read():
    """Three blocks at equal caps: the PE reads two (1.5 rounds to 2), the DE one, so the halves land at
    different times; prefill may start only at the later."""
    request = Round(prompt_tokens=3 * BLOCK + 64, cached_tokens=3 * BLOCK, gen_tokens=2)
    sim = ClusterSim(BASE, Mode.SPLIT, [[request]])
    ready_at = []
    original = sim._ready
    sim._ready = lambda req: (ready_at.append(sim.now), original(req))
    result = sim.run()
    ends = [end for node in (0, 1) for _, end, _ in result.snic_reads[node]]
    assert len(ends) == 2 and ends[0] > ends[1]  # the PE's two blocks land after the DE's one
    assert ready_at == [max(ends)]


@pytest.mark.parametrize("de_rate", [SNIC, SNIC / 1000])
def test_every_hit_byte_is_read_exactly_once(de_rate):
    # a hit that ends in a partial block (a trace's ``cached`` may), split evenly or all to the PE
    odd = Round(prompt_tokens=5 * BLOCK + 100, cached_tokens=5 * BLOCK - 10, gen_tokens=2)
    pe_bytes, de_bytes = _node_bytes(ClusterSim(_capped(SNIC, de_rate), Mode.SPLIT, [[odd]]).run())
    assert pe_bytes + de_bytes == odd.cached_tokens * KV
    assert de_bytes > 0 if de_rate == SNIC else de_bytes == 0
    agents = agentic_agents(32, rounds_per_agent=4, seed=1)
    result = ClusterSim(_capped(SNIC, de_rate), Mode.SPLIT, agents).run()
    hit_bytes = sum(r.cached_tokens for rounds in agents for r in rounds) * KV
    assert sum(_node_bytes(result)) == hit_bytes
    assert sum(result.read_bytes_by_path.values()) == hit_bytes
    assert min(result.read_bytes_by_path.values()) > 0


@pytest.mark.parametrize("second_arrival_s", [0.0, 0.02, 0.05, 0.12])
def test_splitting_is_never_slower_with_one_side_idle_and_the_other_backlogged(second_arrival_s):
    """1P2D, storage NICs at 5 GB/s, two requests with 32K-token hits (126 ms of one NIC each): A goes to DE
    node 1, B to DE node 2, both to the one PE node. When B is placed, its PE node still reads A (all of it
    under the per-request choice, half when split) and its DE node is idle (until B arrives after A is read).
    The per-request choice reads B on the idle side; splitting gives the busy side only what it can read by
    the time the idle one is done, so both of B's halves land together and no request is ready later."""
    config = replace(BASE, decode_nodes=2, snic_bytes_per_s_by_node=(5e9,) * 3)
    hit = 512 * BLOCK
    agents = [[Round(prompt_tokens=hit + 256, cached_tokens=hit, gen_tokens=4)]] * 2
    starts = [0.0, second_arrival_s]
    runs = {mode: ClusterSim(config, mode, agents, agent_start_s=starts).run() for mode in (Mode.SCHEDULER, Mode.SPLIT)}
    per_request, split = runs[Mode.SCHEDULER], runs[Mode.SPLIT]
    assert [len(per_request.snic_reads[node]) for node in (0, 1, 2)] == [1, 0, 1]  # A on the PE, B on its DE
    assert [len(split.snic_reads[node]) for node in (0, 1, 2)] == [2, 1, 1]
    block_s = BLOCK * KV / 5e9
    (_, a_pe, _), (_, b_pe, _) = split.snic_reads[0]
    assert abs(a_pe - split.snic_reads[1][0][1]) <= block_s
    assert abs(b_pe - split.snic_reads[2][0][1]) <= block_s
    assert split.jct_s <= per_request.jct_s
    ttft = {mode: sorted((r.arrival_s, r.ttft_s) for r in run.requests) for mode, run in runs.items()}
    for (_, split_ttft), (_, choice_ttft) in zip(ttft[Mode.SPLIT], ttft[Mode.SCHEDULER], strict=True):
        assert split_ttft <= choice_ttft + 1e-9


def test_per_node_storage_nic_caps_are_validated():
    with pytest.raises(ConfigError, match="snic_bytes_per_s_by_node needs 2 caps > 0"):
        replace(BASE, snic_bytes_per_s_by_node=(SNIC,))
    with pytest.raises(ConfigError, match="got \\(50000000000.0, 0.0\\)"):
        replace(BASE, snic_bytes_per_s_by_node=(50e9, 0.0))


def test_cli_prints_splitting_beside_the_per_request_choice(tmp_path, capsys):
    trace = write_agent_trace(tmp_path / "t.jsonl", table2_trace(16, 65536, seed=0))
    out = tmp_path / "o.json"
    argv = ["simulate", "--cluster", "ds27b_1p1d", "--trace", str(trace), "--modes", "scheduler,split"]
    assert main([*argv, "--json", str(out)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows[-2:]] == ["scheduler", "split"]
    modes = json.loads(out.read_text())["modes"]
    assert set(modes) == {"scheduler", "split"}
    assert modes["split"]["read_bytes_by_path"]["pe"] > modes["scheduler"]["read_bytes_by_path"]["pe"]
    assert all(0 < share <= 1 for share in modes["split"]["snic_utilisation_by_node"].values())
    assert main([*argv[:-1], "scheduler,spilt"]) == 2
    assert "unknown mode 'spilt'" in capsys.readouterr().err
