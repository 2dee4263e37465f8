"""The one registration point of the ``ascend_dualpath`` torch ops: schemas, docs and kernels per dispatch key.

Every op is defined here once (``torch.library.Library(..., "DEF")`` plus ``define``/``impl``, the low-overhead
form vLLM's ``direct_register_custom_op`` uses), with

- a ``CPU`` kernel: pure torch (:mod:`.cpu`), or the host side of a stateful runtime (:mod:`.moe_buffer`);
- a ``CUDA`` kernel: the Triton kernel where one exists (:mod:`.cuda`), else the same pure-torch kernel;
- a ``PrivateUse1`` kernel, registered only where torch_npu is installed: the AscendC launchers (:mod:`.npu`),
  else the pure-torch kernel (run by torch_npu's aten);
- a fake kernel (``register_fake``) giving output shapes, dtypes and strides without computing, for
  ``torch.compile`` / FakeTensor tracing.

Mutated arguments carry ``(a!)`` in the schema and the op returns ``()``. docs/ops.md lists the schemas; a test
keeps it in step with :data:`OPS`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ascend_dualpath.ops import aiv, cpu, cuda, moe_buffer, npu

NAMESPACE = "ascend_dualpath"


@dataclass(frozen=True)
class OpDef:
    """One op: ``schema`` (without the namespace), its doc, and a kernel per dispatch key (None: the CPU one).

    ``on_cuda`` False registers no CUDA kernel (the NPU launchers: their CPU kernel is host-memory only).
    """

    schema: str
    doc: str
    cpu: Callable
    fake: Callable
    cuda: Callable | None = None
    npu: Callable | None = None
    on_cuda: bool = True

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]


# ---------------------------------------------------------------------------------------------- fake kernels
def _dispatch_layout_fake(topk_idx, num_experts, num_ranks, ranks_per_node):
    tokens = topk_idx.shape[0]
    nodes = cpu.num_nodes_of(num_ranks, ranks_per_node)
    int32 = torch.int32
    return (
        topk_idx.new_empty((num_ranks,), dtype=int32),
        topk_idx.new_empty((nodes if nodes > 1 else 0,), dtype=int32),
        topk_idx.new_empty((num_experts,), dtype=int32),
        topk_idx.new_empty((tokens, num_ranks), dtype=torch.bool),
    )


def _fp8_quantize_fake(x, round_scale, use_ue8m0):
    tokens, hidden = x.shape
    values = x.new_empty((tokens, hidden), dtype=torch.float8_e4m3fn)
    if use_ue8m0:
        return values, x.new_empty((tokens, hidden // (4 * cpu.FP8_BLOCK)), dtype=torch.int32)
    return values, x.new_empty((tokens, hidden // cpu.FP8_BLOCK), dtype=torch.float32)


def _dequantize_fake(values, scales):
    return values.new_empty(values.shape, dtype=torch.float32)


def _int8_quantize_fake(x):
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0],), dtype=torch.float32)


def _ue8m0_pack_fake(scales):
    return scales.new_empty((*scales.shape[:-1], scales.shape[-1] // 4), dtype=torch.int32)


def _ue8m0_unpack_fake(packed):
    return packed.new_empty((*packed.shape[:-1], packed.shape[-1] * 4), dtype=torch.float32)


def _kv_encode_rows_fake(fields, field_ndims):
    leading = fields[0].shape[: fields[0].dim() - field_ndims[0]]
    return fields[0].new_empty((*leading, cpu.kv_row_bytes(fields, field_ndims)), dtype=torch.uint8)


def _kv_decode_field_fake(rows, offset, dtype, shape):
    return rows.new_empty((*rows.shape[:-1], *shape), dtype=dtype)


def _kv_gather_tokens_fake(cache, blocks, offsets):
    return cache.new_empty((blocks.shape[0], *cache.shape[2:]))


def _returns_nothing_fake(*args):
    return None


# ---------------------------------------------------------------------------------------------- the ops
_LAYOUT_DOC = """MoE dispatch layout of ``topk_idx`` (``Buffer.get_dispatch_layout``'s computation, no communication).

Parameters
----------
topk_idx : int64 [T, K], ids in ``[-1, num_experts)`` (-1: unused slot)
num_experts, num_ranks, ranks_per_node : int, ``num_experts % num_ranks == 0``; node = rank // ranks_per_node

Returns
-------
num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank int32 [R / ranks_per_node] (``[0]`` on one node),
num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R]. A token counts once per rank and per node."""

_FP8_DOC = """Per-token, per-128-column FP8 (e4m3) quantisation (``moe.quant.per_token_cast_to_fp8``).

Parameters
----------
x : bf16/fp16/fp32 [T, H], ``H % 128 == 0`` (``H % 512 == 0`` with ``use_ue8m0``)
round_scale : bool, round each scale up to a power of two
use_ue8m0 : bool, pack the (power-of-two) scales as UE8M0 bytes, four per int32; needs ``round_scale``

Returns
-------
x_e4m3 float8_e4m3fn [T, H], scales float32 [T, H/128] or int32 [T, H/512]"""

OPS: tuple[OpDef, ...] = (
    OpDef(
        "dispatch_layout(Tensor topk_idx, int num_experts, int num_ranks, int ranks_per_node) -> "
        "(Tensor num_tokens_per_rank, Tensor num_tokens_per_rdma_rank, Tensor num_tokens_per_expert, "
        "Tensor is_token_in_rank)",
        _LAYOUT_DOC,
        cpu.dispatch_layout,
        _dispatch_layout_fake,
        cuda=cuda.dispatch_layout,
    ),
    OpDef(
        "fp8_quantize(Tensor x, bool round_scale, bool use_ue8m0) -> (Tensor x_e4m3, Tensor scales)",
        _FP8_DOC,
        cpu.fp8_quantize,
        _fp8_quantize_fake,
    ),
    OpDef(
        "fp8_dequantize(Tensor x_e4m3, Tensor scales) -> Tensor",
        "FP8 dequantisation: e4m3 [T, H] and float32 [T, H/128] (or UE8M0 int32 [T, H/512]) scales -> float32 "
        "[T, H] (``moe.quant.per_token_cast_back``).",
        cpu.fp8_dequantize,
        _dequantize_fake,
    ),
    OpDef(
        "int8_quantize(Tensor x) -> (Tensor x_int8, Tensor scales)",
        "Dynamic per-token INT8 quantisation (MC2 ``quant_mode=2``): bf16/fp16/fp32 [T, H] -> (int8 [T, H], "
        "float32 [T]) with ``x ~= x_int8 * scales[:, None]`` (``moe.quant.per_token_cast_to_int8``).",
        cpu.int8_quantize,
        _int8_quantize_fake,
    ),
    OpDef(
        "int8_dequantize(Tensor x_int8, Tensor scales) -> Tensor",
        "INT8 dequantisation: int8 [T, H] and float32 [T] -> float32 [T, H] (``moe.quant.per_token_cast_back_int8``).",
        cpu.int8_dequantize,
        _dequantize_fake,
    ),
    OpDef(
        "ue8m0_pack(Tensor scales) -> Tensor",
        "Pack power-of-two float32 scales [..., B] (B % 4 == 0) into UE8M0 int32 [..., B/4]: byte j of word i "
        "is the biased exponent of scale 4i+j. Raises ConfigError for a scale that is not a power of two "
        "(``moe.quant.pack_ue8m0``).",
        cpu.ue8m0_pack,
        _ue8m0_pack_fake,
    ),
    OpDef(
        "ue8m0_unpack(Tensor packed) -> Tensor",
        "Unpack UE8M0 int32 [..., B/4] into float32 powers of two [..., B] (``moe.quant.unpack_ue8m0``).",
        cpu.ue8m0_unpack,
        _ue8m0_unpack_fake,
    ),
    OpDef(
        "kv_encode_rows(Tensor[] fields, int[] field_ndims) -> Tensor",
        "Pack typed KV fields into fresh token rows (``kv.layout.KVLayout.encode_rows``).\n\nParameters\n"
        "----------\nfields : list of Tensor, field i ``dtype_i [..., *shape_i]``, one leading shape for all\n"
        "field_ndims : list of int, ``len(shape_i)``\n\nReturns\n-------\nuint8 [..., C], C = sum of the "
        "fields' row bytes, field i's bytes after field i-1's.",
        cpu.kv_encode_rows,
        _kv_encode_rows_fake,
    ),
    OpDef(
        "kv_decode_field(Tensor rows, int offset, ScalarType dtype, int[] shape) -> Tensor",
        "Copy one typed field out of uint8 token rows [..., C]: the ``dtype [..., *shape]`` value at byte "
        "``offset`` of each row (a fresh tensor; ``KVLayout.field_view`` is the no-copy view).",
        cpu.kv_decode_field,
        _kv_decode_field_fake,
    ),
    OpDef(
        "kv_gather_tokens(Tensor cache, Tensor blocks, Tensor offsets) -> Tensor",
        "Gather token rows of one layer's paged KV cache into a staging tensor (the vLLM connector's "
        "``read_tokens``).\n\nParameters\n----------\ncache : [num_blocks, block_size, *row] any dtype and "
        "strides\nblocks, offsets : int64 [n], block id and in-block offset of each token\n\nReturns\n-------\n"
        "[n, *row] in cache.dtype, contiguous: ``cache[blocks, offsets]``.",
        cpu.kv_gather_tokens,
        _kv_gather_tokens_fake,
    ),
    OpDef(
        "kv_scatter_tokens(Tensor(a!) cache, Tensor blocks, Tensor offsets, Tensor rows) -> ()",
        "Scatter staged token rows [n, *row] into one layer's paged KV cache [num_blocks, block_size, *row] in "
        "place (the vLLM connector's ``write_tokens``): ``cache[blocks[i], offsets[i]] = rows[i]``; no other "
        "byte changes. blocks, offsets: int64 [n].",
        cpu.kv_scatter_tokens,
        _returns_nothing_fake,
    ),
    OpDef(
        "hccl_stage(int src_addr, Tensor(a!) window, Tensor tiling, int block_dim) -> ()",
        "Launch the AscendC ``hccl_stage`` kernel: copy ``StageTiling.total_bytes`` bytes from device address "
        "``src_addr`` into the HCCL window tensor (uint8, contiguous) on ``block_dim`` AI cores. tiling: uint8 "
        "[16] ``StageTiling`` (op_kernels/include/adp/transfer_kernels.h). CPU: the same copy in host memory.",
        npu.hccl_stage_cpu,
        _returns_nothing_fake,
        npu=npu.hccl_stage_npu,
        on_cuda=False,
    ),
    OpDef(
        "aiv_post_wqe(Tensor segments, Tensor queues, Tensor(a!) status, Tensor tiling, int block_dim) -> ()",
        "Launch the AscendC ``aiv_post_wqe`` kernel: each of ``block_dim`` vector cores posts its share of the "
        "segments (uint8 [n * 32], ``Segment``) as RDMA WQEs to its queue (uint8 [block_dim * 64], ``AivQueue``) "
        "and writes its ``CoreStatus`` into status (uint8 [block_dim * 16]). tiling: uint8 [32] ``AivPostTiling``. "
        "CPU: the emulated kernel on the emulator's queue pairs, which ``ops.aiv_queues`` encodes and records; "
        "a queue matching no live recorded queue pair is refused before any core starts.",
        aiv.aiv_post_wqe_cpu,
        _returns_nothing_fake,
        npu=npu.aiv_post_wqe_npu,
        on_cuda=False,
    ),
    OpDef(
        "moe_cached_dispatch(Tensor[] x, int buffer_id, int handle_id) -> Tensor[]",
        "Cached-mode ``Buffer.dispatch``: send ``x`` ([x] bf16/fp16/fp32 [T, H], or [values, scales] as "
        "quantised) along the layout of handle ``handle_id``; returns the received parts, [N, ...] each, N from "
        "the handle. Ids from ``ops.register_buffer`` / ``ops.register_handle``.",
        moe_buffer.cached_dispatch,
        moe_buffer.cached_dispatch_fake,
        cuda=moe_buffer.cached_dispatch,
    ),
    OpDef(
        "moe_combine(Tensor x, Tensor? topk_weights, Tensor? bias_0, Tensor? bias_1, int buffer_id, "
        "int handle_id, bool weighted) -> (Tensor combined_x, Tensor combined_topk_weights)",
        "``Buffer.combine`` along handle ``handle_id``: x [N, H] -> combined_x [T, H] in x.dtype and "
        "combined_topk_weights float32 [T, K] ([T, 0] without topk_weights).",
        moe_buffer.combine,
        moe_buffer.combine_fake,
        cuda=moe_buffer.combine,
    ),
    OpDef(
        "moe_low_latency_dispatch(Tensor x, Tensor topk_idx, int buffer_id, int num_max_dispatch_tokens_per_rank, "
        "int num_experts, bool use_fp8, bool round_scale, bool use_ue8m0) -> (Tensor recv_x, "
        "Tensor recv_scales, Tensor recv_count, Tensor src_info, Tensor layout_range)",
        "``Buffer.low_latency_dispatch`` (received at once): x bf16 [T, H], topk_idx int64 [T, K] -> recv_x "
        "[L, R*M, H] (bf16, or e4m3 with use_fp8), recv_scales float32 [L, R*M, H/128] / UE8M0 int32 "
        "[L, R*M, H/512] ([0] without use_fp8), recv_count int32 [L], src_info int32 [L, R*M], layout_range "
        "int64 [L, R]; worst-case shapes, rows past recv_count are zero.",
        moe_buffer.low_latency_dispatch,
        moe_buffer.low_latency_dispatch_fake,
        cuda=moe_buffer.low_latency_dispatch,
    ),
    OpDef(
        "moe_low_latency_combine(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor src_info, "
        "Tensor layout_range, int buffer_id, int num_max_dispatch_tokens_per_rank, int num_experts) -> Tensor",
        "``Buffer.low_latency_combine``: expert outputs bf16 [L, R*M, H] in the dispatch's packed layout -> "
        "bf16 [T, H], the weighted sum over each token's valid slots.",
        moe_buffer.low_latency_combine,
        moe_buffer.low_latency_combine_fake,
        cuda=moe_buffer.low_latency_combine,
    ),
)

_LIB: torch.library.Library | None = None


def register() -> None:
    """Define every op of :data:`OPS` and register its kernels (once per process)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library(NAMESPACE, "DEF")
    with_npu = npu.has_torch_npu()
    for op in OPS:
        lib.define(op.schema)
        lib.impl(op.name, op.cpu, "CPU")
        if op.on_cuda:
            lib.impl(op.name, op.cuda or op.cpu, "CUDA")
        if with_npu:
            lib.impl(op.name, op.npu or op.cpu, "PrivateUse1")
        torch.library.register_fake(f"{NAMESPACE}::{op.name}", op.fake, lib=lib)
        packet = getattr(getattr(torch.ops, NAMESPACE), op.name)
        packet.__doc__ = packet.default.__doc__ = f"{NAMESPACE}::{op.schema}\n\n{op.doc}"
    _LIB = lib
