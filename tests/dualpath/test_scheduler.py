from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dualpath.dualpath.scheduler import (
    EngineProfile,
    EngineState,
    GroupReport,
    PrefillWork,
    ReadPath,
    Request,
    Scheduler,
    choose_read_path,
    decode_token_threshold,
    plan_decode,
    plan_decode_groups,
    plan_prefill,
    plan_prefill_batch,
    split_hit_blocks,
)
from ascend_dualpath.errors import ConfigError

ALPHA, BETA = 1000, 5000


def req(i, length=100, cached=0, hbm=10):
    return Request(i, length, cached, hbm)


def pe(engine_id, node, tokens):
    return EngineState(engine_id, node, seqs=0, tokens=tokens)


def test_category_two_beats_lower_tokens_in_category_three():
    engines = [pe(0, 0, 10), pe(1, 1, 3000)]  # node 0 has a long read queue
    placed = plan_prefill([req(0)], engines, {0: ALPHA + 1, 1: ALPHA}, ALPHA, BETA)
    assert placed == [(req(0), 1)]


def test_category_three_used_when_two_is_empty_and_min_tokens_wins():
    engines = [pe(0, 0, 300), pe(1, 0, 200), pe(2, 1, 100)]
    placed = plan_prefill([req(0)], engines, {0: ALPHA + 1, 1: ALPHA + 5}, ALPHA, BETA)
    assert placed[0][1] == 2


def test_beta_excludes_and_stops_the_fifo():
    engines = [pe(0, 0, BETA + 1), pe(1, 0, BETA - 150)]
    placed = plan_prefill([req(0, 100), req(1, 100), req(2, 100)], engines, {}, ALPHA, BETA)
    # engine 1 takes r0 (tokens -> BETA-50 <= BETA), r1 (-> BETA+50), then nobody is <= beta
    assert [(r.request_id, e) for r, e in placed] == [(0, 1), (1, 1)]
    assert engines[1].tokens == BETA - 150  # plan is pure


def test_min_tokens_spreads_fifo_and_ties_break_on_id():
    engines = [pe(3, 0, 0), pe(1, 0, 0), pe(2, 0, 0)]
    placed = plan_prefill([req(i, 100) for i in range(4)], engines, {}, ALPHA, BETA)
    assert [e for _, e in placed] == [1, 2, 3, 1]


def test_decode_phase_one_balances_group_tokens():
    placed = plan_decode_groups([req(0, 500), req(1, 100), req(2, 100)], {7: 1000, 8: 200})
    assert [(r.request_id, g) for r, g in placed] == [(0, 8), (1, 8), (2, 8)]
    placed = plan_decode_groups([req(0, 900), req(1, 100)], {7: 1000, 8: 200})
    assert [g for _, g in placed] == [8, 7]


def de(engine_id, tokens, seqs, free):
    return EngineState(engine_id, 0, seqs=seqs, tokens=tokens, free_hbm_bytes=free)


def test_z_threshold_counts_only_the_hbm_fitting_head():
    engines = [de(0, 1000, 1, 100), de(1, 3000, 1, 100)]
    queue = [req(0, 400, hbm=150), req(1, 600, hbm=60), req(2, 10_000, hbm=20)]  # r1 would overflow: 150+60 > 200
    assert decode_token_threshold(queue, engines) == pytest.approx(1.05 * (400 + 4000) / 2)


def test_decode_prefers_non_high_token_with_fewest_seqs():
    # Z = 1.05 * (100 + 900 + 1000 + 1200) / 3 = 1120: engine 1 (1000+100) and 0 (900+100) are low-token;
    # engine 0 has fewer seqs even with more free HBM elsewhere; engine 2 is high-token.
    engines = [de(0, 900, 3, 100), de(1, 1000, 5, 100), de(2, 1200, 0, 100)]
    assert plan_decode([req(0, 100)], engines) == [(req(0, 100), 0)]


def test_decode_falls_back_to_min_tokens_when_all_are_high():
    engines = [de(0, 5000, 0, 100), de(1, 4000, 9, 100)]
    # Z = 1.05*(6000+9000)/2 = 7875; every engine + 6000 > Z: pick min tokens
    assert plan_decode([req(0, 6000)], engines)[0][1] == 1


def test_decode_skips_engines_without_hbm_and_stops_when_none_fits():
    engines = [de(0, 0, 0, 50), de(1, 100, 3, 200)]
    queue = [req(0, hbm=150), req(1, hbm=60), req(2, hbm=10)]
    placed = plan_decode(queue, engines)
    # r0 only fits engine 1 (free 200 -> 50); r1 (60) fits nowhere: stop, even though r2 would fit
    assert [(r.request_id, e) for r, e in placed] == [(0, 1)]
    assert engines[1].free_hbm_bytes == 200


def test_read_path_takes_the_shorter_queue_whatever_was_read_before():
    assert choose_read_path(10, 5) is ReadPath.DE
    assert choose_read_path(5, 10) is ReadPath.PE
    assert choose_read_path(10, 5, pe_node_read_tokens=0, de_node_read_tokens=10**9) is ReadPath.DE
    assert choose_read_path(5, 10, pe_node_read_tokens=10**9, de_node_read_tokens=0) is ReadPath.PE


def test_read_path_tie_goes_to_the_node_that_has_read_less_then_to_the_pe():
    assert choose_read_path(0, 0, pe_node_read_tokens=640, de_node_read_tokens=64) is ReadPath.DE
    assert choose_read_path(0, 0, pe_node_read_tokens=64, de_node_read_tokens=640) is ReadPath.PE
    assert choose_read_path(7, 7, pe_node_read_tokens=5, de_node_read_tokens=5) is ReadPath.PE
    assert choose_read_path(7, 7) is ReadPath.PE


def test_scheduler_breaks_idle_ties_by_tokens_read_so_far_not_always_to_the_pe():
    """One request per pull and both read queues reported empty each time (the reads finished between
    pulls): the seed's tie rule would read all four on the PE node; ours follows the nodes' read totals."""
    scheduler = Scheduler(alpha=ALPHA, beta=BETA)
    paths = []
    for i in range(4):
        scheduler.submit(req(i, 1000, cached=64 * (i + 1)))
        scheduler.pull_decode(GroupReport(10, [EngineState(80, 10, free_hbm_bytes=10**9)], {10: 0}))
        (assignment,) = scheduler.pull_prefill(GroupReport(0, [pe(0, 0, 0)], {0: 0}))
        paths.append(assignment.read_path)
    # read totals PE/DE before each: 0/0 -> PE; 64/0 -> DE; 64/128 -> PE; 256/128 -> DE
    assert paths == [ReadPath.PE, ReadPath.DE, ReadPath.PE, ReadPath.DE]


def linear_time(cached, bsz):
    return 0.001 * bsz + 0.0001 * cached


def test_quota_batch_splits_the_overflow_by_binary_search():
    queue = [PrefillWork(0, 0, 100), PrefillWork(1, 1000, 300)]  # 0.1 s, then 0.1 + 0.3 s
    batch = plan_prefill_batch(queue, linear_time, quota_s=0.3)
    assert batch[0] == (queue[0], 100)
    work, chunk = batch[1]
    # largest chunk with 0.1 + 0.1 + 0.001 * chunk <= 0.3 is 100 (floating point allows exactly 100 or 99)
    assert work is queue[1] and chunk in (99, 100)
    assert 0.1 + linear_time(1000, chunk) <= 0.3 < 0.1 + linear_time(1000, chunk + 1)


def test_quota_batch_takes_head_whole_when_nothing_fits():
    queue = [PrefillWork(0, 10**6, 50), PrefillWork(1, 0, 1)]  # 100 s of cached cost alone
    assert plan_prefill_batch(queue, linear_time, quota_s=0.3) == [(queue[0], 50)]
    with pytest.raises(ConfigError, match="quota"):
        plan_prefill_batch(queue, linear_time, quota_s=0)


def test_profile_thresholds_and_sparse_attention_flops():
    profile = EngineProfile(
        read_tokens_per_s=1000, prefill_tokens_per_s=200, attn_flops_per_pair=2.0, seconds_per_flop=1.0, sparse_topk=4
    )
    assert profile.alpha_tokens == 3000 and profile.beta_tokens == 1000
    # new tokens 3..6 after 2 cached: contexts 3,4 (dense) then capped at 4, 4 -> 3+4+4+4 = 15 pairs
    assert profile.attention_flops(2, 4) == 2.0 * 15
    dense = EngineProfile(1, 1, attn_flops_per_pair=1.0, seconds_per_flop=1.0)
    assert dense.attention_flops(10, 3) == 11 + 12 + 13


def test_scheduler_run_end_to_end_is_deterministic_and_tracks_read_queues():
    def run():
        scheduler = Scheduler(alpha=ALPHA, beta=BETA)
        for i in range(6):
            scheduler.submit(req(i, 100, cached=64, hbm=10))
        de_report = GroupReport(10, [EngineState(80 + i, 10, free_hbm_bytes=100) for i in range(2)], {10: 100})
        admitted = scheduler.pull_decode(de_report)
        pe_report = GroupReport(0, [pe(0, 0, 0), pe(1, 0, 0)], {0: 0})
        return admitted, scheduler.pull_prefill(pe_report), scheduler

    admitted, assignments, scheduler = run()
    assert len(admitted) == 6 and len(assignments) == 6 and scheduler.queued == 0
    # PE node 0 starts empty (0 < 100): PE path until its queue passes the DE node's 100 tokens
    assert [a.read_path for a in assignments] == [
        ReadPath.PE,
        ReadPath.PE,
        ReadPath.DE,
        ReadPath.PE,
        ReadPath.DE,
        ReadPath.PE,
    ]
    assert assignments == run()[1]


def test_request_validation():
    with pytest.raises(ConfigError, match="cached_tokens=200"):
        Request(1, 100, 200)
    with pytest.raises(ConfigError, match="prompt_tokens"):
        Request(1, 0)
    with pytest.raises(ConfigError, match="no engines"):
        GroupReport(1, [])


def admitted_scheduler(requests, de_node=10):
    scheduler = Scheduler(alpha=ALPHA, beta=BETA)
    for request in requests:
        scheduler.submit(request)
    de_report = GroupReport(de_node, [EngineState(80, de_node, free_hbm_bytes=10**9)], {de_node: 0})
    assert len(scheduler.pull_decode(de_report)) == len(requests)
    return scheduler


def test_prefill_choice_is_global_and_delivered_at_the_owning_groups_pull():
    scheduler = admitted_scheduler([req(0), req(1)])
    busy = GroupReport(0, [pe(0, 0, 4000), pe(1, 0, 4000)], {0: 0})
    idle = GroupReport(1, [pe(8, 1, 0), pe(9, 1, 50)], {1: 0})
    scheduler.register_prefill_group(idle)
    assert scheduler.pull_prefill(busy) == []  # both requests belong on the idle group's engines
    assert scheduler.queued == 2
    assert [(a.request.request_id, a.prefill_engine) for a in scheduler.pull_prefill(idle)] == [(0, 8), (1, 9)]
    assert scheduler.queued == 0 and scheduler.pull_prefill(idle) == []


def test_undelivered_assignments_keep_counting_after_their_groups_report():
    scheduler = admitted_scheduler([req(0, 3000, cached=64), req(1, 100, cached=64), req(2, 100)])
    scheduler.register_prefill_group(GroupReport(1, [pe(8, 1, 0)], {1: 0}))
    # group 0 pulls: r0 -> engine 8 (idle, group 1: held for it); r1 then sees engine 8 at 3000 tokens
    first = scheduler.pull_prefill(GroupReport(0, [pe(0, 0, 1000)], {0: 0}))
    assert [(a.request.request_id, a.prefill_engine) for a in first] == [(1, 0), (2, 0)]
    # group 1's report predates the delivery of r0; r0 is delivered once, with its read path
    delivered = scheduler.pull_prefill(GroupReport(1, [pe(8, 1, 0)], {1: 0}))
    assert [(a.request.request_id, a.prefill_engine, a.read_path) for a in delivered] == [(0, 8, ReadPath.PE)]
    assert scheduler.queued == 0


@settings(max_examples=60, deadline=None)
@given(
    loads=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2 * BETA)), min_size=1, max_size=12),
    queues=st.lists(st.integers(0, 2 * ALPHA), min_size=4, max_size=4),
    lengths=st.lists(st.integers(1, 3000), min_size=1, max_size=20),
)
def test_scheduler_places_like_plan_prefill_over_all_groups(loads, queues, lengths):
    """Without hits (read queues fixed) the scheduler's global choice equals plan_prefill over every PE."""
    engines = [pe(index, node, tokens) for index, (node, tokens) in enumerate(loads)]
    read_queues = dict(enumerate(queues))
    requests = [req(i, length) for i, length in enumerate(lengths)]
    expected = plan_prefill(requests, engines, read_queues, ALPHA, BETA)
    scheduler = admitted_scheduler(requests, de_node=10)
    groups = sorted({e.node_id for e in engines})
    reports = {g: GroupReport(g, [e for e in engines if e.node_id == g], {g: read_queues[g]}) for g in groups}
    for group in groups[1:]:
        scheduler.register_prefill_group(reports[group])
    delivered = [a for g in groups for a in scheduler.pull_prefill(reports[g])]
    got = sorted((a.request.request_id, a.prefill_engine) for a in delivered)
    assert got == sorted((r.request_id, e) for r, e in expected)


@given(
    blocks=st.integers(0, 512),
    pe_backlog=st.integers(0, 1 << 30),
    de_backlog=st.integers(0, 1 << 30),
    pe_rate=st.floats(1e6, 1e11),
    de_rate=st.floats(1e6, 1e11),
)
def test_split_finishes_both_reads_together_within_one_block(blocks, pe_backlog, de_backlog, pe_rate, de_rate):
    b = 1 << 20
    k = split_hit_blocks(blocks, b, pe_backlog, pe_rate, de_backlog, de_rate)
    assert 0 <= k <= blocks

    def finish(pe_blocks):
        return max((pe_backlog + pe_blocks * b) / pe_rate, (de_backlog + (blocks - pe_blocks) * b) / de_rate)

    # no other whole-block split finishes the request earlier
    best = min(finish(j) for j in range(blocks + 1))
    assert finish(k) <= best * (1 + 1e-9) + max(b / pe_rate, b / de_rate)


def test_split_follows_the_caps_and_the_backlogs():
    assert split_hit_blocks(100, 4096, 0, 4e9, 0, 1e9) == 80  # 4x the rate: 4x the blocks
    assert split_hit_blocks(100, 4096, 0, 1e9, 0, 1e9) == 50
    assert split_hit_blocks(100, 4096, 400 * 4096, 1e9, 0, 1e9) == 0  # its backlog outlasts the other's whole read
    assert split_hit_blocks(0, 4096, 0, 1e9, 0, 1e9) == 0


@pytest.mark.parametrize(
    "args",
    [(-1, 4096, 0, 1e9, 0, 1e9), (4, 0, 0, 1e9, 0, 1e9), (4, 4096, float("nan"), 1e9, 0, 1e9),
     (4, 4096, 0, 0.0, 0, 1e9), (4, 4096, 0, 1e9, 0, float("inf")), (4, 4096, 0, 1e9, -1, 1e9)],
)  # fmt: skip
def test_split_rejects_bad_input_naming_it(args):
    with pytest.raises(ConfigError, match="must be"):
        split_hit_blocks(*args)


def test_withdraw_takes_a_request_out_of_each_queue_and_frees_the_head():
    scheduler = Scheduler(alpha=10, beta=10)
    scheduler.register_decode_group(0)
    full = GroupReport(0, [EngineState(5, 1, free_hbm_bytes=3)], {1: 0})
    scheduler.submit(Request(1, 5, 0, decode_hbm_bytes=10))  # more than the DE has: the private queue's head
    scheduler.submit(Request(2, 5, 0, decode_hbm_bytes=1))
    assert scheduler.pull_decode(full) == []  # the head blocks the request behind it
    assert scheduler.withdraw(1) == "decode"
    assert [r.request_id for r, _ in scheduler.pull_decode(full)] == [2]  # now waiting for a PE
    assert scheduler.withdraw(2) == "prefill" and scheduler.queued == 0
    assert scheduler.withdraw(2) is None


def test_read_scales_make_a_slower_node_count_its_reads_by_time():
    def paths(scales):
        sched = Scheduler(alpha=10_000, beta=10_000)
        sched.set_read_scales(scales)
        sched.register_decode_group(0)
        for i in range(3):
            sched.submit(Request(i, prompt_tokens=200, cached_tokens=100, decode_hbm_bytes=1))
        sched.pull_decode(GroupReport(0, [EngineState(10, 1, free_hbm_bytes=10)], {1: 0}))
        return [a.read_path for a in sched.pull_prefill(GroupReport(1, [pe(0, 0, 0)], {0: 0}))]

    # PE on node 0, DE on node 1, both idle: the first read goes to the PE, the second to the now shorter DE queue
    assert paths({}) == [ReadPath.PE, ReadPath.DE, ReadPath.PE]  # then 100 = 100 tokens queued: a tie, to the PE
    # node 0 reads 4x slower: its 100 tokens cost 400, so the third read is shorter on node 1 too
    assert paths({0: 4.0, 1: 1.0}) == [ReadPath.PE, ReadPath.DE, ReadPath.DE]
    with pytest.raises(ConfigError, match="read scale of node 0"):
        Scheduler(alpha=1, beta=1).set_read_scales({0: float("nan")})
