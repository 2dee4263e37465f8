"""Triton kernels of the ``cuda`` MoE strategy (imported only when that strategy is created)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _store_row(dst, slot, cols, vals, mask, row_elems):
    if slot >= 0:  # slot < 0: the token does not go to this destination
        tl.store(dst + slot.to(tl.int64) * row_elems + cols, vals, mask=mask)


@triton.jit
def push_rows(src, slots, d0, d1, d2, d3, d4, d5, d6, d7, num_tokens, row_elems,
              NUM_DST: tl.constexpr, BLOCK: tl.constexpr):
    """Row t of src goes to row slots[t, r] of destination r, for every r with slots[t, r] >= 0."""
    for t in range(tl.program_id(0).to(tl.int64), num_tokens, tl.num_programs(0)):  # int64 row offsets
        base = slots + t * NUM_DST
        for start in range(0, row_elems, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < row_elems
            vals = tl.load(src + t * row_elems + cols, mask=mask)
            _store_row(d0, tl.load(base), cols, vals, mask, row_elems)
            if NUM_DST > 1:
                _store_row(d1, tl.load(base + 1), cols, vals, mask, row_elems)
            if NUM_DST > 2:
                _store_row(d2, tl.load(base + 2), cols, vals, mask, row_elems)
                _store_row(d3, tl.load(base + 3), cols, vals, mask, row_elems)
            if NUM_DST > 4:
                _store_row(d4, tl.load(base + 4), cols, vals, mask, row_elems)
                _store_row(d5, tl.load(base + 5), cols, vals, mask, row_elems)
                _store_row(d6, tl.load(base + 6), cols, vals, mask, row_elems)
                _store_row(d7, tl.load(base + 7), cols, vals, mask, row_elems)


@triton.jit
def _add_row(acc, src, row, cols, mask, row_elems):
    if row >= 0:
        acc += tl.load(src + row.to(tl.int64) * row_elems + cols, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def reduce_rows(out, rows, s0, s1, s2, s3, s4, s5, s6, s7, bias0, bias1, num_tokens, row_elems,
                NUM_SRC: tl.constexpr, HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = sum over r ascending of s_r[rows[t, r]] (rows < 0 skipped), + bias0[t] + bias1[t], in fp32."""
    for t in range(tl.program_id(0).to(tl.int64), num_tokens, tl.num_programs(0)):  # int64 row offsets
        base = rows + t * NUM_SRC
        for start in range(0, row_elems, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < row_elems
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            acc = _add_row(acc, s0, tl.load(base), cols, mask, row_elems)
            if NUM_SRC > 1:
                acc = _add_row(acc, s1, tl.load(base + 1), cols, mask, row_elems)
            if NUM_SRC > 2:
                acc = _add_row(acc, s2, tl.load(base + 2), cols, mask, row_elems)
                acc = _add_row(acc, s3, tl.load(base + 3), cols, mask, row_elems)
            if NUM_SRC > 4:
                acc = _add_row(acc, s4, tl.load(base + 4), cols, mask, row_elems)
                acc = _add_row(acc, s5, tl.load(base + 5), cols, mask, row_elems)
                acc = _add_row(acc, s6, tl.load(base + 6), cols, mask, row_elems)
                acc = _add_row(acc, s7, tl.load(base + 7), cols, mask, row_elems)
            offset = t * row_elems + cols
            if HAS_BIAS0:
                acc += tl.load(bias0 + offset, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS1:
                acc += tl.load(bias1 + offset, mask=mask, other=0.0).to(tl.float32)
            tl.store(out + offset, acc.to(out.dtype.element_ty), mask=mask)
