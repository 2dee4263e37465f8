"""Lazy loader of the compiled extension ``ascend_dualpath._C``.

Nothing here runs at package import: the first call to :func:`load` imports torch (whose shared
libraries ``_C`` links against) and then ``_C``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ascend_dualpath.errors import BackendUnavailable

_module: ModuleType | None = None


def load() -> ModuleType:
    """Import and return ``ascend_dualpath._C``; raise :class:`BackendUnavailable` if it was not built."""
    global _module
    if _module is None:
        import torch  # noqa: F401  (loads libc10/libtorch for _C)

        try:
            _module = importlib.import_module("ascend_dualpath._C")
        except ImportError as exc:
            raise BackendUnavailable(
                f"the compiled extension ascend_dualpath._C is missing ({exc}); "
                "build it with `pip install --no-build-isolation -e .`"
            ) from exc
    return _module


def compiled_backends() -> tuple[str, ...]:
    """Backends whose native code was compiled into ``_C`` (always includes ``emulator``)."""
    try:
        return tuple(load().compiled_backends())
    except BackendUnavailable:
        return ()
