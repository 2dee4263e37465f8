"""Emulated NIC throughput: WQE posting-and-execution rate per SQ, and copy bandwidth against memcpy.

Wall-clock measurements of the emulator itself (not the virtual clock): they say how fast tests and
emulator benchmarks can push work, and that moving bytes through WQEs costs little over a plain copy.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from ascend_dualpath import _args, _json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wqes", type=_args.positive_int(10**8), default=200_000, help="4 KB writes per rate trial")
    parser.add_argument(
        "--mb-writes", type=_args.positive_int(10**6), default=512, help="1 MB writes per bandwidth trial"
    )
    parser.add_argument(
        "--trials", type=_args.positive_int(1000), default=5, help="trials per measurement (median reported)"
    )
    parser.add_argument("--depth", type=_args.Number(4, 1 << 16, integer=True), default=4096, help="SQ depth")
    parser.add_argument("--out", type=Path, default=None, help="write results.json here")


def _segments(n: int, size: int, span: int, base_src: int, base_dst: int):
    offsets = (np.arange(n, dtype=np.uint64) * np.uint64(size)) % np.uint64(span - size)
    return base_src + offsets, base_dst + offsets, np.full(n, size, dtype=np.uint64)


def _time_wqes(qp, cq, src, dst, n, size, span, signal_every, timeout_s=120.0) -> float:
    local, remote, lengths = _segments(n, size, span, src.addr, dst.addr)
    start = time.perf_counter()
    qp.post_segments(3, local, src.lkey, remote, dst.rkey, lengths, signal_every, 0.0, timeout_s)
    qp.drain(timeout_s)
    elapsed = time.perf_counter() - start
    polled = 0
    while polled < -(-n // signal_every):
        got = cq.poll(1 << 16, timeout_s)
        assert all(c.status == 0 for c in got), [c.detail for c in got if c.status]
        polled += len(got)
    return elapsed


def _time_memcpy(src: np.ndarray, dst: np.ndarray, n: int, size: int, span: int) -> float:
    offsets = [(i * size) % (span - size) for i in range(n)]
    start = time.perf_counter()
    for off in offsets:
        np.copyto(dst[off : off + size], src[off : off + size])
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    from ascend_dualpath import _ext
    from ascend_dualpath.backends import emulator as emu

    C = _ext.load()
    span = 64 << 20
    results: dict = {"machine": platform.processor() or platform.machine(), "python": platform.python_version()}
    with emu.emulated_devices(2) as (d0, d1):
        src = d0.alloc_region(span, C.MemKind.DEVICE_GM, 7)
        dst = d1.alloc_region(span, C.MemKind.DEVICE_GM, 7)
        np.frombuffer(src, dtype=np.uint8)[:] = 1
        np.frombuffer(dst, dtype=np.uint8)[:] = 0  # fault the pages in before timing
        cq = d0.create_cq(1 << 16)
        qp = d0.create_qp(cq, None, args.depth, 4)
        signal_every = args.depth // 4

        _time_wqes(qp, cq, src, dst, 10_000, 4096, span, signal_every)  # warm-up
        rate_times = [_time_wqes(qp, cq, src, dst, args.wqes, 4096, span, signal_every) for _ in range(args.trials)]
        wqe_rate = args.wqes / statistics.median(rate_times)

        mb = 1 << 20
        _time_wqes(qp, cq, src, dst, 16, mb, span, 1)
        bw_times = [_time_wqes(qp, cq, src, dst, args.mb_writes, mb, span, 1) for _ in range(args.trials)]
        src_np, dst_np = np.frombuffer(src, dtype=np.uint8), np.frombuffer(dst, dtype=np.uint8)
        _time_memcpy(src_np, dst_np, 16, mb, span)
        cp_times = [_time_memcpy(src_np, dst_np, args.mb_writes, mb, span) for _ in range(args.trials)]
        nic_bw = args.mb_writes * mb / statistics.median(bw_times) / 1e9
        memcpy_bw = args.mb_writes * mb / statistics.median(cp_times) / 1e9

    results.update(
        {
            "wqe_rate_4k_per_s": wqe_rate,
            "wqe_rate_trials_s": rate_times,
            "wqes_per_trial": args.wqes,
            "nic_copy_1mb_GBps": nic_bw,
            "memcpy_1mb_GBps": memcpy_bw,
            "copy_ratio": nic_bw / memcpy_bw,
            "sq_depth": args.depth,
            "signal_every": signal_every,
        }
    )
    rows = [
        ("WQE rate, 4 KB writes, one SQ", f"{wqe_rate / 1e6:.2f} M WQE/s", ">= 1 M WQE/s"),
        ("copy bandwidth, 1 MB writes", f"{nic_bw:.2f} GB/s", ""),
        ("memcpy, same 1 MB chunks", f"{memcpy_bw:.2f} GB/s", ""),
        ("NIC copy / memcpy", f"{100 * nic_bw / memcpy_bw:.0f} %", ">= 50 %"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'median of ' + str(args.trials):>16}  target")
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:>16}  {target}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "emulator_bench.json").write_text(_json.dumps(results, indent=2))
    return 0
