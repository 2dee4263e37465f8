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
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
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
def _signal_peers(
    peers, signals, me, epoch, SIGNAL: tl.constexpr, NUM_RANKS: tl.constexpr, INCLUDE_SELF: tl.constexpr = False
):
    """Called by every CTA after its stores: the last CTA to finish publishes ``epoch`` to every peer (and to
    its own signal word if INCLUDE_SELF: ops whose own rows also go through the buffer) and records it as this
    rank's current epoch."""
    tl.debug_barrier()
    finished = tl.atomic_add(signals + DONE, 1, sem="acq_rel", scope="sys")
    if finished == tl.num_programs(0) - 1:
        tl.atomic_xchg(signals + DONE, 0)
        tl.atomic_xchg(signals + EPOCH, epoch)
        for rank in tl.static_range(NUM_RANKS):
            if INCLUDE_SELF:
                tl.atomic_xchg(_peer_words(peers, rank) + SIGNAL + me, epoch, sem="release", scope="sys")
            elif rank != me:
                tl.atomic_xchg(_peer_words(peers, rank) + SIGNAL + me, epoch, sem="release", scope="sys")


@triton.jit
def _wait_all_peers(
    signals,
    me,
    epoch,
    timeout_ns,
    SIGNAL: tl.constexpr,
    NUM_RANKS: tl.constexpr,
    TIMED: tl.constexpr,
    INCLUDE_SELF: tl.constexpr = False,
):
    for rank in tl.static_range(NUM_RANKS):
        if INCLUDE_SELF:
            _wait_at_least(signals + SIGNAL + rank, epoch, signals + ERROR, timeout_ns, TIMED)
        elif rank != me:
            _wait_at_least(signals + SIGNAL + rank, epoch, signals + ERROR, timeout_ns, TIMED)


# ---------------------------------------------------------------------------------------------- counts
@triton.jit(do_not_specialize=["epoch"])
def exchange_counts(
    peers,
    signals,
    row,
    me,
    epoch,
    width,
    area,
    timeout_ns,
    NUM_RANKS: tl.constexpr,
    BLOCK: tl.constexpr,
    TIMED: tl.constexpr,
):
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


@triton.jit(do_not_specialize=["num_tokens"])
def push_rows(
    peers,
    signals,
    slots,
    num_tokens,
    me,
    recv_prefix,
    timeout_ns,
    s0,
    o0,
    w0,
    r0,
    m0,
    s1,
    o1,
    w1,
    r1,
    m1,
    s2,
    o2,
    w2,
    r2,
    m2,
    s3,
    o3,
    w3,
    r3,
    m3,
    s4,
    o4,
    w4,
    r4,
    m4,
    NUM_RANKS: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    B0: tl.constexpr,
    B1: tl.constexpr,
    B2: tl.constexpr,
    B3: tl.constexpr,
    B4: tl.constexpr,
    TILE: tl.constexpr,
    FUSED: tl.constexpr,
    TIMED: tl.constexpr,
):
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
        _receive(
            signals,
            me,
            epoch,
            recv_prefix,
            timeout_ns,
            m0,
            o0,
            w0,
            m1,
            o1,
            w1,
            m2,
            o2,
            w2,
            m3,
            o3,
            w3,
            m4,
            o4,
            w4,
            NUM_RANKS,
            NUM_PARTS,
            B0,
            B1,
            B2,
            B3,
            B4,
            TILE,
            TIMED,
        )


@triton.jit
def _copy_part(row, live, src, out, words, BLOCK: tl.constexpr):
    for start in range(0, words, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = live[:, None] & (cols < words)[None, :]
        offsets = row[:, None] * words + cols[None, :]
        tl.store(out + offsets, tl.load(src + offsets, mask=mask), mask=mask)


@triton.jit
def _receive(
    signals,
    me,
    epoch,
    recv_prefix,
    timeout_ns,
    m0,
    o0,
    w0,
    m1,
    o1,
    w1,
    m2,
    o2,
    w2,
    m3,
    o3,
    w3,
    m4,
    o4,
    w4,
    NUM_RANKS: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    B0: tl.constexpr,
    B1: tl.constexpr,
    B2: tl.constexpr,
    B3: tl.constexpr,
    B4: tl.constexpr,
    TILE: tl.constexpr,
    TIMED: tl.constexpr,
):
    _wait_all_peers(signals, me, epoch, timeout_ns, SIG_DATA, NUM_RANKS, TIMED)
    own_begin = tl.load(recv_prefix + me).to(tl.int64)
    own = tl.load(recv_prefix + me + 1).to(tl.int64) - own_begin
    num_rows = tl.load(recv_prefix + NUM_RANKS).to(tl.int64)
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
def receive_rows(
    signals,
    me,
    recv_prefix,
    timeout_ns,
    m0,
    o0,
    w0,
    m1,
    o1,
    w1,
    m2,
    o2,
    w2,
    m3,
    o3,
    w3,
    m4,
    o4,
    w4,
    NUM_RANKS: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    B0: tl.constexpr,
    B1: tl.constexpr,
    B2: tl.constexpr,
    B3: tl.constexpr,
    B4: tl.constexpr,
    TILE: tl.constexpr,
    TIMED: tl.constexpr,
):
    """Dispatch receive half: wait for every peer's signal, then copy the peers' rows (all rows but this
    rank's own, ``recv_prefix[me]:recv_prefix[me + 1]`` of the ``recv_prefix[R]`` received) of each part from
    this rank's buffer region ``m_p`` to the output ``o_p``. Runs after the push kernel on the stream, so
    ``EPOCH`` is that push's epoch."""
    epoch = tl.load(signals + EPOCH, volatile=True)
    _receive(
        signals,
        me,
        epoch,
        recv_prefix,
        timeout_ns,
        m0,
        o0,
        w0,
        m1,
        o1,
        w1,
        m2,
        o2,
        w2,
        m3,
        o3,
        w3,
        m4,
        o4,
        w4,
        NUM_RANKS,
        NUM_PARTS,
        B0,
        B1,
        B2,
        B3,
        B4,
        TILE,
        TIMED,
    )


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


@triton.jit(do_not_specialize=["num_tokens"])
def push_back(
    peers,
    signals,
    recv_prefix,
    slot_base,
    me,
    s0,
    w0,
    r0,
    s1,
    w1,
    r1,
    timeout_ns,
    out,
    gather,
    local,
    mine,
    bias0,
    bias1,
    num_tokens,
    row_elems,
    NUM_RANKS: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    B0: tl.constexpr,
    B1: tl.constexpr,
    TILE: tl.constexpr,
    FUSED: tl.constexpr,
    HAS_BIAS0: tl.constexpr,
    HAS_BIAS1: tl.constexpr,
    RBLOCK: tl.constexpr,
    RTILE: tl.constexpr,
    TIMED: tl.constexpr,
):
    """Combine send half: received row ``row`` (from source rank s, rows grouped by source as in
    ``recv_prefix`` [R + 1]) goes back to row ``slot_base[s] + row - recv_prefix[s]`` of rank s's buffer.
    Own rows stay (the reduction reads them in place). The last CTA signals the op's epoch (``EPOCH`` + 1).
    If FUSED, every CTA then does :func:`reduce_rows` of part 0 (``local`` = part 0 typed, ``mine`` its buffer
    region)."""
    epoch = tl.load(signals + EPOCH, volatile=True) + 1
    own_begin = tl.load(recv_prefix + me).to(tl.int64)
    own = tl.load(recv_prefix + me + 1).to(tl.int64) - own_begin
    num_rows = tl.load(recv_prefix + NUM_RANKS).to(tl.int64)
    for first in range(tl.program_id(0).to(tl.int64) * TILE, num_rows - own, tl.num_programs(0) * TILE):
        i = first + tl.arange(0, TILE)
        live = i < num_rows - own
        row = tl.where(i < own_begin, i, i + own)
        source = tl.zeros([TILE], dtype=tl.int32)
        for rank in tl.static_range(1, NUM_RANKS):
            source += (row >= tl.load(recv_prefix + rank)).to(tl.int32)
        slot = (
            tl.load(slot_base + source, mask=live, other=0).to(tl.int64)
            + row
            - tl.load(recv_prefix + source, mask=live, other=0)
        )
        _return_part(row, live, source, slot, s0, w0, r0, peers, NUM_RANKS, B0)
        if NUM_PARTS > 1:
            _return_part(row, live, source, slot, s1, w1, r1, peers, NUM_RANKS, B1)
    _signal_peers(peers, signals, me, epoch, SIG_DATA, NUM_RANKS)
    if FUSED:
        _reduce(
            signals,
            me,
            epoch,
            timeout_ns,
            out,
            gather,
            local,
            mine,
            bias0,
            bias1,
            num_tokens,
            row_elems,
            NUM_RANKS,
            HAS_BIAS0,
            HAS_BIAS1,
            True,
            RBLOCK,
            RTILE,
            TIMED,
        )


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


@triton.jit(do_not_specialize=["num_tokens"])
def reduce_rows(
    signals,
    me,
    timeout_ns,
    out,
    rows,
    local,
    mine,
    bias0,
    bias1,
    num_tokens,
    row_elems,
    NUM_RANKS: tl.constexpr,
    HAS_BIAS0: tl.constexpr,
    HAS_BIAS1: tl.constexpr,
    WAIT: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE: tl.constexpr,
    TIMED: tl.constexpr,
):
    """Combine receive half: ``out[t] = Σ_{r ascending} row rows[t, r] of (local if r == me else mine)``
    (rows < 0 skipped), then + bias0[t] + bias1[t], all in float32; waits for the peers first if WAIT (for the
    epoch of the push kernel before it on the stream)."""
    epoch = tl.load(signals + EPOCH, volatile=True)
    _reduce(
        signals,
        me,
        epoch,
        timeout_ns,
        out,
        rows,
        local,
        mine,
        bias0,
        bias1,
        num_tokens,
        row_elems,
        NUM_RANKS,
        HAS_BIAS0,
        HAS_BIAS1,
        WAIT,
        BLOCK,
        TILE,
        TIMED,
    )


@triton.jit
def _reduce(
    signals,
    me,
    epoch,
    timeout_ns,
    out,
    rows,
    local,
    mine,
    bias0,
    bias1,
    num_tokens,
    row_elems,
    NUM_RANKS: tl.constexpr,
    HAS_BIAS0: tl.constexpr,
    HAS_BIAS1: tl.constexpr,
    WAIT: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE: tl.constexpr,
    TIMED: tl.constexpr,
):
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


# ---------------------------------------------------------------------------------------------- fresh dispatch
@triton.jit(do_not_specialize=["epoch", "area", "num_topk_entries", "num_in_rank"])
def exchange_dispatch_counts(
    peers,
    signals,
    per_rank,
    per_expert,
    topk,
    num_topk_entries,
    in_rank,
    num_in_rank,
    layout_range,
    me,
    epoch,
    num_experts,
    area,
    timeout_ns,
    NUM_RANKS: tl.constexpr,
    RANKS_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    HAS_LAYOUT_RANGE: tl.constexpr,
    TIMED: tl.constexpr,
):
    """One CTA: the count exchange of a fresh dispatch with its checks computed here, not on the host.

    Row ``me`` of every rank's count area (word offset ``area``, rows of ``R + E + 4`` int32) receives
    ``per_rank`` [R], ``per_expert`` [E], then (min id, max id) of ``topk`` (int64, ``num_topk_entries``
    entries; ``(-1, -1)`` without top-k) widened by the layout's out-of-range indicator ``layout_range``
    (``max(0, -min id), max(0, max id)`` of the ids the layout kernel saw), the sum of ``per_rank`` and the
    number of set bytes of ``in_rank`` (``num_in_rank`` bytes). Ids are clamped into int32. Then signal and
    wait for every peer's row (the host reads the matrix: the one host sync of a fresh dispatch)."""
    width = NUM_RANKS + num_experts + 4
    int32_min, int32_max = -2147483648, 2147483647
    low = tl.full((), -1, tl.int64)
    high = tl.full((), -1, tl.int64)
    if HAS_TOPK:
        lows = tl.full([BLOCK], int32_max, tl.int64)
        highs = tl.full([BLOCK], int32_min, tl.int64)
        for start in range(0, num_topk_entries, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            ids = tl.load(topk + offsets, mask=offsets < num_topk_entries, other=-1)
            lows = tl.minimum(lows, ids)
            highs = tl.maximum(highs, ids)
        if num_topk_entries > 0:
            low = tl.maximum(tl.min(lows), int32_min)
            high = tl.minimum(tl.max(highs), int32_max)
    if HAS_LAYOUT_RANGE:
        low = tl.minimum(low, -tl.load(layout_range).to(tl.int64))
        high = tl.maximum(high, tl.load(layout_range + 1).to(tl.int64))
    marked = tl.zeros([BLOCK], tl.int32)
    for start in range(0, num_in_rank, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        marked += (tl.load(in_rank + offsets, mask=offsets < num_in_rank, other=0) != 0).to(tl.int32)
    ranks = tl.arange(0, RANKS_PAD)
    rank_counts = tl.load(per_rank + ranks, mask=ranks < NUM_RANKS, other=0)
    stats = tl.arange(0, 4)
    stat_values = tl.where(
        stats == 0,
        low.to(tl.int32),
        tl.where(stats == 1, high.to(tl.int32), tl.where(stats == 2, tl.sum(rank_counts), tl.sum(marked))),
    )
    for rank in tl.static_range(NUM_RANKS):
        row = _peer_words(peers, rank) + area + me * width
        tl.store(row + ranks, rank_counts, mask=ranks < NUM_RANKS)
        for start in range(0, num_experts, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            tl.store(
                row + NUM_RANKS + cols, tl.load(per_expert + cols, mask=cols < num_experts), mask=cols < num_experts
            )
        tl.store(row + NUM_RANKS + num_experts + stats, stat_values)
    tl.debug_barrier()
    for rank in tl.static_range(NUM_RANKS):
        if rank != me:
            tl.atomic_xchg(_peer_words(peers, rank) + SIG_COUNT + me, epoch, sem="release", scope="sys")
    _wait_all_peers(signals, me, epoch, timeout_ns, SIG_COUNT, NUM_RANKS, TIMED)


@triton.jit(do_not_specialize=["num_tokens", "width"])
def plan_tables(
    in_rank,
    matrix,
    width,
    me,
    num_tokens,
    slots,
    gather,
    recv_prefix,
    slot_base,
    rank_prefix,
    NUM_RANKS: tl.constexpr,
    RANKS_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One CTA: a normal dispatch plan from ``in_rank`` (uint8 [T, R]) and the count matrix (int32, row s =
    sender s, its first R words = tokens s sends to each rank; rows ``width`` words apart).

    Writes ``slots`` [T, R] (row of token t in rank r's receive order, -1 if not sent: rows from lower source
    ranks first, then t's rank among this rank's tokens for r), ``gather`` [T, R] (where combine finds t's row:
    on peer r at its place in this rank's send order to r, rows sent to lower ranks first; for r = me the
    received row ``slots[t, me]``), ``recv_prefix`` [R + 1] (received rows by source rank), ``slot_base`` [R]
    (where source s keeps the rows it sent here, after those it sent to lower ranks) and ``rank_prefix``
    [R, R] (DeepEP's ``rank_prefix_matrix``: column sums over senders 0..i). All int32."""
    senders = tl.arange(0, RANKS_PAD)
    ranks = tl.arange(0, RANKS_PAD)
    present = (senders < NUM_RANKS)[:, None] & (ranks < NUM_RANKS)[None, :]
    counts = tl.load(matrix + senders[:, None] * width + ranks[None, :], mask=present, other=0)
    from_lower = tl.sum(tl.where((senders < me)[:, None], counts, 0), axis=0)
    sent = tl.sum(tl.where((senders == me)[:, None], counts, 0), axis=0)
    send_offset = tl.cumsum(sent, axis=0) - sent
    received = tl.sum(tl.where((ranks == me)[None, :], counts, 0), axis=1)
    tl.store(recv_prefix + senders, tl.cumsum(received, axis=0) - received, mask=senders < NUM_RANKS)
    tl.store(recv_prefix + NUM_RANKS, tl.sum(received))
    tl.store(slot_base + senders, tl.sum(tl.where((ranks < me)[None, :], counts, 0), axis=1), mask=senders < NUM_RANKS)
    tl.store(rank_prefix + senders[:, None] * NUM_RANKS + ranks[None, :], tl.cumsum(counts, axis=0), mask=present)
    carry = tl.zeros([RANKS_PAD], tl.int32)
    for start in range(0, num_tokens, BLOCK):
        tokens = start + tl.arange(0, BLOCK)
        live = (tokens < num_tokens)[:, None] & (ranks < NUM_RANKS)[None, :]
        offsets = tokens.to(tl.int64)[:, None] * NUM_RANKS + ranks[None, :]
        marked = (tl.load(in_rank + offsets, mask=live, other=0) != 0).to(tl.int32)
        position = tl.cumsum(marked, axis=0) - 1 + carry[None, :]
        carry += tl.sum(marked, axis=0)
        slot = tl.where(marked != 0, position + from_lower[None, :], -1)
        tl.store(slots + offsets, slot, mask=live)
        back = tl.where(marked != 0, position + send_offset[None, :], -1)
        tl.store(gather + offsets, tl.where((ranks == me)[None, :], slot, back), mask=live)


@triton.jit(do_not_specialize=["num_entries", "first_expert"])
def localize_topk(topk, weights, num_entries, first_expert, LOCAL_EXPERTS: tl.constexpr, BLOCK: tl.constexpr):
    """In place on received rows: global expert ids (int64) become local ids ``id - first_expert`` where the
    expert lives on this rank and -1 elsewhere; the weight (float32) of a -1 slot becomes 0."""
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, num_entries, tl.num_programs(0) * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        live = offsets < num_entries
        ids = tl.load(topk + offsets, mask=live, other=-1)
        local = ids - first_expert
        here = (ids >= 0) & (local >= 0) & (local < LOCAL_EXPERTS)
        tl.store(topk + offsets, tl.where(here, local, -1), mask=live)
        tl.store(weights + offsets, tl.where(here, tl.load(weights + offsets, mask=live, other=0.0), 0.0), mask=live)


# ---------------------------------------------------------------------------------------------- low latency
# A low-latency message is one (token, top-k slot) of a source rank. Message j of source s for local expert l
# of rank r (j = how many earlier (token, slot) pairs of s chose the same expert) lives in row
# ``(l * R + s) * M + j`` of r's receive regions (values, scales, source token); r's count area holds
# ``[R, L]`` message counts (row = source). Combine returns expert l's row for that message into row
# ``(r * L + l) * M + j`` of s's combine region, where s's reduction finds it again from the same j.
@triton.jit
def _message_index(topk, t, slots, ids, TOPK: tl.constexpr, CHUNK: tl.constexpr):
    """For each slot of token ``t`` (``ids`` [TOPK_PAD] its expert ids): how many earlier (token, slot) pairs
    of this rank chose the same expert, in (token, slot) order."""
    index = tl.zeros(ids.shape, tl.int32)
    for start in range(0, t, CHUNK):
        earlier = start + tl.arange(0, CHUNK)
        block = tl.load(
            topk + earlier[:, None] * TOPK + slots[None, :],
            mask=(earlier < t)[:, None] & (slots < TOPK)[None, :],
            other=-1,
        )
        same = (block[:, :, None] == ids[None, None, :]).to(tl.int32)
        index += tl.sum(tl.sum(same, axis=0), axis=0)
    before = (ids[:, None] == ids[None, :]) & (slots[:, None] < slots[None, :])
    return index + tl.sum(before.to(tl.int32), axis=0)


@triton.jit
def _e4m3_bits(values):
    """float32 (finite, |v| <= 448) -> e4m3 bit pattern (uint32 in [0, 256)), rounded to nearest-even from the
    bits: what the GPU's cvt.rn does, spelled out because the Triton interpreter's conversion does not round."""
    bits = values.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude_bits = bits & 0x7FFFFFFF
    magnitude = magnitude_bits.to(tl.float32, bitcast=True)
    # Normal range (>= 2^-6): keep 3 mantissa bits with ties to even, rebias the exponent 127 -> 7.
    normal = ((magnitude_bits + 0x7FFFF + ((magnitude_bits >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal range: units of 2^-9, rounded to an integer (ties to even) by the 1.5 * 2^23 trick; 8 is 2^-6.
    scaled = magnitude * 512.0
    subnormal = ((scaled + 12582912.0) - 12582912.0).to(tl.uint32)
    return tl.where(magnitude >= 0.015625, normal, subnormal) | sign


@triton.jit
def _ll_dispatch_receive(
    signals,
    me,
    epoch,
    timeout_ns,
    values_region,
    scales_region,
    source_region,
    counts_region,
    out_values,
    out_scales,
    out_source,
    recv_count,
    layout_range,
    stats,
    NUM_RANKS: tl.constexpr,
    MAX_TOKENS: tl.constexpr,
    LOCAL_EXPERTS: tl.constexpr,
    VALUE_WORDS: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    SCALE_PAD: tl.constexpr,
    USE_FP8: tl.constexpr,
    TILE: tl.constexpr,
    WORD_BLOCK: tl.constexpr,
    HAS_STATS: tl.constexpr,
    TIMED: tl.constexpr,
):
    """The receive half of :func:`ll_dispatch` (its docstring describes it), inlined into that kernel."""
    program, programs = tl.program_id(0), tl.num_programs(0)
    _wait_all_peers(signals, me, epoch, timeout_ns, SIG_DATA, NUM_RANKS, TIMED, True)
    slab = NUM_RANKS * MAX_TOKENS
    for pair in range(program, LOCAL_EXPERTS * NUM_RANKS, programs):
        expert = pair // NUM_RANKS
        source = pair % NUM_RANKS
        begin = tl.zeros((), tl.int32)
        count = tl.zeros((), tl.int32)
        total = tl.zeros((), tl.int32)
        for rank in tl.static_range(NUM_RANKS):
            sent = tl.load(signals + counts_region + rank * LOCAL_EXPERTS + expert)
            begin += tl.where(source > rank, sent, 0)
            count += tl.where(source == rank, sent, 0)
            total += sent
        tl.store(layout_range + pair, (begin.to(tl.int64) << 32) | count.to(tl.int64))
        if source == 0:
            tl.store(recv_count + expert, total)
            if HAS_STATS:
                tl.store(stats + expert, tl.load(stats + expert) + total)
        for first in range(0, count, TILE):
            index = first + tl.arange(0, TILE)
            live = index < count
            src_row = (pair * MAX_TOKENS + index).to(tl.int64)
            dst_row = (begin + index).to(tl.int64)
            tl.store(
                out_source + expert * slab + dst_row, tl.load(signals + source_region + src_row, mask=live), mask=live
            )
            for start in range(0, VALUE_WORDS, WORD_BLOCK):
                cols = start + tl.arange(0, WORD_BLOCK)
                mask = live[:, None] & (cols < VALUE_WORDS)[None, :]
                values = tl.load(signals + values_region + src_row[:, None] * VALUE_WORDS + cols[None, :], mask=mask)
                tl.store(
                    out_values + (expert * slab + dst_row)[:, None] * VALUE_WORDS + cols[None, :], values, mask=mask
                )
            if USE_FP8:
                cols = tl.arange(0, SCALE_PAD)
                mask = live[:, None] & (cols < SCALE_WORDS)[None, :]
                values = tl.load(signals + scales_region + src_row[:, None] * SCALE_WORDS + cols[None, :], mask=mask)
                tl.store(
                    out_scales + expert * SCALE_WORDS * slab + cols[None, :] * slab + dst_row[:, None],
                    values,
                    mask=mask,
                )


@triton.jit(do_not_specialize=["num_tokens", "epoch_arg"])
def ll_dispatch(
    peers,
    signals,
    x_words,
    x_values,
    topk,
    num_tokens,
    me,
    timeout_ns,
    epoch_arg,
    values_region,
    scales_region,
    source_region,
    counts_region,
    out_values,
    out_scales,
    out_source,
    recv_count,
    layout_range,
    stats,
    NUM_RANKS: tl.constexpr,
    MAX_TOKENS: tl.constexpr,
    LOCAL_EXPERTS: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    HIDDEN: tl.constexpr,
    VALUE_WORDS: tl.constexpr,
    SCALE_WORDS: tl.constexpr,
    SCALE_PAD: tl.constexpr,
    BLOCKS_PER_CHUNK: tl.constexpr,
    USE_FP8: tl.constexpr,
    ROUND_SCALE: tl.constexpr,
    UE8M0: tl.constexpr,
    EXPERT_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,
    WORD_BLOCK: tl.constexpr,
    SEND: tl.constexpr,
    RECEIVE: tl.constexpr,
    HAS_STATS: tl.constexpr,
    TIMED: tl.constexpr,
):
    """Low-latency dispatch into the packed layout ``[L, R·M, H]``.

    Send half (SEND): every CTA stores this rank's message counts for a share of the experts into their
    ranks' count areas, then, one token at a time, quantises the row once (USE_FP8: per-128-column e4m3 with
    float32 scales ``amax / 448``, ROUND_SCALE to powers of two, UE8M0 packing four exponent bytes per word;
    bit-exact with :mod:`ascend_dualpath.moe.quant`) and stores it with its scales and token index into the
    message row of every valid slot, on the expert's rank (itself included). The last CTA signals every rank
    (itself included) with the op's epoch (``EPOCH`` + 1).

    Receive half (RECEIVE; after the send half, or later on its own with ``epoch_arg`` = the send's epoch,
    for ``return_recv_hook``): waits for every rank's signal, then for each (local expert l, source s)
    copies the ``count[s, l]`` messages to rows ``begin .. begin + count`` of expert l (begin = messages of
    lower sources) of ``out_values`` (int32 words [L, R·M, VALUE_WORDS]), ``out_scales`` (words [L,
    SCALE_WORDS, R·M]: the column-major scales) and ``out_source`` [L, R·M]; writes ``layout_range[l, s] =
    begin << 32 | count`` (int64), ``recv_count[l]`` and adds it to ``stats[l]`` (HAS_STATS). Rows past the
    count are left as they were (zero from the caller)."""
    program, programs = tl.program_id(0), tl.num_programs(0)
    slots = tl.arange(0, TOPK_PAD)
    if SEND:
        epoch = tl.load(signals + EPOCH, volatile=True) + 1
        num_experts = NUM_RANKS * LOCAL_EXPERTS
        for first in range(program * EXPERT_BLOCK, num_experts, programs * EXPERT_BLOCK):
            experts = first + tl.arange(0, EXPERT_BLOCK)
            counted = tl.zeros([EXPERT_BLOCK], tl.int32)
            for start in range(0, num_tokens, CHUNK):
                tokens = start + tl.arange(0, CHUNK)
                block = tl.load(
                    topk + tokens[:, None] * TOPK + slots[None, :],
                    mask=(tokens < num_tokens)[:, None] & (slots < TOPK)[None, :],
                    other=-1,
                )
                same = (block[None, :, :] == experts[:, None, None]).to(tl.int32)
                counted += tl.sum(tl.sum(same, axis=2), axis=1)
            live = experts < num_experts
            base = tl.load(peers + experts // LOCAL_EXPERTS, mask=live, other=0).to(tl.pointer_type(tl.int32))
            tl.store(base + counts_region + me * LOCAL_EXPERTS + experts % LOCAL_EXPERTS, counted, mask=live)
        groups = tl.arange(0, BLOCKS_PER_CHUNK)
        words = tl.arange(0, 32)
        nibbles = tl.arange(0, 4)
        for t in range(program.to(tl.int64), num_tokens, programs):
            ids = tl.load(topk + t * TOPK + slots, mask=slots < TOPK, other=-1)
            valid = ids >= 0
            index = _message_index(topk, t, slots, ids, TOPK, CHUNK)
            local = tl.where(valid, ids % LOCAL_EXPERTS, 0)
            row = ((local * NUM_RANKS + me) * MAX_TOKENS + index).to(tl.int64)
            base = tl.load(peers + tl.where(valid, ids // LOCAL_EXPERTS, 0)).to(tl.pointer_type(tl.int32))
            tl.store(base + source_region + row, (slots * 0 + t).to(tl.int32), mask=valid)
            if USE_FP8:
                for start in range(0, HIDDEN, BLOCKS_PER_CHUNK * 128):
                    # [block, word, byte]: 128 columns per scale, 4 e4m3 bytes per stored word
                    columns = start + groups[:, None, None] * 128 + words[None, :, None] * 4 + nibbles[None, None, :]
                    values = tl.load(x_values + t * HIDDEN + columns).to(tl.float32)
                    amax = tl.maximum(tl.max(tl.max(tl.abs(values), axis=2), axis=1), 1e-4)
                    scale = tl.math.div_rn(amax, tl.full([BLOCKS_PER_CHUNK], 448.0, tl.float32))
                    if ROUND_SCALE:
                        scale_bits = scale.to(tl.uint32, bitcast=True)
                        exponent = ((scale_bits >> 23) & 0xFF) + ((scale_bits & 0x7FFFFF) != 0).to(tl.uint32)
                        scale = (exponent << 23).to(tl.float32, bitcast=True)
                    quantised = tl.math.div_rn(values, scale[:, None, None])
                    codes = _e4m3_bits(tl.minimum(tl.maximum(quantised, -448.0), 448.0))
                    packed = (
                        tl.sum(tl.where(nibbles[None, None, :] == 0, codes, 0), axis=2)
                        | (tl.sum(tl.where(nibbles[None, None, :] == 1, codes, 0), axis=2) << 8)
                        | (tl.sum(tl.where(nibbles[None, None, :] == 2, codes, 0), axis=2) << 16)
                        | (tl.sum(tl.where(nibbles[None, None, :] == 3, codes, 0), axis=2) << 24)
                    )
                    word_cols = start // 4 + groups[:, None] * 32 + words[None, :]
                    tl.store(
                        base[:, None, None] + values_region + row[:, None, None] * VALUE_WORDS + word_cols[None, :, :],
                        packed.to(tl.int32, bitcast=True)[None, :, :],
                        mask=valid[:, None, None],
                    )
                    if UE8M0:
                        exponents = tl.reshape(
                            (scale.to(tl.uint32, bitcast=True) >> 23) & 0xFF, [BLOCKS_PER_CHUNK // 4, 4]
                        )
                        scale_words = (
                            tl.sum(tl.where(nibbles[None, :] == 0, exponents, 0), axis=1)
                            | (tl.sum(tl.where(nibbles[None, :] == 1, exponents, 0), axis=1) << 8)
                            | (tl.sum(tl.where(nibbles[None, :] == 2, exponents, 0), axis=1) << 16)
                            | (tl.sum(tl.where(nibbles[None, :] == 3, exponents, 0), axis=1) << 24)
                        )
                        scale_cols = start // 512 + tl.arange(0, BLOCKS_PER_CHUNK // 4)
                        tl.store(
                            base[:, None] + scales_region + row[:, None] * SCALE_WORDS + scale_cols[None, :],
                            scale_words.to(tl.int32, bitcast=True)[None, :],
                            mask=valid[:, None],
                        )
                    else:
                        scale_cols = start // 128 + groups
                        tl.store(
                            base[:, None] + scales_region + row[:, None] * SCALE_WORDS + scale_cols[None, :],
                            scale.to(tl.int32, bitcast=True)[None, :],
                            mask=valid[:, None],
                        )
            else:
                for start in range(0, VALUE_WORDS, WORD_BLOCK):
                    cols = start + tl.arange(0, WORD_BLOCK)
                    inside = cols < VALUE_WORDS
                    values = tl.load(x_words + t * VALUE_WORDS + cols, mask=inside)
                    tl.store(
                        base[:, None] + values_region + row[:, None] * VALUE_WORDS + cols[None, :],
                        values[None, :],
                        mask=valid[:, None] & inside[None, :],
                    )
        _signal_peers(peers, signals, me, epoch, SIG_DATA, NUM_RANKS, True)
    else:
        epoch = epoch_arg
    if RECEIVE:
        _ll_dispatch_receive(
            signals,
            me,
            epoch,
            timeout_ns,
            values_region,
            scales_region,
            source_region,
            counts_region,
            out_values,
            out_scales,
            out_source,
            recv_count,
            layout_range,
            stats,
            NUM_RANKS,
            MAX_TOKENS,
            LOCAL_EXPERTS,
            VALUE_WORDS,
            SCALE_WORDS,
            SCALE_PAD,
            USE_FP8,
            TILE,
            WORD_BLOCK,
            HAS_STATS,
            TIMED,
        )


@triton.jit(do_not_specialize=["num_tokens", "epoch_arg"])
def ll_combine(
    peers,
    signals,
    x_words,
    layout_range,
    topk,
    weights,
    out,
    mine,
    num_tokens,
    me,
    timeout_ns,
    epoch_arg,
    region,
    NUM_RANKS: tl.constexpr,
    MAX_TOKENS: tl.constexpr,
    LOCAL_EXPERTS: tl.constexpr,
    TOPK: tl.constexpr,
    TOPK_PAD: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,
    SEND: tl.constexpr,
    RECEIVE: tl.constexpr,
    TIMED: tl.constexpr,
):
    """Weighted low-latency combine.

    Send half (SEND): for each (local expert l, source s) with ``layout_range[l, s] = begin << 32 | count``,
    rows ``begin .. begin + count`` of expert l of ``x_words`` (bf16 as int32 words [L, R·M, H/2]) go back to
    rows ``(me·L + l)·M + j`` of s's combine region (word offset ``region``); the last CTA signals every rank.

    Receive half (RECEIVE): waits for every rank's signal, then ``out[t] = Σ_k w[t,k] · row(t, k)`` over the
    slots in order, in float32 (a -1 slot adds 0), rounded to nearest-even into bf16; ``row(t, k)`` is row
    ``id·M + j`` of ``mine`` (this rank's combine region as bf16 [E·M, H]), j the slot's message index."""
    program, programs = tl.program_id(0), tl.num_programs(0)
    slots = tl.arange(0, TOPK_PAD)
    if SEND:
        epoch = tl.load(signals + EPOCH, volatile=True) + 1
        slab = NUM_RANKS * MAX_TOKENS
        words = HIDDEN // 2
        for pair in range(program, LOCAL_EXPERTS * NUM_RANKS, programs):
            expert = pair // NUM_RANKS
            source = pair % NUM_RANKS
            packed = tl.load(layout_range + pair)
            begin = packed >> 32
            count = packed & 0xFFFFFFFF
            base = tl.load(peers + source).to(tl.pointer_type(tl.int32))
            for first in range(0, count, TILE):
                index = first + tl.arange(0, TILE)
                live = index < count
                src_row = expert * slab + begin + index
                dst_row = (me * LOCAL_EXPERTS + expert) * MAX_TOKENS + index
                for start in range(0, words, BLOCK // 2):
                    cols = start + tl.arange(0, BLOCK // 2)
                    mask = live[:, None] & (cols < words)[None, :]
                    values = tl.load(x_words + src_row[:, None] * words + cols[None, :], mask=mask)
                    tl.store(base + region + dst_row[:, None] * words + cols[None, :], values, mask=mask)
        _signal_peers(peers, signals, me, epoch, SIG_DATA, NUM_RANKS, True)
    else:
        epoch = epoch_arg
    if RECEIVE:
        _wait_all_peers(signals, me, epoch, timeout_ns, SIG_DATA, NUM_RANKS, TIMED, True)
        for t in range(program.to(tl.int64), num_tokens, programs):
            ids = tl.load(topk + t * TOPK + slots, mask=slots < TOPK, other=-1)
            valid = ids >= 0
            weight = tl.where(valid, tl.load(weights + t * TOPK + slots, mask=slots < TOPK, other=0.0), 0.0)
            rows = tl.where(valid, ids * MAX_TOKENS + _message_index(topk, t, slots, ids, TOPK, CHUNK), 0)
            for start in range(0, HIDDEN, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                inside = cols < HIDDEN
                acc = tl.zeros([BLOCK], tl.float32)
                for k in tl.static_range(TOPK):
                    chosen = slots == k
                    row = tl.sum(tl.where(chosen, rows, 0))
                    used = (cols * 0 + tl.sum(tl.where(chosen & valid, 1, 0))) > 0
                    values = tl.load(mine + row * HIDDEN + cols, mask=inside & used, other=0.0).to(tl.float32)
                    acc += tl.sum(tl.where(chosen, weight, 0.0)) * values
                tl.store(out + t * HIDDEN + cols, _bf16_round_to_nearest_even(acc), mask=inside)
