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
per (plan, part layout, data half); they are built once into a :class:`~ascend_dualpath._triton_launch.LaunchSite` kept by the strategy, whose
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
import weakref
from typing import Any

import torch

from ascend_dualpath import _env
from ascend_dualpath._triton_launch import LaunchSite
from ascend_dualpath.errors import BackendUnavailable, WaitTimeout
from ascend_dualpath.moe.config import Config
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
# The copy and reduce kernels' block, tile and warp settings are data: ascend_dualpath.moe.config (per EP size).
PLAN_BLOCK_TOKENS = 1024
LOCALIZE_GRID = 16
# Low-latency kernels: at most this many CTAs (all resident: they wait for the peers in the same launch);
# messages of a (token, expert) pair are stored WORD_BLOCK int32 words at a time, received TILE rows at a time.
LL_MAX_CTAS = 128
LL_EXPERT_BLOCK = 64
LL_TOKEN_CHUNK = 16
LL_TILE = 4
LL_WORD_BLOCK = 1024
LL_COMBINE_BLOCK = 1024
LL_WARPS = 8


def expected_ranks_per_token(num_experts: int, num_topk: int, num_ranks: int) -> float:
    """Expected number of distinct ranks a token's top-k (uniform, without replacement) lands on."""
    local = num_experts // num_ranks
    if num_experts - local < num_topk:
        return float(num_ranks)
    miss = math.comb(num_experts - local, num_topk) / math.comb(num_experts, num_topk)
    return num_ranks * (1 - miss)


def choose_num_sms(
    num_experts: int,
    num_topk: int,
    num_ranks: int,
    device_sms: int,
    nvlink_gbs: float = NVLINK_GBS,
    sm_read_gbs: float = SM_READ_GBS,
    sm_write_gbs: float = SM_WRITE_GBS,
) -> int:
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


def _site(kernel: Any, grid: int, constants: dict) -> LaunchSite:
    """A launch site (:class:`ascend_dualpath._triton_launch.LaunchSite`): later launches call the compiled binary
    directly, unless ``ADP_MOE_DIRECT_LAUNCH=0`` (then every launch goes through Triton). Its ``key`` is the
    16-byte alignment of the caller-supplied tensors (:func:`_aligned`); the other tensors are the strategy's own
    or fresh from the caching allocator (512-byte aligned)."""
    # ADP_MOE_DIRECT_LAUNCH is kept: the direct call uses Triton's compiled launcher, not a public API; a Triton
    # version that changes it in a way the refusal check does not catch is put back on `kernel[grid]` by it
    # (tools/gpu_moe.sh does so after a failed eager check).
    return LaunchSite(kernel, grid, constants, mode="direct" if _env.moe_direct_launch() else "jit")


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
        # Send and receive halves in one launch (all CTAs resident: grid <= SMs), unless ADP_MOE_FUSED=0. Kept
        # as a switch: the split launches are the path for a GPU whose SMs are shared (MPS, green contexts), where
        # not every CTA of a fused grid is resident and the waiting ones would hold SMs until the timeout; the
        # Triton interpreter harness, which runs the ranks in turn, uses the split path for the same reason.
        self.fused = _env.moe_fused()
        self._epoch = 0  # host copy of the device epoch (signal word EPOCH): picks each data op's half
        self._count_epoch = 0
        self._generation = 0  # bumped when the symmetric buffer is replaced (cached launch sites then expire)
        self._layout_sites: dict = {}
        self._layout_ranges: dict = {}  # id(is_token_in_rank) -> (weak ref, device id range of its layout)
        self._sites: dict = {}  # launch sites of the data ops, by part layout, region size, grid, data half
        self._count_sites: dict = {}
        self._plan_sites: dict = {}
        self._source_index: dict = {}
        self._fresh_matrix: Any = None  # (count epoch, device count matrix, row width) of the last exchange

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
            bases = [
                local.data_ptr() if r == self.rank else handle.get_buffer(r, (capacity,), torch.uint8, 0).data_ptr()
                for r in range(self.world)
            ]
            peers = torch.tensor(bases, dtype=torch.int64, device=self.device)
            self._symm = (local, handle, peers, local[:HEADER_BYTES].view(torch.int32))
            self._generation += 1
            for sites in (self._sites, self._count_sites, self._plan_sites):
                sites.clear()
        return self._symm

    def _half(self, epoch: int) -> int:
        """Byte offset of the data half used by the op of this epoch."""
        local = self._symm[0]
        return DATA_OFFSET + (epoch % 2) * (
            (local.numel() - DATA_OFFSET) // 2 // REGION_ALIGN_BYTES * REGION_ALIGN_BYTES
        )

    @staticmethod
    def _regions(widths_bytes: list[int], rows: int) -> tuple[list[int], int]:
        offsets, total = [], 0
        for width in widths_bytes:
            offsets.append(total)
            total += -(-rows * width // REGION_ALIGN_BYTES) * REGION_ALIGN_BYTES
        return offsets, total

    def _local_view(self, byte_offset: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        size = rows * cols * torch.empty((), dtype=dtype).element_size()
        return self._symm[0][byte_offset : byte_offset + size].view(dtype).view(rows, cols)

    def _check_device_error(self, error_word: int) -> None:
        if error_word:
            raise WaitTimeout(
                f"a device-side wait of the cuda MoE strategy exceeded {self.timeout_s:g} s (a peer "
                f"did not signal its rows); this buffer cannot be used further"
            )

    @staticmethod
    def config_of(plan: NormalPlan) -> Config:
        """The kernel settings the plan was made with (``Buffer.dispatch``'s ``config``)."""
        return plan.private["config"]

    def num_sms_for(self, plan: NormalPlan) -> int:
        override = self.config_of(plan).num_sms or self.fixed_num_sms
        if override:
            return min(override, self.device_sms)
        return plan.private["model_sms"]

    # ------------------------------------------------------------------ layout and counts
    def dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int):
        """The layout in one kernel, no host sync; returns ``(layout 4-tuple, None)``.

        The kernel also writes the ids' range (``max(0, -min id), max(0, max id)``, int32 [2] on the device),
        kept (see :meth:`layout_range`) under the returned ``is_token_in_rank``: a fresh dispatch given that
        layout exchanges it with its counts and raises ``BoundsError`` on every rank at the count exchange's
        host sync, before any row moves. ``None`` tells the caller there is no host-side range to check now.
        """
        tokens, topk = topk_idx.shape
        num_nodes = num_ranks // ranks_per_node if num_ranks > ranks_per_node else 1
        extra = num_nodes if num_nodes > 1 else 0
        counts = torch.zeros(num_ranks + extra + num_experts + 2, dtype=torch.int32, device=topk_idx.device)
        in_rank = torch.empty(tokens, num_ranks, dtype=torch.bool, device=topk_idx.device)
        if tokens:
            key = (tokens, topk, num_experts, num_ranks, ranks_per_node)
            launch = self._layout_sites.get(key)
            if launch is None:
                from ascend_dualpath.ops import _layout_kernel  # the same kernel as the dispatch_layout op's

                launch = self._layout_sites[key] = _site(
                    _layout_kernel.dispatch_layout,
                    _cdiv(tokens, _layout_kernel.BLOCK_TOKENS),
                    _layout_kernel.launch_constants(num_ranks, ranks_per_node, num_nodes, topk),
                )
            topk_idx = topk_idx.contiguous()
            launch(
                topk_idx,
                counts,
                in_rank.view(torch.uint8),
                tokens,
                topk,
                num_experts // num_ranks,
                num_experts,
                key=_aligned(topk_idx),
            )
        key = id(in_rank)
        # Dropped with the tensor (ids are reused only after the object is gone).
        self._layout_ranges[key] = (weakref.ref(in_rank, lambda _: self._layout_ranges.pop(key, None)), counts[-2:])
        per_rank = counts[:num_ranks]
        per_node = counts[num_ranks : num_ranks + extra] if num_nodes > 1 else None
        per_expert = counts[num_ranks + extra : num_ranks + extra + num_experts]
        return (per_rank, per_node, per_expert, in_rank), None

    def layout_range(self, is_token_in_rank: torch.Tensor) -> torch.Tensor | None:
        """The device-side id range (int32 [2]: ``max(0, -min id), max(0, max id)``) of the layout that produced
        ``is_token_in_rank`` (this very tensor), or None."""
        entry = self._layout_ranges.get(id(is_token_in_rank))
        if entry is None or entry[0]() is not is_token_in_rank:
            return None
        return entry[1]

    def exchange_counts(self, counts: torch.Tensor, what: str) -> torch.Tensor:
        """Device-side all-gather through the count slots; one host copy. Values travel as int32 (clamped)."""
        width = counts.numel()
        if self.world * width * 4 > COUNT_SLOT_BYTES:
            return super().exchange_counts(counts, what)
        _, _, peers, signals = self._buffer(0)
        self._count_epoch += 1
        area = HEADER_BYTES + (self._count_epoch % 2) * COUNT_SLOT_BYTES
        row = counts.to(torch.int64).clamp(-(2**31), 2**31 - 1).to(torch.int32).contiguous()
        self.kernels.exchange_counts[(1,)](
            peers,
            signals,
            row,
            self.rank,
            self._count_epoch,
            width,
            area // 4,
            self.timeout_ns,
            NUM_RANKS=self.world,
            BLOCK=_pow2_block(width, 1024),
            TIMED=_timed(),
        )
        matrix = self._local_view(area, self.world, width, torch.int32)
        host = torch.cat([signals[self.kernels.ERROR_WORD : self.kernels.ERROR_WORD + 1], matrix.reshape(-1)]).cpu()
        self._check_device_error(int(host[0]))
        return host[1:].view(self.world, width).to(torch.int64)

    def exchange_dispatch_counts(
        self,
        num_tokens_per_rank: torch.Tensor,
        num_tokens_per_expert: torch.Tensor,
        topk_idx: torch.Tensor | None,
        is_token_in_rank: torch.Tensor,
        what: str,
    ) -> torch.Tensor:
        """A fresh dispatch's count exchange, its statistics computed in the exchange kernel (one launch, one
        host copy): returns the CPU int64 ``[R, R + E + 4]`` table of ``Buffer.dispatch`` (per-rank counts,
        per-expert counts, min id, max id, sum of the per-rank counts, set entries of ``is_token_in_rank``).
        The id range includes the layout's (:meth:`layout_range`), so ids the layout saw out of range raise
        here even when the dispatch gets no ``topk_idx``."""
        num_experts = num_tokens_per_expert.numel()
        width = self.world + num_experts + 4
        if self.world * width * 4 > COUNT_SLOT_BYTES:
            return super().exchange_dispatch_counts(
                num_tokens_per_rank, num_tokens_per_expert, topk_idx, is_token_in_rank, what
            )
        _, _, peers, signals = self._buffer(0)
        self._count_epoch += 1
        area = HEADER_BYTES + (self._count_epoch % 2) * COUNT_SLOT_BYTES
        layout_range = self.layout_range(is_token_in_rank)
        key = (num_experts, topk_idx is not None, layout_range is not None, self._generation)
        launch = self._count_sites.get(key)
        if launch is None:
            launch = self._count_sites[key] = _site(
                self.kernels.exchange_dispatch_counts,
                1,
                dict(
                    NUM_RANKS=self.world,
                    RANKS_PAD=_next_power_of_2(self.world),
                    BLOCK=1024,
                    HAS_TOPK=topk_idx is not None,
                    HAS_LAYOUT_RANGE=layout_range is not None,
                    TIMED=_timed(),
                ),
            )
        in_rank = is_token_in_rank.view(torch.uint8)
        topk = topk_idx if topk_idx is not None else in_rank
        launch(
            peers,
            signals,
            num_tokens_per_rank,
            num_tokens_per_expert,
            topk,
            0 if topk_idx is None else topk_idx.numel(),
            in_rank,
            in_rank.numel(),
            layout_range if layout_range is not None else num_tokens_per_rank,
            self.rank,
            self._count_epoch,
            num_experts,
            area // 4,
            self.timeout_ns,
            key=_aligned(num_tokens_per_rank, num_tokens_per_expert, topk, in_rank, layout_range),
        )
        matrix = self._local_view(area, self.world, width, torch.int32)
        host = torch.cat([signals[self.kernels.ERROR_WORD : self.kernels.ERROR_WORD + 1], matrix.reshape(-1)]).cpu()
        self._check_device_error(int(host[0]))
        self._fresh_matrix = (self._count_epoch, matrix, width)
        return host[1:].view(self.world, width).to(torch.int64)

    # ------------------------------------------------------------------ plans
    def prepare_plan(self, plan: NormalPlan) -> None:
        """The plan's tables built on the device by one kernel (:func:`_cuda_kernels.plan_tables`) from the count
        matrix the count exchange left in this rank's buffer (or, for a plan made elsewhere, a copy of the host
        matrix); the host keeps only the two maxima that size the buffer regions."""
        in_rank = plan.is_token_in_rank
        counts = plan.count_matrix
        world = self.world
        tokens = in_rank.shape[0]
        fresh, self._fresh_matrix = self._fresh_matrix, None
        if fresh is not None and fresh[0] == self._count_epoch:
            matrix, width = fresh[1], fresh[2]
        else:
            matrix, width = to_device_async(counts.to(torch.int32).contiguous(), in_rank.device), counts.shape[1]
        device = in_rank.device
        slots = torch.empty(tokens, world, dtype=torch.int32, device=device)
        gather = torch.empty(tokens, world, dtype=torch.int32, device=device)
        tables = torch.empty(2 * world + 1 + world * world, dtype=torch.int32, device=device)
        launch = self._plan_sites.get(self._generation)
        if launch is None:
            launch = self._plan_sites[self._generation] = _site(
                self.kernels.plan_tables,
                1,
                dict(NUM_RANKS=world, RANKS_PAD=_next_power_of_2(world), BLOCK=PLAN_BLOCK_TOKENS),
            )
        launch(
            in_rank.view(torch.uint8),
            matrix,
            width,
            self.rank,
            tokens,
            slots,
            gather,
            tables,
            tables[world + 1 :],
            tables[2 * world + 1 :],
            key=_aligned(in_rank, matrix),
        )
        private = dict(plan.private or {})
        private.update(
            dispatch_slots=slots,
            gather_rows=gather,
            recv_prefix_dev=tables[: world + 1],
            slot_base_dev=tables[world + 1 : 2 * world + 1],
            rank_prefix_matrix=tables[2 * world + 1 :].view(world, world),
            max_recv=int(counts.sum(dim=0).max()),
            max_send=int(counts.sum(dim=1).max()),
        )
        private["model_sms"] = choose_num_sms(private["num_experts"], private["num_topk"], world, self.device_sms)
        plan.private = private

    def localize_topk(
        self, topk_idx: torch.Tensor, topk_weights: torch.Tensor, rank: int, local_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In place on a fresh dispatch's received top-k: local expert ids of ``rank`` (-1 for other ranks'
        experts), weights of -1 slots zeroed (one kernel instead of a chain of torch ops); returns the two."""
        if not topk_idx.numel():
            return topk_idx, topk_weights
        key = ("localize", local_experts, self._generation)
        launch = self._plan_sites.get(key)
        if launch is None:
            launch = self._plan_sites[key] = _site(
                self.kernels.localize_topk, LOCALIZE_GRID, dict(LOCAL_EXPERTS=local_experts, BLOCK=1024)
            )
        launch(topk_idx, topk_weights, topk_idx.numel(), rank * local_experts, key=_aligned(topk_idx, topk_weights))
        return topk_idx, topk_weights

    def source_index(self, tokens: int, device: torch.device) -> torch.Tensor:
        """``arange(tokens)`` int32, made once per size (only read)."""
        index = self._source_index.get(tokens)
        if index is None:
            index = self._source_index[tokens] = torch.arange(tokens, dtype=torch.int32, device=device)
        return index

    # ------------------------------------------------------------------ normal dispatch
    @staticmethod
    def _rows_capacity(rows: int) -> int:
        """Rows a buffer region is sized for: a power of two, so that plans of similar size share launch sites
        (the regions' offsets are compile-time-fixed arguments of a site)."""
        return _next_power_of_2(max(1, rows))

    def _dispatch_site(self, plan: NormalPlan, wire: list[torch.Tensor], parity: int) -> dict:
        """Everything of a dispatch launch that is fixed for a part layout, region size, grid and data half (not
        for a plan: the plan's tables and counts are per-call arguments, so a fresh dispatch reuses the site)."""
        private = plan.private
        widths = tuple(w.shape[1] for w in wire)
        rows = self._rows_capacity(private["max_recv"])
        offsets, total = self._regions([4 * w for w in widths], rows)
        _, _, peers, signals = self._buffer(total)
        sms, config = self.num_sms_for(plan), self.config_of(plan)
        key = ("dispatch", widths, rows, sms, config, parity, self._generation, self.fused)
        site = self._sites.get(key)
        if site is not None:
            return site
        half = self._half(parity)
        blocks = [_pow2_block(w, config.copy_block_words) for w in widths] + [1] * (MAX_PARTS - len(wire))
        constants = dict(
            NUM_RANKS=self.world,
            NUM_PARTS=len(wire),
            B0=blocks[0],
            B1=blocks[1],
            B2=blocks[2],
            B3=blocks[3],
            B4=blocks[4],
            TILE=config.copy_tile,
            TIMED=_timed(),
            num_warps=config.copy_warps,
        )
        site = self._sites[key] = dict(
            widths=widths,
            regions=[(half + offset) // 4 for offset in offsets],
            mines=[
                self._local_view(half + offset, rows, width, torch.int32)
                for width, offset in zip(widths, offsets, strict=True)
            ],
            push=_site(self.kernels.push_rows, sms, dict(constants, FUSED=self.fused)),
            receive=None if self.fused else _site(self.kernels.receive_rows, sms, constants),
            peers=peers,
            signals=signals,
        )
        return site

    def dispatch_rows(self, plan: NormalPlan, parts: list[torch.Tensor], what: str) -> list[torch.Tensor]:
        if len(parts) > MAX_PARTS:
            return super().dispatch_rows(plan, parts, what)
        wire = [_words(p) for p in parts]
        site = self._dispatch_site(plan, wire, (self._epoch + 1) % 2)
        self._epoch += 1
        private = plan.private
        num_recv = plan.num_recv_tokens
        slots, prefix = private["dispatch_slots"], private["recv_prefix_dev"]
        outs = [torch.empty(num_recv, width, dtype=torch.int32, device=self.device) for width in site["widths"]]
        send_args = [site["peers"], site["signals"], slots, slots.shape[0], self.rank, prefix, self.timeout_ns]
        recv_args = [site["signals"], self.rank, prefix, self.timeout_ns]
        for w, out, width, region, mine in zip(wire, outs, site["widths"], site["regions"], site["mines"], strict=True):
            send_args += (w, out, width, region, mine)
            recv_args += (mine, out, width)
        pad = MAX_PARTS - len(wire)
        send_args += (wire[0], outs[0], 0, 0, outs[0]) * pad
        recv_args += (outs[0], outs[0], 0) * pad
        alignment = _aligned(*wire, slots, prefix)
        site["push"](*send_args, key=alignment)
        if site["receive"] is not None:
            site["receive"](*recv_args, key=alignment)
        return [_typed(out, part) for out, part in zip(outs, parts, strict=True)]

    # ------------------------------------------------------------------ normal combine
    def _combine_site(
        self,
        plan: NormalPlan,
        parts: list[torch.Tensor],
        wire: list[torch.Tensor],
        has_bias: tuple[bool, bool],
        parity: int,
    ) -> dict:
        """Everything of a combine launch that is fixed for a part layout, biases, region size, grid and data
        half (the plan's tables are per-call arguments)."""
        private = plan.private
        widths = tuple(w.shape[1] for w in wire)
        rows = self._rows_capacity(private["max_send"])
        offsets, total = self._regions([4 * w for w in widths], rows)
        _, _, peers, signals = self._buffer(total)
        sms, config = self.num_sms_for(plan), self.config_of(plan)
        key = ("combine", widths, parts[0].dtype, has_bias, rows, sms, config, parity, self._generation, self.fused)
        site = self._sites.get(key)
        if site is not None:
            return site
        half = self._half(parity)
        blocks = [_pow2_block(w, config.copy_block_words) for w in widths] + [1]
        reduce_x = dict(HAS_BIAS0=has_bias[0], HAS_BIAS1=has_bias[1], TIMED=_timed(), num_warps=config.reduce_warps)
        x_block = _pow2_block(parts[0].shape[1], config.reduce_block)
        reduce = reduce_weights = None
        if not self.fused:
            reduce = _site(
                self.kernels.reduce_rows,
                sms,
                dict(reduce_x, NUM_RANKS=self.world, WAIT=True, BLOCK=x_block, TILE=config.reduce_tile),
            )
        if len(parts) > 1:
            reduce_weights = _site(
                self.kernels.reduce_rows,
                sms,
                dict(
                    NUM_RANKS=self.world,
                    HAS_BIAS0=False,
                    HAS_BIAS1=False,
                    WAIT=False,
                    BLOCK=_pow2_block(parts[1].shape[1], config.reduce_block),
                    TILE=config.reduce_tile,
                    TIMED=_timed(),
                    num_warps=config.reduce_warps,
                ),
            )
        site = self._sites[key] = dict(
            widths=widths,
            regions=[(half + offset) // 4 for offset in offsets],
            mines=[
                self._local_view(half + offset, rows, part.shape[1], part.dtype)
                for part, offset in zip(parts, offsets, strict=True)
            ],
            peers=peers,
            signals=signals,
            push=_site(
                self.kernels.push_back,
                sms,
                dict(
                    reduce_x,
                    NUM_RANKS=self.world,
                    NUM_PARTS=len(wire),
                    B0=blocks[0],
                    B1=blocks[1],
                    TILE=config.copy_tile,
                    FUSED=self.fused,
                    RBLOCK=x_block,
                    RTILE=config.reduce_tile,
                ),
            ),
            reduce=reduce,
            reduce_weights=reduce_weights,
        )
        return site

    def combine_rows(
        self, plan: NormalPlan, x: torch.Tensor, weights: torch.Tensor | None, biases: tuple
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        parts = [x.contiguous()] if weights is None else [x.contiguous(), weights.contiguous()]
        wire = [_words(p) for p in parts]
        bias0, bias1 = (tuple(biases) + (None, None))[:2]
        site = self._combine_site(plan, parts, wire, (bias0 is not None, bias1 is not None), (self._epoch + 1) % 2)
        self._epoch += 1
        private = plan.private
        gather_rows, prefix, slot_base = private["gather_rows"], private["recv_prefix_dev"], private["slot_base_dev"]
        tokens = gather_rows.shape[0]
        outs = [torch.empty(tokens, part.shape[1], dtype=part.dtype, device=self.device) for part in parts]
        back_args = []
        for w, width, region in zip(wire, site["widths"], site["regions"], strict=True):
            back_args += (w, width, region)
        if len(wire) == 1:
            back_args += (wire[0], 0, 0)
        out = outs[0]
        x_args = (
            out,
            gather_rows,
            parts[0],
            site["mines"][0],
            out if bias0 is None else bias0,
            out if bias1 is None else bias1,
            tokens,
            parts[0].shape[1],
        )
        alignment = _aligned(*parts, bias0, bias1, gather_rows, prefix, slot_base)
        site["push"](
            site["peers"],
            site["signals"],
            prefix,
            slot_base,
            self.rank,
            *back_args,
            self.timeout_ns,
            *x_args,
            key=alignment,
        )
        reduce_head = (site["signals"], self.rank, self.timeout_ns)
        if site["reduce"] is not None:
            site["reduce"](*reduce_head, *x_args, key=alignment)
        if weights is not None:  # after the x reduction on the stream, so the peers' rows are known to be here
            site["reduce_weights"](
                *reduce_head,
                outs[1],
                gather_rows,
                parts[1],
                site["mines"][1],
                outs[1],
                outs[1],
                tokens,
                parts[1].shape[1],
                key=alignment,
            )
        return out, (outs[1].float() if weights is not None else None)

    # ------------------------------------------------------------------ low latency
    def _ll_grid(self) -> int:
        return max(1, min(self.device_sms, LL_MAX_CTAS))

    def ll_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        max_tokens: int,
        num_experts: int,
        use_fp8: bool,
        round_scale: bool,
        use_ue8m0: bool,
        stats: torch.Tensor | None,
        deferred: bool,
    ):
        """Low-latency dispatch in one launch (:func:`_cuda_kernels.ll_dispatch`), or its send half now and the
        receive half when the returned function runs (``deferred``: ``return_recv_hook``).

        Returns ``(recv_x, recv_count, src_info, layout_range, receive)`` as ``Buffer.low_latency_dispatch``
        documents; ``receive`` is None unless deferred. Inputs are validated by the caller.
        """
        tokens, hidden = x.shape
        world, topk = self.world, topk_idx.shape[1]
        local_experts = num_experts // world
        slab = world * max_tokens
        messages = num_experts * max_tokens
        value_words = hidden // 4 if use_fp8 else hidden // 2
        scale_words = (hidden // 512 if use_ue8m0 else hidden // 128) if use_fp8 else 0
        offsets, total = self._packed_regions(
            [messages * value_words * 4, messages * scale_words * 4, messages * 4, world * local_experts * 4]
        )
        _, _, peers, signals = self._buffer(total)
        parity = (self._epoch + 1) % 2
        self._epoch += 1
        epoch = self._epoch
        half = self._half(parity)
        fused = self.fused and not deferred
        key = (
            "ll_dispatch",
            hidden,
            topk,
            max_tokens,
            num_experts,
            use_fp8,
            round_scale,
            use_ue8m0,
            stats is not None,
            parity,
            self._generation,
            fused,
        )
        sites = self._sites.get(key)
        if sites is None:
            blocks_per_chunk = (hidden // 128) & -(hidden // 128)  # largest power of two dividing H / 128 ...
            blocks_per_chunk = min(blocks_per_chunk, 8)  # ... at most 1024 columns a step
            constants = dict(
                NUM_RANKS=world,
                MAX_TOKENS=max_tokens,
                LOCAL_EXPERTS=local_experts,
                TOPK=topk,
                TOPK_PAD=_next_power_of_2(topk),
                HIDDEN=hidden,
                VALUE_WORDS=value_words,
                SCALE_WORDS=max(1, scale_words),
                SCALE_PAD=_next_power_of_2(max(1, scale_words)),
                BLOCKS_PER_CHUNK=blocks_per_chunk,
                USE_FP8=use_fp8,
                ROUND_SCALE=round_scale,
                UE8M0=use_ue8m0,
                EXPERT_BLOCK=LL_EXPERT_BLOCK,
                CHUNK=LL_TOKEN_CHUNK,
                TILE=LL_TILE,
                WORD_BLOCK=LL_WORD_BLOCK,
                HAS_STATS=stats is not None,
                TIMED=_timed(),
                num_warps=LL_WARPS,
            )
            grid = self._ll_grid()
            sites = self._sites[key] = (
                _site(self.kernels.ll_dispatch, grid, dict(constants, SEND=True, RECEIVE=fused)),
                None if fused else _site(self.kernels.ll_dispatch, grid, dict(constants, SEND=False, RECEIVE=True)),
            )
        device = x.device
        values_dtype = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
        recv_values = torch.zeros(local_experts, slab, hidden, dtype=values_dtype, device=device)
        scales_store = torch.zeros(local_experts, max(1, scale_words), slab, dtype=torch.int32, device=device)
        src_info = torch.full((local_experts, slab), -1, dtype=torch.int32, device=device)
        recv_count = torch.zeros(local_experts, dtype=torch.int32, device=device)
        layout_range = torch.zeros(local_experts, world, dtype=torch.int64, device=device)
        x_words = x.view(torch.int32)  # hidden is a multiple of 128
        regions = [(half + offset) // 4 for offset in offsets]
        args = [
            peers,
            signals,
            x_words,
            x,
            topk_idx,
            tokens,
            self.rank,
            self.timeout_ns,
            epoch,
            *regions,
            recv_values.view(torch.int32),
            scales_store,
            src_info,
            recv_count,
            layout_range,
            stats if stats is not None else recv_count,
        ]
        alignment = _aligned(x, topk_idx, stats)
        sites[0](*args, key=alignment)
        receive = None
        if sites[1] is not None:

            def receive() -> None:
                sites[1](*args, key=alignment)

        recv_x = recv_values
        if use_fp8:
            scales = scales_store.transpose(1, 2)
            recv_x = (recv_values, scales if use_ue8m0 else scales.view(torch.float32))
        return recv_x, recv_count, src_info, layout_range, receive

    @staticmethod
    def _packed_regions(sizes_bytes: list[int]) -> tuple[list[int], int]:
        """Byte offsets (in a data half) of consecutive regions of these sizes, each aligned; and the total."""
        offsets, total = [], 0
        for size in sizes_bytes:
            offsets.append(total)
            total += -(-size // REGION_ALIGN_BYTES) * REGION_ALIGN_BYTES
        return offsets, total

    def ll_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        layout_range: torch.Tensor,
        max_tokens: int,
        num_experts: int,
        out: torch.Tensor,
        deferred: bool,
    ):
        """Weighted low-latency combine in one launch (:func:`_cuda_kernels.ll_combine`) into ``out``, or its
        send half now and the reduction when the returned function runs (``deferred``). Returns that function
        or None."""
        local_experts, _, hidden = x.shape
        world, topk = self.world, topk_idx.shape[1]
        rows = num_experts * max_tokens
        total = -(-rows * hidden * 2 // REGION_ALIGN_BYTES) * REGION_ALIGN_BYTES
        _, _, peers, signals = self._buffer(total)
        parity = (self._epoch + 1) % 2
        self._epoch += 1
        epoch = self._epoch
        half = self._half(parity)
        fused = self.fused and not deferred
        key = ("ll_combine", hidden, topk, max_tokens, num_experts, parity, self._generation, fused)
        sites = self._sites.get(key)
        if sites is None:
            constants = dict(
                NUM_RANKS=world,
                MAX_TOKENS=max_tokens,
                LOCAL_EXPERTS=local_experts,
                TOPK=topk,
                TOPK_PAD=_next_power_of_2(topk),
                HIDDEN=hidden,
                BLOCK=_pow2_block(hidden, LL_COMBINE_BLOCK),
                CHUNK=LL_TOKEN_CHUNK,
                TILE=LL_TILE,
                TIMED=_timed(),
                num_warps=LL_WARPS,
            )
            grid = self._ll_grid()
            sites = self._sites[key] = (
                _site(self.kernels.ll_combine, grid, dict(constants, SEND=True, RECEIVE=fused)),
                None if fused else _site(self.kernels.ll_combine, grid, dict(constants, SEND=False, RECEIVE=True)),
                self._local_view(half, rows, hidden, torch.bfloat16),
            )
        x = x.contiguous()
        args = [
            peers,
            signals,
            x.view(torch.int32),
            layout_range,
            topk_idx,
            topk_weights,
            out,
            sites[2],
            topk_idx.shape[0],
            self.rank,
            self.timeout_ns,
            epoch,
            half // 4,
        ]
        alignment = _aligned(x, layout_range, topk_idx, topk_weights, out)
        sites[0](*args, key=alignment)
        if sites[1] is None:
            return None

        def receive() -> None:
            sites[1](*args, key=alignment)

        return receive

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
        for sites in (self._sites, self._count_sites, self._plan_sites, self._layout_ranges):
            sites.clear()


def create(group: Any, timeout_s: float, **options: Any) -> CudaStrategy:
    ok, reason = availability(group)
    if not ok:
        raise BackendUnavailable(reason)
    return CudaStrategy(group, timeout_s, **options)
