"""NPU (``PrivateUse1``) kernels: the AscendC layer-block transfer launchers, and the CPU reference of
``hccl_stage`` (``aiv_post_wqe``'s CPU kernel, on the emulator, is :mod:`.aiv`'s).

The launchers are the ``_C.npu_transfer`` functions built with CANN (``ADP_WITH_NPU=1``); they enqueue the
kernel on the current NPU stream and return at once. Tiling layouts are ``op_kernels/include/adp/
transfer_kernels.h``'s (``StageTiling``: total_bytes u64, chunk_bytes u32, buffer_num u32; ``AivPostTiling``).
Nothing here imports torch_npu: :mod:`ascend_dualpath.ops._library` registers these only when torch_npu is
installed, and the compiled module is loaded on the first call.
"""

from __future__ import annotations

import ctypes
import importlib.util

import torch

from ascend_dualpath.errors import BackendUnavailable, BoundsError, ConfigError

STAGE_TILING_BYTES = 16
CORE_STATUS_BYTES = 16


def has_torch_npu() -> bool:
    """Whether torch_npu is installed (checked without importing it)."""
    return importlib.util.find_spec("torch_npu") is not None


def stage_total_bytes(tiling: torch.Tensor) -> int:
    """``StageTiling.total_bytes`` of a ``uint8 [16]`` tiling tensor (read on the host)."""
    if tiling.dtype != torch.uint8 or tiling.numel() != STAGE_TILING_BYTES:
        raise ConfigError(
            f"hccl_stage tiling must be uint8 [{STAGE_TILING_BYTES}], got {tiling.dtype} {list(tiling.shape)}"
        )
    return int(tiling.cpu()[:8].view(torch.int64)[0])


def hccl_stage_cpu(src_addr: int, window: torch.Tensor, tiling: torch.Tensor, block_dim: int) -> None:
    """What the ``hccl_stage`` kernel leaves behind, for host memory: ``total_bytes`` bytes from ``src_addr``
    to the start of ``window`` (the cores' shares of the copy together cover it exactly once)."""
    total = stage_total_bytes(tiling)
    capacity = window.numel() * window.element_size()
    if total > capacity:
        raise BoundsError(f"hccl_stage total_bytes={total} exceeds the window's {capacity} bytes")
    if not window.is_contiguous():
        raise ConfigError("hccl_stage window must be contiguous")
    if total:
        ctypes.memmove(window.data_ptr(), src_addr, total)


def _launchers():
    from ascend_dualpath.transport import npu

    module = npu.native()
    if not hasattr(module, "hccl_stage"):
        raise BackendUnavailable("this build has no AscendC launchers: rebuild with ADP_WITH_ASCENDC_KERNELS")
    return module


def hccl_stage_npu(src_addr: int, window: torch.Tensor, tiling: torch.Tensor, block_dim: int) -> None:
    """Enqueue ``hccl_stage`` on ``block_dim`` AI cores of the current NPU stream."""
    _launchers().hccl_stage(src_addr, window, tiling, block_dim)


def aiv_post_wqe_npu(
    segments: torch.Tensor, queues: torch.Tensor, status: torch.Tensor, tiling: torch.Tensor, block_dim: int
) -> None:
    """Enqueue ``aiv_post_wqe`` on ``block_dim`` vector cores of the current NPU stream."""
    _launchers().aiv_post_wqe(segments, queues, status, tiling, block_dim)
