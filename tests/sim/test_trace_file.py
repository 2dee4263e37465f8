"""The agent-trace file format: round trips from the Table-2 generator and the Mooncake loader, tool latency and
resets in the simulator, and one error per bad field."""

from __future__ import annotations

import gzip
import json

import pytest

from ascend_dualpath.errors import ConfigError
from ascend_dualpath.sim.cluster import ClusterConfig, ClusterSim, Mode
from ascend_dualpath.sim.models import QWEN_32B
from ascend_dualpath.sim.trace_file import (
    AgentTrace,
    Turn,
    agents_rounds,
    mooncake_trace,
    read_agent_trace,
    table2_trace,
    write_agent_trace,
)
from ascend_dualpath.sim.traces import Round, generate_trajectories, load_mooncake, replay


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_table2_trace_round_trips_and_replays_as_the_generator(tmp_path, name):
    agents = table2_trace(20, 65536, seed=4)
    path = write_agent_trace(tmp_path / name, agents)
    assert read_agent_trace(path) == agents
    expected = [replay(trajectory) for trajectory in generate_trajectories(65536, 20, seed=4)]
    assert agents_rounds(read_agent_trace(path)) == expected


def test_every_optional_field_round_trips(tmp_path):
    agents = [
        AgentTrace("a", (Turn(100, 5, tool_s=1.5), Turn(20, 3, reset=True), Turn(700, 2, cached=64)), 3.0, 4096),
        AgentTrace("b", (Turn(1, 1),)),
    ]
    assert read_agent_trace(write_agent_trace(tmp_path / "t.jsonl", agents)) == agents


def test_mooncake_trace_round_trips_with_its_hits_and_arrivals(tmp_path):
    source = tmp_path / "m.jsonl.gz"
    with gzip.open(source, "wt") as handle:
        for record in (
            {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
            {"timestamp": 1500, "input_length": 1600, "output_length": 7, "hash_ids": [1, 2, 4, 9]},
        ):
            handle.write(json.dumps(record) + "\n")
    agents = read_agent_trace(write_agent_trace(tmp_path / "t.jsonl", mooncake_trace(source)))
    rounds = [agent.rounds()[0] for agent in agents]
    loaded = load_mooncake(source)
    assert [(r.prompt_tokens, r.cached_tokens, r.gen_tokens) for r in rounds] == [
        (r.prompt_tokens, r.cached_tokens, r.gen_tokens) for r in loaded
    ]
    assert [agent.start_s for agent in agents] == [r.arrival_s for r in loaded]


def test_reset_drops_the_history_and_its_hit():
    agent = AgentTrace("a", (Turn(1000, 24), Turn(100, 10), Turn(50, 5, reset=True), Turn(30, 2)))
    assert agent.rounds(64) == [Round(1000, 0, 24), Round(1124, 1024, 10), Round(50, 0, 5), Round(85, 0, 2)]


def test_tool_latency_delays_the_next_turn_by_exactly_its_length():
    """Oracle, one agent: a 1 s tool gap (a whole number of 20 ms pulls, so the placement phase is the same)
    moves the agent's finish by 1 s."""
    config = ClusterConfig(QWEN_32B, prefill_nodes=1, decode_nodes=1, tp=2)

    def finish(tool_s):
        agent = AgentTrace("a", (Turn(500, 4, tool_s=tool_s), Turn(200, 3)))
        return ClusterSim(config, Mode.ORACLE, agents_rounds([agent])).run().jct_s

    assert finish(1.0) == pytest.approx(finish(0.0) + 1.0, abs=1e-9)


GOOD = {"agent": "a", "turns": [{"input": 10, "output": 2}]}


@pytest.mark.parametrize(
    "record,message",
    [
        ([1, 2], "a line must be a JSON object"),
        ({**GOOD, "agnet": "x"}, "unknown field 'agnet'"),
        ({"turns": GOOD["turns"]}, r"\.agent must be a non-empty string, got None"),
        ({**GOOD, "agent": ""}, r"\.agent must be a non-empty string"),
        ({**GOOD, "turns": []}, r"\.turns must be a non-empty list"),
        ({**GOOD, "start_s": -1}, r"\.start_s must be a finite number of seconds >= 0, got -1"),
        ({**GOOD, "start_s": "soon"}, r"\.start_s must be a finite number"),
        ({**GOOD, "max_context": 1}, r"\.max_context must be an integer >= 2, got 1"),
        ({**GOOD, "max_context": 11}, r"context 10 \+ output 2 exceeds max_context 11"),
        ({**GOOD, "turns": [5]}, r"turns\[0\] must be an object"),
        ({**GOOD, "turns": [{"input": 0, "output": 2}]}, r"turns\[0\]\.input must be an integer >= 1, got 0"),
        ({**GOOD, "turns": [{"input": 2.5, "output": 2}]}, r"turns\[0\]\.input must be an integer >= 1, got 2.5"),
        ({**GOOD, "turns": [{"input": 3}]}, r"turns\[0\]\.output must be an integer >= 1, got None"),
        ({**GOOD, "turns": [{"input": 3, "output": True}]}, r"turns\[0\]\.output must be an integer >= 1"),
        ({**GOOD, "turns": [{"input": 3, "output": 1, "tool_s": -0.5}]}, r"turns\[0\]\.tool_s must be a finite"),
        ({**GOOD, "turns": [{"input": 3, "output": 1, "reset": 1}]}, r"turns\[0\]\.reset must be true or false"),
        ({**GOOD, "turns": [{"input": 3, "output": 1, "cached": -1}]}, r"turns\[0\]\.cached must be an integer >= 0"),
        ({**GOOD, "turns": [{"input": 3, "output": 1, "cached": 4}]}, r"turns\[0\]\.cached=4 exceeds its prompt of 3"),
        ({**GOOD, "turns": [{"input": 3, "output": 1, "outptu": 1}]}, r"turns\[0\]: unknown field 'outptu'"),
    ],
)
def test_each_bad_field_is_one_error_naming_line_field_and_limit(tmp_path, record, message):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(GOOD).replace('"a"', '"ok"') + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ConfigError, match=message) as error:
        read_agent_trace(path)
    assert f"{path}:2" in str(error.value)


def test_file_level_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        read_agent_trace(tmp_path / "nowhere.jsonl")
    path = tmp_path / "t.jsonl"
    path.write_text("\n")
    with pytest.raises(ConfigError, match="holds no agent"):
        read_agent_trace(path)
    path.write_text("{not json\n")
    with pytest.raises(ConfigError, match=r"t.jsonl:1: not JSON"):
        read_agent_trace(path)
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(ConfigError, match=r":2\.agent 'a' appears twice"):
        read_agent_trace(path)
