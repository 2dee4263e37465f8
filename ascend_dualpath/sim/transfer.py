"""Submission cost of the layer-block transfers, per transfer kind, as the emulator's cost model charges it.

DualPath moves KV layer by layer: for every layer of a request it issues one layer block, which in a paged
cache is one segment per KV block (``ceil(tokens / block_tokens)`` segments). Who posts those segments sets
what a layer block costs before the wire moves a byte:

==================  ===============================================================================
kind                submission of one layer block of ``n`` segments and ``bytes`` bytes
==================  ===============================================================================
``aiv``             ``ceil(n / aiv_cores) * aiv_submit_s`` (vector cores post their share in parallel)
``aicpu``           ``aicpu_issue_s + n * aicpu_wqe_s`` (one BatchWrite, serial on one AICPU)
``host``            ``n * host_submit_s`` (one host submission per segment, as layerwise loading issues them)
``host-batched``    ``host_submit_s`` (one batched host call for the whole layer block)
``staging``         ``ceil(bytes / staging_chunk_bytes) * host_submit_s`` posted, plus ``bytes /
                    staging_copy_bytes_per_s`` copied into the HCCL window before the send (not pipelined)
``free``            0 (the transfer as the Oracle of transfers: only the wire)
==================  ===============================================================================

Posting is pipelined with the wire (a leg lasts ``max(wire, submission)``); staging's copy is not (it adds).
Defaults are the emulator's (``csrc/emulator/cost_model.h``, sources in docs/cost_model.md: AIV 1 µs per WQE,
host 6 µs per submission, AICPU 1.5 µs per issue + 0.2 µs per WQE, PCIe 26 GB/s) and its engine (8 vector
cores, 1 MiB staging chunks); a cluster file can override every one.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields

from ascend_dualpath.errors import ConfigError


class TransferKind(enum.Enum):
    AIV = "aiv"
    AICPU = "aicpu"
    HOST = "host"
    HOST_BATCHED = "host-batched"
    STAGING = "staging"
    FREE = "free"


@dataclass(frozen=True)
class SubmissionCosts:
    """Per-operation costs (seconds, bytes, bytes/s) of the transfer kinds; defaults from the emulator."""

    aiv_submit_s: float = 1.0e-6
    aiv_cores: int = 8
    aicpu_issue_s: float = 1.5e-6
    aicpu_wqe_s: float = 0.2e-6
    host_submit_s: float = 6.0e-6
    staging_chunk_bytes: int = 1 << 20
    staging_copy_bytes_per_s: float = 26e9

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            positive = item.name in ("aiv_cores", "staging_chunk_bytes", "staging_copy_bytes_per_s")
            if not math.isfinite(value) or value < 0 or (positive and value <= 0):
                raise ConfigError(
                    f"transfer cost {item.name} must be finite and {'> 0' if positive else '>= 0'}, got {value}"
                )

    def layer_block(self, kind: TransferKind, segments: int, nbytes: float) -> tuple[float, float]:
        """``(posting_s, serial_s)`` of one layer block of ``segments`` segments and ``nbytes`` bytes: the
        posting time (pipelined with the wire) and the time added in series (staging's copy)."""
        if segments <= 0:
            return 0.0, 0.0
        if kind is TransferKind.AIV:
            return math.ceil(segments / self.aiv_cores) * self.aiv_submit_s, 0.0
        if kind is TransferKind.AICPU:
            return self.aicpu_issue_s + segments * self.aicpu_wqe_s, 0.0
        if kind is TransferKind.HOST:
            return segments * self.host_submit_s, 0.0
        if kind is TransferKind.HOST_BATCHED:
            return self.host_submit_s, 0.0
        if kind is TransferKind.STAGING:
            chunks = math.ceil(nbytes / self.staging_chunk_bytes)
            return chunks * self.host_submit_s, nbytes / self.staging_copy_bytes_per_s
        return 0.0, 0.0


def parse_kinds(text: str) -> list[TransferKind]:
    """``"aiv,aicpu,host,staging"`` as kinds; an unknown name is a ConfigError listing the known ones."""
    kinds = []
    for name in (part.strip() for part in text.split(",")):
        try:
            kinds.append(TransferKind(name))
        except ValueError:
            raise ConfigError(f"unknown transfer kind {name!r}; known: {[k.value for k in TransferKind]}") from None
    return kinds
