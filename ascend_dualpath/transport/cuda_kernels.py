"""Triton kernels of the device-initiated copy; imported only when a copy is planned (needs Triton).

Each program walks the tile table (src, dst, elements) with a stride of the grid size and copies a tile
with one masked vector load and store per thread; the last program to arrive publishes the ready flag.
Compile-time switches (one binary per combination, chosen by the plan):

- ``ELEM_BYTES``: 16/8/4 copy int32 words (``ELEM_BYTES // 4`` per table element, so 16 gives 16-byte vector
  loads and stores); 1 copies bytes (segments not 4-byte aligned).
- ``SINGLE``: a grid of one program publishes without the arrival count.
- ``ARRIVE_SYS``: count arrivals with system-scope atomics (else GPU scope; the flag itself is always a
  system-scope release); the plan sets it where a destination is not the GPU's own memory.
- ``STREAMING``: loads bypass L1 (``.cg``) and stores are streaming (``.cs``, evict-first in L2): the bytes
  are touched once. (ptxas refuses ``.cg`` combined with an ``evict_first`` hint.)
- ``FROM_EPOCH``: publish the plan's next epoch instead of ``word_value`` (CUDA graph replays, which cannot take a
  new argument); the flag gets the caller's value in the plan's value cell (``state[2]``, written in stream order
  before the replay) where that is not 0, else the epoch too.

``host_flag`` (an address, 0 for none) is a pinned host word that receives ``word_value`` (or the epoch) after the
flag, also with a system-scope release: the host learns completion by reading its own memory, with no event and no
driver call. The flag may get another value (the caller's notify value); the host word's values only grow.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _release_flag(state, flag, flag_value, host_flag, word_value, FROM_EPOCH: tl.constexpr):
    if FROM_EPOCH:  # graph replays cannot take a new argument: each publishes the plan's next epoch
        word = tl.atomic_add(state + 1, 1, sem="relaxed", scope="gpu") + 1
        cell = tl.load(state + 2, volatile=True)  # the caller's notify value, 0 for none
        value = tl.where(cell != 0, cell, word)
    else:
        word = word_value
        value = flag_value
    tl.atomic_xchg(flag, value, sem="release", scope="sys")
    if host_flag != 0:  # after the flag: a host that saw its word may rely on the receiver's flag too
        tl.atomic_xchg(host_flag.to(tl.pointer_type(tl.int64)), word, sem="release", scope="sys")


@triton.jit
def publish(
    state,
    flag,
    flag_value,
    host_flag,
    word_value,
    FROM_EPOCH: tl.constexpr,
    SINGLE: tl.constexpr,
    ARRIVE_SYS: tl.constexpr,
):
    """After this program's stores: count its arrival; the last arrival writes the flag (then the host word) with a
    system-scope release."""
    tl.debug_barrier()  # every thread's stores precede the arrival, so the release covers them
    if SINGLE:
        _release_flag(state, flag, flag_value, host_flag, word_value, FROM_EPOCH)
    else:
        if ARRIVE_SYS:
            arrived = tl.atomic_add(state, 1, sem="acq_rel", scope="sys")
        else:
            arrived = tl.atomic_add(state, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - 1:
            tl.atomic_xchg(state, 0, sem="relaxed", scope="gpu")  # ready for the next launch on the stream
            _release_flag(state, flag, flag_value, host_flag, word_value, FROM_EPOCH)


@triton.jit
def _copy_tile(src_addr, dst_addr, elems, offs, ELEM_BYTES: tl.constexpr, STREAMING: tl.constexpr):
    if ELEM_BYTES == 1:
        src = src_addr.to(tl.pointer_type(tl.int8))
        dst = dst_addr.to(tl.pointer_type(tl.int8))
        mask = offs < elems
    else:
        src = tl.multiple_of(src_addr.to(tl.pointer_type(tl.int32)), ELEM_BYTES)
        dst = tl.multiple_of(dst_addr.to(tl.pointer_type(tl.int32)), ELEM_BYTES)
        mask = offs < elems * (ELEM_BYTES // 4)
    if STREAMING:
        data = tl.load(src + offs, mask=mask, cache_modifier=".cg")
        tl.store(dst + offs, data, mask=mask, cache_modifier=".cs")
    else:
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


# scalars are not specialised, so one compiled kernel serves every plan, flag address and flag value
@triton.jit(do_not_specialize=["n_tiles", "flag", "flag_value", "host_flag", "word_value"])
def copy_tiles(
    table,
    n_tiles,
    state,
    flag,
    flag_value: tl.int64,
    host_flag: tl.int64,
    word_value: tl.int64,
    TILE: tl.constexpr,
    ELEM_BYTES: tl.constexpr,
    FROM_EPOCH: tl.constexpr,
    SINGLE: tl.constexpr,
    ARRIVE_SYS: tl.constexpr,
    STREAMING: tl.constexpr,
):
    """Copy the table's tiles; ``TILE`` is the number of words (bytes when ``ELEM_BYTES == 1``) per tile."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, TILE)
    for t in range(pid, n_tiles, nprog):
        row = table + t * 3
        _copy_tile(tl.load(row), tl.load(row + 1), tl.load(row + 2), offs, ELEM_BYTES, STREAMING)
    publish(state, flag, flag_value, host_flag, word_value, FROM_EPOCH, SINGLE, ARRIVE_SYS)


@triton.jit
def empty(unused):
    """Does nothing: its GPU time between two events is the floor of any Triton launch."""
    pass
