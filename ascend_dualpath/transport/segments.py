"""Source segments, the remote slot, and splitting them into wire pieces of bounded size."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ascend_dualpath import errors as E
from ascend_dualpath.transport.kinds import MemoryKind


@dataclass(frozen=True)
class MemorySegment:
    """A contiguous source range.

    Parameters
    ----------
    addr : int
        Address of the first byte.
    nbytes : int
        Length in bytes (>= 1).
    memory : MemoryKind
        Where it lives; host DRAM cannot be addressed by the vector cores.
    key : int
        Local key of its registration (0 where the backend needs none).
    """

    addr: int
    nbytes: int
    memory: MemoryKind
    key: int = 0

    @classmethod
    def of_region(cls, region, offset: int = 0, nbytes: int | None = None) -> MemorySegment:
        """``nbytes`` bytes (default: to the end) of an emulated registered region, from ``offset``."""
        nbytes = region.size - offset if nbytes is None else nbytes
        if offset < 0 or nbytes < 1 or offset + nbytes > region.size:
            raise E.BoundsError(f"segment [{offset}, +{nbytes}) is outside the region of {region.size} bytes")
        memory = MemoryKind.HOST if int(region.kind) == 1 else MemoryKind.DEVICE
        return cls(region.addr + offset, nbytes, memory, region.lkey)


@dataclass(frozen=True)
class RemoteSlot:
    """Where the concatenated sources land on ``peer``: ``nbytes`` bytes at ``addr`` under ``rkey``."""

    peer: int
    addr: int
    nbytes: int
    rkey: int = 0


@dataclass(frozen=True)
class WirePiece:
    """One work request: ``nbytes`` from ``local_addr`` to ``remote_addr``."""

    local_addr: int
    remote_addr: int
    nbytes: int
    lkey: int
    rkey: int
    source_index: int


@dataclass(frozen=True)
class Strided:
    """Copies of one length at constant strides, as one 2-D copy: ``height`` rows of ``width`` bytes, row ``i`` from
    ``src + i * spitch`` to ``dst + i * dpitch``."""

    src: int
    spitch: int
    dst: int
    dpitch: int
    width: int
    height: int


def uniform_stride(
    srcs: Sequence[int], dsts: Sequence[int], sizes: Sequence[int], max_pitch: int = (1 << 31) - 1
) -> Strided | None:
    """The copies ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` as one :class:`Strided`, or None when they are
    not one: every copy the same length, sources a constant stride apart and destinations another, each stride at
    least the length (rows that do not overlap, as ``cudaMemcpy2D`` needs) and at most ``max_pitch``. Copies that
    touch at both ends merge into one row; one copy is one row. ~0.2 µs per copy in Python: run it when a pattern
    is prepared, not per submission."""
    if not sizes or not len(srcs) == len(dsts) == len(sizes):
        return None
    width, src, dst = sizes[0], srcs[0], dsts[0]
    if width < 1:
        return None
    if len(sizes) == 1:
        return Strided(src, width, dst, width, width, 1)
    spitch, dpitch = srcs[1] - src, dsts[1] - dst
    if not (width <= spitch <= max_pitch and width <= dpitch <= max_pitch):
        return None
    for i, (s, d, n) in enumerate(zip(srcs, dsts, sizes, strict=True)):
        if n != width or s != src + i * spitch or d != dst + i * dpitch:
            return None
    if spitch == dpitch == width:  # end to end on both sides: one contiguous copy
        return Strided(src, width * len(sizes), dst, width * len(sizes), width * len(sizes), 1)
    return Strided(src, spitch, dst, dpitch, width, len(sizes))


def split_segments(sources: Sequence[MemorySegment], remote: RemoteSlot, max_piece: int) -> list[WirePiece]:
    """Cut ``sources`` into pieces of at most ``max_piece`` bytes, laid end to end from ``remote.addr``.

    A source of ``k * max_piece`` bytes gives exactly ``k`` pieces; one more byte gives ``k + 1``.
    Raises EmptyTransfer for no sources or an empty one, BoundsError when they overflow the slot.
    """
    if max_piece < 1:
        raise E.ConfigError(f"max_piece must be >= 1 byte, got {max_piece}")
    if not sources:
        raise E.EmptyTransfer("a transfer needs at least one source segment")
    total = 0
    for i, s in enumerate(sources):
        if s.nbytes < 1:
            raise E.EmptyTransfer(f"source segment {i} has {s.nbytes} bytes; every segment needs at least 1")
        total += s.nbytes
    if total > remote.nbytes:
        raise E.BoundsError(
            f"{total} source bytes overflow the remote slot of {remote.nbytes} bytes on rank {remote.peer}"
        )
    pieces: list[WirePiece] = []
    offset = 0
    for i, s in enumerate(sources):
        for start in range(0, s.nbytes, max_piece):
            n = min(max_piece, s.nbytes - start)
            pieces.append(WirePiece(s.addr + start, remote.addr + offset + start, n, s.key, remote.rkey, i))
        offset += s.nbytes
    return pieces
