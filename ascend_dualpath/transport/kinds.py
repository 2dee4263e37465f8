"""Transfer kinds and the gates that choose one, after the seed's ``aiv_candidate_layer_transfer``.

The gates run in order and the first that fails decides::

    capability   the product supports the AIV dataplane (capability bit 0x04)   else fall back
    protocol     the path to the peer is RoCE                                    else fall back
    addressable  the vector cores can address every source (device memory)     else ``staging``
    payload      a source above the maximum single AIV payload is split into segments (never a fallback)

A fallback is ``aicpu`` when every source is device memory (the AICPU BatchWrite server takes device
GM items), else ``host``. The :class:`Selection` records which gate decided and why.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from ascend_dualpath import errors as E

AIV_DATAPLANE_BIT = 0x04
ROCE = "RoCE"


class TransferKind(str, enum.Enum):
    """How a layer block reaches the remote slot."""

    AIV = "aiv"  # vector cores post the WQEs themselves, from device memory
    AICPU = "aicpu"  # vector cores fill BatchWrite items, the AICPU server posts the WQEs
    STAGING = "staging"  # copy into the registered HCCL window first, then AIV-direct from there
    HOST = "host"  # the host posts (HcclBatchPut on Ascend, cudaMemcpyAsync per segment on CUDA)


class MemoryKind(str, enum.Enum):
    DEVICE = "device"  # device memory (HBM/GM): addressable by the vector cores
    HOST = "host"  # host DRAM: not addressable by the vector cores


@dataclass(frozen=True)
class ChannelCapabilities:
    """What the channel to one peer offers.

    Parameters
    ----------
    capability_bitmap : int
        The communicator's capability bitmap; bit 0x04 is the AIV dataplane.
    protocol : str
        Transport to the peer: ``"RoCE"``, ``"HCCS"``, ``"PCIe"``.
    max_single_aiv_payload : int
        Largest payload one AIV-posted WQE may carry, in bytes.
    """

    capability_bitmap: int
    protocol: str
    max_single_aiv_payload: int

    def __post_init__(self) -> None:
        if self.max_single_aiv_payload < 1:
            raise E.ConfigError(f"max_single_aiv_payload must be >= 1 byte, got {self.max_single_aiv_payload}")


@dataclass(frozen=True)
class GateDecision:
    gate: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class Selection:
    """The chosen kind, the gate that decided it and the full gate trail."""

    kind: TransferKind
    decided_by: str
    reason: str
    gates: tuple[GateDecision, ...]
    segmented: bool


def _fallback(memory: Sequence[MemoryKind]) -> tuple[TransferKind, str]:
    if all(m is MemoryKind.DEVICE for m in memory):
        return TransferKind.AICPU, "fall back to the AICPU BatchWrite server"
    return TransferKind.HOST, "fall back to the host path (AICPU BatchWrite needs device-memory sources)"


def select_kind(
    caps: ChannelCapabilities,
    memory: Sequence[MemoryKind],
    largest_source_bytes: int,
    direct_protocols: tuple[str, ...] = (ROCE,),
) -> Selection:
    """Run the gates for sources in ``memory`` whose largest one has ``largest_source_bytes`` bytes.

    ``direct_protocols`` are the transports the device-posted path works over: RoCE for AIV-posted WQEs on
    Ascend; a backend with another device-initiated path names its own (the CUDA engine: peer load/store access).
    """
    if not memory:
        raise E.EmptyTransfer("a transfer needs at least one source segment")
    gates: list[GateDecision] = []

    def decide(kind: TransferKind, gate: str, reason: str) -> Selection:
        segmented = (
            kind in (TransferKind.AIV, TransferKind.STAGING) and largest_source_bytes > caps.max_single_aiv_payload
        )
        return Selection(kind, gate, reason, tuple(gates), segmented)

    has_bit = bool(caps.capability_bitmap & AIV_DATAPLANE_BIT)
    gates.append(
        GateDecision(
            "capability",
            has_bit,
            f"capability bitmap {caps.capability_bitmap:#x}, AIV dataplane bit "
            f"{AIV_DATAPLANE_BIT:#x} {'set' if has_bit else 'clear'}",
        )
    )
    if not has_bit:
        kind, how = _fallback(memory)
        return decide(kind, "capability", f"the product does not support the AIV dataplane; {how}")

    direct = caps.protocol in direct_protocols
    gates.append(GateDecision("protocol", direct, f"protocol to the peer is {caps.protocol}"))
    if not direct:
        kind, how = _fallback(memory)
        need = " or ".join(direct_protocols)
        return decide(
            kind, "protocol", f"the device-posted path needs {need}, the peer is reached over {caps.protocol}; {how}"
        )

    host_sources = sum(m is MemoryKind.HOST for m in memory)
    gates.append(
        GateDecision("addressable", host_sources == 0, f"{host_sources} of {len(memory)} sources in host DRAM")
    )
    segmented = largest_source_bytes > caps.max_single_aiv_payload
    gates.append(
        GateDecision(
            "payload",
            True,
            f"largest source {largest_source_bytes} B "
            f"{'>' if segmented else '<='} max single AIV payload "
            f"{caps.max_single_aiv_payload} B"
            f"{': split into segments' if segmented else ''}",
        )
    )
    if host_sources:
        return decide(
            TransferKind.STAGING,
            "addressable",
            "the vector cores cannot address host DRAM: stage through the HCCL window",
        )
    return decide(TransferKind.AIV, "addressable", "every gate passed: AIV-direct from device memory")
