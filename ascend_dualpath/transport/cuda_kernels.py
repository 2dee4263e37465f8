"""Triton kernels of the device-initiated copy; imported only when a copy is planned (needs Triton).

Each program walks the tile table (src, dst, elements) with a stride of the grid size and copies a tile
with one masked vector load and store per thread; the last program to arrive publishes the ready flag.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def publish(state, flag, flag_value, FROM_EPOCH: tl.constexpr):
    """Count this program's arrival; the last arrival writes the flag with a system-scope release."""
    tl.debug_barrier()  # every thread's stores precede the arrival, so the release covers them
    arrived = tl.atomic_add(state, 1, sem="acq_rel", scope="sys")
    if arrived == tl.num_programs(0) - 1:
        tl.atomic_xchg(state, 0, sem="relaxed", scope="sys")  # ready for the next launch on the stream
        if FROM_EPOCH:  # graph replays cannot take a new argument: each publishes the plan's next epoch
            value = tl.atomic_add(state + 1, 1, sem="relaxed", scope="gpu") + 1
        else:
            value = flag_value
        tl.atomic_xchg(flag, value, sem="release", scope="sys")


# scalars are not specialised, so one compiled kernel serves every plan, flag address and flag value
@triton.jit(do_not_specialize=["n_tiles", "flag", "flag_value"])
def copy_words(
    table,
    n_tiles,
    state,
    flag,
    flag_value: tl.int64,
    TILE: tl.constexpr,
    WORDS: tl.constexpr,
    FROM_EPOCH: tl.constexpr,
):
    """Copy tiles of int32 words; a table element is WORDS words (4 -> 16-byte vector loads and stores)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, TILE)
    for t in range(pid, n_tiles, nprog):
        row = table + t * 3
        src = tl.multiple_of(tl.load(row).to(tl.pointer_type(tl.int32)), 4 * WORDS)
        dst = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(tl.int32)), 4 * WORDS)
        mask = offs < tl.load(row + 2) * WORDS
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
    publish(state, flag, flag_value, FROM_EPOCH)


@triton.jit(do_not_specialize=["n_tiles", "flag", "flag_value"])
def copy_bytes(table, n_tiles, state, flag, flag_value: tl.int64, TILE: tl.constexpr, FROM_EPOCH: tl.constexpr):
    """Byte-granular variant for segments whose addresses or lengths are not 4-byte aligned."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, TILE)
    for t in range(pid, n_tiles, nprog):
        row = table + t * 3
        src = tl.load(row).to(tl.pointer_type(tl.int8))
        dst = tl.load(row + 1).to(tl.pointer_type(tl.int8))
        mask = offs < tl.load(row + 2)
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
    publish(state, flag, flag_value, FROM_EPOCH)
