"""ascend_dualpath: DualPath KV loading, AIV-direct RDMA and DeepEP-style MoE for Ascend NPUs.

Importing the package touches no device, loads no compiled code and needs no torch_npu: backends,
the compiled ``_C`` module and torch_npu are loaded lazily, on first use. The main entry points are named
here and imported on first access (module ``__getattr__``), so ``import ascend_dualpath`` stays lean:

- ``Backend``, ``get_backend``: the device backend (npu, cuda, emulator) and its detection;
- ``Buffer``, ``Config``: DeepEP-compatible MoE dispatch/combine (:mod:`ascend_dualpath.moe`);
- ``create_engine``, ``TransferEngine``, ``MemorySegment``, ``RemoteSlot``: the layer-block transfer engine and
  its segments (:mod:`ascend_dualpath.transport`);
- ``LocalBlockStore``, ``ReadQueue``: the KV block store and one node's paced read queue (:mod:`ascend_dualpath.kv`);
- ``DualPathConnector``: the vLLM KV connector (:mod:`ascend_dualpath.integrations.vllm`; needs vLLM).
"""

from __future__ import annotations

import importlib
from typing import Any

from ascend_dualpath.backends import Backend, get_backend
from ascend_dualpath.version import __version__

# name -> module that defines it; imported on first access only
_LAZY = {
    "Buffer": "ascend_dualpath.moe",
    "Config": "ascend_dualpath.moe",
    "create_engine": "ascend_dualpath.transport",
    "TransferEngine": "ascend_dualpath.transport",
    "MemorySegment": "ascend_dualpath.transport",
    "RemoteSlot": "ascend_dualpath.transport",
    "LocalBlockStore": "ascend_dualpath.kv",
    "ReadQueue": "ascend_dualpath.kv",
    "DualPathConnector": "ascend_dualpath.integrations.vllm.connector",
}

__all__ = ["Backend", "get_backend", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later accesses skip this hook
        return value
    raise AttributeError(f"module 'ascend_dualpath' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
