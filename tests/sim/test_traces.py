from __future__ import annotations

import gzip
import json
import statistics

import pytest

from ascend_dualpath.errors import ConfigError
from ascend_dualpath.sim.cluster import ClusterConfig, ClusterSim, Mode
from ascend_dualpath.sim.models import DS_660B, MODELS, cache_compute_ratio
from ascend_dualpath.sim.traces import (
    TABLE2,
    Round,
    default_mooncake_path,
    generate_trajectories,
    load_mooncake,
    replay,
)


def test_replay_follows_a3_with_full_block_hits():
    rounds = replay([(100, 10), (30, 5), (7, 1)], block_tokens=64)
    assert rounds == [Round(100, 0, 10), Round(140, 64, 5), Round(152, 128, 1)]


@pytest.mark.parametrize("max_len", sorted(TABLE2))
def test_generator_matches_table2_per_round_means(max_len):
    bucket = TABLE2[max_len]
    trajectories = generate_trajectories(max_len, 500, seed=3)
    appends = [a for t in trajectories for a, _ in t[1:]]
    gens = [g for t in trajectories for _, g in t]
    assert statistics.mean(appends) == pytest.approx(bucket.append, rel=0.05)
    assert statistics.mean(gens) == pytest.approx(bucket.gen, rel=0.05)
    assert all(sum(a + g for a, g in t) <= max_len for t in trajectories)


def test_64k_contexts_and_hit_rate_match_the_paper():
    requests = [r for t in generate_trajectories(65536, 500, seed=3) for r in replay(t)]
    assert statistics.mean(r.cached_tokens for r in requests) == pytest.approx(32721, rel=0.05)
    hit = sum(r.cached_tokens for r in requests) / sum(r.prompt_tokens for r in requests)
    assert hit == pytest.approx(0.987, abs=0.01)


def test_generator_rejects_unknown_bucket():
    with pytest.raises(ConfigError, match="Table 2"):
        generate_trajectories(1000, 1)


@pytest.mark.parametrize(
    "name,context,paper",
    [("ds660b", 16384, 13), ("ds660b", 65536, 36), ("qwen32b", 16384, 117), ("qwen32b", 65536, 267)],
)
def test_kv_bytes_match_table1_cache_compute_ratio(name, context, paper):
    assert cache_compute_ratio(MODELS[name], context) == pytest.approx(paper, rel=0.10)


def _write(path, records):
    with gzip.open(path, "wt") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")


def test_mooncake_hits_are_full_block_prefixes(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    _write(
        path,
        [
            {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
            {"timestamp": 1500, "input_length": 1600, "output_length": 7, "hash_ids": [1, 2, 4, 9]},
            {"timestamp": 2000, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
        ],
    )
    rounds = load_mooncake(path)
    # request 1: blocks 1,2 stored (3 is partial, never stored); request 2: 1,2 hit, 4 miss
    assert rounds == [Round(1100, 0, 5, 0.0), Round(1600, 1024, 7, 1.5), Round(1024, 1024, 1, 2.0)]


def test_mooncake_validation(tmp_path):
    path = tmp_path / "bad.jsonl.gz"
    _write(path, [{"timestamp": 0, "input_length": 2000, "output_length": 5, "hash_ids": [1]}])
    with pytest.raises(ConfigError, match="expected ceil"):
        load_mooncake(path)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_mooncake(tmp_path / "nowhere.jsonl")


def _real_trace():
    path = default_mooncake_path()
    assert path.exists(), f"the shipped Mooncake trace is missing at {path}"
    return path


def test_real_mooncake_trace_statistics():
    rounds = load_mooncake(_real_trace())
    assert len(rounds) == 12031
    assert statistics.mean(r.prompt_tokens for r in rounds) == pytest.approx(12035, rel=0.01)
    hit = sum(r.cached_tokens for r in rounds) / sum(r.prompt_tokens for r in rounds)
    assert 0.30 < hit < 0.40  # ~37% block reuse, far below agentic 98.7%


def test_real_mooncake_trace_runs_through_the_simulator():
    rounds = load_mooncake(_real_trace(), limit=600)
    agents = [[r] for r in rounds]
    starts = [r.arrival_s for r in rounds]
    results = {
        mode: ClusterSim(ClusterConfig(DS_660B), mode, agents, agent_start_s=starts).run()
        for mode in (Mode.BASIC, Mode.SCHEDULER)
    }
    assert all(result.completed_requests == 600 for result in results.values())
    assert results[Mode.SCHEDULER].mean_ttft_s <= results[Mode.BASIC].mean_ttft_s
