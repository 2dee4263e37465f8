"""``aiv``: our AscendC dispatch/combine kernels on the emulated device: a reserved slot, not built yet.

The kernels need the emulated device runtime (``csrc/emulator``, being built on main); until it lands this
strategy reports itself unavailable, so ``"auto"`` skips it and an explicit ``strategy="aiv"`` fails loudly.
"""

from __future__ import annotations

from typing import Any

from ascend_dualpath.errors import BackendUnavailable

REASON = ("aiv strategy needs the emulated device runtime (csrc/emulator on main), which this MoE package "
          "does not use yet; use strategy='alltoall' on CPU")


def availability(group: Any) -> tuple[bool, str]:
    return False, REASON


def create(group: Any, timeout_s: float, **options: Any):
    raise BackendUnavailable(REASON)
