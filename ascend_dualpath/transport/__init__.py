"""Layer-block transfers: one engine interface over four kinds (AIV-direct, AICPU, HCCL-buffer staging, host).

Importing this package touches no device; backends load their runtime when an engine is created::

    from ascend_dualpath.transport import MemorySegment, RemoteSlot, create_engine

    engine = create_engine("emulator", comm, peer=1)
    ticket = engine.submit([MemorySegment.of_region(kv_region)], RemoteSlot(1, addr, nbytes, rkey), notify_slot=3)
    result = ticket.wait(timeout_s=5.0)     # result.kind, result.selection.decided_by, ...
"""

from __future__ import annotations

from ascend_dualpath.transport.engine import PreparedTransfer, StagingPool, Ticket, TransferEngine, TransferResult
from ascend_dualpath.transport.factory import create_engine, engine_class
from ascend_dualpath.transport.kinds import (
    AIV_DATAPLANE_BIT,
    ChannelCapabilities,
    GateDecision,
    MemoryKind,
    Selection,
    TransferKind,
    select_kind,
)
from ascend_dualpath.transport.segments import MemorySegment, RemoteSlot, WirePiece, split_segments

__all__ = [
    "AIV_DATAPLANE_BIT",
    "ChannelCapabilities",
    "GateDecision",
    "MemoryKind",
    "MemorySegment",
    "PreparedTransfer",
    "RemoteSlot",
    "Selection",
    "StagingPool",
    "Ticket",
    "TransferEngine",
    "TransferKind",
    "TransferResult",
    "WirePiece",
    "create_engine",
    "engine_class",
    "select_kind",
    "split_segments",
]
