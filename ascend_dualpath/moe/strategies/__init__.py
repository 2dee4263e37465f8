"""Strategy registry behind :class:`~ascend_dualpath.moe.Buffer`.

=========  ================================================================  ==========================
name       what moves the data                                               available when
=========  ================================================================  ==========================
mc2        ``torch_npu.npu_moe_distribute_dispatch(_v2)/combine(_v2)``        torch_npu imports, hccl
           for low-latency ops; normal ops over ``alltoall``
aiv        our AscendC kernels (``moe_dispatch``/``moe_combine``) on the      gloo group (CPU tensors),
           emulated device: AIV-direct WQEs or AICPU BatchWrite; fullmesh,    the compiled emulator
           or two hops when the ranks span several nodes
cuda       Triton copy kernels writing into NVLink peers' symmetric memory   CUDA group (nccl), 2/4/8
                                                                             ranks, all peers P2P
alltoall   ``torch.distributed.all_to_all_single`` (gloo, nccl, hccl)        always
=========  ================================================================  ==========================

``"auto"`` tries them in the order of the table (mc2, aiv, cuda, alltoall) and takes the first available;
an explicit name that cannot run raises :class:`~ascend_dualpath.errors.BackendUnavailable` with the reason.
"""

from __future__ import annotations

import importlib
from typing import Any

from ascend_dualpath.errors import BackendUnavailable, ConfigError

AUTO_ORDER = ("mc2", "aiv", "cuda", "alltoall")
_MODULES = {
    "mc2": "ascend_dualpath.moe.strategies.mc2",
    "aiv": "ascend_dualpath.moe.strategies.aiv",
    "cuda": "ascend_dualpath.moe.strategies.cuda",
    "alltoall": "ascend_dualpath.moe.strategies.alltoall",
}


def _module(name: str):
    if name not in _MODULES:
        raise ConfigError(f"unknown MoE strategy {name!r}; choose one of: auto, {', '.join(_MODULES)}")
    return importlib.import_module(_MODULES[name])


def availability(name: str, group: Any) -> tuple[bool, str]:
    """``(available, reason)`` for strategy ``name`` on ``group``; touches no device beyond probing."""
    module = _module(name)
    return module.availability(group) if hasattr(module, "availability") else (True, "always available")


def resolve(name: str, group: Any) -> str:
    """Resolve ``"auto"`` to the first available strategy in :data:`AUTO_ORDER`; check an explicit name."""
    if name == "auto":
        reasons = []
        for candidate in AUTO_ORDER:
            ok, reason = availability(candidate, group)
            if ok:
                return candidate
            reasons.append(f"{candidate}: {reason}")
        raise BackendUnavailable("no MoE strategy is available: " + "; ".join(reasons))
    ok, reason = availability(name, group)
    if not ok:
        raise BackendUnavailable(f"MoE strategy {name!r} is unavailable: {reason}")
    return name


def create(name: str, group: Any, timeout_s: float, **options: Any):
    """Instantiate the (resolved) strategy ``name``."""
    return _module(name).create(group, timeout_s, **options)
