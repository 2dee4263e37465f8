"""The rows tensor-parallel ranks of one instance share (MLA's latent, replicated GQA heads): each request's lead
pair and the bounded copies between an instance's ranks (``dualpath/replicas.py``). The copies themselves are
tested on the connector's workers, bit for bit: ``tests/integrations/vllm/test_tensor_parallel.py``."""

from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dualpath.dualpath.replicas import RankGroup, Replicas
from ascend_dualpath.errors import ConfigError, WaitTimeout
from ascend_dualpath.kv.layout import KVLayout
from tests.integrations.vllm.worker_harness import on_ranks, rank_groups

SIZES = (1, 2, 4, 8)


def _layout(kind: str, heads: int) -> KVLayout:
    if kind == "mla":
        return KVLayout.mla(2, 16, torch.float16, 4)
    return KVLayout.gqa(2, heads, 8, torch.float16, 4)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["mla", "gqa"]),
    heads=st.sampled_from([1, 2, 4, 8]),
    pe=st.sampled_from(SIZES),
    de=st.sampled_from(SIZES),
    key=st.text(min_size=1, max_size=12),
)
def test_each_unit_moves_through_exactly_one_pair_per_request(kind, heads, pe, de, key):
    """For any sizes and request: every DE rank's units come from its lead's sources only, each PE rank either leads
    (moves with at least one DE rank) or takes its rows from the one replica that does, and the PE's and DE's leads
    are paired (the PE lead is a source of a DE lead)."""
    full = _layout(kind, heads)
    pe_shards = [full.shard(pe, p) for p in range(pe)]
    de_shards = [full.shard(de, d) for d in range(de)]
    for shard in pe_shards:
        lead = shard.lead(key, de)
        assert lead in shard.replicas
        movers = [r for r in shard.replicas if full.shard(pe, r).targets(de, key)]
        assert movers == [lead]
        assert bool(shard.targets(de, key)) == (lead == shard.rank)
    for shard in de_shards:
        assert shard.lead(key) in shard.replicas
        assert full.shard(de, shard.lead(key)).lead(key) == shard.lead(key)  # the replicas agree
    moved = {}  # unit -> the (PE rank, DE rank) pairs moving it
    for shard in pe_shards:
        for d in shard.targets(de, key):
            for unit in set(shard.units) & set(de_shards[d].units):
                moved.setdefault(unit, set()).add((shard.rank, d))
    de_groups = {tuple(s.replicas) for s in de_shards}
    for unit in range(full.num_units):  # each unit reaches each DE replica group holding it through one pair
        holders = [g for g in de_groups if unit in de_shards[g[0]].units]
        assert len(moved[unit]) == len(holders), (unit, moved[unit])


def test_requests_spread_over_the_replicas():
    shard = _layout("mla", 1).shard(4, 0)
    assert {shard.lead(f"x{i}") for i in range(64)} == {0, 1, 2, 3}


def test_a_rank_with_replicas_needs_its_instance_group_as_that_rank():
    shard = _layout("mla", 1).shard(2, 1)
    with pytest.raises(ConfigError, match=r"rank 1 of 2 shares its KV with ranks \[0, 1\] .* got none"):
        Replicas(shard, None)
    groups = rank_groups(2)
    with pytest.raises(ConfigError, match="got rank 0 of 2"):
        Replicas(shard, groups[0])
    assert not Replicas(_layout("gqa", 4).shard(2, 1), None).active  # no replicas: no group needed


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_the_group_timeout_must_be_positive_and_finite(bad):
    with pytest.raises(ConfigError, match=f"got {bad}"):
        RankGroup(rank_groups(2)[0].group, bad)


def test_a_copy_no_rank_sends_ends_at_the_timeout_naming_what_it_waited_for():
    groups = [RankGroup(g.group, 0.5) for g in rank_groups(2)]
    rows = torch.empty(4, dtype=torch.uint8)
    start = time.monotonic()
    with pytest.raises(WaitTimeout, match=r"rank 1 of 2: layer 3's rows did not complete within timeout_s=0.5 s"):
        groups[1].exchange([], [(rows, 0)], "layer 3's rows")
    assert time.monotonic() - start < 5


def test_copies_and_gathers_arrive_exact():
    groups = rank_groups(3)
    sent = torch.randint(0, 256, (5, 7), dtype=torch.uint8)
    got = [torch.full((5, 7), 0x5A, dtype=torch.uint8) for _ in range(2)]

    def rank(r: int):
        if r == 0:
            groups[0].exchange([(sent, 1), (sent, 2)], [], "rows")
        else:
            groups[r].exchange([], [(got[r - 1], 0)], "rows")
        return groups[r].gather(b"r" * r, "payloads")

    assert on_ranks([lambda r=r: rank(r) for r in range(3)]) == [[b"", b"r", b"rr"]] * 3
    assert all(torch.equal(g, sent) for g in got)
