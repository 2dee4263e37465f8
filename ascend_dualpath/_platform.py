"""Workarounds for the host platform, kept apart from the mechanisms that need them."""

from __future__ import annotations

import ctypes
import platform

# arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): Linux's x86-64 request for the AMX tile state
ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18


def request_amx_state() -> None:
    """Ask Linux for the AMX tile state now, before the caller's threads exist (x86-64 only, best effort).

    Without it, a vLLM decode instance's first forward after the DualPath fabric handshake died with SIGILL inside
    vLLM's CPU attention (vLLM 0.32.0 on Sapphire Rapids): the lazy request made there did not take effect for that
    process. Plain vLLM servers that run beside one (benchmarks' baselines) get the same call.
    """
    if platform.machine() != "x86_64":
        return
    ctypes.CDLL(None, use_errno=True).syscall(ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
