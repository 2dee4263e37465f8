"""Engines under faults: each fault ends in a clean fallback or a clear error, and accounting returns to zero."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch

from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.bootstrap import in_process_engines
from ascend_dualpath.dualpath.channels import EngineLost
from ascend_dualpath.dualpath.nodes import KV_BF16_ATOL, EngineConfig, verify_turn
from ascend_dualpath.dualpath.workload import synthetic_conversations
from ascend_dualpath.errors import ProtocolError
from ascend_dualpath.kv.faults import FaultInjector
from tests.dualpath.fast_config import FAST

rng = np.random.default_rng(7)
FIRST = [int(t) for t in rng.integers(0, 512, 40)]
APPEND = [int(t) for t in rng.integers(0, 512, 12)]


def assert_accounting_zero(pe, de) -> None:
    for buffer in (pe.buffer, de.buffer):
        stats = buffer.stats()
        assert (stats.used_bytes, stats.live_leases, stats.live_requests, stats.waiting_allocations) == (0, 0, 0, 0), (
            f"{buffer.role}: {stats}"
        )
        buffer.check_invariants()
    for queue in (pe.read_queue, de.read_queue):
        stats = queue.stats()
        assert (stats.queued_requests, stats.inflight_requests) == (0, 0), stats
    assert not pe.connector._prefetched


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


def test_storage_read_error_on_the_de_side_falls_back_to_the_pe_path(engines):
    pe, de, (pe_faults, de_faults) = engines
    result = serve_second_turn(de, "de", de_faults.fail_next_read)
    assert result.path == "pe" and result.hit_tokens > 0 and result.pe_read_bytes == result.hit_tokens * 4 * 128
    assert len(result.fallbacks) == 1 and result.fallbacks[0].startswith("de: StorageReadError")


def test_checksum_mismatch_on_the_pe_side_falls_back_to_the_de_path(engines):
    pe, de, (pe_faults, _) = engines
    result = serve_second_turn(de, "pe", lambda: pe_faults.corrupt_next_read(byte_offset=100))
    assert result.path == "de" and result.de_read_bytes > 0
    assert len(result.fallbacks) == 1 and "ChecksumMismatch" in result.fallbacks[0]


@pytest.mark.parametrize("mode, failing, after", [("de", "de", 2), ("de", "pe", 1), ("pe", "pe", 2), ("pe", "pe", 5)])
def test_transfer_failure_in_the_middle_of_a_layer_falls_back(engines, mode, failing, after):
    pe, de, _ = engines
    # submit number `after` of the failing engine in the second turn fails (a hit push, a local copy or a save)
    result = serve_second_turn(de, mode, lambda: (pe if failing == "pe" else de).leg.fail_after(after))
    assert len(result.fallbacks) == 1 and result.path != mode
    assert "TransferFailed" in result.fallbacks[0] or "PeerAborted" in result.fallbacks[0]


def test_both_paths_failing_recomputes_without_the_cache(engines):
    pe, de, (pe_faults, de_faults) = engines
    result = serve_second_turn(de, "de", lambda: (de_faults.fail_next_read(), pe_faults.fail_next_read()))
    assert result.path == "recompute" and result.hit_tokens == 0 and len(result.fallbacks) == 2


def test_full_pe_buffer_falls_back_to_the_de_path(tmp_path):
    config = EngineConfig(str(tmp_path / "store"), **{**FAST, "pe_buffer_bytes": 8192})  # < one Full Block
    with in_process_engines(config) as (pe, de):
        result = serve_second_turn(de, "pe")
        assert result.path == "de" and "CapacityError" in result.fallbacks[0]
        assert_accounting_zero(pe, de)


def test_full_de_buffer_defers_turns_until_space_frees(tmp_path):
    layout_bytes = 4 * 128  # L * C of the tiny model in bf16
    config = EngineConfig(str(tmp_path / "store"), **{**FAST, "de_buffer_bytes": 160 * layout_bytes})
    conversations = synthetic_conversations(agents=3, turns=2, first_prompt=60, append_mean=8, gen_tokens=2)
    with in_process_engines(config) as (pe, de):
        summary = de.run_conversations(conversations)
        assert summary["deferred"] > 0
        assert sorted((r.agent_id, r.turn) for r in summary["results"]) == [(a, t) for a in range(3) for t in range(2)]
        assert_accounting_zero(pe, de)


def test_a_turn_that_can_never_fit_is_a_clear_error(tmp_path):
    config = EngineConfig(str(tmp_path / "store"), **{**FAST, "de_buffer_bytes": 4096})
    with in_process_engines(config) as (pe, de):
        with pytest.raises(Exception, match="de_buffer"):
            de.run_conversations(synthetic_conversations(agents=1, turns=1, first_prompt=60))
        assert_accounting_zero(pe, de)


def test_a_wave_aborted_by_an_engine_error_gives_back_every_pending_turn(engines, monkeypatch):
    """An error that is not a turn's own (here a lost PE after the first turn) ends the wave with that very error;
    the turns still pending release their DE leases and their PE prefetches (checked by the fixture)."""
    pe, de, _ = engines
    first, _, _ = de.serve_wave([(0, 0, FIRST, 2)], "pe")
    prompt = first[0].sequence + APPEND
    serve, served = de._serve, []

    def serve_then_lose(*args):
        if served:
            raise EngineLost("prefill engine lost (injected)")
        served.append(args[0])
        return serve(*args)

    monkeypatch.setattr(de, "_serve", serve_then_lose)
    with pytest.raises(EngineLost, match="injected"):
        de.serve_wave([(agent, 1, prompt, 2) for agent in range(3)], "pe")
    assert len(served) == 1
    monkeypatch.undo()
    # a later wave runs normally; the PE has handled the drops of the aborted turns' prefetches before it
    results, deferred, _ = de.serve_wave([(0, 1, prompt, 2)], "pe")
    assert not deferred and results[0].error is None


def test_thousand_requests_with_random_faults_leave_no_leases_behind(tmp_path):
    config = EngineConfig(str(tmp_path / "store"), **{**FAST, "verify": False})
    chooser = random.Random(1234)
    pe_faults, de_faults = FaultInjector(), FaultInjector()
    results = []
    with in_process_engines(config, pe_faults, de_faults) as (pe, de):
        fabric = de.comm.device.fabric
        regions_before = fabric.num_live_regions
        for job in range(10):
            conversations = synthetic_conversations(
                agents=10, turns=10, first_prompt=24, append_mean=6, gen_tokens=2, seed=job
            )
            mode = chooser.choice(["dual", "pe", "de"])

            def arm(_result) -> None:  # about one fault per request, of every kind, at random points
                fault = chooser.choice(["pe_read", "de_read", "pe_crc", "de_crc", "pe_leg", "de_leg"])
                if fault.endswith("read"):
                    (pe_faults if fault[0] == "p" else de_faults).fail_next_read()
                elif fault.endswith("crc"):
                    (pe_faults if fault[0] == "p" else de_faults).corrupt_next_read(
                        byte_offset=chooser.randrange(config.layout.full_block_bytes)
                    )
                else:
                    (pe if fault[0] == "p" else de).leg.fail_after(chooser.randrange(12))

            summary = de.run_conversations(conversations, mode, arm)
            results += summary["results"]
            assert summary["deferred"] == 0
        assert_accounting_zero(pe, de)
        assert fabric.num_live_regions == regions_before
    failed = [r for r in results if r.error is not None]
    fallbacks = sum(len(r.fallbacks) for r in results)
    # a failed turn ends its conversation, so a few of the 1,000 turns never run
    assert len(results) + sum(10 - r.turn - 1 for r in failed) == 1000
    assert all("every path failed" in r.error for r in failed)
    assert len(failed) < 50 and fallbacks > 200, (len(failed), fallbacks)
    for r in results:
        if r.error is None:
            assert len(r.generated) == 2 and r.path in ("pe", "de", "recompute")


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
        (
            lambda c: m.Speaks(m.PROTOCOL_VERSION + 1, c, c.digest),
            r"version \d+ at the prefill engine, \d+ at the decode",
        ),
        (
            lambda c: _speaking(msgspec.structs.replace(c, num_layers=c.num_layers + 1)),
            r"digest \w+ at the prefill engine, \w+ at the decode engine: num_layers",
        ),
    ],
    ids=["version", "layout"],
)
def test_a_decode_engine_of_another_version_or_layout_is_refused_at_set_up(tmp_path, monkeypatch, speaks, match):
    """The demo engines check what the other speaks before the PE takes the DE's buffer; both name both values."""
    config = EngineConfig(str(tmp_path / "store"), **FAST)
    monkeypatch.setattr(m.Speaks, "of", classmethod(lambda cls, compat: speaks(compat)))  # what the DE sends
    with pytest.raises(ProtocolError, match=match), in_process_engines(config):
        pytest.fail("the engines came up")
