"""Where the host time of the cuda strategy's eager MoE ops goes (2 GPUs, one process per rank).

For each op (layout, cached BF16 dispatch, combine, fresh dispatch) rank 0 reports the median host time per call
over ``--iters`` calls (``perf_counter`` around the call, the GPU kept busy by a sleep kernel so that no call waits
on the device; the fresh dispatch, which waits for its count exchange, on an idle GPU), then profiles the same calls with cProfile and prints the functions with the most own time.
Calibration rows time plain torch calls on the same host (an empty CUDA tensor, a 4-element ``zero_``, an empty
Triton kernel through :class:`ascend_dualpath._triton_launch.LaunchSite`), so a slow host can be told apart from a
slow code path.

    python3 tools/profile_moe_host.py --tokens 4096 --hidden 7168 --iters 200 [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
import time

import triton
import triton.language as tl


@triton.jit
def _empty_kernel(x_ptr, N: tl.constexpr):
    pass


def _host_us(fn, iters: int, hold: bool = True) -> float:
    import torch

    samples = []
    for _ in range(iters):
        if hold:  # keep the GPU busy so that the call's kernels cannot start (and nothing waits on them)
            torch.cuda._sleep(2_000_000)
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def _profile(fn, iters: int, top: int, hold: bool = True) -> str:
    import torch

    profiler = cProfile.Profile()
    for _ in range(iters):
        if hold:
            torch.cuda._sleep(2_000_000)
        profiler.enable()
        fn()
        profiler.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def _calibration(iters: int) -> list[tuple[str, float]]:
    import torch

    from ascend_dualpath._triton_launch import LaunchSite

    small = torch.zeros(4, dtype=torch.int32, device="cuda")
    site = LaunchSite(_empty_kernel, 1, dict(N=1))
    site(small)
    torch.cuda.synchronize()
    return [
        (
            "torch.empty(4096, 7168, bf16)",
            _host_us(lambda: torch.empty(4096, 7168, dtype=torch.bfloat16, device="cuda"), iters),
        ),
        ("small.zero_()", _host_us(small.zero_, iters)),
        ("LaunchSite(empty kernel)", _host_us(lambda: site(small), iters)),
        ("python no-op call", _host_us(lambda: None, iters)),
    ]


def _worker(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from ascend_dualpath.bench.moe import join_group, make_inputs
    from ascend_dualpath.moe import Buffer

    device, group = join_group(rank, world, store)
    x, topk_idx, topk_weights = make_inputs(args.tokens, args.hidden, args.experts, args.topk, device, seed=rank)
    buffer = Buffer(group, num_nvl_bytes=int(4e9), strategy="cuda")
    layout = buffer.get_dispatch_layout(topk_idx, args.experts)
    recv_x, _, _, _, handle, _ = buffer.dispatch(
        x,
        num_tokens_per_rank=layout[0],
        is_token_in_rank=layout[3],
        num_tokens_per_expert=layout[2],
        topk_idx=topk_idx,
        topk_weights=topk_weights,
    )
    ops = {
        "layout": lambda: buffer.get_dispatch_layout(topk_idx, args.experts),
        "dispatch bf16 (cached)": lambda: buffer.dispatch(x, handle=handle),
        "combine bf16": lambda: buffer.combine(recv_x, handle),
        "dispatch bf16 (fresh, layout given)": lambda: buffer.dispatch(
            x,
            num_tokens_per_rank=layout[0],
            is_token_in_rank=layout[3],
            num_tokens_per_expert=layout[2],
            topk_idx=topk_idx,
            topk_weights=topk_weights,
        ),
    }
    report = []
    if rank == 0:
        report.append(f"host: {os.cpu_count()} CPUs, python {sys.version.split()[0]}, torch {torch.__version__}")
        report += [f"calibration  {name:<40} {us:8.1f} us" for name, us in _calibration(args.iters)]
    dist.barrier(group)  # rank 1 waits out rank 0's calibration before the first collective op
    for name, fn in ops.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        dist.barrier(group)
        fresh = "fresh" in name  # syncs with the host at its count exchange: timed on an idle GPU
        iters = max(10, args.iters // 10) if fresh else args.iters
        us = _host_us(fn, iters, hold=not fresh)
        dist.barrier(group)
        text = _profile(fn, iters, args.top, hold=not fresh)
        dist.barrier(group)
        if rank == 0:
            report.append(f"op  {name:<40} {us:8.1f} us host per call (median of {iters})")
            report.append(text)
    if rank == 0:
        out = "\n".join(report)
        print(out, flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "profile_moe_host.txt"), "w") as handle_out:
                handle_out.write(out)
    buffer.destroy()
    dist.barrier(group)
    dist.destroy_process_group()


def main() -> int:
    import torch.multiprocessing as mp

    from ascend_dualpath.bench.moe import add_workload_arguments

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--top", type=int, default=25, help="functions listed per op")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    store = tempfile.mktemp(prefix="adp_profile_moe_")
    mp.spawn(_worker, args=(2, store, args), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
