"""``aiv_post_wqe``'s CPU kernel on an emulated 2-device rig: opcheck over several samples, the bytes landing
exactly (guard zones poisoned), each core's ``CoreStatus`` written, and every refusal leaving every buffer as it
was (the queues are raw addresses: only recorded, live, unchanged queue pairs are posted to)."""

from __future__ import annotations

import gc
import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from ascend_dualpath import errors, ops
from ascend_dualpath.ops import aiv
from tests.conftest import POISON

TIMEOUT_S = 10.0
CORES = 4
CQ_DEPTH = 4096  # opcheck calls the op several times per sample: room for all their CQEs


@dataclass
class Rig:
    d0: object
    src: object  # Poisoned region of device 0, random bytes
    dst: object  # Poisoned region of device 1
    cq: object
    qps: list

    def segments(self, lengths, src_offsets, dst_offsets, lkey=None, rkey=None) -> torch.Tensor:
        n = len(lengths)
        return ops.aiv_segments(
            [self.src.addr + o for o in src_offsets],
            [self.dst.addr + o for o in dst_offsets],
            lengths,
            [self.src.region.lkey if lkey is None else lkey] * n,
            [self.dst.region.rkey if rkey is None else rkey] * n,
        )

    def drain(self) -> list:
        """Every completion the posted WQEs produced (each SQ drained first)."""
        for qp in self.qps:
            qp.drain(TIMEOUT_S)
        out, batch = [], self.cq.poll(CQ_DEPTH, 0.0)
        while batch:
            out += batch
            batch = self.cq.poll(CQ_DEPTH, 0.0)
        return out


@pytest.fixture
def rig(two_devices, poisoned):
    d0, d1 = two_devices
    src, dst = poisoned(d0, 1 << 16), poisoned(d1, 1 << 16)
    data = np.random.default_rng(0).integers(0, 256, src.view.size, dtype=np.uint8)
    src.view[:] = data
    src.expected[:] = data
    cq = d0.create_cq(CQ_DEPTH)
    yield Rig(d0, src, dst, cq, [d0.create_qp(cq, None, 8, 4) for _ in range(CORES)])


# (lengths, block_dim, doorbell_batch): one WQE on one core, more segments than the 8-deep SQs hold, uneven shares
SAMPLES = [([64], 1, 1), ([1, 300, 4096, 17, 2000, 9, 64, 512, 33, 1000, 7, 1500, 250], 3, 4), ([100] * 40, 4, 32)]


def sample(rig: Rig, lengths, block_dim, batch):
    src_offsets = np.cumsum([0] + lengths[:-1]).tolist()
    dst_offsets = [o + 5 for o in src_offsets]  # unaligned destinations are fine for RDMA
    args = (
        rig.segments(lengths, src_offsets, dst_offsets),
        ops.aiv_queues(rig.d0, rig.qps[:block_dim]),
        torch.full((block_dim * 16,), POISON, dtype=torch.uint8),
        ops.aiv_post_tiling(len(lengths), batch, TIMEOUT_S, submit_ns=1000.0),
        block_dim,
    )
    return args, src_offsets, dst_offsets


def expect_landed(rig: Rig, lengths, src_offsets, dst_offsets) -> None:
    for s, d, n in zip(src_offsets, dst_offsets, lengths, strict=True):
        rig.dst.expect(d, rig.src.view[s : s + n])
    rig.dst.assert_intact()
    rig.src.assert_intact()


@pytest.mark.parametrize("index", range(len(SAMPLES)))
def test_opcheck(rig, index):
    lengths, block_dim, batch = SAMPLES[index]
    args, src_offsets, dst_offsets = sample(rig, lengths, block_dim, batch)
    torch.library.opcheck(torch.ops.ascend_dualpath.aiv_post_wqe.default, args)
    completions = rig.drain()
    assert completions and len(completions) % len(lengths) == 0
    assert all(c.status == 0 for c in completions)
    expect_landed(rig, lengths, src_offsets, dst_offsets)


@pytest.mark.parametrize("index", range(len(SAMPLES)))
def test_bytes_land_exactly_and_status_is_written(C, rig, index):
    lengths, block_dim, batch = SAMPLES[index]
    args, src_offsets, dst_offsets = sample(rig, lengths, block_dim, batch)
    inputs = [args[i].clone() for i in (0, 1, 3)]
    ops.aiv_post_wqe(*args)
    completions = rig.drain()
    assert len(completions) == len(lengths) and all(c.status == 0 for c in completions)
    expect_landed(rig, lengths, src_offsets, dst_offsets)
    status = args[2].view(torch.int32).view(block_dim, 4).tolist()
    n = len(lengths)
    shares = [n * (i + 1) // block_dim - n * i // block_dim for i in range(block_dim)]
    assert [s[:2] for s in status] == [[C.CORE_OK, share] for share in shares]
    assert [s[2] for s in status] == [qp.head for qp in rig.qps[:block_dim]]
    assert all(torch.equal(a, b) for a, b in zip((args[0], args[1], args[3]), inputs, strict=True))


def test_a_full_sq_that_never_drains_is_reported_in_status(C, rig):
    rig.d0.nic.set_paused(True)  # nothing retires: the 8-deep SQ takes 7 WQEs, then its core times out
    args, _, _ = sample(rig, [64] * 10, 1, 2)
    args = (*args[:3], ops.aiv_post_tiling(10, 2, 0.3), 1)
    ops.aiv_post_wqe(*args)
    code, posted, head, _ = args[2].view(torch.int32).tolist()
    assert (code, posted, head) == (C.CORE_SQ_TIMEOUT, 7, 7)
    rig.dst.assert_intact()


def _queue_with(rig: Rig, index: int, **fields) -> torch.Tensor:
    """The recorded queues of the first two QPs with fields of queue ``index`` changed."""
    queues = ops.aiv_queues(rig.d0, rig.qps[:2])
    names = ["sq", "head", "tail", "doorbell", "post_vtime", "depth", "wqe_size", "owner_shift", "qpn", "sl", "r"]
    values = list(aiv.AIV_QUEUE.unpack(queues[index * 64 : (index + 1) * 64].numpy().tobytes()))
    for name, value in fields.items():
        values[names.index(name)] = value
    queues[index * 64 : (index + 1) * 64] = torch.frombuffer(bytearray(aiv.AIV_QUEUE.pack(*values)), dtype=torch.uint8)
    return queues


def _where(index: int, sq_addr: int) -> str:
    return re.escape(f"queue {index} (sq_addr {sq_addr:#x})")


def _unrecorded(rig: Rig) -> tuple:
    stranger = rig.d0.create_qp(rig.cq, None, 8, 4)  # a live QP that aiv_queues never saw
    queues = ops.aiv_queues(rig.d0, rig.qps[:1])
    rig.qps.append(stranger)
    return torch.cat([queues, torch.frombuffer(bytearray(aiv._queue_bytes(stranger)), dtype=torch.uint8)]), 2, {}


def _forged(rig: Rig) -> tuple:
    return _queue_with(rig, 1, sq=rig.dst.addr), 2, {}


def _closed(rig: Rig) -> tuple:
    queues = ops.aiv_queues(rig.d0, rig.qps[:2])
    rig.qps[1].close()
    return queues, 2, {}


REFUSALS = {
    "unrecorded": (_unrecorded, errors.NotRegistered, lambda r: _where(1, r.qps[-1].sq_addr) + ".*no live"),
    "forged address": (_forged, errors.NotRegistered, lambda r: _where(1, r.dst.addr) + ".*no live"),
    "changed depth": (
        lambda r: (_queue_with(r, 0, depth=16), 2, {}),
        errors.ConfigError,
        lambda r: _where(0, r.qps[0].sq_addr) + ".*differ",
    ),
    "changed sl": (
        lambda r: (_queue_with(r, 1, sl=5), 2, {}),
        errors.ConfigError,
        lambda r: _where(1, r.qps[1].sq_addr) + ".*differ",
    ),
    "repeated queue": (
        lambda r: (ops.aiv_queues(r.d0, [r.qps[0], r.qps[0]]), 2, {}),
        errors.ConfigError,
        lambda r: _where(1, r.qps[0].sq_addr) + ".*also queue 0",
    ),
    "closed": (_closed, errors.QueueError, lambda r: _where(1, r.qps[1].sq_addr) + ".*closed"),
    "block_dim above queues": (
        lambda r: (ops.aiv_queues(r.d0, r.qps[:2]), 3, {}),
        errors.ConfigError,
        lambda r: re.escape("queues must be uint8 [192]"),
    ),
    "block_dim below queues": (
        lambda r: (ops.aiv_queues(r.d0, r.qps[:2]), 1, {}),
        errors.ConfigError,
        lambda r: re.escape("queues must be uint8 [64]"),
    ),
    "short status": (
        lambda r: (ops.aiv_queues(r.d0, r.qps[:2]), 2, {"status_bytes": 16}),
        errors.ConfigError,
        lambda r: re.escape("status must be uint8 [32]"),
    ),
    "tiling count": (
        lambda r: (ops.aiv_queues(r.d0, r.qps[:2]), 2, {"num_segments": 3}),
        errors.ConfigError,
        lambda r: "num_segments=3 but segments holds 4",
    ),
    "zero timeout": (
        lambda r: (ops.aiv_queues(r.d0, r.qps[:2]), 2, {"timeout_s": 0.0}),
        errors.ConfigError,
        lambda r: "timeout_cycles=0",
    ),
    "remote past its region": (
        lambda r: (ops.aiv_queues(r.d0, r.qps[:2]), 2, {"dst_offset": (1 << 16) - 224}),
        errors.BoundsError,
        lambda r: "segment 3: remote range",  # the last one straddles the end: none moves
    ),
    "bad lkey": (
        lambda r: (ops.aiv_queues(r.d0, r.qps[:2]), 2, {"lkey": 0xDEAD}),
        errors.NotRegistered,
        lambda r: "segment 0",
    ),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusals_leave_every_buffer_intact(rig, case):
    build, error, pattern = REFUSALS[case]
    queues, block_dim, opts = build(rig)
    lengths = [64] * 4
    src_offsets = [0, 64, 128, 192]
    dst_offsets = [opts.get("dst_offset", 0) + o for o in src_offsets]
    segments = rig.segments(lengths, src_offsets, dst_offsets, lkey=opts.get("lkey"))
    status = torch.full((opts.get("status_bytes", block_dim * 16),), POISON, dtype=torch.uint8)
    tiling = ops.aiv_post_tiling(opts.get("num_segments", 4), 2, opts.get("timeout_s", TIMEOUT_S))
    before = [t.clone() for t in (segments, queues, status, tiling)]
    with pytest.raises(error, match=pattern(rig)):
        ops.aiv_post_wqe(segments, queues, status, tiling, block_dim)
    assert all(torch.equal(a, b) for a, b in zip((segments, queues, status, tiling), before, strict=True))
    assert rig.cq.poll(16, 0.0) == []
    rig.dst.assert_intact()
    rig.src.assert_intact()
    assert all(qp.head == 0 for qp in rig.qps if qp.region.registered)


def test_a_dropped_queue_pair_is_no_longer_posted_to(rig):
    """The record is weak: once the caller drops its queue pair (the device closes nothing else), its address
    names no live queue pair, whatever is allocated there next."""
    qp = rig.d0.create_qp(rig.cq, None, 8, 4)
    queues = ops.aiv_queues(rig.d0, [qp])
    sq_addr = qp.sq_addr
    del qp
    gc.collect()
    segments = rig.segments([64], [0], [0])
    status = torch.full((16,), POISON, dtype=torch.uint8)
    with pytest.raises(errors.NotRegistered, match=_where(0, sq_addr)):
        ops.aiv_post_wqe(segments, queues, status, ops.aiv_post_tiling(1, 1, TIMEOUT_S), 1)
    assert (status == POISON).all()
    rig.dst.assert_intact()
