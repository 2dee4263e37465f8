"""Host cost and latency of :class:`CudaTransferEngine` requests against the bare copier, per kind.

For each case and kind: ``submit`` µs (host time of ``engine.submit``), ``wait`` µs (host time from submit to the
end of ``ticket.wait``, i.e. end to end with the notify), p50 over ``--repeats`` requests after two warm-ups; the
bare ``DeviceCopier.run`` + stream sync of the same pattern is the reference row. Every request is checked exact.

    python3 tools/bench_cuda_engine.py [--repeats 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ascend_dualpath.transport.cuda import DeviceCopier
from ascend_dualpath.transport.cuda_engine import CudaTransferEngine

CASES = {"61x42K layer blocks": (61, 42 * 1024), "64x1M": (64, 1 << 20), "1x4K": (1, 4096)}
KINDS = ("aiv", "aiv prepared", "staging", "aicpu", "host")  # "prepared": engine.prepare() once, then .submit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", action="store_true",
                        help="cProfile prepared aiv requests of 61x42K (submit + wait) instead")
    args = parser.parse_args()
    src_dev = torch.device("cuda:0")
    dst_dev = torch.device("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    torch.cuda.set_device(src_dev)
    notify = torch.zeros(1, dtype=torch.int64, device=dst_dev)
    engine = CudaTransferEngine(src_dev, dst_dev, notify)
    if args.profile:
        _profile(engine, dst_dev, args.repeats)
        return
    rows = []
    print(f"{torch.cuda.get_device_name(0)} -> {dst_dev}; p50 of {args.repeats} requests")
    print(f"{'case':<22}{'kind':<14}{'submit us':>11}{'end to end us':>15}")
    for name, (count, size) in CASES.items():
        device_src = torch.randint(0, 256, (count * size,), dtype=torch.uint8, device=src_dev)
        host_src = device_src.cpu().pin_memory()
        engine.register(host_src)
        dst = torch.empty(count * size, dtype=torch.uint8, device=dst_dev)
        torch.cuda.synchronize()
        remote = engine.slot(dst)
        for kind in ("copier",) + KINDS:
            source = host_src if kind in ("staging", "host") else device_src
            segments = [engine.segment(source, i * size, size) for i in range(count)]
            submit_us, total_us = _measure(engine, kind, segments, remote, args.repeats, dst, device_src)
            rows.append({"case": name, "kind": kind, "submit_us_p50": submit_us, "end_to_end_us_p50": total_us})
            print(f"{name:<22}{kind:<14}{submit_us:>11.1f}{total_us:>15.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"gpu": torch.cuda.get_device_name(0), "peer": dst_dev != src_dev, "rows": rows}, out, indent=1)


def _measure(engine, kind, segments, remote, repeats, dst, expected):
    submits, totals = [], []
    prepared = engine.prepare(segments, remote, notify_slot=0, kind="aiv") if kind == "aiv prepared" else None
    if kind == "copier":  # the bare device kernel of the same pattern, synchronised on its stream
        copier = DeviceCopier(engine.device, torch.zeros(1, dtype=torch.int64, device=engine.device))
        plan = copier.plan([s.addr for s in segments], [remote.addr + i * s.nbytes for i, s in enumerate(segments)],
                           [s.nbytes for s in segments])
    for i in range(repeats + 2):
        dst.zero_()
        torch.cuda.synchronize(dst.device)
        torch.cuda.synchronize(engine.device)
        start = time.perf_counter()
        if kind == "copier":
            copier.run(plan, i + 1)
            submitted = time.perf_counter()
            torch.cuda.current_stream().synchronize()
        else:
            ticket = prepared.submit() if prepared else engine.submit(segments, remote, notify_slot=0, kind=kind)
            submitted = time.perf_counter()
            ticket.wait()
        done = time.perf_counter()
        if not torch.equal(dst, expected.to(dst.device)):
            raise AssertionError(f"{kind}: the destination differs from the source")
        if i >= 2:
            submits.append((submitted - start) * 1e6)
            totals.append((done - start) * 1e6)
    return statistics.median(submits), statistics.median(totals)


def _profile(engine, dst_dev, repeats) -> None:
    import cProfile
    import pstats

    count, size = CASES["61x42K layer blocks"]
    src = torch.randint(0, 256, (count * size,), dtype=torch.uint8, device=engine.device)
    dst = torch.empty(count * size, dtype=torch.uint8, device=dst_dev)
    segments = [engine.segment(src, i * size, size) for i in range(count)]
    prepared = engine.prepare(segments, engine.slot(dst), notify_slot=0)
    prepared.transfer()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeats):
        prepared.transfer()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
