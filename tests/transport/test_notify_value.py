"""The caller's notify value: ``submit`` / ``prepare`` take the value written into the peer's notify slot after the
bytes landed (as Mooncake's batch transfer carries its notify), on the emulator's engine (CI) and the CUDA engine
(``-m cuda``; skips without a GPU). A bad value is refused before anything moves, naming the value."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_dualpath import errors
from ascend_dualpath.transport import MemoryKind, MemorySegment, TransferKind
from ascend_dualpath.transport.engine import NOTIFY_VALUE_MAX
from tests.conftest import POISON, cuda_torch
from tests.transport.test_cuda_engine import _setup
from tests.transport.test_transfer import MAX_PIECE, Channel

SLOT = 2  # < 4: the CUDA engine's test setup has 4 notify slots


@pytest.fixture(scope="module")
def channel(C, emu):
    with emu.emulated_devices(2) as devices:
        ch = Channel(C, emu, devices)
        yield ch
        ch.engine.close()


def _reset(channel) -> None:
    channel.window[:] = POISON


@pytest.mark.parametrize("kind", list(TransferKind))
def test_submit_writes_the_callers_value_after_the_bytes(channel, kind):
    memory = MemoryKind.HOST if kind is TransferKind.STAGING else MemoryKind.DEVICE
    region, view = channel.source(3 * MAX_PIECE + 11, memory, seed=4)
    _reset(channel)
    value = 0x5EED_0000 + list(TransferKind).index(kind)
    result = channel.engine.submit([MemorySegment.of_region(region)], channel.slot(), SLOT, kind, value).wait()
    assert result.notify_magic == value == channel.comms[1].notify_value(SLOT)
    channel.assert_window(0, view)


def test_a_prepared_request_writes_each_submissions_own_value(channel):
    region, view = channel.source(5 * MAX_PIECE, seed=5)
    prepared = channel.engine.prepare([MemorySegment.of_region(region)], channel.slot(offset=128), notify_slot=SLOT)
    for value in (7, NOTIFY_VALUE_MAX, 3, 1 << 40):
        _reset(channel)
        result = prepared.submit(notify_value=value).wait()
        assert result.notify_magic == value == channel.comms[1].notify_value(SLOT)
        channel.assert_window(128, view)
    result = prepared.transfer(notify_value=11)
    assert result.notify_magic == 11 == channel.comms[1].notify_value(SLOT)
    fresh = prepared.submit().wait()  # no value: the engine picks its own fresh magic
    assert fresh.notify_magic == channel.comms[1].notify_value(SLOT) != 11


@pytest.mark.parametrize(
    ("value", "slot", "error", "named"),
    [
        (0, SLOT, errors.BoundsError, "notify_value 0 is outside"),
        (-3, SLOT, errors.BoundsError, "notify_value -3 is outside"),
        (NOTIFY_VALUE_MAX + 1, SLOT, errors.BoundsError, f"notify_value {NOTIFY_VALUE_MAX + 1} is outside"),
        (True, SLOT, errors.ArgumentTypeError, "notify_value must be int, got bool True"),
        (2.0, SLOT, errors.ArgumentTypeError, "notify_value must be int, got float 2.0"),
        (9, None, errors.ProtocolError, "notify_value 9 given without a notify_slot"),
    ],
)
def test_a_bad_value_is_refused_before_anything_moves(channel, value, slot, error, named):
    region, _ = channel.source(2 * MAX_PIECE, seed=6)
    _reset(channel)
    before = channel.comms[1].notify_value(SLOT)
    sources = [MemorySegment.of_region(region)]
    with pytest.raises(error, match=named):
        channel.engine.submit(sources, channel.slot(), slot, notify_value=value)
    prepared = channel.engine.prepare(sources, channel.slot(), notify_slot=slot)
    with pytest.raises(error, match=named):
        prepared.submit(notify_value=value)
    channel.assert_window(0, [])
    assert channel.comms[1].notify_value(SLOT) == before
    channel.engine.transfer(sources, channel.slot(), SLOT, notify_value=1)  # the engine stays usable
    assert channel.comms[1].notify_value(SLOT) == 1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.integers(1, NOTIFY_VALUE_MAX), nbytes=st.integers(1, 3 * MAX_PIECE), offset=st.integers(0, 4096))
def test_any_value_in_range_is_what_the_peer_reads_with_the_bytes(channel, value, nbytes, offset):
    region, view = channel.source(nbytes, seed=nbytes)
    _reset(channel)
    result = channel.engine.transfer([MemorySegment.of_region(region)], channel.slot(offset), SLOT, notify_value=value)
    assert result.notify_magic == value == channel.comms[1].notify_value(SLOT)
    channel.assert_window(offset, view)


# ---- CUDA --------------------------------------------------------------------------------------------


def _cuda_setup(torch, **options):
    """:func:`tests.transport.test_cuda_engine._setup`'s engine (4 notify slots), a device source, a registered pinned
    host source and a poisoned destination."""
    engine, notify, src_dev, dst_dev = _setup(torch, **options)
    source = torch.randint(0, 256, (3 * 65536 + 5,), dtype=torch.uint8, device=src_dev)
    host = torch.randint(0, 256, (2 * 4096 + 3,), dtype=torch.uint8).pin_memory()
    engine.register(host)
    dst = torch.full((source.numel() + host.numel() + 64,), POISON, dtype=torch.uint8, device=dst_dev)
    torch.cuda.synchronize()
    return engine, notify, source, host, dst


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["aiv", "staging", "aicpu", "host"])
def test_cuda_submit_writes_the_callers_value_after_the_bytes(kind):
    torch = cuda_torch()
    engine, notify, source, host, dst = _cuda_setup(torch)
    blocks = [source, host] if kind in ("staging", "host") else [source]
    segments = [engine.segment(b, 0, b.numel()) for b in blocks]
    expected = torch.cat([b.cpu() for b in blocks])
    for value in (0x5EED, NOTIFY_VALUE_MAX):
        dst.fill_(POISON)
        torch.cuda.synchronize()
        result = engine.submit(segments, engine.slot(dst, 32, expected.numel()), SLOT, kind, value).wait()
        assert result.notify_magic == value == int(notify[SLOT].item())
        got = dst.cpu()
        assert torch.equal(got[32 : 32 + expected.numel()], expected)
        assert (got[:32] == POISON).all() and (got[32 + expected.numel() :] == POISON).all()


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_prepared_submissions_write_each_callers_value(graphs):
    torch = cuda_torch()
    engine, notify, source, _, dst = _cuda_setup(torch, graphs=graphs)
    segments = [engine.segment(source, 0, source.numel())]
    prepared = engine.prepare(segments, engine.slot(dst, 0, source.numel()), notify_slot=SLOT)
    expected = source.cpu()
    for value in (9, 1 << 50, 4, NOTIFY_VALUE_MAX, 9):
        dst.fill_(POISON)
        torch.cuda.synchronize()
        result = prepared.submit(notify_value=value).wait()
        assert result.notify_magic == value == int(notify[SLOT].item())
        assert torch.equal(dst.cpu()[: source.numel()], expected)
    assert prepared.transfer(notify_value=12).notify_magic == 12 == int(notify[SLOT].item())


@pytest.mark.cuda
def test_cuda_bad_values_are_refused_before_anything_moves():
    torch = cuda_torch()
    engine, notify, source, _, dst = _cuda_setup(torch)
    segments = [engine.segment(source, 0, source.numel())]
    remote = engine.slot(dst, 0, source.numel())
    for value, error in (
        (0, errors.BoundsError),
        (NOTIFY_VALUE_MAX + 1, errors.BoundsError),
        (True, errors.ArgumentTypeError),
    ):
        with pytest.raises(error, match="notify_value"):
            engine.submit(segments, remote, SLOT, notify_value=value)
    with pytest.raises(errors.ProtocolError, match="notify_value 3 given without a notify_slot"):
        engine.submit(segments, remote, None, notify_value=3)
    torch.cuda.synchronize()
    assert (dst.cpu() == POISON).all() and int(notify[SLOT].item()) == 0
    assert np.all(notify.cpu().numpy() == 0)
