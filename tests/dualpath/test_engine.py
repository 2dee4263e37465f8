"""Engines under faults: each fault ends in a clean fallback or a clear error, and accounting returns to zero."""

from __future__ import annotations

import random
import time

import msgspec
import numpy as np
import pytest
import torch

from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.bootstrap import in_process_engines
from ascend_dualpath.dualpath.channels import EngineLost
from ascend_dualpath.dualpath.nodes import KV_BF16_ATOL, EngineConfig, verify_turn
from ascend_dualpath.dualpath.transfer_leg import FaultInjectingLeg
from ascend_dualpath.dualpath.workload import synthetic_conversations
from ascend_dualpath.errors import AdmissionDeferred, ProtocolError
from ascend_dualpath.kv.buffers import HostBuffer
from ascend_dualpath.kv.faults import FaultInjector
from tests.dualpath.fast_config import FAST

rng = np.random.default_rng(7)
FIRST = [int(t) for t in rng.integers(0, 512, 40)]
APPEND = [int(t) for t in rng.integers(0, 512, 12)]


def settle(pe, de) -> None:
    """Give back what the quarantines hold once nothing can write into it (a failed receive quarantines its lease
    until the PE says its writes ended); bounded."""
    deadline = time.monotonic() + 10.0
    while (pe.quarantine.held_bytes or de.quarantine.held_bytes) and time.monotonic() < deadline:
        pe.quarantine.sweep()
        de.quarantine.sweep()
        time.sleep(0.01)


def assert_accounting_zero(pe, de) -> None:
    settle(pe, de)
    for engine in (pe, de):
        buffer = engine.dataplane.host
        stats = buffer.stats()
        assert (stats.used_bytes, stats.live_leases, stats.live_requests, stats.waiting_allocations) == (0, 0, 0, 0), (
            f"{buffer.role}: {stats}"
        )
        buffer.check_invariants()
        queue = engine.read_queue.stats()
        assert (queue.queued_requests, queue.inflight_requests) == (0, 0), queue
        assert engine.quarantine.held_bytes == 0
        assert engine.blocks.free == engine.blocks.num_blocks
    assert not pe.half._pe_xfers and not de.half._xfers and not de.half._recvs


def fault_leg(engine) -> FaultInjectingLeg:
    """The engine's one pair link's leg, wrapped (once) so that a test can make a chosen submit fail."""
    (link,) = engine.dataplane.links.values()
    if not isinstance(link.leg, FaultInjectingLeg):
        link.leg = FaultInjectingLeg(link.leg)
    return link.leg


def shrink_host_buffer(engine, nbytes: int) -> None:
    """The engine's registered host buffer, cut to ``nbytes`` (the settings size it in whole MiB)."""
    engine.dataplane.host = HostBuffer(
        backing=engine.dataplane.host_region, capacity_bytes=nbytes, role=engine.dataplane.host.role, timeout_s=1.0
    )


@pytest.fixture
def engines(tmp_path):
    faults = FaultInjector(), FaultInjector()
    config = EngineConfig(str(tmp_path / "store"), **FAST)
    with in_process_engines(config, *faults) as (pe, de):
        yield pe, de, faults
        assert_accounting_zero(pe, de)


def serve_second_turn(de, mode, arm=lambda: None):
    """Serve turn 0 (caches the prefix), arm the fault, serve turn 1 and check it against a no-cache run."""
    first, _, _ = de.serve_wave([(0, 0, FIRST, 2)], mode)
    arm()
    prompt = first[0].sequence + APPEND
    results, deferred, _ = de.serve_wave([(0, 1, prompt, 2)], mode)
    assert not deferred
    result = results[0]
    check = verify_turn(
        result, prompt, de.model, de.model.with_dtype(torch.float64), de.store, de.namespace, KV_BF16_ATOL
    )
    assert check["loaded_exact"] and check["kv_ok"] and check["tokens_equal"], check
    return result


def test_storage_read_error_on_the_de_side_is_taken_over_by_the_pe(engines):
    pe, de, (pe_faults, de_faults) = engines
    result = serve_second_turn(de, "de", de_faults.fail_next_read)
    assert result.path == "de" and result.hit_tokens > 0 and result.pe_read_bytes == result.hit_tokens * 4 * 128
    assert len(result.fallbacks) == 1 and result.fallbacks[0].startswith("de: the DE's half failed")
    assert pe.counters.takeovers == 1


def test_checksum_mismatch_on_the_pe_side_recomputes_from_the_corrupted_block(engines):
    pe, de, (pe_faults, _) = engines
    result = serve_second_turn(de, "pe", lambda: pe_faults.corrupt_next_read(byte_offset=100))
    # the good blocks before the corrupted one (whichever the read queue read first) stay loaded
    assert result.path == "recompute" and result.hit_tokens in (0, 16)
    assert len(result.fallbacks) == 1 and f"computed again from token {result.hit_tokens}" in result.fallbacks[0]
    assert pe.counters.checksum_errors == 1


@pytest.mark.parametrize("mode, failing, after", [("de", "de", 2), ("de", "pe", 1), ("pe", "pe", 0), ("pe", "pe", 3)])
def test_transfer_failure_in_the_middle_of_a_layer_falls_back(engines, mode, failing, after):
    pe, de, _ = engines
    # submit number `after` of the failing side's link in the second turn fails (a hit push or a layer's rows)
    result = serve_second_turn(de, mode, lambda: fault_leg(pe if failing == "pe" else de).fail_after(after))
    assert result.fallbacks, result
    if failing == "de":  # the DE's push broke: the PE read the DE's half itself
        assert result.path == mode and pe.counters.takeovers == 1
    else:  # the PE's rows broke: the DE computed the prompt itself
        assert result.path == "recompute" and "receive failed" in result.fallbacks[-1]


def test_both_paths_failing_recomputes_without_the_cache(engines):
    pe, de, (pe_faults, de_faults) = engines
    result = serve_second_turn(de, "de", lambda: (de_faults.fail_next_read(), pe_faults.fail_next_read()))
    assert result.path == "recompute" and result.hit_tokens == 0 and len(result.fallbacks) == 2


@pytest.mark.parametrize("mode", ["split", "dual"])
def test_a_split_wave_reads_through_both_storage_nics_bit_exact(engines, mode):
    pe, de, _ = engines
    first, _, _ = de.serve_wave([(a, 0, FIRST[: 33 + 3 * a], 2) for a in range(4)], mode)
    prompts = [r.sequence + APPEND for r in first]
    results, deferred, timing = de.serve_wave([(a, 1, p, 2) for a, p in enumerate(prompts)], mode)
    assert not deferred and all(r.error is None and r.hit_tokens > 0 for r in results)
    reference = de.model.with_dtype(torch.float64)
    for r, prompt in zip(results, prompts, strict=True):
        check = verify_turn(r, prompt, de.model, reference, de.store, de.namespace, KV_BF16_ATOL)
        assert check["loaded_exact"] and check["kv_ok"] and check["tokens_equal"], check
    assert timing["pe_read_bytes"] > 0 and timing["de_read_bytes"] > 0, timing  # both storage NICs read
    hits = sum(r.hit_tokens for r in results) * 4 * 128
    assert timing["pe_read_bytes"] + timing["de_read_bytes"] == hits  # every hit block read once
    if mode == "split":
        assert pe.counters.loads_split + pe.counters.loads_pe + pe.counters.loads_de == 4


def test_a_pe_read_that_outlives_its_wait_quarantines_its_lease_until_it_ended(tmp_path):
    """The demo gets the halves' quarantine: a PE read slower than the load's bound fails the load (computed again),
    and its lease, which the read still writes into, is kept out of the buffer until the read ended."""
    config = EngineConfig(str(tmp_path / "store"), **{**FAST, "timeout_s": 0.5})
    with in_process_engines(config) as (pe, de):
        first, _, _ = de.serve_wave([(0, 0, FIRST, 2)], "pe")
        pe.store.faults.delay_reads(2.0)
        prompt = first[0].sequence + APPEND
        results, _, _ = de.serve_wave([(0, 1, prompt, 2)], "pe")
        assert results[0].path == "recompute" and results[0].error is None
        assert pe.counters.quarantined_leases == 1
        pe.store.faults.delay_reads(0)
        deadline = time.monotonic() + 10
        while pe.quarantine.held_bytes and time.monotonic() < deadline:
            pe.quarantine.sweep()
            time.sleep(0.05)
        assert pe.counters.reclaimed_leases == 1
        assert_accounting_zero(pe, de)


def test_full_pe_buffer_recomputes_the_load(tmp_path):
    config = EngineConfig(str(tmp_path / "store"), **FAST)
    with in_process_engines(config) as (pe, de):
        shrink_host_buffer(pe, 8192 - 64)  # < one Full Block
        result = serve_second_turn(de, "pe")
        assert result.path == "recompute" and result.hit_tokens == 0
        assert_accounting_zero(pe, de)


def test_full_de_buffer_defers_turns_until_space_frees(tmp_path):
    layout_bytes = 4 * 128  # L * C of the tiny model in bf16
    config = EngineConfig(str(tmp_path / "store"), **FAST)
    conversations = synthetic_conversations(agents=3, turns=2, first_prompt=60, append_mean=8, gen_tokens=2)
    with in_process_engines(config) as (pe, de):
        shrink_host_buffer(de, 160 * layout_bytes)
        summary = de.run_conversations(conversations)
        assert summary["deferred"] > 0
        assert sorted((r.agent_id, r.turn) for r in summary["results"]) == [(a, t) for a in range(3) for t in range(2)]
        assert_accounting_zero(pe, de)


def test_a_turn_that_can_never_fit_is_a_clear_error(tmp_path):
    config = EngineConfig(str(tmp_path / "store"), **FAST)
    with in_process_engines(config) as (pe, de):
        shrink_host_buffer(de, 4096)
        with pytest.raises(AdmissionDeferred, match="de_buffer holds 4096 bytes"):
            de.run_conversations(synthetic_conversations(agents=1, turns=1, first_prompt=60))
        assert_accounting_zero(pe, de)


def test_a_wave_aborted_by_an_engine_error_gives_back_every_turn(engines, monkeypatch):
    """An error that is not a turn's own (here a lost engine while the first turn finishes) ends the wave with that
    very error; every turn of the wave gives back its cache blocks and leases (checked by the fixture)."""
    pe, de, _ = engines
    first, _, _ = de.serve_wave([(0, 0, FIRST, 2)], "pe")
    prompt = first[0].sequence + APPEND
    finish, finished = de._finish_turn, []

    def finish_then_lose(t, reply, ttft):
        if finished:
            raise EngineLost("prefill engine lost (injected)")
        finished.append(t.xfer_id)
        return finish(t, reply, ttft)

    monkeypatch.setattr(de, "_finish_turn", finish_then_lose)
    with pytest.raises(EngineLost, match="injected"):
        de.serve_wave([(agent, 1, prompt, 2) for agent in range(3)], "pe")
    assert len(finished) == 1
    monkeypatch.undo()
    results, deferred, _ = de.serve_wave([(0, 1, prompt, 2)], "pe")  # a later wave runs normally
    assert not deferred and results[0].error is None


def test_thousand_requests_with_random_faults_leave_nothing_behind(tmp_path):
    config = EngineConfig(str(tmp_path / "store"), **{**FAST, "verify": False})
    chooser = random.Random(1234)
    pe_faults, de_faults = FaultInjector(), FaultInjector()
    results = []
    with in_process_engines(config, pe_faults, de_faults) as (pe, de):
        fabric = de.dataplane.fabric
        regions_before = fabric.num_live_regions
        for job in range(10):
            conversations = synthetic_conversations(
                agents=10, turns=10, first_prompt=24, append_mean=6, gen_tokens=2, seed=job
            )
            mode = chooser.choice(["dual", "pe", "de", "split"])

            def arm(_result) -> None:  # about one fault per request, of every kind, at random points
                fault = chooser.choice(["pe_read", "de_read", "pe_crc", "de_crc", "pe_leg", "de_leg"])
                if fault.endswith("read"):
                    (pe_faults if fault[0] == "p" else de_faults).fail_next_read()
                elif fault.endswith("crc"):
                    (pe_faults if fault[0] == "p" else de_faults).corrupt_next_read(
                        byte_offset=chooser.randrange(config.layout.full_block_bytes)
                    )
                else:
                    fault_leg(pe if fault[0] == "p" else de).fail_after(chooser.randrange(12))

            summary = de.run_conversations(conversations, mode, arm)
            results += summary["results"]
            assert summary["deferred"] == 0
        assert_accounting_zero(pe, de)
        assert fabric.num_live_regions == regions_before
    failed = [r for r in results if r.error is not None]
    fallbacks = sum(len(r.fallbacks) for r in results)
    assert not failed, failed[:3]  # every fault ends in a takeover or a recompute, never in a lost turn
    assert len(results) == 1000 and fallbacks > 200, (len(results), fallbacks)
    for r in results:
        assert len(r.generated) == 2 and r.path in ("pe", "de", "split", "recompute")


@pytest.mark.slow
def test_killed_prefill_engine_process_is_a_clear_error(tmp_path):
    from ascend_dualpath.cli.demo import run_job

    config = EngineConfig(
        str(tmp_path / "store"), **{**FAST, "timeout_s": 5.0, "idle_timeout_s": 60.0, "verify": False}
    )
    conversations = synthetic_conversations(agents=2, turns=3, first_prompt=40, append_mean=8, gen_tokens=2)
    clear_error = "decode engine: (EngineLost|WaitTimeout): .*(prefill engine|from the PE)"
    with pytest.raises(RuntimeError, match=clear_error):
        run_job(config, {"conversations": conversations, "mode": "dual"}, lambda event: None, kill_pe_after=2)


def _speaking(compat: m.Compat) -> m.Speaks:
    return m.Speaks(m.PROTOCOL_VERSION, compat, compat.digest)


@pytest.mark.parametrize(
    ("speaks", "match"),
    [
        (lambda c: m.Speaks(m.PROTOCOL_VERSION + 1, c, c.digest), r"version \d+ at DE de, \d+ at PE tcp://"),
        (
            lambda c: _speaking(msgspec.structs.replace(c, num_layers=c.num_layers + 1)),
            r"digest \w+ at DE de, \w+ at PE tcp://\S+: num_layers",
        ),
    ],
    ids=["version", "layout"],
)
def test_a_prefill_engine_of_another_version_or_layout_is_refused_at_hello(tmp_path, monkeypatch, speaks, match):
    """The demo's PE says hello to the DE at set-up, as a vLLM PE does at its first request: the DE checks what it
    speaks before any byte moves, and the error names both ends' values."""
    config = EngineConfig(str(tmp_path / "store"), **FAST)
    monkeypatch.setattr(m.Speaks, "of", classmethod(lambda cls, compat: speaks(compat)))  # what the PE sends
    with pytest.raises(ProtocolError, match=match):
        with in_process_engines(config):
            pytest.fail("the engines came up")
