"""Tune the cuda strategy's copy and reduce kernels on 2 GPUs: cached BF16 dispatch and combine device time for
several (copy block words, copy tile rows, copy warps, reduce block, reduce tile, reduce warps, SMs) settings.

Each setting is a :class:`ascend_dualpath.moe.Config` passed to a fresh dispatch (the plan it makes runs its
cached dispatches and its combine with those kernel settings); the tool checks that the dispatch output and
combine output are bit-identical to the default setting's, and times both ops with the stream held by a sleep kernel
(device time: what DeepEP's figures measure), median of ``--iters`` after 3 warm-up calls.

    python3 tools/tune_moe_copy.py --iters 20 [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile

# Candidate kernel settings; the winner goes into ascend_dualpath/moe/config.py (DISPATCH_CONFIGS/COMBINE_CONFIGS).
SETTINGS = [
    dict(),  # the default
    dict(copy_tile=2, copy_warps=8, reduce_tile=2, reduce_warps=8),
    dict(copy_tile=2, copy_warps=8),
    dict(num_sms=96, copy_tile=2, copy_warps=8, reduce_tile=2, reduce_warps=8),
    dict(num_sms=132, copy_tile=2, copy_warps=8, reduce_tile=2, reduce_warps=8),
    dict(num_sms=132),
    dict(copy_tile=2),
    dict(),  # the default again: the spread between the two is the noise
]


def _device_us(fn, iters: int) -> float:
    import torch

    for _ in range(3):
        fn()
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(3_000_000)  # the whole call is enqueued before the GPU reaches it
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def _worker(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from ascend_dualpath.bench.moe import join_group, make_inputs
    from ascend_dualpath.moe import Buffer, Config

    device, group = join_group(rank, world, store)
    x, topk_idx, topk_weights = make_inputs(args.tokens, args.hidden, args.experts, args.topk, device, seed=rank)
    reference = None
    rows = []
    for setting in SETTINGS:
        config = Config(**setting)
        buffer = Buffer(group, num_nvl_bytes=int(4e9), strategy="cuda")
        try:
            layout = buffer.get_dispatch_layout(topk_idx, args.experts)
            recv_x, _, _, _, handle, _ = buffer.dispatch(
                x,
                num_tokens_per_rank=layout[0],
                is_token_in_rank=layout[3],
                num_tokens_per_expert=layout[2],
                topk_idx=topk_idx,
                topk_weights=topk_weights,
                config=config,
            )
            combined = buffer.combine(recv_x, handle, config=config)[0]
            if reference is None:
                reference = (recv_x.clone(), combined.clone())
            exact = bool(torch.equal(recv_x, reference[0]) and torch.equal(combined, reference[1]))
            dispatch_us = _device_us(functools.partial(buffer.dispatch, x, handle=handle, config=config), args.iters)
            combine_us = _device_us(functools.partial(buffer.combine, recv_x, handle, config=config), args.iters)
            sms = config.num_sms or handle.plan.private.get("model_sms")
            times = torch.tensor([dispatch_us, combine_us], dtype=torch.float64, device=device)
            dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
            rows.append(
                dict(setting=setting, sms=sms, exact=exact, dispatch_us=float(times[0]), combine_us=float(times[1]))
            )
        except Exception as error:  # every rank fails the same way; report and go on
            rows.append(dict(setting=setting, error=repr(error)[:200]))
        buffer.destroy()
        dist.barrier(group)
        if rank == 0:
            row = rows[-1]
            if "error" in row:
                print(f"{setting}  error {row['error']}", flush=True)
            else:
                print(
                    f"{setting or 'default'} sms {row['sms']:>3}  exact {row['exact']!s:5}  "
                    f"dispatch {row['dispatch_us']:7.1f} us  combine {row['combine_us']:7.1f} us",
                    flush=True,
                )
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tune_moe_copy.json"), "w") as handle_out:
            json.dump(rows, handle_out, indent=1)
    dist.barrier(group)
    dist.destroy_process_group()


def main() -> int:
    import torch.multiprocessing as mp

    from ascend_dualpath.bench.moe import add_workload_arguments

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    mp.spawn(_worker, args=(2, tempfile.mktemp(prefix="adp_tune_moe_"), args), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
