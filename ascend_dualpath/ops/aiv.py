"""``aiv_post_wqe`` on the emulated device: its CPU kernel, and the builders of its byte-format inputs.

The op's tensors are the kernel's GM arguments (op_kernels/include/adp/transfer_kernels.h): ``segments`` uint8
[n * 32] of ``Segment``, ``queues`` uint8 [block_dim * 64] of ``AivQueue``, ``status`` uint8 [block_dim * 16]
of ``CoreStatus``, ``tiling`` uint8 [32] of ``AivPostTiling``. An ``AivQueue`` is raw addresses of a queue
pair's ring and control words, so the CPU kernel never trusts them: it posts only to queue pairs that
:func:`aiv_queues` recorded (weakly: the caller's references decide their lifetime), still open, whose every
field equals the queue's bytes, and hands those queue pairs, not the addresses, to ``_C.launch_aiv_post_wqe``,
which checks every segment against the fabric's registrations before a core starts.
"""

from __future__ import annotations

import struct
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ascend_dualpath.errors import ConfigError, NotRegistered, QueueError

SEGMENT = struct.Struct("<QQIIII")  # local_addr, remote_addr, length, lkey, rkey, reserved
AIV_QUEUE = struct.Struct("<QQQQQIIIIII")  # sq/head/tail/doorbell/post_vtime addrs, depth .. sl, reserved
CORE_STATUS = struct.Struct("<IIII")  # code, posted, head, tail
AIV_POST_TILING = struct.Struct("<IIQdd")  # num_segments, doorbell_batch, timeout_cycles, EmulatorClock
MAX_TIMEOUT_S = 3600.0  # bound of one SQ-space wait the CPU kernel accepts from a tiling


@dataclass(frozen=True)
class _Recorded:
    """A queue pair :func:`aiv_queues` encoded, and the UB size and core count of its device."""

    qp: weakref.ref
    ub_bytes: int
    vector_cores: int


_QUEUES: dict[int, _Recorded] = {}  # by sq_addr


def _queue_bytes(qp) -> bytes:
    """``AivQueue`` of ``qp``, laid out as ``queue_of`` in csrc/bindings/transfer.cpp fills it."""
    return AIV_QUEUE.pack(
        qp.sq_addr,
        qp.head_addr,
        qp.tail_addr,
        qp.doorbell_addr,
        qp.post_vtime_addr,
        qp.depth,
        qp.wqe_size,
        qp.owner_shift,
        qp.qpn,
        qp.sl,
        0,
    )


def _uint8(values: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(values), dtype=torch.uint8)


def aiv_queues(device, qps: Sequence) -> torch.Tensor:
    """uint8 [len(qps) * 64]: the ``AivQueue`` of each emulated queue pair of ``device`` (core i posts to
    ``qps[i]``), recorded so that the CPU kernel of ``aiv_post_wqe`` accepts them."""
    if not qps:
        raise ConfigError("aiv_queues needs at least 1 queue pair, got none")
    profile = device.profile
    for qp in qps:
        _QUEUES[qp.sq_addr] = _Recorded(weakref.ref(qp), profile.ub_bytes, profile.vector_cores)
    for addr in [a for a, r in _QUEUES.items() if r.qp() is None]:
        del _QUEUES[addr]
    return _uint8(b"".join(_queue_bytes(qp) for qp in qps))


def aiv_segments(local_addrs, remote_addrs, lengths, lkeys, rkeys) -> torch.Tensor:
    """uint8 [n * 32]: ``Segment`` i moves ``lengths[i]`` bytes from ``local_addrs[i]`` (lkey ``lkeys[i]``) to
    ``remote_addrs[i]`` (rkey ``rkeys[i]``); five sequences of n ints."""
    columns = [list(c) for c in (local_addrs, remote_addrs, lengths, lkeys, rkeys)]
    if len({len(c) for c in columns}) != 1:
        raise ConfigError(f"segment columns must have equal lengths, got {[len(c) for c in columns]}")
    return _uint8(b"".join(SEGMENT.pack(*row, 0) for row in zip(*columns, strict=True)))


def aiv_post_tiling(
    num_segments: int, doorbell_batch: int, timeout_s: float, start_vtime_ns: float = 0.0, submit_ns: float = 0.0
) -> torch.Tensor:
    """uint8 [32] ``AivPostTiling``: ``timeout_s`` becomes ``timeout_cycles`` of the 50 MHz system counter;
    ``start_vtime_ns`` / ``submit_ns`` are the emulator's virtual clock (ignored on hardware)."""
    from ascend_dualpath import _ext

    cycles = int(timeout_s * _ext.load().SYSTEM_CYCLE_HZ)
    return _uint8(AIV_POST_TILING.pack(num_segments, doorbell_batch, cycles, start_vtime_ns, submit_ns))


def _check_bytes(name: str, t: torch.Tensor, nbytes: int) -> None:
    if t.dtype != torch.uint8 or t.numel() != nbytes:
        raise ConfigError(f"aiv_post_wqe {name} must be uint8 [{nbytes}], got {t.dtype} {list(t.shape)}")


def _host_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().numpy().tobytes()


def _live_queue_pairs(C, queues: bytes, block_dim: int) -> tuple[list, _Recorded]:
    """The recorded, open queue pair each ``AivQueue`` of ``queues`` names (NotRegistered, QueueError or
    ConfigError naming the queue index and its sq_addr otherwise), and the record of the first."""
    qps, records, seen = [], [], {}
    for i in range(block_dim):
        raw = queues[i * AIV_QUEUE.size : (i + 1) * AIV_QUEUE.size]
        sq_addr = AIV_QUEUE.unpack(raw)[0]
        where = f"aiv_post_wqe queue {i} (sq_addr {sq_addr:#x})"
        record = _QUEUES.get(sq_addr)
        qp = record.qp() if record is not None else None
        if qp is None:
            raise NotRegistered(f"{where} matches no live queue pair recorded by ops.aiv_queues")
        if not qp.region.registered or qp.send_cq.closed or qp.state != C.QpState.READY_TO_SEND:
            raise QueueError(f"{where}: qpn {qp.qpn} is closed, its send CQ is closed or it is in ERROR")
        if raw != _queue_bytes(qp):
            raise ConfigError(f"{where}: its fields differ from those of qpn {qp.qpn} at that address")
        if sq_addr in seen:
            raise ConfigError(f"{where} is also queue {seen[sq_addr]}: each vector core needs its own queue pair")
        seen[sq_addr] = i
        qps.append(qp)
        records.append(record)
    return qps, records[0]


def _segment_arrays(segments: bytes) -> tuple[np.ndarray, ...]:
    """Local and remote addresses, lengths (uint64), lkeys and rkeys (uint32) of packed ``Segment``\\ s."""
    rows = np.frombuffer(
        segments,
        dtype=np.dtype(
            [("local", "<u8"), ("remote", "<u8"), ("length", "<u4"), ("lkey", "<u4"), ("rkey", "<u4"), ("r", "<u4")]
        ),
    )
    return (
        rows["local"].astype(np.uint64),
        rows["remote"].astype(np.uint64),
        rows["length"].astype(np.uint64),
        rows["lkey"].astype(np.uint32),
        rows["rkey"].astype(np.uint32),
    )


def aiv_post_wqe_cpu(
    segments: torch.Tensor, queues: torch.Tensor, status: torch.Tensor, tiling: torch.Tensor, block_dim: int
) -> None:
    """Run ``aiv_post_wqe`` on ``block_dim`` emulated vector cores and write each core's ``CoreStatus`` into
    ``status``. Every argument is checked before a core starts, so a refused call leaves every buffer as it
    was: the tensor sizes against ``block_dim``, each queue against its recorded queue pair, the tiling's
    segment count, doorbell batch and timeout, and (in ``_C.launch_aiv_post_wqe``) every segment's ranges
    against their registrations. Returns once the cores have posted; the WQEs complete on the queue pairs'
    send CQs."""
    from ascend_dualpath import _ext

    if isinstance(block_dim, bool) or not 1 <= block_dim <= 0xFFFF:
        raise ConfigError(f"aiv_post_wqe block_dim {block_dim!r} is outside [1, 65535]")
    _check_bytes("queues", queues, block_dim * AIV_QUEUE.size)
    _check_bytes("status", status, block_dim * CORE_STATUS.size)
    _check_bytes("tiling", tiling, AIV_POST_TILING.size)
    if segments.dtype != torch.uint8 or segments.numel() == 0 or segments.numel() % SEGMENT.size:
        raise ConfigError(
            f"aiv_post_wqe segments must be uint8 [n * {SEGMENT.size}], n >= 1, got {segments.dtype} "
            f"{list(segments.shape)}"
        )
    num_segments, doorbell_batch, cycles, start_vtime_ns, submit_ns = AIV_POST_TILING.unpack(_host_bytes(tiling))
    n = segments.numel() // SEGMENT.size
    if num_segments != n:
        raise ConfigError(f"aiv_post_wqe tiling num_segments={num_segments} but segments holds {n}")
    C = _ext.load()
    timeout_s = cycles / C.SYSTEM_CYCLE_HZ
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ConfigError(f"aiv_post_wqe tiling timeout_cycles={cycles} is outside (0, {MAX_TIMEOUT_S:g}] s")
    qps, record = _live_queue_pairs(C, _host_bytes(queues), block_dim)
    if block_dim > record.vector_cores:
        raise ConfigError(f"aiv_post_wqe block_dim {block_dim} exceeds the device's {record.vector_cores} vector cores")
    run = C.launch_aiv_post_wqe(
        qps,
        *_segment_arrays(_host_bytes(segments)),
        doorbell_batch,
        start_vtime_ns,
        submit_ns,
        record.ub_bytes,
        timeout_s,
    )
    # each core waits at most timeout_s for SQ space per WQE it posts; the launch as a whole at most that often
    per_core = -(-n // block_dim)
    cores = run.wait(timeout_s * (per_core + 1))
    written = b"".join(CORE_STATUS.pack(s["code"], s["posted"], s["head"], s["tail"]) for s in cores)
    status.copy_(_uint8(written).view(status.shape))
