"""``cuda``: intranode dispatch/combine over NVLink with Triton copy kernels and torch symmetric memory.

Every rank owns one symmetric-memory buffer, mapped into every peer (``torch.distributed._symmetric_memory``).
Normal dispatch: one Triton kernel reads each token row once and stores it to every destination: straight
into this rank's freshly allocated output for its own tokens, into the peer's buffer at the row's final
position for the others; a barrier; then each remote block is one contiguous local copy out of the buffer.
Combine: each rank copies the rows it received back into their source's buffer (one contiguous peer copy per
source, copy engine), a barrier, then a Triton kernel sums every token's rows in float32 in destination-rank
order (its own rows straight from the local input) plus the biases. Count exchange and the low-latency ops
use NCCL collectives (inherited from ``alltoall``).

The kernels' grid (SMs) comes from :func:`choose_num_sms`, a bandwidth model after DeepEP V2's: enough SMs
that their read and write throughput keeps the NVLink busy, with 25 % headroom.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import torch

from ascend_dualpath.errors import BackendUnavailable
from ascend_dualpath.moe.strategies.alltoall import AllToAllStrategy
from ascend_dualpath.moe.strategies.base import NormalPlan

MAX_PEERS = 8
# Per-direction NVLink bandwidth of an H200 SXM pair (NV18: 18 links x 26.56 GB/s), the model's default.
NVLINK_GBS = 478.0
# What one SM sustains reading local HBM and writing (local or remote) memory, DeepEP V2's figures.
SM_READ_GBS = 200.0
SM_WRITE_GBS = 50.0
SM_HEADROOM = 1.25
MIN_SMS = 4
REGION_ALIGN_BYTES = 256
ROW_BLOCK = 1024


def expected_ranks_per_token(num_experts: int, num_topk: int, num_ranks: int) -> float:
    """Expected number of distinct ranks a token's top-k (uniform, without replacement) lands on."""
    local = num_experts // num_ranks
    if num_experts - local < num_topk:
        return float(num_ranks)
    miss = math.comb(num_experts - local, num_topk) / math.comb(num_experts, num_topk)
    return num_ranks * (1 - miss)


def choose_num_sms(num_experts: int, num_topk: int, num_ranks: int, device_sms: int, nvlink_gbs: float = NVLINK_GBS,
                   sm_read_gbs: float = SM_READ_GBS, sm_write_gbs: float = SM_WRITE_GBS) -> int:
    """SMs for the copy kernels so that SM throughput is not what bounds the NVLink transfer.

    Per token the kernel reads one row and writes ``g`` rows (``g`` = expected destination ranks), of which
    ``g (R-1)/R`` cross NVLink. At link speed a token takes ``cross / nvlink_gbs``; the SMs needed to keep
    up are ``max(read, write) / that time / per-SM speed``, times 1.25, even, within ``[4, device_sms]``.
    """
    g = expected_ranks_per_token(num_experts, num_topk, num_ranks)
    cross = g * (num_ranks - 1) / num_ranks
    if cross <= 0:
        return MIN_SMS
    sms = max(nvlink_gbs / cross / sm_read_gbs, nvlink_gbs * g / cross / sm_write_gbs) * SM_HEADROOM
    sms = max(MIN_SMS, math.ceil(sms))
    sms += sms % 2
    return min(sms, device_sms - device_sms % 2)


def availability(group: Any) -> tuple[bool, str]:
    if torch.version.cuda is None or not torch.cuda.is_available():
        return False, "cuda strategy needs a CUDA build of torch and a visible GPU"
    if importlib.util.find_spec("triton") is None:
        return False, "cuda strategy needs triton"
    try:
        import torch.distributed as dist

        backend = dist.get_backend(group)
        world = dist.get_world_size(group)
    except Exception as exc:
        return False, f"cuda strategy needs an initialised nccl process group ({exc})"
    if backend != "nccl":
        return False, f"cuda strategy needs an nccl process group, this group uses {backend!r}"
    if world > MAX_PEERS:
        return False, f"cuda strategy is intranode: at most {MAX_PEERS} NVLink peers, group has {world}"
    return True, f"{world} CUDA ranks over NVLink"


def _kernels():
    from ascend_dualpath.moe.strategies import _cuda_kernels

    return _cuda_kernels.push_rows, _cuda_kernels.reduce_rows


def _wire_view(t: torch.Tensor) -> torch.Tensor:
    """A 2-D contiguous view with a dtype Triton moves bit-exactly (FP8 and bool travel as uint8)."""
    t = t.contiguous().reshape(t.shape[0], -1) if t.shape[0] else t.reshape(0, math.prod(t.shape[1:]))
    if t.dtype in (torch.float8_e4m3fn, torch.bool):
        t = t.view(torch.uint8)
    return t


class CudaStrategy(AllToAllStrategy):
    name = "cuda"

    def __init__(self, group: Any, timeout_s: float, num_sms: int = 0) -> None:
        super().__init__(group, timeout_s)
        import torch.distributed as dist

        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.device_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.fixed_num_sms = num_sms
        self._push, self._reduce = _kernels()
        self._symm: tuple[torch.Tensor, Any] | None = None

    # ------------------------------------------------------------------ symmetric buffer
    def _buffer(self, nbytes: int):
        """The symmetric buffer, grown collectively (every rank computes the same ``nbytes``)."""
        if self._symm is None or self._symm[0].numel() < nbytes:
            import torch.distributed._symmetric_memory as symm_mem

            self._symm = None
            capacity = 1 << max(20, (nbytes - 1).bit_length())
            local = symm_mem.empty(capacity, dtype=torch.uint8, device=self.device)
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(self.group.group_name)
            self._symm = (local, symm_mem.rendezvous(local, self.group.group_name))
        return self._symm

    def _barrier(self) -> None:
        self._symm[1].barrier(channel=0, timeout_ms=int(self.timeout_s * 1000))

    def _regions(self, parts: list[torch.Tensor], rows: int) -> tuple[list[int], int]:
        offsets, total = [], 0
        for part in parts:
            offsets.append(total)
            total += -(-rows * part.shape[1] * part.element_size() // REGION_ALIGN_BYTES) * REGION_ALIGN_BYTES
        return offsets, total

    def _peer_view(self, peer: int, like: torch.Tensor, rows: int, byte_offset: int) -> torch.Tensor:
        if peer == self.rank:
            flat = self._symm[0][byte_offset:byte_offset + rows * like.shape[1] * like.element_size()]
            return flat.view(like.dtype).view(rows, like.shape[1])
        return self._symm[1].get_buffer(peer, (rows, like.shape[1]), like.dtype, byte_offset // like.element_size())

    def num_sms_for(self, plan: NormalPlan) -> int:
        override = (plan.private or {}).get("num_sms") or self.fixed_num_sms
        if override:
            return min(override, self.device_sms)
        return plan.private["model_sms"]

    # ------------------------------------------------------------------ plans
    def prepare_plan(self, plan: NormalPlan) -> None:
        in_rank = plan.is_token_in_rank
        counts = plan.count_matrix
        # Row of token t in rank r's receive order: rows from lower source ranks first, then t's rank among
        # this rank's tokens going to r.
        before_me = counts[:self.rank].sum(dim=0).to(in_rank.device)
        position = in_rank.to(torch.int32).cumsum(dim=0, dtype=torch.int32) - 1
        dispatch_slots = torch.where(in_rank, position + before_me.to(torch.int32), -1).to(torch.int32).contiguous()
        # Combine: this rank reads token t's row from destination r at its place in the send order (rows
        # sent to lower ranks first), or, for its own rows, at the received row index.
        sent_before = torch.cumsum(counts[self.rank], 0) - counts[self.rank]
        gather_rows = torch.where(in_rank, position + sent_before.to(in_rank.device).to(torch.int32), -1)
        gather_rows[:, self.rank] = dispatch_slots[:, self.rank]
        private = dict(plan.private or {})
        private.update(dispatch_slots=dispatch_slots, gather_rows=gather_rows.to(torch.int32).contiguous())
        private["model_sms"] = choose_num_sms(private["num_experts"], private["num_topk"], self.world,
                                              self.device_sms)
        plan.private = private

    # ------------------------------------------------------------------ normal dispatch
    def dispatch_rows(self, plan: NormalPlan, parts: list[torch.Tensor], what: str) -> list[torch.Tensor]:
        wire = [_wire_view(p) for p in parts]
        max_recv = int(plan.count_matrix.sum(dim=0).max())
        offsets, total = self._regions(wire, max_recv)
        self._buffer(total)
        num_recv = plan.num_recv_tokens
        outs = [torch.empty(num_recv, w.shape[1], dtype=w.dtype, device=self.device) for w in wire]
        slots = plan.private["dispatch_slots"]
        tokens = slots.shape[0]
        grid = (max(1, min(self.num_sms_for(plan), tokens)),)
        self._barrier()  # peers have finished reading what the previous op left in their buffers
        for w, out, offset in zip(wire, outs, offsets):
            if tokens == 0 or w.shape[1] == 0:
                continue
            dsts = [out if r == self.rank else self._peer_view(r, w, max_recv, offset) for r in range(self.world)]
            dsts += [w] * (MAX_PEERS - len(dsts))
            self._push[grid](w, slots, *dsts, tokens, w.shape[1], NUM_DST=self.world, BLOCK=ROW_BLOCK)
        self._barrier()
        prefix = [0] + torch.cumsum(plan.count_matrix[:, self.rank], 0).tolist()
        for w, out, offset in zip(wire, outs, offsets):
            mine = self._peer_view(self.rank, w, max_recv, offset)
            for src in range(self.world):
                if src != self.rank and prefix[src + 1] > prefix[src]:
                    out[prefix[src]:prefix[src + 1]].copy_(mine[prefix[src]:prefix[src + 1]])
        return [o.view(p.dtype).reshape(num_recv, *p.shape[1:]) if p.dtype != torch.bool
                else o.view(torch.bool).reshape(num_recv, *p.shape[1:]) for o, p in zip(outs, parts)]

    # ------------------------------------------------------------------ normal combine
    def combine_rows(self, plan: NormalPlan, x: torch.Tensor, weights: torch.Tensor | None,
                     biases: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
        parts = [x.contiguous()] + ([] if weights is None else [weights.contiguous()])
        max_send = int(plan.count_matrix.sum(dim=1).max())
        offsets, total = self._regions(parts, max_send)
        self._buffer(total)
        recv_prefix = [0] + torch.cumsum(plan.count_matrix[:, self.rank], 0).tolist()
        self._barrier()
        for part, offset in zip(parts, offsets):
            for src in range(self.world):
                begin, end = recv_prefix[src], recv_prefix[src + 1]
                if src == self.rank or end == begin:
                    continue
                # Rows of source src go where src keeps the rows it sent to this rank: after those sent lower.
                sent_before = int(plan.count_matrix[src, :self.rank].sum())
                peer = self._peer_view(src, part, max_send, offset)
                peer[sent_before:sent_before + end - begin].copy_(part[begin:end])
        self._barrier()
        gather_rows = plan.private["gather_rows"]
        tokens = gather_rows.shape[0]
        grid = (max(1, min(self.num_sms_for(plan), tokens)),)
        results = []
        for index, (part, offset) in enumerate(zip(parts, offsets)):
            out = torch.empty(tokens, part.shape[1], dtype=part.dtype, device=self.device)
            results.append(out)
            if tokens == 0:
                continue
            mine = self._peer_view(self.rank, part, max_send, offset)
            srcs = [part if r == self.rank else mine for r in range(self.world)]
            srcs += [part] * (MAX_PEERS - len(srcs))
            bias0, bias1 = (biases + (None, None))[:2] if index == 0 else (None, None)
            self._reduce[grid](out, gather_rows, *srcs, bias0 if bias0 is not None else out,
                               bias1 if bias1 is not None else out, tokens, part.shape[1], NUM_SRC=self.world,
                               HAS_BIAS0=bias0 is not None, HAS_BIAS1=bias1 is not None, BLOCK=ROW_BLOCK)
        combined_weights = results[1].float() if weights is not None else None
        return results[0], combined_weights

    def close(self) -> None:
        self._symm = None


def create(group: Any, timeout_s: float, **options: Any) -> CudaStrategy:
    ok, reason = availability(group)
    if not ok:
        raise BackendUnavailable(reason)
    return CudaStrategy(group, timeout_s, **options)
