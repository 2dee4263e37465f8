"""``cuda``: intranode dispatch/combine over NVLink with Triton kernels and torch symmetric memory.

Every rank owns one symmetric-memory buffer, mapped into every peer (``torch.distributed._symmetric_memory``):
a header of signal words, two count-exchange slots and two data halves, used alternately (by the parity of
the op's epoch) so that no op waits for peers to finish reading the previous one. Kernels (``_cuda_kernels``):

- layout: one kernel computes every count, ``is_token_in_rank`` and the id range (one host sync, for the
  bounds check);
- count exchange: one single-CTA kernel stores this rank's row into every peer's count slot, signals, waits;
  one host copy reads the matrix (DeepEP also syncs once for the receive count);
- dispatch: a push kernel reads each token row once and stores it to its final row on every destination:
  this rank's output for its own tokens, the peer's buffer otherwise, all parts (x, scales, top-k, index) in
  one launch; its last CTA signals each peer once. A receive kernel waits for the peers' signals and copies
  their rows from the buffer into the fresh output;
- combine: a push kernel writes each received row back into its source's buffer and signals; a reduce kernel
  waits, then sums each token's rows in float32 in destination-rank order (its own rows read in place from
  the input), then the biases.

Waits run on the device, bounded by ``timeout_s`` (GPU global timer); one that expires sets an error word,
reported as :class:`~ascend_dualpath.errors.WaitTimeout` at the strategy's next host synchronisation.
The low-latency ops use the inherited ``alltoall`` row exchange over NCCL (with this count exchange).

Host path: the epoch of a data op lives on the device (signal word ``EPOCH``), so a launch's arguments are fixed
per (plan, part layout, data half); they are built once into a :class:`_Launch` site kept in the plan, whose
later launches call the compiled binary directly. Cached dispatch and combine can be recorded as CUDA graphs
(:meth:`ascend_dualpath.moe.Buffer.capture_graph`).

The kernels' grid (SMs) comes from :func:`choose_num_sms`, a bandwidth model after DeepEP V2's: enough SMs
that their read and write throughput keeps the NVLink busy, with 25 % headroom.
"""

from __future__ import annotations

import importlib.util
import math
import os
import warnings
from typing import Any

import torch

from ascend_dualpath import _env
from ascend_dualpath.errors import BackendUnavailable, WaitTimeout
from ascend_dualpath.moe.strategies.alltoall import AllToAllStrategy
from ascend_dualpath.moe.strategies.base import NormalPlan, to_device_async

MAX_PEERS = 8
# Per-direction NVLink bandwidth of an H200 SXM pair (NV18: 18 links x 26.56 GB/s), the model's default.
NVLINK_GBS = 478.0
# What one SM sustains reading local HBM (DeepEP V2's figure) and writing rows (measured: `bench moe`'s SM
# calibration, cached BF16 dispatch at 8 SMs on 2x H200, 2026-11-30: 18 GB/s of rows written per SM).
SM_READ_GBS = 200.0
SM_WRITE_GBS = 18.0
SM_HEADROOM = 1.25
MIN_SMS = 4
REGION_ALIGN_BYTES = 256
HEADER_BYTES = 256
# Count-exchange slot: room for R = 8 rows of (8 rank counts + 8192 expert counts + 8 statistics) int32.
COUNT_SLOT_BYTES = 266240
DATA_OFFSET = HEADER_BYTES + 2 * COUNT_SLOT_BYTES
MAX_PARTS = 5
# Copy kernels: TILE rows x up to COPY_BLOCK_WORDS words per CTA iteration (16 warps: 128 bytes in flight per
# thread); the reduce: TILE tokens x REDUCE_BLOCK elements.
COPY_BLOCK_WORDS = 4096
COPY_TILE = 4
COPY_WARPS = 16
REDUCE_BLOCK = 2048
REDUCE_TILE = 4
REDUCE_WARPS = 16
LAYOUT_BLOCK_TOKENS = 64


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

    return _cuda_kernels


def _words(t: torch.Tensor) -> torch.Tensor:
    """A 2-D contiguous int32 view of a wire tensor (every wire row is a multiple of 4 bytes)."""
    if t.dim() == 2 and t.dtype != torch.bool and t.is_contiguous():
        return t if t.dtype == torch.int32 else t.view(torch.int32)  # one view op on the hot path
    row_bytes = math.prod(t.shape[1:]) * t.element_size()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], row_bytes).view(torch.int32)


def _typed(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The int32 rows ``out`` [N, w] viewed with ``like``'s dtype and row shape."""
    if like.dim() == 2 and like.dtype != torch.bool:
        return out if like.dtype == torch.int32 else out.view(like.dtype)
    dtype = torch.uint8 if like.dtype == torch.bool else like.dtype
    value = out.view(torch.uint8).view(dtype).reshape(out.shape[0], *like.shape[1:])
    return value.view(torch.bool) if like.dtype == torch.bool else value


def _aligned(*tensors: torch.Tensor | None) -> tuple:
    """Which of the tensors start at a multiple of 16 bytes: what Triton specialises a pointer argument on."""
    return tuple(t is None or t.data_ptr() % 16 == 0 for t in tensors)


class _Launch:
    """One launch site: a kernel whose grid, integer arguments and compile-time constants are fixed (one plan,
    part layout and data half), called with varying tensors.

    The first call goes through Triton (``kernel[grid](...)``: binds and specialises the arguments, finds or
    compiles the binary, launches it and returns it). Later calls hand the arguments straight to that binary's
    launcher (``compiled[grid](*args)``), skipping Triton's per-call binding, key hashing and cache lookup. The
    binary was specialised on the pointers' 16-byte alignment (and on the integers, fixed here): the caller
    passes the alignment of the caller-supplied tensors (:func:`_aligned`), and a call whose alignment differs
    goes through Triton again. The other tensors are the site's own or fresh from the caching allocator (whose
    blocks are 512-byte aligned). Under the interpreter every call goes through Triton.
    """

    direct = True  # cleared (for the process) if a Triton version's launcher refuses the direct call

    def __init__(self, kernel: Any, grid: int, constants: dict) -> None:
        self.kernel, self.grid, self.constants = kernel, (grid,), constants
        self.runner: Any = None
        self.tail: list = []
        self.alignment: tuple = ()

    def __call__(self, alignment: tuple, *args: Any) -> None:
        if self.runner is not None and alignment == self.alignment:
            try:
                self.runner(*args, *self.tail)
                return
            except TypeError:  # argument parsing, before anything was launched
                _Launch.direct = False
                self.runner = None
        compiled = self.kernel[self.grid](*args, **self.constants)
        if not (_Launch.direct and _timed() and _env.moe_direct_launch() and hasattr(compiled, "__getitem__")):
            return
        try:
            self.tail = [self.constants[name] for name in self.kernel.arg_names[len(args):]]
            self.runner = compiled[(self.grid[0], 1, 1)]
            self.alignment = alignment
        except (AttributeError, KeyError, TypeError):
            _Launch.direct = False
            self.runner = None


def _next_power_of_2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def _pow2_block(words: int, cap: int) -> int:
    return min(cap, _next_power_of_2(words))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _timed() -> bool:
    """Device waits use the GPU global timer, except under the Triton interpreter (spin count)."""
    return os.environ.get("TRITON_INTERPRET", "0") != "1"


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
        self.kernels = _kernels()
        self.timeout_ns = int(timeout_s * 1e9)
        self._symm: Any = None  # (local uint8 tensor, handle, peers int64 [R], signals int32 header view)
        # Send and receive halves in one launch (all CTAs resident: grid <= SMs), unless ADP_MOE_FUSED=0.
        self.fused = _env.moe_fused()
        self._epoch = 0  # host copy of the device epoch (signal word EPOCH): picks each data op's half
        self._count_epoch = 0
        self._generation = 0  # bumped when the symmetric buffer is replaced (cached launch sites then expire)
        self._layout_sites: dict = {}

    # ------------------------------------------------------------------ symmetric buffer
    def _buffer(self, half_bytes: int):
        """The symmetric buffer with data halves of at least ``half_bytes`` (every rank passes the same)."""
        needed = DATA_OFFSET + 2 * half_bytes
        if self._symm is None or self._symm[0].numel() < needed:
            import torch.distributed._symmetric_memory as symm_mem

            self._symm = None
            capacity = 1 << max(21, (needed - 1).bit_length())
            local = symm_mem.empty(capacity, dtype=torch.uint8, device=self.device)
            local[:HEADER_BYTES].zero_()
            # A new buffer continues the epoch count (the kernels read it from here).
            local[:HEADER_BYTES].view(torch.int32)[self.kernels.EPOCH_WORD] = self._epoch
            # The zeroed header must be in place before any peer, returning from the rendezvous, signals here.
            torch.cuda.current_stream(self.device).synchronize()
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                with warnings.catch_warnings():  # deprecated (not needed) from torch 2.11 on, needed before
                    warnings.simplefilter("ignore", FutureWarning)
                    symm_mem.enable_symm_mem_for_group(self.group.group_name)
            handle = symm_mem.rendezvous(local, self.group.group_name)
            bases = [local.data_ptr() if r == self.rank
                     else handle.get_buffer(r, (capacity,), torch.uint8, 0).data_ptr() for r in range(self.world)]
            peers = torch.tensor(bases, dtype=torch.int64, device=self.device)
            self._symm = (local, handle, peers, local[:HEADER_BYTES].view(torch.int32))
            self._generation += 1
        return self._symm

    def _half(self, epoch: int) -> int:
        """Byte offset of the data half used by the op of this epoch."""
        local = self._symm[0]
        return DATA_OFFSET + (epoch % 2) * ((local.numel() - DATA_OFFSET) // 2 // REGION_ALIGN_BYTES
                                            * REGION_ALIGN_BYTES)

    @staticmethod
    def _regions(widths_bytes: list[int], rows: int) -> tuple[list[int], int]:
        offsets, total = [], 0
        for width in widths_bytes:
            offsets.append(total)
            total += -(-rows * width // REGION_ALIGN_BYTES) * REGION_ALIGN_BYTES
        return offsets, total

    def _local_view(self, byte_offset: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        size = rows * cols * torch.empty((), dtype=dtype).element_size()
        return self._symm[0][byte_offset:byte_offset + size].view(dtype).view(rows, cols)

    def _check_device_error(self, error_word: int) -> None:
        if error_word:
            raise WaitTimeout(f"a device-side wait of the cuda MoE strategy exceeded {self.timeout_s:g} s (a peer "
                              f"did not signal its rows); this buffer cannot be used further")

    def num_sms_for(self, plan: NormalPlan) -> int:
        override = (plan.private or {}).get("num_sms") or self.fixed_num_sms
        if override:
            return min(override, self.device_sms)
        return plan.private["model_sms"]

    # ------------------------------------------------------------------ layout and counts
    def dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int):
        """The layout in one kernel; returns ``(layout 4-tuple, (min id, max id))`` (the range clamped at 0)."""
        tokens, topk = topk_idx.shape
        num_nodes = num_ranks // ranks_per_node if num_ranks > ranks_per_node else 1
        extra = num_nodes if num_nodes > 1 else 0
        counts = torch.zeros(num_ranks + extra + num_experts + 2, dtype=torch.int32, device=topk_idx.device)
        in_rank = torch.empty(tokens, num_ranks, dtype=torch.bool, device=topk_idx.device)
        if tokens:
            key = (tokens, topk, num_experts, num_ranks, ranks_per_node)
            launch = self._layout_sites.get(key)
            if launch is None:
                launch = self._layout_sites[key] = _Launch(self.kernels.dispatch_layout,
                                                           _cdiv(tokens, LAYOUT_BLOCK_TOKENS), dict(
                    NUM_RANKS=num_ranks, RANKS_PAD=_next_power_of_2(num_ranks), RANKS_PER_NODE=ranks_per_node,
                    NUM_NODES=num_nodes, NODES_PAD=_next_power_of_2(num_nodes), TOPK_PAD=_next_power_of_2(topk),
                    BLOCK_T=LAYOUT_BLOCK_TOKENS))
            topk_idx = topk_idx.contiguous()
            launch(_aligned(topk_idx), topk_idx, counts, in_rank.view(torch.uint8), tokens, topk,
                   num_experts // num_ranks, num_experts)
        below, above = counts[-2:].tolist()
        per_rank = counts[:num_ranks]
        per_node = counts[num_ranks:num_ranks + extra] if num_nodes > 1 else None
        per_expert = counts[num_ranks + extra:num_ranks + extra + num_experts]
        return (per_rank, per_node, per_expert, in_rank), (-below, above)

    def exchange_counts(self, counts: torch.Tensor, what: str) -> torch.Tensor:
        """Device-side all-gather through the count slots; one host copy. Values travel as int32 (clamped)."""
        width = counts.numel()
        if self.world * width * 4 > COUNT_SLOT_BYTES:
            return super().exchange_counts(counts, what)
        _, _, peers, signals = self._buffer(0)
        self._count_epoch += 1
        area = HEADER_BYTES + (self._count_epoch % 2) * COUNT_SLOT_BYTES
        row = counts.to(torch.int64).clamp(-(2 ** 31), 2 ** 31 - 1).to(torch.int32).contiguous()
        self.kernels.exchange_counts[(1,)](peers, signals, row, self.rank, self._count_epoch, width, area // 4,
                                           self.timeout_ns, NUM_RANKS=self.world,
                                           BLOCK=_pow2_block(width, 1024), TIMED=_timed())
        matrix = self._local_view(area, self.world, width, torch.int32)
        host = torch.cat([signals[self.kernels.ERROR_WORD:self.kernels.ERROR_WORD + 1], matrix.reshape(-1)]).cpu()
        self._check_device_error(int(host[0]))
        return host[1:].view(self.world, width).to(torch.int64)

    # ------------------------------------------------------------------ plans
    def prepare_plan(self, plan: NormalPlan) -> None:
        in_rank = plan.is_token_in_rank
        counts = plan.count_matrix
        world, me = self.world, self.rank
        recv_prefix = [0] + torch.cumsum(counts[:, me], 0).tolist()
        # All small tables in one asynchronous copy: [0:R] rows from lower source ranks at each destination,
        # [R:2R] rows this rank sends to lower destinations, [2R:3R+1] receive prefix by source, [3R+1:4R+1]
        # where each source keeps the rows it sent to this rank (after those it sent to lower ranks).
        host = torch.cat([counts[:me].sum(dim=0), torch.cumsum(counts[me], 0) - counts[me],
                          torch.tensor(recv_prefix), counts[:, :me].sum(dim=1)]).to(torch.int32)
        tables = to_device_async(host, in_rank.device)
        # Row of token t in rank r's receive order: rows from lower source ranks first, then t's rank among
        # this rank's tokens going to r.
        position = in_rank.to(torch.int32).cumsum(dim=0, dtype=torch.int32) - 1
        dispatch_slots = torch.where(in_rank, position + tables[:world], -1).to(torch.int32).contiguous()
        # Combine: this rank reads token t's row from destination r at its place in the send order (rows
        # sent to lower ranks first), or, for its own rows, at the received row index.
        gather_rows = torch.where(in_rank, position + tables[world:2 * world], -1)
        gather_rows[:, me] = dispatch_slots[:, me]
        private = dict(plan.private or {})
        private.update(dispatch_slots=dispatch_slots, gather_rows=gather_rows.to(torch.int32).contiguous(),
                       recv_prefix=recv_prefix, recv_prefix_dev=tables[2 * world:3 * world + 1],
                       slot_base_dev=tables[3 * world + 1:], max_recv=int(counts.sum(dim=0).max()),
                       max_send=int(counts.sum(dim=1).max()))
        private["model_sms"] = choose_num_sms(private["num_experts"], private["num_topk"], world, self.device_sms)
        plan.private = private

    # ------------------------------------------------------------------ normal dispatch
    def _dispatch_site(self, plan: NormalPlan, wire: list[torch.Tensor], parity: int) -> dict:
        """Everything of a dispatch launch that is fixed for this plan, part layout and data half."""
        private = plan.private
        widths = [w.shape[1] for w in wire]
        max_recv = private["max_recv"]
        offsets, total = self._regions([4 * w for w in widths], max_recv)
        _, _, peers, signals = self._buffer(total)
        key = ("dispatch", tuple(widths), parity, self._generation, self.fused)
        sites = private.setdefault("sites", {})
        if key in sites:
            return sites[key]
        half = self._half(parity)
        num_recv = plan.num_recv_tokens
        slots = private["dispatch_slots"]
        tokens = slots.shape[0]
        sms = self.num_sms_for(plan)
        blocks = [_pow2_block(w, COPY_BLOCK_WORDS) for w in widths] + [1] * (MAX_PARTS - len(wire))
        prefix = private["recv_prefix"]
        own_begin, own_end = prefix[self.rank], prefix[self.rank + 1]
        remote = num_recv - (own_end - own_begin)
        work = max(_cdiv(tokens, COPY_TILE), _cdiv(remote, COPY_TILE)) if self.fused else _cdiv(tokens, COPY_TILE)
        constants = dict(NUM_RANKS=self.world, NUM_PARTS=len(wire), B0=blocks[0], B1=blocks[1], B2=blocks[2],
                         B3=blocks[3], B4=blocks[4], TILE=COPY_TILE, TIMED=_timed(), num_warps=COPY_WARPS)
        receive = None
        if not self.fused:
            receive = _Launch(self.kernels.receive_rows, max(1, min(sms, _cdiv(remote, COPY_TILE))), constants)
        site = dict(
            num_recv=num_recv, widths=widths, regions=[(half + offset) // 4 for offset in offsets],
            mines=[self._local_view(half + offset, max_recv, width, torch.int32)
                   for width, offset in zip(widths, offsets)],
            push=_Launch(self.kernels.push_rows, max(1, min(sms, work)), dict(constants, FUSED=self.fused)),
            receive=receive, push_head=(peers, signals, slots, tokens, self.rank, num_recv, own_begin, own_end,
                                        self.timeout_ns),
            receive_head=(signals, self.rank, num_recv, own_begin, own_end, self.timeout_ns))
        sites[key] = site
        return site

    def dispatch_rows(self, plan: NormalPlan, parts: list[torch.Tensor], what: str) -> list[torch.Tensor]:
        if len(parts) > MAX_PARTS:
            return super().dispatch_rows(plan, parts, what)
        wire = [_words(p) for p in parts]
        site = self._dispatch_site(plan, wire, (self._epoch + 1) % 2)
        self._epoch += 1
        num_recv = site["num_recv"]
        outs = [torch.empty(num_recv, width, dtype=torch.int32, device=self.device) for width in site["widths"]]
        send_args, recv_args = list(site["push_head"]), list(site["receive_head"])
        for w, out, width, region, mine in zip(wire, outs, site["widths"], site["regions"], site["mines"]):
            send_args += (w, out, width, region, mine)
            recv_args += (mine, out, width)
        pad = MAX_PARTS - len(wire)
        send_args += (wire[0], outs[0], 0, 0, outs[0]) * pad
        recv_args += (outs[0], outs[0], 0) * pad
        alignment = _aligned(*wire)
        site["push"](alignment, *send_args)
        if site["receive"] is not None:
            site["receive"](alignment, *recv_args)
        return [_typed(out, part) for out, part in zip(outs, parts)]

    # ------------------------------------------------------------------ normal combine
    def _combine_site(self, plan: NormalPlan, parts: list[torch.Tensor], wire: list[torch.Tensor],
                      has_bias: tuple[bool, bool], parity: int) -> dict:
        """Everything of a combine launch that is fixed for this plan, part layout, biases and data half."""
        private = plan.private
        widths = [w.shape[1] for w in wire]
        max_send = private["max_send"]
        offsets, total = self._regions([4 * w for w in widths], max_send)
        _, _, peers, signals = self._buffer(total)
        key = ("combine", tuple(widths), parts[0].dtype, has_bias, parity, self._generation, self.fused)
        sites = private.setdefault("sites", {})
        if key in sites:
            return sites[key]
        half = self._half(parity)
        sms = self.num_sms_for(plan)
        num_recv = plan.num_recv_tokens
        blocks = [_pow2_block(w, COPY_BLOCK_WORDS) for w in widths] + [1]
        prefix = private["recv_prefix"]
        remote = num_recv - (prefix[self.rank + 1] - prefix[self.rank])
        gather_rows = private["gather_rows"]
        tokens = gather_rows.shape[0]
        mines = [self._local_view(half + offset, max_send, part.shape[1], part.dtype)
                 for part, offset in zip(parts, offsets)]
        reduce_x = dict(HAS_BIAS0=has_bias[0], HAS_BIAS1=has_bias[1], TIMED=_timed(), num_warps=REDUCE_WARPS)
        x_block = _pow2_block(parts[0].shape[1], REDUCE_BLOCK)
        work = _cdiv(remote, COPY_TILE)
        if self.fused:
            work = max(work, _cdiv(tokens, REDUCE_TILE))
        reduce_grid = max(1, min(sms, _cdiv(tokens, REDUCE_TILE)))
        reduce = reduce_weights = None
        if not self.fused:
            reduce = _Launch(self.kernels.reduce_rows, reduce_grid, dict(
                reduce_x, NUM_RANKS=self.world, WAIT=True, BLOCK=x_block, TILE=REDUCE_TILE))
        if len(parts) > 1:
            reduce_weights = _Launch(self.kernels.reduce_rows, reduce_grid, dict(
                NUM_RANKS=self.world, HAS_BIAS0=False, HAS_BIAS1=False, WAIT=False,
                BLOCK=_pow2_block(parts[1].shape[1], REDUCE_BLOCK), TILE=REDUCE_TILE, TIMED=_timed(),
                num_warps=REDUCE_WARPS))
        site = dict(
            tokens=tokens, widths=widths, regions=[(half + offset) // 4 for offset in offsets], mines=mines,
            gather_rows=gather_rows, head=(peers, signals, private["recv_prefix_dev"], private["slot_base_dev"],
                                           self.rank, num_recv),
            reduce_head=(signals, self.rank, self.timeout_ns),
            push=_Launch(self.kernels.push_back, max(1, min(sms, work)), dict(
                reduce_x, NUM_RANKS=self.world, NUM_PARTS=len(wire), B0=blocks[0], B1=blocks[1], TILE=COPY_TILE,
                FUSED=self.fused, RBLOCK=x_block, RTILE=REDUCE_TILE)),
            reduce=reduce, reduce_weights=reduce_weights)
        sites[key] = site
        return site

    def combine_rows(self, plan: NormalPlan, x: torch.Tensor, weights: torch.Tensor | None,
                     biases: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
        parts = [x.contiguous()] if weights is None else [x.contiguous(), weights.contiguous()]
        wire = [_words(p) for p in parts]
        bias0, bias1 = (tuple(biases) + (None, None))[:2]
        site = self._combine_site(plan, parts, wire, (bias0 is not None, bias1 is not None), (self._epoch + 1) % 2)
        self._epoch += 1
        tokens = site["tokens"]
        outs = [torch.empty(tokens, part.shape[1], dtype=part.dtype, device=self.device) for part in parts]
        back_args = []
        for w, width, region in zip(wire, site["widths"], site["regions"]):
            back_args += (w, width, region)
        if len(wire) == 1:
            back_args += (wire[0], 0, 0)
        out = outs[0]
        x_args = (out, site["gather_rows"], parts[0], site["mines"][0], out if bias0 is None else bias0,
                  out if bias1 is None else bias1, tokens, parts[0].shape[1])
        alignment = _aligned(*parts, bias0, bias1)
        site["push"](alignment, *site["head"], *back_args, self.timeout_ns, *x_args)
        if site["reduce"] is not None:
            site["reduce"](alignment, *site["reduce_head"], *x_args)
        if weights is not None:  # after the x reduction on the stream, so the peers' rows are known to be here
            site["reduce_weights"](alignment, *site["reduce_head"], outs[1], site["gather_rows"], parts[1],
                                   site["mines"][1], outs[1], outs[1], tokens, parts[1].shape[1])
        return out, (outs[1].float() if weights is not None else None)

    # ------------------------------------------------------------------ CUDA graphs
    graph_capturable = True

    @property
    def data_epoch(self) -> int:
        """Data ops issued so far (the host copy of the device epoch)."""
        return self._epoch

    @data_epoch.setter
    def data_epoch(self, value: int) -> None:
        self._epoch = value

    @property
    def count_epoch(self) -> int:
        return self._count_epoch

    @property
    def generation(self) -> int:
        return self._generation

    def close(self) -> None:
        self._symm = None


def create(group: Any, timeout_s: float, **options: Any) -> CudaStrategy:
    ok, reason = availability(group)
    if not ok:
        raise BackendUnavailable(reason)
    return CudaStrategy(group, timeout_s, **options)
