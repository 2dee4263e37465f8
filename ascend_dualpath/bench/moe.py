"""``bench moe``: dispatch/combine time and bandwidth of MoE strategies, against ``alltoall`` in the same run.

Spawns one process per GPU (nccl) or ``--ranks`` CPU processes (gloo). Every timed call is preceded by a
barrier and an L2 flush; a call's time is the slowest rank's. Bandwidth is reported two ways:
``logical`` counts every received row, a rank's own tokens included (DeepEP's convention), ``cross``
counts only rows that crossed between devices. ``host us`` is the median time until the Python call returns
(GPU work may still be running then): where it nears the timed figure, host overhead is what bounds the op.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank, normal mode")
    parser.add_argument("--ll-tokens", type=int, default=128, help="tokens per rank, low-latency mode")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--strategies", default="cuda,alltoall", help="comma-separated; alltoall is the baseline")
    parser.add_argument("--ranks", type=int, default=0, help="processes (default: CUDA GPUs, else 2 on CPU)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--num-sms", default="0", help="comma-separated SM counts for cuda; 0 = bandwidth model")
    parser.add_argument("--json", default="", help="write all results here")


def _time(fn, iters, warmup, device, group):
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if cuda else None
    import time

    samples, host = [], []
    for _ in range(iters):
        dist.barrier(group)
        if cuda:
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            seconds = time.perf_counter() - t0
            host.append(seconds)
        slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        samples.append(float(slowest))
    return samples, host


def _worker(rank, world, store, args, queue):
    import torch
    import torch.distributed as dist

    from ascend_dualpath.moe import Buffer, Config, quant

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            **({"device_id": device} if cuda else {}))
    group = dist.group.WORLD
    g = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(args.tokens, args.hidden, device=device, generator=g).to(torch.bfloat16)
    scores = torch.randn(args.tokens, args.experts, device=device, generator=g).abs() + 1
    topk_idx = scores.topk(args.topk, dim=1).indices
    topk_weights = torch.rand(args.tokens, args.topk, device=device, generator=g)
    x_fp8 = quant.per_token_cast_to_fp8(x)
    ll_x, ll_idx, ll_w = x[:args.ll_tokens], topk_idx[:args.ll_tokens], topk_weights[:args.ll_tokens]
    rows = []
    for strategy in args.strategies.split(","):
        sm_list = [int(s) for s in args.num_sms.split(",")] if strategy == "cuda" else [0]
        for num_sms in sm_list:
            buffer = Buffer(group, num_nvl_bytes=int(4e9), num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(
                args.ll_tokens, args.hidden, world, args.experts), low_latency_mode=True, strategy=strategy)
            config = Config(num_sms=num_sms)
            layout = buffer.get_dispatch_layout(topk_idx, args.experts)
            recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
                x, num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1], is_token_in_rank=layout[3],
                num_tokens_per_expert=layout[2], topk_idx=topk_idx, topk_weights=topk_weights, config=config)
            recv_counts = handle.plan.count_matrix[:, rank]
            logical_rows, cross_rows = int(recv_counts.sum()), int(recv_counts.sum() - recv_counts[rank])
            used_sms = handle.plan.private.get("model_sms") if not num_sms else num_sms
            bf16_row, fp8_row = args.hidden * 2, args.hidden + args.hidden // 128 * 4

            def op(name, fn, row_bytes):
                samples, host = _time(fn, args.iters, args.warmup, device, group)
                rows.append(dict(strategy=strategy, num_sms=used_sms if strategy == "cuda" else None, op=name,
                                 mean_us=statistics.mean(samples) * 1e6, median_us=statistics.median(samples) * 1e6,
                                 min_us=min(samples) * 1e6, host_us=statistics.median(host) * 1e6,
                                 logical_bytes=logical_rows * row_bytes,
                                 cross_bytes=cross_rows * row_bytes))

            op("layout", lambda: buffer.get_dispatch_layout(topk_idx, args.experts), 0)
            op("dispatch bf16 (cached)", lambda: buffer.dispatch(x, handle=handle, config=config), bf16_row)
            op("dispatch fp8 (cached)", lambda: buffer.dispatch(x_fp8, handle=handle, config=config), fp8_row)
            op("dispatch bf16 (with topk, layout given)", lambda: buffer.dispatch(
                x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
                topk_idx=topk_idx, topk_weights=topk_weights, config=config), bf16_row)
            op("combine bf16", lambda: buffer.combine(recv_x, handle, config=config), bf16_row)
            if num_sms == sm_list[0]:
                ll = buffer.low_latency_dispatch(ll_x, ll_idx, args.ll_tokens, args.experts, use_fp8=True)
                ll_bf16 = torch.zeros_like(ll[0][0], dtype=torch.bfloat16)
                valid = int(ll[1].sum())
                before = len(rows)
                op("ll dispatch fp8", lambda: buffer.low_latency_dispatch(ll_x, ll_idx, args.ll_tokens, args.experts,
                                                                         use_fp8=True), fp8_row + 16)
                op("ll combine bf16", lambda: buffer.low_latency_combine(ll_bf16, ll_idx, ll_w, ll[2]), bf16_row)
                for row in rows[before:]:  # LL bytes: one message per valid (token, expert) received
                    row["logical_bytes"] = valid * (fp8_row + 16 if "dispatch" in row["op"] else bf16_row)
                    row["cross_bytes"] = None
            buffer.destroy()
    if rank == 0:
        queue.put(dict(world=world, device=torch.cuda.get_device_name(0) if cuda else "cpu",
                       torch=torch.__version__, rows=rows))
    dist.barrier(group)
    dist.destroy_process_group()


def _table(result) -> str:
    lines = [f"{'strategy':<9} {'sms':>4} {'op':<40} {'median us':>10} {'mean us':>10} {'host us':>8} "
             f"{'logical GB/s':>12} {'cross GB/s':>10}"]
    for r in result["rows"]:
        t = r["median_us"] / 1e6
        logical = f"{r['logical_bytes'] / t / 1e9:.0f}" if r["logical_bytes"] else "-"
        cross = f"{r['cross_bytes'] / t / 1e9:.0f}" if r.get("cross_bytes") else "-"
        lines.append(f"{r['strategy']:<9} {str(r['num_sms'] or '-'):>4} {r['op']:<40} {r['median_us']:>10.1f} "
                     f"{r['mean_us']:>10.1f} {r['host_us']:>8.1f} {logical:>12} {cross:>10}")
    return "\n".join(lines)


def sm_calibration(rows: list[dict]) -> dict | None:
    """Per-SM write throughput of the cuda strategy's copy kernels, from the cached BF16 dispatch at the
    smallest SM count measured (where the SMs, not NVLink, bound it): every written row (own and peer)
    per second per SM. This is the figure ``choose_num_sms`` takes as ``sm_write_gbs``."""
    runs = [r for r in rows if r["strategy"] == "cuda" and r["op"] == "dispatch bf16 (cached)" and r["num_sms"]]
    if not runs:
        return None
    fewest = min(runs, key=lambda r: r["num_sms"])
    per_sm = fewest["logical_bytes"] / (fewest["median_us"] / 1e6) / 1e9 / fewest["num_sms"]
    return dict(num_sms=fewest["num_sms"], per_sm_write_gbs=per_sm)


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.multiprocessing as mp

    world = args.ranks or (torch.cuda.device_count() if torch.cuda.device_count() >= 2 else 2)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = tempfile.mktemp(prefix="adp_bench_moe_")
    procs = [ctx.Process(target=_worker, args=(r, world, store, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    import queue as queue_module
    import time

    result, deadline = None, time.monotonic() + 540
    try:
        while result is None and time.monotonic() < deadline:
            try:
                result = queue.get(timeout=2)
            except queue_module.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break  # a rank failed; its traceback is on stderr
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if result is None:
        print("bench moe: no result (a rank failed or the run exceeded 540 s)", file=sys.stderr)
        return 1
    result["args"] = vars(args)
    result["sm_calibration"] = sm_calibration(result["rows"])
    print(_table(result))
    if result["sm_calibration"]:
        print("sm calibration: {per_sm_write_gbs:.1f} GB/s written per SM (cached BF16 dispatch at {num_sms} SMs)"
              .format(**result["sm_calibration"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m ascend_dualpath.bench.moe", description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
