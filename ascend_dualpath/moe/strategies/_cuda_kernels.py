"""Triton kernels of the ``cuda`` MoE strategy (imported only when that strategy is created).

Rows travel as int32 words (every wire row is a multiple of 4 bytes). A rank reaches its peers' symmetric
buffers through ``peers``, an int64 ``[R]`` table of their base addresses (its own included). Every buffer
starts with a header of int32 words, ``signals`` being a rank's own header:

- ``SIG_DATA + src``: epoch of the last data op whose rows ``src`` finished writing into this buffer;
- ``SIG_COUNT + src``: the same for the count exchange;
- ``DONE``: finished CTAs of this rank's running push kernel (the last one to finish signals the peers);
- ``ERROR``: set to 1 when a device-side wait gave up after ``timeout_ns``;
- ``EPOCH``: epoch of the last data op this rank started. A push kernel runs as epoch ``EPOCH + 1`` and its last
  CTA stores that back, so the epoch lives on the device: launches take no per-call argument and can be
  recorded in a CUDA graph and replayed (the host keeps a copy of the count only to pick the data half).

Ordering: each CTA's stores, then a CTA barrier and a system-scope release increment of ``DONE``; the CTA that
finishes last acquires it and release-stores the epoch into every peer's signal word; a receiver acquire-polls
that word. Every CTA reads ``EPOCH`` before its release increment of ``DONE``, so the last CTA's store of the new
epoch cannot overtake any CTA's read. The count exchange keeps a host-passed epoch (it ends in a host sync
anyway), not specialised (Triton would otherwise compile a variant the first time it is 1 or a multiple of 16).
Waits are bounded by the GPU global timer (by a spin count in the interpreter).
"""

from __future__ import annotations

import triton
import triton.language as tl

ERROR_WORD = 33  # for the host
SIG_DATA = tl.constexpr(0)
SIG_COUNT = tl.constexpr(16)
DONE = tl.constexpr(32)
ERROR = tl.constexpr(ERROR_WORD)
EPOCH_WORD = 34  # for the host
EPOCH = tl.constexpr(EPOCH_WORD)
INTERPRETER_SPINS = tl.constexpr(1 << 10)


@triton.jit
def _now(TIMED: tl.constexpr):
    if TIMED:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)
    else:
        return tl.full((), 0, tl.int64)


@triton.jit
def _wait_at_least(word, target, error, timeout_ns, TIMED: tl.constexpr):
    """Acquire-poll ``*word`` until it is >= ``target``; on timeout set ``*error`` and return."""
    value = tl.atomic_add(word, 0, sem="acquire", scope="sys")
    deadline = _now(TIMED) + timeout_ns
    spins = 0
    while (value < target) & (spins >= 0):
        value = tl.atomic_add(word, 0, sem="acquire", scope="sys")
        spins += 1
        if TIMED:
            if _now(TIMED) > deadline:
                spins = -1
        else:
            if spins > INTERPRETER_SPINS:
                spins = -1
    if spins < 0:
        tl.atomic_xchg(error, 1)


@triton.jit
def _peer_words(peers, rank):
    return tl.load(peers + rank).to(tl.pointer_type(tl.int32))


@triton.jit
def _signal_peers(peers, signals, me, epoch, SIGNAL: tl.constexpr, NUM_RANKS: tl.constexpr):
    """Called by every CTA after its stores: the last CTA to finish publishes ``epoch`` to every peer and
    records it as this rank's current epoch."""
    tl.debug_barrier()
    finished = tl.atomic_add(signals + DONE, 1, sem="acq_rel", scope="sys")
    if finished == tl.num_programs(0) - 1:
        tl.atomic_xchg(signals + DONE, 0)
        tl.atomic_xchg(signals + EPOCH, epoch)
        for rank in tl.static_range(NUM_RANKS):
            if rank != me:
                tl.atomic_xchg(_peer_words(peers, rank) + SIGNAL + me, epoch, sem="release", scope="sys")


@triton.jit
def _wait_all_peers(signals, me, epoch, timeout_ns, SIGNAL: tl.constexpr, NUM_RANKS: tl.constexpr,
                    TIMED: tl.constexpr):
    for rank in tl.static_range(NUM_RANKS):
        if rank != me:
            _wait_at_least(signals + SIGNAL + rank, epoch, signals + ERROR, timeout_ns, TIMED)


# ---------------------------------------------------------------------------------------------- layout
@triton.jit
def dispatch_layout(topk_idx, counts, in_rank, num_tokens, num_topk, experts_per_rank, num_experts,
                    NUM_RANKS: tl.constexpr, RANKS_PAD: tl.constexpr, RANKS_PER_NODE: tl.constexpr,
                    NUM_NODES: tl.constexpr, NODES_PAD: tl.constexpr, TOPK_PAD: tl.constexpr,
                    BLOCK_T: tl.constexpr):
    """One pass over ``topk_idx`` [T, K]: ``in_rank`` [T, R] (uint8) and, by atomic adds into the zeroed
    int32 ``counts``: tokens per rank [R], per node [NODES] (when NUM_NODES > 1), per expert [E], then
    ``max(0, -min id)`` and ``max(0, max id)`` for the caller's bounds check. Out-of-range ids count nowhere."""
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.arange(0, TOPK_PAD)
    present = (tokens < num_tokens)[:, None] & (slots < num_topk)[None, :]
    idx = tl.load(topk_idx + tokens[:, None] * num_topk + slots[None, :], mask=present, other=-1)
    int32_max = 2147483647
    below = tl.minimum(tl.max(tl.maximum(-idx, 0)), int32_max).to(tl.int32)
    above = tl.minimum(tl.max(tl.maximum(idx, 0)), int32_max).to(tl.int32)
    stats = counts + NUM_RANKS + (NUM_NODES if NUM_NODES > 1 else 0) + num_experts
    tl.atomic_max(stats, below)
    tl.atomic_max(stats + 1, above)
    valid = present & (idx >= 0) & (idx < num_experts)
    rank_of = tl.where(valid, idx // experts_per_rank, -1)
    ranks = tl.arange(0, RANKS_PAD)
    hit = tl.max((rank_of[:, :, None] == ranks[None, None, :]).to(tl.int32), axis=1)
    tl.store(in_rank + tokens[:, None] * NUM_RANKS + ranks[None, :], hit.to(tl.uint8),
             mask=(tokens < num_tokens)[:, None] & (ranks < NUM_RANKS)[None, :])
    tl.atomic_add(counts + ranks, tl.sum(hit, axis=0), mask=ranks < NUM_RANKS)
    if NUM_NODES > 1:
        nodes = tl.arange(0, NODES_PAD)
        node_of = tl.where(valid, rank_of // RANKS_PER_NODE, -1)
        node_hit = tl.max((node_of[:, :, None] == nodes[None, None, :]).to(tl.int32), axis=1)
        tl.atomic_add(counts + NUM_RANKS + nodes, tl.sum(node_hit, axis=0), mask=nodes < NUM_NODES)
    expert_counts = counts + NUM_RANKS + (NUM_NODES if NUM_NODES > 1 else 0)
    tl.atomic_add(expert_counts + tl.where(valid, idx, 0), tl.full(idx.shape, 1, tl.int32), mask=valid)


# ---------------------------------------------------------------------------------------------- counts
@triton.jit(do_not_specialize=["epoch"])
def exchange_counts(peers, signals, row, me, epoch, width, area, timeout_ns, NUM_RANKS: tl.constexpr,
                    BLOCK: tl.constexpr, TIMED: tl.constexpr):
    """One CTA: store ``row`` [width] into row ``me`` of every rank's count area (word offset ``area``),
    signal, then wait until every peer's row is here."""
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        values = tl.load(row + cols, mask=cols < width)
        for rank in tl.static_range(NUM_RANKS):
            tl.store(_peer_words(peers, rank) + area + me * width + cols, values, mask=cols < width)
    tl.debug_barrier()
    for rank in tl.static_range(NUM_RANKS):
        if rank != me:
            tl.atomic_xchg(_peer_words(peers, rank) + SIG_COUNT + me, epoch, sem="release", scope="sys")
    _wait_all_peers(signals, me, epoch, timeout_ns, SIG_COUNT, NUM_RANKS, TIMED)


# ---------------------------------------------------------------------------------------------- dispatch
# The copy kernels move TILE rows per iteration: several rows in flight per CTA is what keeps a CTA from
# being bound by memory latency (one row at a time measured ~11 GB/s per SM on H200).
@triton.jit
def _push_part(t, live, slots, src, out, words, region, peers, me, NUM_RANKS: tl.constexpr, BLOCK: tl.constexpr):
    for start in range(0, words, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = live[:, None] & (cols < words)[None, :]
        values = tl.load(src + t[:, None] * words + cols[None, :], mask=mask)
        for rank in tl.static_range(NUM_RANKS):
            slot = tl.load(slots + t * NUM_RANKS + rank, mask=live, other=-1).to(tl.int64)
            to_rank = mask & (slot >= 0)[:, None]
            offsets = slot[:, None] * words + cols[None, :]
            if rank == me:
                tl.store(out + offsets, values, mask=to_rank)
            else:
                tl.store(_peer_words(peers, rank) + region + offsets, values, mask=to_rank)


@triton.jit
def push_rows(peers, signals, slots, num_tokens, me, num_rows, own_begin, own_end, timeout_ns,
              s0, o0, w0, r0, m0, s1, o1, w1, r1, m1, s2, o2, w2, r2, m2, s3, o3, w3, r3, m3, s4, o4, w4, r4, m4,
              NUM_RANKS: tl.constexpr, NUM_PARTS: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
              B2: tl.constexpr, B3: tl.constexpr, B4: tl.constexpr, TILE: tl.constexpr, FUSED: tl.constexpr,
              TIMED: tl.constexpr):
    """Dispatch. Token t's row of part p (int32 words ``s_p`` [T, w_p]) goes to row ``slots[t, r]`` of rank
    r (skipped when < 0): this rank's own output ``o_p`` for r = me, word offset ``r_p`` of peer r's buffer
    otherwise; the last CTA signals the op's epoch (``EPOCH`` + 1) to every peer. If FUSED, every CTA then
    does the receive half (:func:`receive_rows`, with ``m_p`` this rank's buffer region of part p): one launch
    instead of two, which needs all CTAs resident at once (the grid is at most one CTA per SM)."""
    epoch = tl.load(signals + EPOCH, volatile=True) + 1
    for first in range(tl.program_id(0).to(tl.int64) * TILE, num_tokens, tl.num_programs(0) * TILE):
        t = first + tl.arange(0, TILE)
        live = t < num_tokens
        _push_part(t, live, slots, s0, o0, w0, r0, peers, me, NUM_RANKS, B0)
        if NUM_PARTS > 1:
            _push_part(t, live, slots, s1, o1, w1, r1, peers, me, NUM_RANKS, B1)
        if NUM_PARTS > 2:
            _push_part(t, live, slots, s2, o2, w2, r2, peers, me, NUM_RANKS, B2)
        if NUM_PARTS > 3:
            _push_part(t, live, slots, s3, o3, w3, r3, peers, me, NUM_RANKS, B3)
        if NUM_PARTS > 4:
            _push_part(t, live, slots, s4, o4, w4, r4, peers, me, NUM_RANKS, B4)
    _signal_peers(peers, signals, me, epoch, SIG_DATA, NUM_RANKS)
    if FUSED:
        _receive(signals, me, epoch, num_rows, own_begin, own_end, timeout_ns, m0, o0, w0, m1, o1, w1, m2, o2, w2,
                 m3, o3, w3, m4, o4, w4, NUM_RANKS, NUM_PARTS, B0, B1, B2, B3, B4, TILE, TIMED)


@triton.jit
def _copy_part(row, live, src, out, words, BLOCK: tl.constexpr):
    for start in range(0, words, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = live[:, None] & (cols < words)[None, :]
        offsets = row[:, None] * words + cols[None, :]
        tl.store(out + offsets, tl.load(src + offsets, mask=mask), mask=mask)


@triton.jit
def _receive(signals, me, epoch, num_rows, own_begin, own_end, timeout_ns,
             m0, o0, w0, m1, o1, w1, m2, o2, w2, m3, o3, w3, m4, o4, w4,
             NUM_RANKS: tl.constexpr, NUM_PARTS: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
             B2: tl.constexpr, B3: tl.constexpr, B4: tl.constexpr, TILE: tl.constexpr, TIMED: tl.constexpr):
    _wait_all_peers(signals, me, epoch, timeout_ns, SIG_DATA, NUM_RANKS, TIMED)
    own = own_end - own_begin
    for first in range(tl.program_id(0).to(tl.int64) * TILE, num_rows - own, tl.num_programs(0) * TILE):
        i = first + tl.arange(0, TILE)
        live = i < num_rows - own
        row = tl.where(i < own_begin, i, i + own)
        _copy_part(row, live, m0, o0, w0, B0)
        if NUM_PARTS > 1:
            _copy_part(row, live, m1, o1, w1, B1)
        if NUM_PARTS > 2:
            _copy_part(row, live, m2, o2, w2, B2)
        if NUM_PARTS > 3:
            _copy_part(row, live, m3, o3, w3, B3)
        if NUM_PARTS > 4:
            _copy_part(row, live, m4, o4, w4, B4)


@triton.jit
def receive_rows(signals, me, num_rows, own_begin, own_end, timeout_ns,
                 m0, o0, w0, m1, o1, w1, m2, o2, w2, m3, o3, w3, m4, o4, w4,
                 NUM_RANKS: tl.constexpr, NUM_PARTS: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
                 B2: tl.constexpr, B3: tl.constexpr, B4: tl.constexpr, TILE: tl.constexpr, TIMED: tl.constexpr):
    """Dispatch receive half: wait for every peer's signal, then copy the peers' rows (all rows but
    ``[own_begin, own_end)``) of each part from this rank's buffer region ``m_p`` to the output ``o_p``. Runs
    after the push kernel on the stream, so ``EPOCH`` is that push's epoch."""
    epoch = tl.load(signals + EPOCH, volatile=True)
    _receive(signals, me, epoch, num_rows, own_begin, own_end, timeout_ns, m0, o0, w0, m1, o1, w1, m2, o2, w2,
             m3, o3, w3, m4, o4, w4, NUM_RANKS, NUM_PARTS, B0, B1, B2, B3, B4, TILE, TIMED)


# ---------------------------------------------------------------------------------------------- combine
@triton.jit
def _return_part(row, live, source, slot, src, words, region, peers, NUM_RANKS: tl.constexpr, BLOCK: tl.constexpr):
    for start in range(0, words, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = live[:, None] & (cols < words)[None, :]
        values = tl.load(src + row[:, None] * words + cols[None, :], mask=mask)
        offsets = region + slot[:, None] * words + cols[None, :]
        for rank in tl.static_range(NUM_RANKS):
            tl.store(_peer_words(peers, rank) + offsets, values, mask=mask & (source == rank)[:, None])


@triton.jit
def push_back(peers, signals, recv_prefix, slot_base, me, num_rows, s0, w0, r0, s1, w1, r1,
              timeout_ns, out, gather, local, mine, bias0, bias1, num_tokens, row_elems,
              NUM_RANKS: tl.constexpr, NUM_PARTS: tl.constexpr, B0: tl.constexpr, B1: tl.constexpr,
              TILE: tl.constexpr, FUSED: tl.constexpr, HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr,
              RBLOCK: tl.constexpr, RTILE: tl.constexpr, TIMED: tl.constexpr):
    """Combine send half: received row ``row`` (from source rank s, rows grouped by source as in
    ``recv_prefix`` [R + 1]) goes back to row ``slot_base[s] + row - recv_prefix[s]`` of rank s's buffer.
    Own rows stay (the reduction reads them in place). The last CTA signals the op's epoch (``EPOCH`` + 1).
    If FUSED, every CTA then does :func:`reduce_rows` of part 0 (``local`` = part 0 typed, ``mine`` its buffer
    region)."""
    epoch = tl.load(signals + EPOCH, volatile=True) + 1
    own_begin = tl.load(recv_prefix + me).to(tl.int64)
    own = tl.load(recv_prefix + me + 1).to(tl.int64) - own_begin
    for first in range(tl.program_id(0).to(tl.int64) * TILE, num_rows - own, tl.num_programs(0) * TILE):
        i = first + tl.arange(0, TILE)
        live = i < num_rows - own
        row = tl.where(i < own_begin, i, i + own)
        source = tl.zeros([TILE], dtype=tl.int32)
        for rank in tl.static_range(1, NUM_RANKS):
            source += (row >= tl.load(recv_prefix + rank)).to(tl.int32)
        slot = tl.load(slot_base + source, mask=live, other=0).to(tl.int64) + row - tl.load(
            recv_prefix + source, mask=live, other=0)
        _return_part(row, live, source, slot, s0, w0, r0, peers, NUM_RANKS, B0)
        if NUM_PARTS > 1:
            _return_part(row, live, source, slot, s1, w1, r1, peers, NUM_RANKS, B1)
    _signal_peers(peers, signals, me, epoch, SIG_DATA, NUM_RANKS)
    if FUSED:
        _reduce(signals, me, epoch, timeout_ns, out, gather, local, mine, bias0, bias1, num_tokens, row_elems,
                NUM_RANKS, HAS_BIAS0, HAS_BIAS1, True, RBLOCK, RTILE, TIMED)


@triton.jit
def _bf16_round_to_nearest_even(values):
    """float32 -> bfloat16, ties to even, from the bits: what the GPU's cvt.rn does, spelled out because the
    Triton interpreter's conversion truncates."""
    bits = values.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(values != values, 0x7FC0, rounded)  # keep NaN a NaN
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _add_rows(acc, src, row, live, cols, col_mask, row_elems):
    mask = (live & (row >= 0))[:, None] & col_mask[None, :]
    offsets = row.to(tl.int64)[:, None] * row_elems + cols[None, :]
    return acc + tl.load(src + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def reduce_rows(signals, me, timeout_ns, out, rows, local, mine, bias0, bias1, num_tokens, row_elems,
                NUM_RANKS: tl.constexpr, HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr, WAIT: tl.constexpr,
                BLOCK: tl.constexpr, TILE: tl.constexpr, TIMED: tl.constexpr):
    """Combine receive half: ``out[t] = Σ_{r ascending} row rows[t, r] of (local if r == me else mine)``
    (rows < 0 skipped), then + bias0[t] + bias1[t], all in float32; waits for the peers first if WAIT (for the
    epoch of the push kernel before it on the stream)."""
    epoch = tl.load(signals + EPOCH, volatile=True)
    _reduce(signals, me, epoch, timeout_ns, out, rows, local, mine, bias0, bias1, num_tokens, row_elems,
            NUM_RANKS, HAS_BIAS0, HAS_BIAS1, WAIT, BLOCK, TILE, TIMED)


@triton.jit
def _reduce(signals, me, epoch, timeout_ns, out, rows, local, mine, bias0, bias1, num_tokens, row_elems,
            NUM_RANKS: tl.constexpr, HAS_BIAS0: tl.constexpr, HAS_BIAS1: tl.constexpr, WAIT: tl.constexpr,
            BLOCK: tl.constexpr, TILE: tl.constexpr, TIMED: tl.constexpr):
    if WAIT:
        _wait_all_peers(signals, me, epoch, timeout_ns, SIG_DATA, NUM_RANKS, TIMED)
    for first in range(tl.program_id(0).to(tl.int64) * TILE, num_tokens, tl.num_programs(0) * TILE):
        t = first + tl.arange(0, TILE)
        live = t < num_tokens
        for start in range(0, row_elems, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            col_mask = cols < row_elems
            acc = tl.zeros([TILE, BLOCK], dtype=tl.float32)
            for rank in tl.static_range(NUM_RANKS):
                row = tl.load(rows + t * NUM_RANKS + rank, mask=live, other=-1)
                if rank == me:
                    acc = _add_rows(acc, local, row, live, cols, col_mask, row_elems)
                else:
                    acc = _add_rows(acc, mine, row, live, cols, col_mask, row_elems)
            offsets = t[:, None] * row_elems + cols[None, :]
            mask = live[:, None] & col_mask[None, :]
            if HAS_BIAS0:
                acc += tl.load(bias0 + offsets, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS1:
                acc += tl.load(bias1 + offsets, mask=mask, other=0.0).to(tl.float32)
            if out.dtype.element_ty == tl.bfloat16:
                tl.store(out + offsets, _bf16_round_to_nearest_even(acc), mask=mask)
            else:
                tl.store(out + offsets, acc.to(out.dtype.element_ty), mask=mask)
