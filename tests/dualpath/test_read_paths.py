"""PE and DE read paths: segment arithmetic, the transfer leg's exactness, and path equivalence end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dualpath.dualpath.bootstrap import in_process_engines
from ascend_dualpath.dualpath.nodes import KV_BF16_ATOL, EngineConfig, verify_turn
from ascend_dualpath.dualpath.transfer_leg import (
    ABORT_SLOT,
    PeerAborted,
    TransferFailed,
    contiguous,
    wait_notify,
)
from ascend_dualpath.errors import BoundsError, NotRegistered, WaitTimeout
from ascend_dualpath.models.tiny_llama import TinyLlamaConfig
from tests.dualpath.fast_config import FAST


def test_leg_moves_segments_exactly_and_sets_the_notify(leg_bench):
    bench = leg_bench
    bench.write_source((np.arange(8192) % 251).astype(np.uint8))
    bench.poison_landing()
    expected = bench.landing().copy()
    out = bench.source()
    magic = bench.next_magic()
    segments = contiguous([(bench.source_addr + 4096, 1000), (bench.source_addr, 24)])
    ticket = bench.leg.submit(2, segments, 1, bench.landing_addr + 64, 2, magic)
    bench.leg.wait(ticket)
    wait_notify(bench.notify, 2, magic, "layer 2", timeout_s=5.0)
    expected[64:1064] = out[4096:5096]
    expected[1064:1088] = out[:24]
    assert np.array_equal(bench.landing(), expected)


def test_leg_failure_names_the_layer_and_moves_nothing(leg_bench):
    bench = leg_bench
    bench.poison_landing()
    pieces, dst_addr = bench.refused
    # the leg rejects it before anything moves: its engine's address resolution (emulator) or the range check of
    # the request (CUDA)
    with pytest.raises((TransferFailed, BoundsError, NotRegistered), match="layer 3"):
        bench.leg.wait(bench.leg.submit(3, contiguous(pieces), 1, dst_addr, 3, bench.next_magic()))
    assert bool((bench.landing() == 0xA5).all()), "a rejected batch moved bytes"
    assert bench.notify.notify_value(3) == 0, "the notify of a failed layer was set"


def test_wait_notify_is_bounded_and_sees_aborts(comms):
    src, dst = comms
    with pytest.raises(WaitTimeout, match="layer 7 of request 9"):
        wait_notify(dst, 7, src.next_magic(), "layer 7 of request 9", timeout_s=0.05)
    abort = src.next_magic()
    src.notify_record(1, ABORT_SLOT, abort, 5.0)
    with pytest.raises(PeerAborted):
        wait_notify(dst, 7, src.next_magic(), "layer 7", abort_magic=abort, timeout_s=5.0)


def _serve_two_turns(tmp_path, name, mode, first, append, gen, dtype="bfloat16"):
    config = EngineConfig(str(tmp_path / name), dtype=dtype, **FAST)
    with in_process_engines(config) as (_, de):
        results, _, _ = de.serve_wave([(0, 0, first, gen)], mode)
        prompt = results[0].sequence + append
        results, deferred, _ = de.serve_wave([(0, 1, prompt, gen)], mode)
        assert not deferred
        result = results[0]
        reference = de.model.with_dtype(torch.float64)
        check = verify_turn(result, prompt, de.model, reference, de.store, de.namespace, KV_BF16_ATOL)
        stats = de.dataplane.host.stats()
        assert stats.used_bytes == 0 and stats.live_leases == 0
    return result, check


@pytest.mark.parametrize("gen", [1, 3])
@settings(max_examples=4, deadline=None)  # each example runs three engine pairs over two turns
@given(first=st.integers(20, 90), append=st.integers(1, 40), seed=st.integers(0, 1000))
def test_pe_de_and_split_paths_agree_bit_for_bit_and_match_full_recompute(tmp_path_factory, gen, first, append, seed):
    tmp_path = tmp_path_factory.mktemp("paths")
    rng = np.random.default_rng(seed)
    first_tokens = [int(t) for t in rng.integers(0, TinyLlamaConfig().vocab_size, first)]
    append_tokens = [int(t) for t in rng.integers(0, TinyLlamaConfig().vocab_size, append)]
    via_pe, check_pe = _serve_two_turns(tmp_path, "pe", "pe", first_tokens, append_tokens, gen)
    via_de, check_de = _serve_two_turns(tmp_path, "de", "de", first_tokens, append_tokens, gen)
    via_split, check_split = _serve_two_turns(tmp_path, "split", "split", first_tokens, append_tokens, gen)
    assert via_pe.hit_tokens == via_de.hit_tokens == via_split.hit_tokens > 0
    assert (via_pe.path, via_de.path, via_split.path) == ("pe", "de", "split")
    hit_bytes = via_pe.hit_tokens // 16 * 16 * 4 * 128
    assert (via_pe.pe_read_bytes, via_pe.de_read_bytes) == (hit_bytes, 0)
    assert (via_de.pe_read_bytes, via_de.de_read_bytes) == (0, hit_bytes)
    assert via_split.pe_read_bytes + via_split.de_read_bytes == hit_bytes
    for other in (via_de, via_split):
        assert torch.equal(via_pe.kv, other.kv), "two read paths left different KV in the DE's cache"
        assert via_pe.generated == other.generated
    for check in (check_pe, check_de, check_split):
        assert check["loaded_exact"] and check["tokens_equal"], check
        assert check["kv_max_err"] <= KV_BF16_ATOL, check


@pytest.mark.parametrize("mode", ["pe", "de"])
def test_both_engines_move_layers_through_the_given_engine_factory(tmp_path, mode):
    """The DualPath stack takes its transfer engines from the caller: every engine a pair link sends with comes
    from the factory (asked once per destination rank), and two turns are served over them (the second hits the
    cache and moves hit layers on the chosen path)."""
    from ascend_dualpath.transport import create_engine

    made = []

    def factory(comm, rank):
        made.append((comm.rank, rank, create_engine("emulator", comm, rank, timeout_s=10.0)))
        return made[-1][2]

    config = EngineConfig(str(tmp_path / mode), **FAST)
    first = [int(t) for t in np.random.default_rng(1).integers(0, TinyLlamaConfig().vocab_size, 40)]
    with in_process_engines(config, engines=factory) as (pe, de):
        results, _, _ = de.serve_wave([(0, 0, first, 2)], mode)
        results, _, _ = de.serve_wave([(0, 1, results[0].sequence + [3, 4, 5], 2)], mode)
        legs = [link.leg for engine in (pe, de) for link in engine.dataplane.links.values()]
        used = [e for leg in legs for e in leg._engines.values()]
        kinds = {kind: n for leg in legs for kind, n in leg.kinds_used.items()}
    assert results[0].error is None and results[0].hit_tokens > 0 and results[0].path == mode
    assert used and {id(e) for e in used} <= {id(e) for _, _, e in made}
    assert len({(a, b) for a, b, _ in made}) == len(made), "an engine was made twice for one rank"
    assert kinds, "no layer went through the factory's engines"
