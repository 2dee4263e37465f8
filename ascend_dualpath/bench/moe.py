"""``bench moe``: dispatch/combine time and bandwidth of MoE strategies, against ``alltoall`` in the same run.

Spawns one process per GPU (nccl) or ``--ranks`` CPU processes (gloo). Every timed call is preceded by a
barrier and an L2 flush; a call's time is the slowest rank's. Three times per op, each the median of
``--iters`` calls:

- ``median us``: CUDA events around the call on an idle GPU: what a caller waits, host enqueue included;
- ``gpu us``: the same, with the stream first held by a sleep kernel so the whole call is enqueued before
  the GPU reaches it: device time alone (for ops that synchronise with the host, such as the layout's bounds
  check and a fresh dispatch's count exchange, the host work after the sync is still included);
- ``host us``: CPU time until the call returned (idle-GPU run: one call after a barrier, a cold host path);
- ``loop us``: DeepEP's own method: ``--iters`` calls back to back, each preceded by the L2 flush and timed by
  CUDA events around it, no synchronisation in between, so the host runs ahead of the GPU as in a model's
  forward pass (an op whose host time exceeds its device time shows its host time here).

Bandwidth is reported two ways: ``logical`` counts every received row, a rank's own tokens included (DeepEP's
convention), ``cross`` counts only rows that crossed between devices. Rows ``(graph)`` replay the cached
dispatch or combine recorded with :meth:`~ascend_dualpath.moe.Buffer.capture_graph` (cuda strategy).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from ascend_dualpath import _args, _json
from ascend_dualpath._progress import ProgressLines


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The normal-mode workload (``--tokens/--hidden/--topk/--experts``), shared with the GPU tools."""
    parser.add_argument("--tokens", type=_args.positive_int(1 << 20), default=4096, help="tokens per rank, normal mode")
    parser.add_argument("--hidden", type=_args.positive_int(1 << 16), default=7168)
    parser.add_argument("--topk", type=_args.positive_int(1024), default=8)
    parser.add_argument("--experts", type=_args.positive_int(1 << 16), default=256)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument(
        "--ll-tokens", type=_args.positive_int(1 << 16), default=128, help="tokens per rank, low-latency mode"
    )
    parser.add_argument(
        "--strategies",
        default="auto",
        help="comma-separated, or auto: every strategy available on this machine (alltoall, the "
        "baseline, always is); an unavailable one named explicitly is reported, not run",
    )
    parser.add_argument(
        "--ranks", type=_args.nonneg_int(256), default=0, help="processes (default: CUDA GPUs, else 2 on CPU)"
    )
    parser.add_argument("--iters", type=_args.positive_int(10**6), default=20)
    parser.add_argument("--warmup", type=_args.nonneg_int(10**6), default=5)
    parser.add_argument(
        "--num-sms",
        type=_args.NumberList(_args.nonneg_int(1024)),
        default="0",
        help="comma-separated SM counts for cuda; 0 = bandwidth model",
    )
    parser.add_argument("--json", default="", help="write all results here")
    parser.add_argument(
        "--deadline-s", type=_args.TIMEOUT_S, default=540, help="print what was measured by then and stop"
    )
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph replay rows")


# Cycles the sleep kernel holds the stream for (about 2.5 ms on an H200): longer than any sync-free enqueue.
PRELOAD_CYCLES = 5_000_000


def _time(fn, iters, warmup, device, group):
    """Returns (end-to-end seconds, device seconds, host seconds) per call; the first two are the slowest rank's."""
    import time

    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    cuda = device.type == "cuda"
    flush = torch.empty(256 << 20, dtype=torch.int8, device=device) if cuda else None
    samples, device_samples, host = [], [], []
    for _ in range(iters):
        pair = []
        for preload in (False, True) if cuda else (False,):
            dist.barrier(group)
            if cuda:
                flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                if preload:
                    torch.cuda._sleep(PRELOAD_CYCLES)
                start.record()
                t0 = time.perf_counter()
                fn()
                spent = time.perf_counter() - t0
                end.record()
                torch.cuda.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                fn()
                seconds = spent = time.perf_counter() - t0
            if not preload:
                host.append(spent)
            pair.append(seconds)
        slowest = torch.tensor(pair, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        samples.append(float(slowest[0]))
        device_samples.append(float(slowest[-1]))
    return samples, device_samples, host, _loop(fn, iters, flush, device, group)


def _loop(fn, iters, flush, device, group) -> float:
    """Median seconds per call of ``iters`` back-to-back calls (slowest rank), each after an L2 flush."""
    import time

    import torch
    import torch.distributed as dist

    dist.barrier(group)
    if device.type != "cuda":
        seconds = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - t0)
        median = statistics.median(seconds)
    else:
        torch.cuda.synchronize()
        events = []
        for _ in range(iters):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        median = statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)
    slowest = torch.tensor([median], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest[0])


@dataclass
class _Rank:
    """What every measurement of one rank shares: its place in the group, where rows go, and its inputs."""

    args: argparse.Namespace
    rank: int
    world: int
    device: Any  # torch.device; torch is imported in the worker only
    group: Any
    queue: Any
    cuda: bool
    x: Any  # bf16 [tokens, hidden]
    x_fp8: Any  # (fp8 [tokens, hidden], float32 scales [tokens, hidden / 128])
    topk_idx: Any  # int64 [tokens, topk]
    topk_weights: Any  # float32 [tokens, topk]


def join_group(rank: int, world: int, store: str):
    """Join the ``world``-rank process group rendezvousing at the file ``store``: nccl with one GPU per rank where
    there are enough GPUs, else gloo on the CPU. Returns ``(device, group)``."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        **({"device_id": device} if cuda else {}),
    )
    return device, dist.group.WORLD


def make_inputs(tokens: int, hidden: int, num_experts: int, num_topk: int, device, seed: int):
    """The benchmark's inputs for one rank: ``x`` bf16 [tokens, hidden], ``topk_idx`` int64 [tokens, num_topk]
    (distinct experts per token, uniformly random), ``topk_weights`` float32 [tokens, num_topk] in [0, 1)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=device, generator=g).to(torch.bfloat16)
    scores = torch.randn(tokens, num_experts, device=device, generator=g).abs() + 1
    topk_idx = scores.topk(num_topk, dim=1).indices
    topk_weights = torch.rand(tokens, num_topk, device=device, generator=g)
    return x, topk_idx, topk_weights


def _worker(rank, world, store, args, queue):
    import torch
    import torch.distributed as dist

    from ascend_dualpath._process import watch_parent
    from ascend_dualpath.moe import quant

    watch_parent(os.getppid())  # a rank outliving the benchmark (killed) would wait on its peers for nothing

    device, group = join_group(rank, world, store)
    cuda = device.type == "cuda"
    if rank == 0:
        queue.put(
            (
                "meta",
                dict(world=world, device=torch.cuda.get_device_name(0) if cuda else "cpu", torch=torch.__version__),
            )
        )
    x, topk_idx, topk_weights = make_inputs(args.tokens, args.hidden, args.experts, args.topk, device, seed=rank)
    ctx = _Rank(
        args=args,
        rank=rank,
        world=world,
        device=device,
        group=group,
        queue=queue,
        cuda=cuda,
        x=x,
        x_fp8=quant.per_token_cast_to_fp8(x),
        topk_idx=topk_idx,
        topk_weights=topk_weights,
    )
    runnable = _runnable_strategies(args.strategies, group, rank, queue)
    if rank == 0:
        queue.put(("expected", _row_count(args, runnable, cuda)))
    for strategy in runnable:
        sm_list = list(args.num_sms) if strategy == "cuda" else [0]
        for num_sms in sm_list:
            # low-latency mode does not take an SM count: measured once per strategy
            _measure(ctx, strategy, num_sms, with_low_latency=num_sms == sm_list[0])
    if rank == 0:
        queue.put(("done", None))
    dist.barrier(group)
    dist.destroy_process_group()


def _row_count(args: argparse.Namespace, runnable: list[str], cuda: bool) -> int:
    """Rows the run reports: one per unavailable strategy named, and per runnable one and SM count, the five
    normal-mode ops, the three graph replays (cuda strategy on a GPU) and, once per strategy, the two LL ops."""
    named = len(args.strategies.split(",")) if args.strategies != "auto" else len(runnable)
    rows = named - len(runnable)
    for strategy in runnable:
        graphs = strategy == "cuda" and cuda and not args.no_graphs
        rows += (len(args.num_sms) if strategy == "cuda" else 1) * (5 + 3 * graphs) + 2
    return rows


def _runnable_strategies(names: str, group: Any, rank: int, queue: Any) -> list[str]:
    """The strategies to measure: ``auto`` = every available one in the registry's order; an unavailable (or
    unknown) name given explicitly becomes one error row (rank 0) instead of a traceback. Availability is the same
    on every rank (it depends on the machine and the group), so every rank skips the same ones."""
    from ascend_dualpath.errors import ConfigError
    from ascend_dualpath.moe import strategies

    explicit = names != "auto"
    runnable = []
    for name in names.split(",") if explicit else strategies.AUTO_ORDER:
        try:
            ok, reason = strategies.availability(name, group)
        except ConfigError as exc:
            ok, reason = False, str(exc)
        if ok:
            runnable.append(name)
        elif explicit and rank == 0:
            queue.put(("row", dict(strategy=name, num_sms=None, op="-", error=f"unavailable: {reason}")))
    return runnable


def _measure(ctx: _Rank, strategy: str, num_sms: int, with_low_latency: bool) -> None:
    """Measures every op of ``strategy`` at ``num_sms`` on a fresh buffer; rank 0 queues one row per op."""
    import torch

    from ascend_dualpath.moe import Buffer, Config

    args, rank, queue = ctx.args, ctx.rank, ctx.queue
    x, x_fp8, topk_idx, topk_weights = ctx.x, ctx.x_fp8, ctx.topk_idx, ctx.topk_weights
    buffer = Buffer(
        ctx.group,
        num_nvl_bytes=int(4e9),
        num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(args.ll_tokens, args.hidden, ctx.world, args.experts),
        low_latency_mode=True,
        strategy=strategy,
    )
    config = Config(num_sms=num_sms)
    layout = buffer.get_dispatch_layout(topk_idx, args.experts)
    recv_x, _, _, _, handle, _ = buffer.dispatch(
        x,
        num_tokens_per_rank=layout[0],
        num_tokens_per_rdma_rank=layout[1],
        is_token_in_rank=layout[3],
        num_tokens_per_expert=layout[2],
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        config=config,
    )
    recv_counts = handle.plan.count_matrix[:, rank]
    logical_rows, cross_rows = int(recv_counts.sum()), int(recv_counts.sum() - recv_counts[rank])
    used_sms = handle.plan.private.get("model_sms") if not num_sms else num_sms
    bf16_row, fp8_row = args.hidden * 2, args.hidden + args.hidden // 128 * 4

    def op(name, fn, row_bytes, ll_valid=None):
        samples, device_samples, host, loop = _time(fn, args.iters, args.warmup, ctx.device, ctx.group)
        row = dict(
            strategy=strategy,
            num_sms=used_sms if strategy == "cuda" else None,
            op=name,
            mean_us=statistics.mean(samples) * 1e6,
            median_us=statistics.median(samples) * 1e6,
            min_us=min(samples) * 1e6,
            gpu_us=statistics.median(device_samples) * 1e6,
            host_us=statistics.median(host) * 1e6,
            loop_us=loop * 1e6,
            logical_bytes=logical_rows * row_bytes,
            cross_bytes=cross_rows * row_bytes,
        )
        if ll_valid is not None:  # LL bytes: one message per valid (token, expert) received
            row.update(logical_bytes=ll_valid * row_bytes, cross_bytes=None)
        if rank == 0:
            queue.put(("row", row))

    def graph_op(name, fn, row_bytes):
        """Capture ``fn`` (collective) and time its replay; a failed capture is reported as a row."""
        try:
            graph = buffer.capture_graph(fn)
        except Exception as exc:  # every rank fails the same way (same calls): report, go on
            if rank == 0:
                queue.put(("row", dict(strategy=strategy, num_sms=used_sms, op=name, error=repr(exc)[:300])))
            return
        op(name, graph.replay, row_bytes)

    op("layout", lambda: buffer.get_dispatch_layout(topk_idx, args.experts), 0)
    op("dispatch bf16 (cached)", lambda: buffer.dispatch(x, handle=handle, config=config), bf16_row)
    op("dispatch fp8 (cached)", lambda: buffer.dispatch(x_fp8, handle=handle, config=config), fp8_row)
    op(
        "dispatch bf16 (with topk, layout given)",
        lambda: buffer.dispatch(
            x,
            num_tokens_per_rank=layout[0],
            is_token_in_rank=layout[3],
            num_tokens_per_expert=layout[2],
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            config=config,
        ),
        bf16_row,
    )
    op("combine bf16", lambda: buffer.combine(recv_x, handle, config=config), bf16_row)
    if strategy == "cuda" and ctx.cuda and not args.no_graphs:
        graph_op("dispatch bf16 (cached, graph)", lambda: buffer.dispatch(x, handle=handle)[0], bf16_row)
        graph_op("dispatch fp8 (cached, graph)", lambda: buffer.dispatch(x_fp8, handle=handle)[0], fp8_row)
        graph_op("combine bf16 (graph)", lambda: buffer.combine(recv_x, handle)[0], bf16_row)
    if with_low_latency:
        ll_x, ll_idx, ll_w = x[: args.ll_tokens], topk_idx[: args.ll_tokens], topk_weights[: args.ll_tokens]
        ll = buffer.low_latency_dispatch(ll_x, ll_idx, args.ll_tokens, args.experts, use_fp8=True)
        ll_bf16 = torch.zeros_like(ll[0][0], dtype=torch.bfloat16)
        valid = int(ll[1].sum())
        op(
            "ll dispatch fp8",
            lambda: buffer.low_latency_dispatch(ll_x, ll_idx, args.ll_tokens, args.experts, use_fp8=True),
            fp8_row + 16,
            valid,
        )
        op("ll combine bf16", lambda: buffer.low_latency_combine(ll_bf16, ll_idx, ll_w, ll[2]), bf16_row, valid)
    buffer.destroy()


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['strategy']:<9} {str(r['num_sms'] or '-'):>4} {r['op']:<40} failed: {r['error']}"
    t = r["median_us"] / 1e6
    logical = f"{r['logical_bytes'] / t / 1e9:.0f}" if r["logical_bytes"] else "-"
    cross = f"{r['cross_bytes'] / t / 1e9:.0f}" if r.get("cross_bytes") else "-"
    return (
        f"{r['strategy']:<9} {str(r['num_sms'] or '-'):>4} {r['op']:<40} {r['median_us']:>10.1f} "
        f"{r['gpu_us']:>9.1f} {r['host_us']:>8.1f} {r['loop_us']:>8.1f} {r['mean_us']:>10.1f} {logical:>12} "
        f"{cross:>10}"
    )


HEADER = (
    f"{'strategy':<9} {'sms':>4} {'op':<40} {'median us':>10} {'gpu us':>9} {'host us':>8} {'loop us':>8} "
    f"{'mean us':>10} {'logical GB/s':>12} {'cross GB/s':>10}"
)


def sm_calibration(rows: list[dict]) -> dict | None:
    """Per-SM write throughput of the cuda strategy's copy kernels, from the device time (``gpu_us``) of the
    cached BF16 dispatch at the smallest SM count measured (where the SMs, not NVLink, bound it): every
    written row (own and peer) per second per SM. This is the figure ``choose_num_sms`` takes as
    ``sm_write_gbs``."""
    runs = [
        r
        for r in rows
        if r["strategy"] == "cuda" and r["op"] == "dispatch bf16 (cached)" and r["num_sms"] and "error" not in r
    ]
    if not runs:
        return None
    fewest = min(runs, key=lambda r: r["num_sms"])
    per_sm = fewest["logical_bytes"] / (fewest["gpu_us"] / 1e6) / 1e9 / fewest["num_sms"]
    return dict(num_sms=fewest["num_sms"], per_sm_write_gbs=per_sm)


def _collect(queue: Any, procs: list, deadline_s: float, result: dict) -> bool:
    """Rows from rank 0 until it reports done (True), a rank fails or the deadline passes (False)."""
    import queue as queue_module
    import time

    deadline = time.monotonic() + deadline_s
    lines, expected = ProgressLines("bench moe", every_s=0.0, on_tty=True), 0
    while time.monotonic() < deadline:
        try:
            kind, payload = queue.get(timeout=2)
        except queue_module.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                return False  # a rank failed; its traceback is on stderr
            continue
        if kind == "done":
            return True
        if kind == "meta":
            result.update(payload)
        elif kind == "expected":
            expected = payload
        else:
            result["rows"].append(payload)
            print(_line(payload), flush=True)  # as measured, so a run cut short still shows its rows
            lines.step("row", len(result["rows"]), max(expected, len(result["rows"])), f" ({payload['op']})")
    return False


def _stop(procs: list, finished: bool, store: str) -> None:
    """Join the ranks; after a failure, the deadline or an interrupt stop them together, quietly."""
    from ascend_dualpath._process import stop

    stop([(p, False) for p in procs], grace_s=5.0, exit_wait_s=30.0 if finished else 0.0)
    # destroy_process_group deletes the rendezvous file, but a rank that failed or was killed never calls it
    with contextlib.suppress(FileNotFoundError):
        os.unlink(store)


def check_sizes(args: argparse.Namespace, world: int, on_cpu: bool) -> None:
    """Refuse, before any rank starts (ConfigError), a workload the strategies cannot route or the host cannot
    hold: ``--topk`` over ``--experts``, fewer than 2 ranks, or, on CPU, more memory than is available (each rank
    may receive every rank's tokens, as bf16 and fp8 copies plus the combine's output: about 4 rows of 2 *
    ``--hidden`` bytes per received token)."""
    from ascend_dualpath.errors import ConfigError

    if args.topk > args.experts:
        raise ConfigError(f"--topk {args.topk} must be <= --experts {args.experts}")
    if world < 2:
        raise ConfigError(f"--ranks {world} must be >= 2 (dispatch and combine exchange tokens between ranks)")
    need = world * world * max(args.tokens, args.ll_tokens) * args.hidden * 2 * 4
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if on_cpu and need > available:
        raise ConfigError(
            f"--ranks {world}, --tokens {args.tokens} and --hidden {args.hidden} need about {need / 2**30:.1f} GiB; "
            f"{available / 2**30:.1f} GiB are available"
        )


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.multiprocessing as mp

    from ascend_dualpath._process import sigint_blocked

    world = args.ranks or (torch.cuda.device_count() if torch.cuda.device_count() >= 2 else 2)
    check_sizes(args, world, on_cpu=torch.cuda.device_count() < world)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = tempfile.mktemp(prefix="adp_bench_moe_")
    procs = [ctx.Process(target=_worker, args=(r, world, store, args, queue)) for r in range(world)]
    with sigint_blocked():  # Ctrl-C stops the benchmark process, which stops the ranks
        for p in procs:
            p.start()
    result, finished = dict(rows=[]), False
    print(HEADER, flush=True)
    try:
        finished = _collect(queue, procs, args.deadline_s, result)
    finally:
        _stop(procs, finished, store)
    if not finished:
        print(
            f"bench moe: incomplete (a rank failed or the run exceeded {args.deadline_s:g} s); "
            f"{len(result['rows'])} rows measured",
            file=sys.stderr,
        )
    result["args"] = vars(args)
    result["sm_calibration"] = sm_calibration(result["rows"])
    if result["sm_calibration"]:
        print(
            "sm calibration: {per_sm_write_gbs:.1f} GB/s written per SM (device time of the cached BF16 "
            "dispatch at {num_sms} SMs)".format(**result["sm_calibration"])
        )
    if args.json:
        with open(args.json, "w") as f:
            f.write(_json.dumps(result, indent=1))
    return 0 if finished and all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m ascend_dualpath.bench.moe", description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
