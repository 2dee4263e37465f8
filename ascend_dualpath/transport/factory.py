"""``create_engine``: the transfer engine of a backend, by the ``Backend`` key (``"auto"`` through ``get_backend``).

Everything above transport asks here instead of naming a backend's class. Constructor arguments differ per
backend and pass through unchanged:

- ``emulator``: :class:`~ascend_dualpath.transport.emulator.EmulatedTransferEngine` ``(comm, peer, ...)``;
- ``cuda``: :class:`~ascend_dualpath.transport.cuda_engine.CudaTransferEngine` ``(device, peer_device, ...)``;
- ``npu``: :class:`~ascend_dualpath.transport.npu.NpuTransferEngine` ``(comm, peer, device, ...)``, the host
  ``HcclBatchPut`` path, **not yet run on hardware**;
- ``mooncake``: :class:`~ascend_dualpath.transport.mooncake.MooncakeTransferEngine` ``(peer, hostname=...,
  protocol="tcp"|"rdma"|"ascend", ...)``, across hosts through the Mooncake Transfer Engine (an optional
  dependency, docs/mooncake.md); not a device backend, so ``"auto"`` never picks it.
"""

from __future__ import annotations

from typing import Any

from ascend_dualpath.backends import Backend, get_backend
from ascend_dualpath.transport.engine import TransferEngine

MOONCAKE = "mooncake"  # the engine over the Mooncake Transfer Engine (any host, any device Mooncake serves)


def engine_class(backend: str | Backend = "auto") -> type[TransferEngine]:
    """The engine class of ``backend`` (its runtime module is imported, no device is touched)."""
    if backend == MOONCAKE:
        from ascend_dualpath.transport.mooncake import MooncakeTransferEngine

        return MooncakeTransferEngine
    chosen = get_backend(backend)
    if chosen is Backend.EMULATOR:
        from ascend_dualpath.transport.emulator import EmulatedTransferEngine

        return EmulatedTransferEngine
    if chosen is Backend.CUDA:
        from ascend_dualpath.transport.cuda_engine import CudaTransferEngine

        return CudaTransferEngine
    from ascend_dualpath.transport.npu import NpuTransferEngine

    return NpuTransferEngine


def create_engine(backend: str | Backend = "auto", *args: Any, **kwargs: Any) -> TransferEngine:
    """A transfer engine of ``backend``; ``args`` and ``kwargs`` go to its constructor."""
    return engine_class(backend)(*args, **kwargs)
