"""Where the time of one host-to-device layer block (61 x 42 KiB, strided in a registered pinned buffer) goes.

    python3 tools/gpu_probe_h2d_layer.py [--out DIR]      # writes probe_h2d_layer.json there

Rows (median of 200, each after ``torch.cuda.synchronize()``, wall clock; GPU time from CUDA events):

- ``2d + sync``: one ``cudaMemcpy2DAsync`` then ``cudaStreamSynchronize``: the copy engine's floor for the shape;
- ``2d + word same stream``: the copy, then the host word written on the same stream (one ``cuStreamBatchMemOp``),
  the host polling the word;
- ``2d + word tail stream``: as the engine does (an event, the tail stream's write);
- ``split K``: the rows cut into K 2-D copies on K streams (K copy engines at once), joined, then synchronised;
- ``1d NNN KiB + sync``: one contiguous copy of the same bytes, and of other sizes: the fixed cost of one copy;
- ``engine ...``: the engine's prepared request (the *strided copy* gate) on a side stream and on torch's default
  stream, with the host time from ``submit()`` to the copy's enqueue and of the whole ``submit()``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
KIB = 1024
COUNT, WIDTH, STRIDE = 61, 42 * KIB, 61 * 42 * KIB
REPEATS = 200


def timed(torch, submit, finish) -> dict:
    """Median wall (sync, submit, finish) and GPU time (events around submit) in µs."""
    walls, gpus = [], []
    for _ in range(REPEATS + 5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        finish(submit())
        walls.append((time.perf_counter() - t0) * 1e6)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000)
        start.record()
        finish_later = submit()
        end.record()
        finish(finish_later)
        torch.cuda.synchronize()
        gpus.append(start.elapsed_time(end) * 1e3)
    return {"wall_us": statistics.median(walls[5:]), "gpu_us": statistics.median(gpus[5:])}


def engine_rows(torch, dev, host, dst, rt) -> dict:
    """The engine's prepared strided request, timed like the bench, on a side stream and on the default stream."""
    from ascend_dualpath.transport.cuda_engine import CudaTransferEngine

    rows = {}
    engine = CudaTransferEngine(dev, dev, torch.zeros(4, dtype=torch.int64, device=dev), timeout_s=30)
    engine.register(host)
    segments = [engine.segment(host, i * STRIDE, WIDTH) for i in range(COUNT)]
    prepared = engine.prepare(segments, engine.slot(dst), notify_slot=0)
    work = prepared.state["work"]
    copy, marks = work.copy2d, []

    def marked(stream):
        marks.append(time.perf_counter())
        copy(stream)

    work.copy2d = marked
    for where, context in (
        ("side stream", torch.cuda.stream(torch.cuda.Stream(dev))),
        ("default stream", nullcontext()),
    ):
        with context:
            issue, submit = [], []

            def go(issue=issue, submit=submit):
                t0 = time.perf_counter()
                ticket = prepared.submit()
                submit.append((time.perf_counter() - t0) * 1e6)
                issue.append((marks[-1] - t0) * 1e6)
                return ticket

            row = timed(torch, go, lambda ticket: ticket.wait())
            row["issue_us"], row["submit_us"] = statistics.median(issue), statistics.median(submit)
            rows[f"engine {where} ({prepared.selection.decided_by})"] = row
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or ".")
    args = parser.parse_args()
    import torch

    from ascend_dualpath.transport import cudart
    from ascend_dualpath.transport.cuda import HostWord

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    host = torch.randint(0, 256, (COUNT * STRIDE,), dtype=torch.uint8).pin_memory()
    dst = torch.empty(COUNT * WIDTH, dtype=torch.uint8, device=dev)
    want = torch.cat([host[i * STRIDE : i * STRIDE + WIDTH] for i in range(COUNT)]).to(dev)
    stream = torch.cuda.Stream(dev)
    handle = stream.cuda_stream
    rt = cudart.runtime()
    rows = {}

    def two_d(rows_from=0, rows_to=COUNT):
        return cudart.Memcpy2D(
            dst.data_ptr() + rows_from * WIDTH,
            WIDTH,
            host.data_ptr() + rows_from * STRIDE,
            STRIDE,
            WIDTH,
            rows_to - rows_from,
        )

    def sync(_):
        rt.lib.cudaStreamSynchronize(torch.cuda.current_stream().cuda_stream)

    with torch.cuda.stream(stream):
        copy = two_d()
        rows["2d + sync"] = timed(torch, lambda: copy(handle), sync)
        word, values = HostWord(torch), iter(range(1, 1 << 60))
        writes = cudart.StreamWrites([word.addr])

        def same_stream():
            copy(handle)
            value = next(values)
            writes(handle, value)
            return value

        def poll(value):
            while not word.reached(value):
                pass

        rows["2d + word same stream"] = timed(torch, same_stream, poll)
        tail = cudart.TailStream(torch, dev)

        def tail_stream():
            copy(handle)
            value = next(values)
            writes(tail.follow(handle), value)
            return value

        rows["2d + word tail stream"] = timed(torch, tail_stream, poll)
        for k in (2, 3, 4):
            streams = [torch.cuda.Stream(dev) for _ in range(k - 1)]
            cuts = [round(i * COUNT / k) for i in range(k + 1)]
            parts = [two_d(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
            fork, joins = torch.cuda.Event(), [torch.cuda.Event() for _ in streams]

            def split(parts=parts, streams=streams, fork=fork, joins=joins):
                fork.record(stream)
                for part, side, join in zip(parts[1:], streams, joins, strict=True):
                    side.wait_event(fork)
                    part(side.cuda_stream)
                    join.record(side)
                parts[0](handle)
                for join in joins:
                    stream.wait_event(join)

            rows[f"split {k}"] = timed(torch, split, sync)
        dst.zero_()
        copy(handle)
        stream.synchronize()
        exact = bool(torch.equal(dst, want))
        for kib in (256, 1024, COUNT * WIDTH // KIB, 8192, 32768):
            src = host[: kib * KIB]
            out = torch.empty(kib * KIB, dtype=torch.uint8, device=dev)
            rows[f"1d {kib} KiB + sync"] = timed(
                torch, lambda out=out, src=src: out.copy_(src, non_blocking=True), sync
            )
            rows[f"1d {kib} KiB + sync"]["gbps"] = kib * KIB / (rows[f"1d {kib} KiB + sync"]["gpu_us"] * 1e3)
    rows.update(engine_rows(torch, dev, host, dst, rt))
    for name, row in rows.items():
        extra = {k: round(v, 2) for k, v in row.items() if k not in ("wall_us", "gpu_us")}
        print(f"{name:<40} wall {row['wall_us']:8.1f} us  gpu {row['gpu_us']:8.1f} us  {extra}")
    print("2-D copy bit-exact:", exact)
    with open(os.path.join(args.out, "probe_h2d_layer.json"), "w") as f:
        json.dump({"rows": rows, "bit_exact": exact, "shape": [COUNT, WIDTH, STRIDE]}, f, indent=1)
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
