"""Backends: where tensors live and which transfer kinds exist.

=========  ===================  ===========================  ============
backend    device type          transfer kinds               collectives
=========  ===================  ===========================  ============
npu        ``npu`` (torch_npu)  aiv, aicpu, staging, host    hccl
cuda       ``cuda``             aiv*, aicpu*, staging, host  nccl
emulator   ``cpu``              aiv, aicpu, staging, host    gloo
=========  ===================  ===========================  ============

(*) on CUDA "aiv" is a device-initiated copy kernel and "aicpu" a host-submitted copy-engine
transfer: the analogues of the Ascend paths.

``get_backend("auto")`` resolves, in this order: the explicit argument; ``ADP_BACKEND``; ``npu`` when
torch_npu imports and sees a device; ``cuda`` when torch sees a GPU; otherwise ``emulator``, which is
always available. Detection imports torch_npu only when asked and never creates a device context.
"""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass, field

from ascend_dualpath import _env
from ascend_dualpath.errors import BackendUnavailable


class Backend(enum.Enum):
    NPU = "npu"
    CUDA = "cuda"
    EMULATOR = "emulator"

    @classmethod
    def parse(cls, name: str | Backend) -> Backend:
        if isinstance(name, Backend):
            return name
        try:
            return cls(str(name).lower())
        except ValueError:
            choices = ", ".join(b.value for b in cls)
            raise ValueError(f"unknown backend {name!r}; choose one of: auto, {choices}") from None


@dataclass(frozen=True)
class Capabilities:
    """What one backend offers; ``available`` is False with ``reason`` when it cannot run here."""

    backend: Backend
    available: bool
    reason: str
    device_type: str
    collective_backend: str
    transfer_kinds: tuple[str, ...]
    details: dict = field(default_factory=dict)

    def supports(self, transfer_kind: str) -> bool:
        return self.available and transfer_kind in self.transfer_kinds


_ALL_KINDS = ("aiv", "aicpu", "staging", "host")


def _probe_npu() -> Capabilities:
    def unavailable(reason: str) -> Capabilities:
        return Capabilities(Backend.NPU, False, reason, "npu", "hccl", ())

    if importlib.util.find_spec("torch_npu") is None:
        return unavailable("torch_npu is not installed")
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception as exc:  # a broken CANN install surfaces here as ImportError/OSError
        return unavailable(f"torch_npu failed to import: {exc}")
    if not torch.npu.is_available():
        return unavailable("torch_npu imported but reports no NPU device")
    count = torch.npu.device_count()
    from ascend_dualpath import _ext

    compiled = _ext.compiled_backends()
    kinds = _ALL_KINDS if "npu" in compiled else ("host",)
    reason = f"{count} NPU(s)" + ("" if "npu" in compiled else "; NPU kernels not compiled, host path only")
    return Capabilities(Backend.NPU, True, reason, "npu", "hccl", kinds, {"device_count": count})


def _probe_cuda() -> Capabilities:
    import torch

    if torch.version.cuda is None:
        return Capabilities(Backend.CUDA, False, f"torch {torch.__version__} is a CPU-only build", "cuda", "nccl", ())
    if not torch.cuda.is_available():  # counts devices; creates no context
        return Capabilities(Backend.CUDA, False, "torch sees no CUDA device", "cuda", "nccl", ())
    count = torch.cuda.device_count()
    return Capabilities(
        Backend.CUDA, True, f"{count} CUDA device(s)", "cuda", "nccl", _ALL_KINDS, {"device_count": count}
    )


def _probe_emulator() -> Capabilities:
    from ascend_dualpath import _ext

    try:
        _ext.load()
    except BackendUnavailable as exc:
        return Capabilities(Backend.EMULATOR, False, str(exc), "cpu", "gloo", ())
    return Capabilities(Backend.EMULATOR, True, "always available (CPU)", "cpu", "gloo", _ALL_KINDS)


_PROBES = {Backend.NPU: _probe_npu, Backend.CUDA: _probe_cuda, Backend.EMULATOR: _probe_emulator}


def capabilities(backend: str | Backend) -> Capabilities:
    """Probe one backend. Imports torch_npu only for ``npu``; never initializes a device."""
    return _PROBES[Backend.parse(backend)]()


def get_backend(name: str | Backend | None = "auto") -> Backend:
    """Resolve ``name`` ("auto", "npu", "cuda", "emulator") to an available :class:`Backend`.

    An explicit name must be available or :class:`BackendUnavailable` is raised with the reason.
    ``"auto"`` (or ``None``) uses ``ADP_BACKEND`` when set, else the first available of npu, cuda,
    emulator.
    """
    if name is None or (isinstance(name, str) and name.lower() == "auto"):
        name = _env.backend() or "auto"
    if isinstance(name, str) and name.lower() == "auto":
        for candidate in (Backend.NPU, Backend.CUDA, Backend.EMULATOR):
            if capabilities(candidate).available:
                return candidate
        raise BackendUnavailable("no backend is available: " + _why_not_all())
    backend = Backend.parse(name)
    caps = capabilities(backend)
    if not caps.available:
        raise BackendUnavailable(f"backend {backend.value!r} is unavailable: {caps.reason}")
    return backend


def _why_not_all() -> str:
    return "; ".join(f"{b.value}: {capabilities(b).reason}" for b in Backend)
