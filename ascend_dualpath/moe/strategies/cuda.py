"""``cuda``: placeholder availability while the kernels are written."""

from __future__ import annotations

from typing import Any


def availability(group: Any) -> tuple[bool, str]:
    return False, "not yet"
