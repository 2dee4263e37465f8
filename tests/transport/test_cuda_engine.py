"""The transfer engine interface on CUDA GPUs (:class:`CudaTransferEngine`): gates, exact bytes for every kind,
remote-ready after completion, refusals that move nothing, bounded waits. GPU tests skip without CUDA."""

from __future__ import annotations

import time

import pytest

from ascend_dualpath import errors
from ascend_dualpath.transport import ChannelCapabilities, MemoryKind, TransferKind, select_kind
from tests.conftest import cuda_torch

DEV, HOST = MemoryKind.DEVICE, MemoryKind.HOST


@pytest.mark.parametrize(
    "protocol,memory,expected,decided_by",
    [
        ("local", [DEV, DEV], TransferKind.AIV, "addressable"),
        ("peer access", [DEV], TransferKind.AIV, "addressable"),
        ("peer access", [DEV, HOST], TransferKind.STAGING, "addressable"),
        ("no peer access", [DEV], TransferKind.AICPU, "protocol"),
        ("no peer access", [HOST], TransferKind.HOST, "protocol"),
    ],
)
def test_cuda_protocols_pass_or_fail_the_protocol_gate(protocol, memory, expected, decided_by):
    from ascend_dualpath.transport.cuda_engine import DIRECT_PROTOCOLS

    sel = select_kind(ChannelCapabilities(0x04, protocol, 1 << 20), memory, 4096, DIRECT_PROTOCOLS)
    assert (sel.kind, sel.decided_by) == (expected, decided_by)
    if decided_by == "protocol":
        assert "needs local or peer access" in sel.reason and protocol in sel.reason


def test_engine_without_a_gpu_is_unavailable():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    from ascend_dualpath.transport.cuda_engine import CudaTransferEngine

    with pytest.raises(errors.BackendUnavailable, match="needs a CUDA GPU"):
        CudaTransferEngine("cuda:0", "cuda:0")


def _setup(torch, **options):
    from ascend_dualpath.transport.cuda_engine import CudaTransferEngine

    src_dev = torch.device("cuda:0")
    dst_dev = torch.device("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    torch.cuda.set_device(src_dev)
    notify = torch.zeros(4, dtype=torch.int64, device=dst_dev)
    engine = CudaTransferEngine(src_dev, dst_dev, notify, timeout_s=30, **options)
    return engine, notify, src_dev, dst_dev


# layer blocks of uneven sizes: 16-byte aligned, 4-byte aligned, odd
_SIZES = [42 * 1024] * 5 + [4100, 3, 65536 + 7]


_ALIVE = []  # segments are addresses: their buffers must outlive the copies (freed memory gets reused at once)


def _sources(torch, engine, src_dev, host_share: bool):
    """Device blocks, and with ``host_share`` every other block from a registered pinned host buffer."""
    length = sum(_SIZES) + 16 * (len(_SIZES) + 1)  # a 16-byte gap before every block
    device = torch.randint(0, 256, (length,), dtype=torch.uint8, device=src_dev)
    host = torch.randint(0, 256, (length,), dtype=torch.uint8).pin_memory()
    engine.register(host)
    torch.cuda.synchronize(src_dev)
    _ALIVE[:] = [device, host]
    segments, expected, offset = [], [], 0
    for i, n in enumerate(_SIZES):
        buffer = host if host_share and i % 2 else device
        segments.append(engine.segment(buffer, 16 + offset, n))
        expected.append(buffer[16 + offset : 16 + offset + n])
        offset += n + 16
    return segments, torch.cat([e.cpu() for e in expected])


@pytest.mark.cuda
def test_gates_pick_the_device_kernel_for_device_memory_and_staging_for_host_memory():
    torch = cuda_torch()
    engine, _, src_dev, _ = _setup(torch)
    segments, _ = _sources(torch, engine, src_dev, host_share=True)
    assert engine.caps.protocol in ("local", "peer access")
    assert engine.select([s for s in segments if s.memory is DEV]).kind is TransferKind.AIV
    zero_copy = engine.select(segments)  # registered pinned memory is mapped: the kernel reads it in place
    assert (zero_copy.kind, zero_copy.decided_by) == (TransferKind.AIV, "zero-copy")
    staged, _, _, _ = _setup(torch, zero_copy=False)
    staged.register(_ALIVE[1])
    assert staged.select(segments).kind is TransferKind.STAGING
    assert staged.select(segments).gates[-1].gate == "zero-copy" and not staged.select(segments).gates[-1].passed
    fallback, _, _, _ = _setup(torch, capability_bitmap=0)
    assert fallback.select([s for s in segments if s.memory is DEV]).kind is TransferKind.AICPU
    assert fallback.select(segments).kind is TransferKind.HOST


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["aiv", "staging", "aicpu", "host"])
def test_every_kind_moves_exact_bytes_and_notifies_after_them(kind):
    torch = cuda_torch()
    engine, notify, src_dev, dst_dev = _setup(torch)
    segments, expected = _sources(torch, engine, src_dev, host_share=kind in ("staging", "host"))
    total = expected.numel()
    dst = torch.full((total + 64,), 0xA5, dtype=torch.uint8, device=dst_dev)
    torch.cuda.synchronize(dst_dev)
    remote = engine.slot(dst, 32, total)
    for round_ in range(2):  # the second request reuses the pattern's cached plan
        dst.fill_(0xA5)
        notify.zero_()
        torch.cuda.synchronize(dst_dev)
        result = engine.submit(segments, remote, notify_slot=2, kind=kind).wait()
        assert result.kind is TransferKind(kind) and result.nbytes == total
        assert int(notify[2].item()) == result.notify_magic
        got = dst.cpu()
        assert torch.equal(got[32 : 32 + total], expected), f"round {round_}"
        assert (got[:32] == 0xA5).all() and (got[32 + total :] == 0xA5).all()
        assert (notify.cpu()[[0, 1, 3]] == 0).all()
    if kind == "staging":
        assert result.staging_bytes > 0


@pytest.mark.cuda
def test_several_tickets_in_flight_complete_in_order():
    torch = cuda_torch()
    engine, _, src_dev, dst_dev = _setup(torch)
    segments, expected = _sources(torch, engine, src_dev, host_share=False)
    total = expected.numel()
    dsts = [torch.full((total,), 0xA5, dtype=torch.uint8, device=dst_dev) for _ in range(3)]
    torch.cuda.synchronize(dst_dev)
    tickets = [engine.submit(segments, engine.slot(d)) for d in dsts]
    for ticket, d in zip(tickets, dsts, strict=True):
        ticket.wait()
        assert torch.equal(d.cpu(), expected)


@pytest.mark.cuda
def test_bad_requests_raise_before_anything_moves():
    """Unregistered host memory, a remote slot off the destination GPU, a notify slot out of range and an
    overflowing slot each raise their own error; the destination and the notify slots keep their poison."""
    torch = cuda_torch()
    engine, notify, src_dev, dst_dev = _setup(torch)
    segments, expected = _sources(torch, engine, src_dev, host_share=False)
    total = expected.numel()
    dst = torch.full((total,), 0xA5, dtype=torch.uint8, device=dst_dev)
    notify.fill_(-1)
    torch.cuda.synchronize(dst_dev)
    unregistered = torch.zeros(4096, dtype=torch.uint8).pin_memory()
    host_segment = engine.segment(unregistered)
    with pytest.raises(errors.NotRegistered, match="registered host buffer"):
        engine.submit([host_segment], engine.slot(dst), kind="host").wait()
    elsewhere = torch.empty(total, dtype=torch.uint8).pin_memory()
    from ascend_dualpath.transport import RemoteSlot

    with pytest.raises(errors.BoundsError, match=f"must lie in memory of {dst_dev}"):
        engine.submit(segments, RemoteSlot(dst_dev.index, elsewhere.data_ptr(), total)).wait()
    with pytest.raises(errors.BoundsError, match="notify slot 4 is outside"):
        engine.submit(segments, engine.slot(dst), notify_slot=4)
    with pytest.raises(errors.BoundsError, match="overflow the remote slot"):
        engine.submit(segments, engine.slot(dst, 0, total - 1))
    with pytest.raises(errors.ConfigError, match="needs device-memory sources"):
        engine.submit([host_segment], engine.slot(dst), kind="aiv")
    torch.cuda.synchronize()
    assert (dst.cpu() == 0xA5).all() and (notify.cpu() == -1).all()


@pytest.mark.cuda
def test_wait_is_bounded_and_names_the_ticket():
    torch = cuda_torch()
    engine, _, src_dev, dst_dev = _setup(torch)
    segments, expected = _sources(torch, engine, src_dev, host_share=False)
    dst = torch.empty(expected.numel(), dtype=torch.uint8, device=dst_dev)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time on the caller's stream, which the request follows
    ticket = engine.submit(segments, engine.slot(dst))
    with pytest.raises(errors.WaitTimeout, match=f"ticket {ticket.id} to {dst_dev}"):
        ticket.wait(timeout_s=0.01)
    torch.cuda.synchronize()
    with pytest.raises(errors.ProtocolError, match="already failed"):
        ticket.wait()


@pytest.mark.cuda
def test_the_copy_kernel_publishes_remote_ready_for_a_receiver_polling_the_slot():
    """An ``aiv`` request's notify magic is released by the copy kernel itself (known at submit): a receiver that
    polls the slot on its own GPU, without the ticket, then finds every byte; ``wait`` reports the same magic."""
    torch = cuda_torch()
    engine, notify, src_dev, dst_dev = _setup(torch)
    segments, expected = _sources(torch, engine, src_dev, host_share=False)
    total = expected.numel()
    dst = torch.full((total,), 0xA5, dtype=torch.uint8, device=dst_dev)
    prepared = engine.prepare(segments, engine.slot(dst), notify_slot=1)
    magics = []
    for _ in range(3):
        dst.fill_(0xA5)
        torch.cuda.synchronize(dst_dev)
        ticket = prepared.submit()
        assert ticket.notify_magic is not None and ticket.notify_magic not in magics
        deadline = time.monotonic() + 10
        while int(notify[1].item()) != ticket.notify_magic:
            assert time.monotonic() < deadline, f"notify slot 1 still {int(notify[1].item())}"
        assert torch.equal(dst.cpu(), expected)
        assert ticket.wait().notify_magic == ticket.notify_magic
        magics.append(ticket.notify_magic)
    assert (notify.cpu()[[0, 2, 3]] == 0).all()


def _gates_only(copy_engine_min_bytes, protocol="local"):
    """A CUDA engine's gates without a GPU (only ``select`` is used)."""
    from ascend_dualpath.transport.cuda_engine import STRIDED_MIN_PIECE_BYTES, CudaTransferEngine

    engine = object.__new__(CudaTransferEngine)
    engine.caps = ChannelCapabilities(0x04, protocol, 1 << 30)
    engine.copy_engine_min_bytes = copy_engine_min_bytes
    engine.strided_min_piece_bytes, engine.max_pitch = STRIDED_MIN_PIECE_BYTES, (1 << 31) - 1
    engine.zero_copy, engine._host_buffers, engine._zero_copy_buffers = True, {}, {}
    return engine


def test_one_large_device_piece_goes_to_the_copy_engine_and_the_gate_says_so():
    from ascend_dualpath.transport import MemorySegment

    engine = _gates_only(8 << 20)
    big = engine.select([MemorySegment(0x1000, 8 << 20, DEV)])
    assert (big.kind, big.decided_by) == (TransferKind.HOST, "copy engine")
    assert big.gates[-1].gate == "copy engine" and not big.gates[-1].passed
    assert ">= copy_engine_min_bytes" in big.gates[-1].detail and "copy engine" in big.reason
    for sources in ([MemorySegment(0x1000, (8 << 20) - 1, DEV)], [MemorySegment(0x1000, 8 << 20, DEV)] * 2):
        kept = engine.select(sources)  # below the threshold, or several pieces: the device kernel
        assert (kept.kind, kept.decided_by) == (TransferKind.AIV, "addressable")
        assert kept.gates[-1].gate == "copy engine" and kept.gates[-1].passed
    host = engine.select([MemorySegment(0x1000, 64 << 20, HOST)])  # unregistered host memory: no zero-copy
    assert host.kind is TransferKind.STAGING and all(g.gate != "copy engine" for g in host.gates)
    assert host.gates[-1].gate == "zero-copy" and "not in a registered buffer" in host.gates[-1].detail


@pytest.mark.cuda
def test_the_copy_engine_gate_moves_one_large_piece_exactly():
    torch = cuda_torch()
    engine, notify, src_dev, dst_dev = _setup(torch, copy_engine_min_bytes=1 << 20)
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device=src_dev)
    dst = torch.full((3 << 20,), 0xA5, dtype=torch.uint8, device=dst_dev)
    torch.cuda.synchronize()
    result = engine.transfer([engine.segment(src)], engine.slot(dst), notify_slot=2)
    assert (result.kind, result.selection.decided_by) == (TransferKind.HOST, "copy engine")
    assert torch.equal(dst.cpu(), src.cpu()) and int(notify[2].item()) == result.notify_magic


@pytest.mark.cuda
def test_an_unregistered_host_buffer_is_refused_and_moves_nothing():
    torch = cuda_torch()
    engine, notify, src_dev, dst_dev = _setup(torch)
    host = torch.randint(0, 256, (8192,), dtype=torch.uint8).pin_memory()
    engine.register(host)
    dst = torch.full((8192,), 0xA5, dtype=torch.uint8, device=dst_dev)
    torch.cuda.synchronize()
    prepared = engine.prepare([engine.segment(host)], engine.slot(dst), notify_slot=1)
    prepared.transfer()
    assert torch.equal(dst.cpu(), host)
    dst.fill_(0xA5)
    notify.fill_(-1)
    torch.cuda.synchronize()
    engine.unregister(host)
    for submit in (prepared.submit, lambda: engine.submit([engine.segment(host)], engine.slot(dst), notify_slot=1)):
        with pytest.raises(errors.NotRegistered):
            submit()
    torch.cuda.synchronize()
    assert (dst.cpu() == 0xA5).all() and (notify.cpu() == -1).all()
    with pytest.raises(errors.NotRegistered, match="not registered"):
        engine.unregister(host)
    engine.register(host)
    prepared.transfer()  # registered again: the prepared request is checked again and moves
    assert torch.equal(dst.cpu(), host)


@pytest.mark.cuda
def test_a_prepared_request_replays_from_a_cuda_graph_and_publishes_successive_magics():
    torch = cuda_torch()
    engine, notify, src_dev, dst_dev = _setup(torch)
    segments, expected = _sources(torch, engine, src_dev, host_share=False)
    dst = torch.full((expected.numel(),), 0xA5, dtype=torch.uint8, device=dst_dev)
    torch.cuda.synchronize()
    prepared = engine.prepare(segments, engine.slot(dst), notify_slot=3)
    graphed = engine.capture(prepared, 1000)
    torch.cuda.synchronize()
    assert (dst.cpu() == 0xA5).all()  # capturing moves nothing
    for magic in (1000, 1001):
        dst.fill_(0xA5)
        torch.cuda.synchronize()
        assert graphed.replay() == magic
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), expected) and int(notify[3].item()) == magic
    dst.fill_(0xA5)
    result = prepared.submit().wait()  # submissions replay the same graph: its magics go on
    assert result.notify_magic == 1002 == int(notify[3].item()) and torch.equal(dst.cpu(), expected)
    host = engine.prepare(segments, engine.slot(dst), kind="host")
    with pytest.raises(errors.ConfigError, match="only an aiv request"):
        engine.capture(host)


@pytest.mark.cuda
def test_record_writes_the_callers_magic_and_locate_names_host_and_device_memory():
    torch = cuda_torch()
    engine, notify, src_dev, _ = _setup(torch)
    engine.record(2, 77)
    assert engine.notify_value(2) == 77
    with pytest.raises(errors.BoundsError, match="notify slot 9"):
        engine.record(9, 1)
    host = torch.zeros(64, dtype=torch.uint8).pin_memory()
    engine.register(host)
    device = torch.zeros(64, dtype=torch.uint8, device=src_dev)
    assert engine.locate(host.data_ptr() + 8, 8).memory is HOST
    assert engine.locate(device.data_ptr(), 8).memory is DEV


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [True, False])
def test_prepared_requests_publish_distinct_magics_with_or_without_graphs(graphs):
    torch = cuda_torch()
    engine, notify, src_dev, dst_dev = _setup(torch, graphs=graphs)
    segments, expected = _sources(torch, engine, src_dev, host_share=False)
    dsts = [torch.full((expected.numel(),), 0xA5, dtype=torch.uint8, device=dst_dev) for _ in range(2)]
    torch.cuda.synchronize()
    prepared = [engine.prepare(segments, engine.slot(d), notify_slot=1) for d in dsts]
    assert all((p.state["work"].graph is not None) == graphs for p in prepared)
    seen = []
    for _ in range(3):
        for p, d in zip(prepared, dsts, strict=True):
            d.fill_(0xA5)
            result = p.submit().wait()
            assert result.notify_magic == int(notify[1].item())  # published after every byte, known at submit
            assert torch.equal(d.cpu(), expected)
            seen.append(result.notify_magic)
    assert len(set(seen)) == len(seen)  # a receiver polling the slot never sees a value twice


@pytest.mark.cuda
def test_plain_submissions_reuse_a_pattern_only_while_its_sources_are_the_same():
    """The second plain submission of a pattern captures its graph and later ones replay it; a list changed in
    place, or other sources to the same slot, move their own bytes. Every result's magic is in the notify slot."""
    torch = cuda_torch()
    engine, notify, src_dev, dst_dev = _setup(torch)
    segments, expected = _sources(torch, engine, src_dev, host_share=False)
    dst = torch.full((expected.numel(),), 0xA5, dtype=torch.uint8, device=dst_dev)
    remote = engine.slot(dst)

    def moved(sources, want):
        dst.fill_(0xA5)
        torch.cuda.synchronize()
        result = engine.submit(sources, remote, notify_slot=0).wait()
        assert torch.equal(dst.cpu(), want) and int(notify[0].item()) == result.notify_magic
        return result.notify_magic

    magics = [moved(segments, expected) for _ in range(3)]
    work = engine._submissions[(remote, 0, None)].state["work"]
    assert work.graph is not None and magics[2] >= 1 << 40 > magics[0]  # the third replayed the graph
    sizes = [s.nbytes for s in segments]
    parts = list(torch.split(expected, sizes))
    segments.reverse()  # the same list object, other contents
    magics.append(moved(segments, torch.cat(parts[::-1])))
    magics.append(moved(tuple(segments[::-1]), expected))  # equal sources as a tuple: the pattern again
    assert len(set(magics)) == len(magics)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["aicpu", "host", "staging"])
def test_requests_without_a_notify_slot_complete_and_publish_nothing(kind):
    torch = cuda_torch()
    engine, notify, src_dev, dst_dev = _setup(torch)
    segments, expected = _sources(torch, engine, src_dev, host_share=kind != "aicpu")
    dst = torch.full((expected.numel(),), 0xA5, dtype=torch.uint8, device=dst_dev)
    notify.fill_(-1)
    torch.cuda.synchronize()
    for _ in range(2):
        result = engine.submit(segments, engine.slot(dst), kind=kind).wait()
        assert result.notify_magic is None and torch.equal(dst.cpu(), expected)
    assert (notify.cpu() == -1).all()


@pytest.mark.cuda
def test_kinds_mixed_on_one_slot_leave_the_last_magic_and_order_the_callers_stream_after_the_bytes():
    """The copy-engine kinds write their notify on a tail stream: a kernel publishing into the same slot right after
    must not be overtaken by it, and work the caller enqueues after a submission still sees every byte."""
    torch = cuda_torch()
    engine, notify, src_dev, dst_dev = _setup(torch)
    segments, expected = _sources(torch, engine, src_dev, host_share=False)
    dst = torch.full((expected.numel(),), 0xA5, dtype=torch.uint8, device=dst_dev)
    big = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, device=src_dev)  # the copy engine's gate
    big_dst = torch.full_like(big, 0xA5, device=dst_dev)
    torch.cuda.synchronize()
    for _ in range(20):
        large = engine.submit([engine.segment(big)], engine.slot(big_dst), notify_slot=1)
        seen = big_dst[-4096:].clone() if dst_dev == src_dev else None  # stream order, no wait
        small = engine.submit(segments, engine.slot(dst), notify_slot=1)
        small_result, large_result = small.wait(), large.wait()
        assert (large_result.kind, small_result.kind) == (TransferKind.HOST, TransferKind.AIV)
        assert int(notify[1].item()) == small_result.notify_magic > large_result.notify_magic
        assert seen is None or torch.equal(seen.cpu(), big[-4096:].cpu())
        assert torch.equal(dst.cpu(), expected) and torch.equal(big_dst, big)
        big_dst.fill_(0xA5)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["aiv", "staging", "aicpu", "host"])
@pytest.mark.parametrize("graphs", [True, False])
def test_the_callers_notify_value_lands_in_the_slot_after_the_bytes(kind, graphs):
    """Plain and repeated prepared submissions with the caller's values, then without one: the notify slot holds
    each request's value (the caller's, or a fresh magic), a graph replay included (it bakes in no value)."""
    torch = cuda_torch()
    engine, notify, src_dev, dst_dev = _setup(torch, graphs=graphs)
    segments, expected = _sources(torch, engine, src_dev, host_share=kind in ("staging", "host"))
    dst = torch.full((expected.numel(),), 0xA5, dtype=torch.uint8, device=dst_dev)
    remote = engine.slot(dst)
    prepared = engine.prepare(segments, remote, notify_slot=2, kind=kind)
    seen, base = [], 1 << 50  # the caller's values, far from the engine's own magics
    for value in (base + 11, 1 << 62, None, base + 12, base + 12, None, base + 7):
        for submit in (prepared.submit, lambda v: engine.submit(segments, remote, 2, kind, notify_value=v)):
            dst.fill_(0xA5)
            torch.cuda.synchronize()
            result = submit(value).wait()
            assert int(notify[2].item()) == result.notify_magic, (kind, value)
            assert value is None or result.notify_magic == value
            assert torch.equal(dst.cpu(), expected) and (notify.cpu()[[0, 1, 3]] == 0).all()
            seen.append(result.notify_magic)
    fresh = [v for v in seen if v not in (base + 11, 1 << 62, base + 12, base + 7)]
    assert len(fresh) == 4 and len(set(fresh)) == 4
    assert (prepared.state["work"].graph is not None) == (graphs and kind == "aiv")


@pytest.mark.cuda
def test_zero_copy_reads_the_host_buffer_as_it_is_at_each_submission():
    """A prepared request from a registered pinned buffer (the kernel reads it in place, from a graph): the host
    rewrites the buffer between submissions and each request moves the bytes of its own moment; forcing ``aiv`` on
    host sources works, and an unregistered buffer is still refused."""
    torch = cuda_torch()
    engine, notify, src_dev, dst_dev = _setup(torch)
    sizes = [42 * 1024] * 7 + [4100, 3, 65536 + 7]
    host = torch.zeros(sum(sizes) + 64 * len(sizes), dtype=torch.uint8).pin_memory()
    engine.register(host)
    offsets = [64 * i + sum(sizes[:i]) for i in range(len(sizes))]
    segments = [engine.segment(host, o, n) for o, n in zip(offsets, sizes, strict=True)]
    dst = torch.full((sum(sizes),), 0xA5, dtype=torch.uint8, device=dst_dev)
    prepared = engine.prepare(segments, engine.slot(dst), notify_slot=0)
    assert (prepared.selection.kind, prepared.selection.decided_by) == (TransferKind.AIV, "zero-copy")
    forced = engine.prepare(segments, engine.slot(dst), notify_slot=0, kind="aiv")
    for round_, request in enumerate([prepared] * 3 + [forced]):
        host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8))
        dst.fill_(0xA5)
        torch.cuda.synchronize()
        result = request.submit(100 + round_).wait()
        want = torch.cat([host[o : o + n] for o, n in zip(offsets, sizes, strict=True)])
        assert torch.equal(dst.cpu(), want), round_
        assert int(notify[0].item()) == result.notify_magic == 100 + round_
    other = torch.zeros(4096, dtype=torch.uint8).pin_memory()
    with pytest.raises(errors.ConfigError, match="needs device-memory sources"):
        engine.prepare([engine.segment(other)], engine.slot(dst), kind="aiv")
