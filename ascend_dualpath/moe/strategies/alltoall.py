"""``alltoall``: every exchange is one ``torch.distributed`` collective, on any backend (gloo, nccl, hccl).

Rows of several tensors are packed into one uint8 row per token so one ``all_to_all_single`` moves them all
(dtype-agnostic: FP8, int8, int32 and bf16 travel as bytes, which gloo and nccl both carry). Every wait is
bounded by the buffer's timeout and raises :class:`~ascend_dualpath.errors.WaitTimeout` naming the exchange.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from ascend_dualpath.errors import WaitTimeout
from ascend_dualpath.moe.strategies.base import PendingRows, Strategy

# Polling interval of a collective wait.
POLL_S = 20e-6


def _as_byte_rows(part: torch.Tensor) -> torch.Tensor:
    rows = part.shape[0]
    flat = part.contiguous().reshape(rows, math.prod(part.shape[1:]))
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8)


def _from_byte_rows(data: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if data.shape[0] == 0:  # a rank that receives no row: a byte view of nothing has no stride to reinterpret
        return torch.empty((0, *like.shape[1:]), dtype=like.dtype, device=data.device)
    dtype = torch.uint8 if like.dtype == torch.bool else like.dtype
    out = data.contiguous().view(dtype).reshape(data.shape[0], *like.shape[1:])
    return out.to(torch.bool) if like.dtype == torch.bool else out


class AllToAllStrategy(Strategy):
    name = "alltoall"

    def _wait(self, work: Any, what: str, timeout_s: float) -> None:
        # Poll instead of ``work.wait(timeout=...)``: with a timeout, NCCL's wait sleeps in 10 ms steps, which
        # dominated every small exchange. Once complete, ``wait()`` only orders the current stream after it.
        deadline = time.monotonic() + timeout_s
        try:
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise WaitTimeout(f"waited {timeout_s:g} s for {what} ({self.name} strategy); it did not finish")
                time.sleep(POLL_S)
            work.wait()
        except WaitTimeout:
            raise
        except RuntimeError as exc:  # gloo and nccl report a failed or aborted collective as RuntimeError
            raise WaitTimeout(f"waited for {what} ({self.name} strategy), which failed: {exc}") from exc

    def exchange_counts(self, counts: torch.Tensor, what: str) -> torch.Tensor:
        import torch.distributed as dist

        world = dist.get_world_size(self.group)
        out = torch.empty(world * counts.numel(), dtype=torch.int64, device=counts.device)
        # torch >= 2.13 renames all_gather_into_tensor to all_gather_single; the device image has 2.11.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(out, counts.to(torch.int64).contiguous(), group=self.group, async_op=True)
        self._wait(work, what, self.timeout_s)
        return out.view(world, counts.numel()).cpu()

    def exchange_rows(self, parts, send_counts, recv_counts, what) -> PendingRows:
        import torch.distributed as dist

        device = parts[0].device
        byte_parts = [_as_byte_rows(part) for part in parts]
        widths = [p.shape[1] for p in byte_parts]
        send = torch.cat(byte_parts, dim=1) if len(byte_parts) > 1 else byte_parts[0]
        recv = torch.empty(sum(recv_counts), sum(widths), dtype=torch.uint8, device=device)
        work = dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=list(recv_counts),
            input_split_sizes=list(send_counts),
            group=self.group,
            async_op=True,
        )

        def finish(timeout_s: float) -> list[torch.Tensor]:
            self._wait(work, what, timeout_s)
            out, start = [], 0
            for like, width in zip(parts, widths, strict=True):
                out.append(_from_byte_rows(recv[:, start : start + width], like))
                start += width
            return out

        return PendingRows(finish, self.timeout_s)


def create(group: Any, timeout_s: float, **options: Any) -> AllToAllStrategy:
    return AllToAllStrategy(group, timeout_s)
