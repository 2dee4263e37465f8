"""MoE dispatch and combine (DeepEP's ``Buffer`` API) on two gloo ranks.

Two processes (``torch.multiprocessing``, spawned; rendezvous on a free port chosen at run time) each hold 32
tokens routed to 2 of 8 experts, 4 experts per rank. ``dispatch`` sends every token once to each rank that holds
one of its experts; each rank's "experts" scale what they received by (rank + 1); ``combine`` returns the rows to
their source and sums them per token. So ``combine`` must give ``x * sum(rank + 1 over the ranks the token went
to)``, which each rank checks against that sum computed in float64 from the routing.

Run::

    python3 examples/moe_two_ranks.py

Prints the strategy (``auto`` picks ``aiv`` on gloo: the AscendC kernels on the emulated device) and each rank's
check; exits 1 if a rank's combine is off by more than bf16 rounding or a rank fails or hangs (bounded wait).
"""

from __future__ import annotations

import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, TOKENS, HIDDEN, EXPERTS, TOP_K = 2, 32, 256, 8, 2
TIMEOUT_S = 120.0
BF16_REL = 2.0**-8  # one rounding of the float32 sum to bf16


def rank_main(rank: int, port: int) -> None:
    """One rank: dispatch, the experts' work, combine, and the check (raises if it fails)."""
    from ascend_dualpath import moe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    buffer = moe.Buffer(None, num_nvl_bytes=1 << 22, timeout_s=60.0)
    try:
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)
        topk_idx = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
        topk_weights = torch.full((TOKENS, TOP_K), 1.0 / TOP_K)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, EXPERTS)
        recv_x, _, _, recv_per_expert, handle, _ = buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
        )
        expert_out = (recv_x.float() * (rank + 1)).to(torch.bfloat16)  # this rank's experts
        combined, _, _ = buffer.combine(expert_out, handle)
        factor = (in_rank.double() * torch.arange(1, WORLD + 1, dtype=torch.float64)).sum(dim=1, keepdim=True)
        reference = x.double() * factor  # float64
        error = float(((combined.double() - reference).abs() / reference.abs().clamp_min(1e-6)).max())
        print(
            f"rank {rank} ({buffer.strategy_name}): sent {int(per_rank.sum())} token rows, received "
            f"{recv_x.shape[0]} for its experts {recv_per_expert}; combine(dispatch(x)) vs float64 reference: "
            f"max relative error {error:.2e} (limit {BF16_REL:.2e})",
            flush=True,
        )
        if not error <= BF16_REL:
            raise AssertionError(f"rank {rank}: combine is off by {error:.2e} > {BF16_REL:.2e}")
    finally:
        buffer.destroy()
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    context = mp.start_processes(rank_main, args=(free_port(),), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                print(f"FAILED: the ranks did not finish within {TIMEOUT_S:.0f} s", file=sys.stderr)
                return 1
    except mp.ProcessException as error:  # a rank raised (its traceback is in the message) or died
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
    print(f"combine(dispatch(x)) matches the float64 reference on all {WORLD} ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
