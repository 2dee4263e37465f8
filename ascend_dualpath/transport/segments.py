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
