"""Zero-copy byte views of host buffers (buffer-protocol objects or contiguous CPU tensors) and their addresses."""

from __future__ import annotations

import ctypes
from typing import Any

import torch


def as_memoryview(buffer: Any, *, writable: bool) -> memoryview:
    """Flat byte view of a buffer-protocol object or CPU torch tensor, without copying."""
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError(
                f"tensor buffers must be contiguous CPU tensors, got {buffer.device} "
                f"contiguous={buffer.is_contiguous()}"
            )
        buffer = buffer.detach().reshape(-1).view(torch.uint8).numpy()
    view = memoryview(buffer)
    if not view.contiguous:
        raise ValueError("buffers must be C-contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if writable and view.readonly:
        raise ValueError("destination buffer is read-only")
    return view


def buffer_address(view: memoryview) -> int:
    """Virtual address of a writable memoryview's first byte (for alignment decisions)."""
    if view.nbytes == 0:
        return 0
    return ctypes.addressof(ctypes.c_char.from_buffer(view))
