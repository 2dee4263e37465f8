"""DeepEP-style MoE dispatch/combine (:class:`Buffer`) with pluggable strategies; see docs/moe.md.

Importing this package touches no device and imports no torch.distributed backend.
"""

from __future__ import annotations

from ascend_dualpath.moe.buffer import Buffer, CapturedGraph, Config, DispatchHandle
from ascend_dualpath.moe.event import EventOverlap

__all__ = ["Buffer", "CapturedGraph", "Config", "DispatchHandle", "EventOverlap"]
