"""The *strided copy* gate of the CUDA engine: pieces of one length at a constant stride as one 2-D copy-engine copy.

The stride detection (:func:`~ascend_dualpath.transport.segments.uniform_stride`) and the gate run without a GPU; the
byte tests (``-m cuda``) skip cleanly without one."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ascend_dualpath.transport import MemoryKind, MemorySegment, TransferKind
from ascend_dualpath.transport.segments import Strided, uniform_stride
from tests.conftest import cuda_torch
from tests.transport.test_cuda_engine import _gates_only, _setup

KIB = 1024
POISON = 0xA5


def _expand(strided: Strided) -> list[tuple[int, int, int]]:
    """(src, dst, nbytes) of every byte run the 2-D copy moves."""
    return [
        (strided.src + i * strided.spitch, strided.dst + i * strided.dpitch, strided.width)
        for i in range(strided.height)
    ]


def _bytes_moved(copies) -> dict[int, int]:
    """destination byte -> source byte of a list of (src, dst, nbytes) copies."""
    return {d + k: s + k for s, d, n in copies for k in range(n)}


@given(
    width=st.integers(1, 64),
    height=st.integers(1, 12),
    sgap=st.integers(0, 40),
    dgap=st.integers(0, 40),
    src=st.integers(0, 1 << 20),
    dst=st.integers(0, 1 << 20),
)
def test_a_uniform_constant_stride_list_is_one_2d_copy_of_the_same_bytes(width, height, sgap, dgap, src, dst):
    srcs = [src + i * (width + sgap) for i in range(height)]
    dsts = [dst + i * (width + dgap) for i in range(height)]
    strided = uniform_stride(srcs, dsts, [width] * height)
    assert strided is not None
    assert strided.width * strided.height == width * height
    assert strided.spitch >= strided.width and strided.dpitch >= strided.width
    assert _bytes_moved(_expand(strided)) == _bytes_moved(zip(srcs, dsts, [width] * height, strict=True))
    merged = height > 1 and sgap == dgap == 0
    assert strided.height == (1 if merged else height)


@given(
    sizes=st.lists(st.integers(1, 32), min_size=2, max_size=10),
    gaps=st.lists(st.integers(0, 16), min_size=10, max_size=10),
)
def test_a_list_of_unequal_lengths_or_strides_is_not_one_copy(sizes, gaps):
    srcs = list(itertools.accumulate([s + g for s, g in zip(sizes, gaps, strict=False)], initial=0))[: len(sizes)]
    dsts = list(itertools.accumulate(sizes, initial=0))[: len(sizes)]
    strided = uniform_stride(srcs, dsts, sizes)
    uniform = len(set(sizes)) == 1 and len({b - a for a, b in itertools.pairwise(srcs)}) == 1
    assert (strided is not None) == uniform
    if strided is not None:
        assert _bytes_moved(_expand(strided)) == _bytes_moved(zip(srcs, dsts, sizes, strict=True))


@pytest.mark.parametrize(
    "srcs,dsts,sizes,why",
    [
        ([0, 8, 16], [0, 16, 32], [16] * 3, "sources overlap (stride 8 < 16 B)"),
        ([0, 32, 64], [0, 8, 16], [16] * 3, "destinations overlap"),
        ([64, 32, 0], [0, 16, 32], [16] * 3, "descending sources"),
        ([0, 0, 0], [0, 16, 32], [16] * 3, "the same source three times"),
        ([0, 32, 64], [0, 16, 32], [16, 16, 15], "a shorter last piece"),
        ([0, 32, 65], [0, 16, 32], [16] * 3, "a stride that changes"),
        ([0, 1 << 40], [0, 16], [16] * 2, "a stride above the largest pitch"),
        ([], [], [], "no pieces"),
    ],
)
def test_refused_lists(srcs, dsts, sizes, why):
    assert uniform_stride(srcs, dsts, sizes) is None, why


def test_one_piece_is_one_row():
    assert uniform_stride([0x1000], [0x2000], [5]) == Strided(0x1000, 5, 0x2000, 5, 5, 1)


class _Buffer:
    """A registered host buffer's stand-in: the gates ask only where it starts and how long it is."""

    def __init__(self, addr: int, nbytes: int):
        self.addr, self.nbytes = addr, nbytes

    def data_ptr(self) -> int:
        return self.addr

    def numel(self) -> int:
        return self.nbytes

    def __bool__(self):
        raise TypeError("a buffer has no truth value (a torch tensor of many bytes raises too)")


def _host_engine(base: int = 0x100_0000, nbytes: int = 1 << 30):
    engine = _gates_only(8 << 20)
    engine._host_buffers[base] = _Buffer(base, nbytes)
    engine._zero_copy_buffers[base] = True
    return engine, base


def test_the_gate_sends_a_strided_layer_block_to_the_copy_engine_and_says_why():
    engine, base = _host_engine()
    full_block, layer_block = 61 * 42 * KIB, 42 * KIB
    layer = [MemorySegment(base + b * full_block + 5 * layer_block, layer_block, MemoryKind.HOST) for b in range(61)]
    chosen = engine.select(layer)
    assert (chosen.kind, chosen.decided_by) == (TransferKind.HOST, "strided copy")
    assert chosen.gates[-1].gate == "strided copy" and chosen.gates[-1].passed
    assert f"61 row(s) of {layer_block} B, {full_block} B apart" in chosen.reason


def test_the_gate_leaves_uneven_small_or_unregistered_host_pieces_to_the_zero_copy_kernel():
    engine, base = _host_engine()
    uneven = [MemorySegment(base + i * 64 * KIB, (32 + i) * KIB, MemoryKind.HOST) for i in range(4)]
    small = [MemorySegment(base + i * 4 * KIB, 2 * KIB, MemoryKind.HOST) for i in range(4)]
    outside = [MemorySegment(0x10, 64 * KIB, MemoryKind.HOST)]
    for sources, detail in (
        (uneven, "not of one length at a constant stride"),
        (small, "below strided_min_piece_bytes"),
        (outside, "not in a registered pinned host buffer"),
    ):
        chosen = engine.select(sources)
        gate = next(g for g in chosen.gates if g.gate == "strided copy")
        assert not gate.passed and detail in gate.detail
        assert chosen.decided_by != "strided copy" and chosen.kind is not TransferKind.HOST
    engine.strided_min_piece_bytes = 2 * KIB
    assert engine.select(small).decided_by == "strided copy"


def test_device_sources_never_meet_the_gate():
    engine, _ = _host_engine()
    device = [MemorySegment(0x4000_0000 + i * 64 * KIB, 32 * KIB, MemoryKind.DEVICE) for i in range(8)]
    chosen = engine.select(device)
    assert chosen.kind is TransferKind.AIV and all(g.gate != "strided copy" for g in chosen.gates)


# ---- bytes on the GPU --------------------------------------------------------------------------------------------


def _strided_host(torch, engine, count: int, width: int, stride: int):
    """A registered pinned buffer of random bytes and ``count`` segments of ``width`` bytes ``stride`` apart."""
    host = torch.randint(0, 256, (count * stride,), dtype=torch.uint8).pin_memory()
    engine.register(host)
    segments = [engine.segment(host, i * stride, width) for i in range(count)]
    want = torch.cat([host[i * stride : i * stride + width] for i in range(count)])
    return host, segments, want


@pytest.mark.cuda
@pytest.mark.parametrize("width,stride", [(42 * KIB, 61 * 42 * KIB), (16 * KIB, 16 * KIB), (16 * KIB + 3, 40007)])
def test_a_strided_host_request_lands_exactly_and_notifies_after_the_bytes(width, stride):
    """Strided layer blocks into a slot in the middle of a poisoned destination: the packed bytes land, every byte
    outside the slot keeps its poison, the caller's value and then fresh magics reach the notify slot."""
    torch = cuda_torch()
    engine, notify, _, dst_dev = _setup(torch)
    count = 61
    host, segments, want = _strided_host(torch, engine, count, width, stride)
    pad = 4096 + 5
    dst = torch.full((count * width + 2 * pad,), POISON, dtype=torch.uint8, device=dst_dev)
    slot = engine.slot(dst, pad, count * width)
    prepared = engine.prepare(segments, slot, notify_slot=1)
    assert (prepared.selection.kind, prepared.selection.decided_by) == (TransferKind.HOST, "strided copy")
    for round_, value in enumerate((77, None, 78)):
        host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8))
        want = torch.cat([host[i * stride : i * stride + width] for i in range(count)])
        dst[pad:-pad].fill_(POISON)
        torch.cuda.synchronize()
        result = prepared.submit(value).wait()
        got = dst.cpu()
        assert torch.equal(got[pad:-pad], want), round_
        assert (got[:pad] == POISON).all() and (got[-pad:] == POISON).all(), round_
        assert int(notify[1].item()) == result.notify_magic and (value is None or result.notify_magic == value)
    plain = engine.submit(segments, slot, notify_slot=1).wait()  # the same pattern through plain submit
    assert plain.selection.decided_by == "strided copy" and int(notify[1].item()) == plain.notify_magic
    assert (notify.cpu()[[0, 2, 3]] == 0).all()


@pytest.mark.cuda
def test_forced_host_kind_moves_strided_device_pieces_in_one_2d_copy():
    """Device sources of one length at a stride, kind ``host`` forced: one 2-D copy, bytes exact, the poison around
    the slot untouched; uneven pieces still go one copy each."""
    torch = cuda_torch()
    engine, notify, src_dev, dst_dev = _setup(torch)
    width, stride, count = 42 * KIB, 50 * KIB, 61
    src = torch.randint(0, 256, (count * stride,), dtype=torch.uint8, device=src_dev)
    segments = [engine.segment(src, i * stride, width) for i in range(count)]
    dst = torch.full((count * width + 128,), POISON, dtype=torch.uint8, device=dst_dev)
    prepared = engine.prepare(segments, engine.slot(dst, 64, count * width), notify_slot=0, kind="host")
    assert prepared.state["work"].copy2d is not None and not prepared.state["work"].each
    torch.cuda.synchronize()
    result = prepared.transfer()
    want = torch.cat([src[i * stride : i * stride + width] for i in range(count)]).cpu()
    got = dst.cpu()
    assert torch.equal(got[64:-64], want) and (got[:64] == POISON).all() and (got[-64:] == POISON).all()
    assert int(notify[0].item()) == result.notify_magic
    uneven = engine.prepare(segments[:-1] + [engine.segment(src, 0, 7)], engine.slot(dst), kind="host")
    assert uneven.state["work"].copy2d is None and len(uneven.state["work"].each) == count
