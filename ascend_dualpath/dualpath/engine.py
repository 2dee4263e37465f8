"""DualPath KV loading engines, by concept (this module keeps the import paths of all of them):

- :mod:`~ascend_dualpath.dualpath.nodes`: the engines (``EngineConfig``, ``PrefillEngine``, ``DecodeEngine``,
  ``TurnResult``, ``verify_turn``);
- :mod:`~ascend_dualpath.dualpath.channels`: the control channels (``QueueChannel``, ``DistChannel``);
- :mod:`~ascend_dualpath.dualpath.bootstrap`: starting a pair (``in_process_engines``, ``engine_process``).
"""

from __future__ import annotations

from ascend_dualpath.dualpath.bootstrap import engine_process, in_process_engines
from ascend_dualpath.dualpath.channels import Channel, DistChannel, EngineLost, QueueChannel
from ascend_dualpath.dualpath.nodes import (
    FALLBACK_ERRORS,
    KV_BF16_ATOL,
    KV_FP32_ATOL,
    DecodeEngine,
    EngineConfig,
    PrefillEngine,
    TurnFailed,
    TurnResult,
    verify_turn,
)

__all__ = [
    "FALLBACK_ERRORS",
    "KV_BF16_ATOL",
    "KV_FP32_ATOL",
    "Channel",
    "DecodeEngine",
    "DistChannel",
    "EngineConfig",
    "EngineLost",
    "PrefillEngine",
    "QueueChannel",
    "TurnFailed",
    "TurnResult",
    "engine_process",
    "in_process_engines",
    "verify_turn",
]
