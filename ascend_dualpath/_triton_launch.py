"""Launch compiled Triton kernels without Triton's per-call Python work.

``kernel[grid](*args)`` costs several microseconds of host time on every call: Triton binds the arguments to
the signature, computes the specialisation key (dtype and 16-byte alignment of every pointer, value class of
every integer), looks the binary up, asks torch for the current device and stream, builds launch metadata for
profiler hooks, and its C launcher calls ``data_ptr()`` and ``cuPointerGetAttribute`` on every tensor. A launch
site whose grid, integer arguments and compile-time constants are fixed needs none of that after its first call.

:class:`LaunchSite` is one such site. Its first call goes through Triton (which compiles or finds the binary and
launches it; :meth:`LaunchSite.prepare` compiles without launching, e.g. before a CUDA graph capture). Later
calls hand the arguments to the binary's launcher in one of two ways (``mode``):

- ``"direct"`` (default): ``CompiledKernel.run`` with the site's grid, the raw current stream of the site's
  device, the cached function handle and packed metadata and no launch hooks. Pointer arguments may be passed
  as plain ``int`` addresses, which the C launcher takes as they are (no ``data_ptr()``, no driver query).
- ``"runner"``: ``compiled[grid](*args)``, Triton's own per-binary runner (asks for the stream and builds hook
  metadata on every call).

``"jit"`` sends every call through ``kernel[grid]``. The binary was specialised on the first call's arguments:
the caller passes a ``key`` describing whatever of its arguments may change that specialisation (e.g. the
16-byte alignment of caller-supplied tensors); a call whose key differs goes through Triton again and rebinds.
Integer addresses must keep the alignment of the tensors the site was compiled with.

Fallbacks: a Triton whose launcher refuses the argument layout raises ``TypeError`` while parsing, before
anything is enqueued; the site then retries the call through Triton and launches through Triton from then on
(for the process: ``LaunchSite.direct_ok``). Under ``TRITON_INTERPRET=1`` every call goes through Triton. With
profiler launch hooks installed at bind time the site uses ``"runner"`` so the hooks still see every launch.
``ADP_DIRECT_LAUNCH=0`` (see :mod:`ascend_dualpath._env`) makes ``"jit"`` the default mode.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from typing import Any

MODES = ("direct", "runner", "jit")


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _launch_hooks_installed() -> bool:
    """Whether a profiler hook wants to see launches (Triton >= 3.4 keeps them in ``knobs``, older on the class)."""
    try:
        from triton import knobs

        hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    except (ImportError, AttributeError):
        from triton.compiler import CompiledKernel

        hooks = (getattr(CompiledKernel, "launch_enter_hook", None), getattr(CompiledKernel, "launch_exit_hook", None))
    # Triton 3.9's hooks are chains that are never None: an empty chain means no hook
    return any(h is not None and getattr(h, "calls", True) for h in hooks)


def raw_stream_getter() -> Callable[[int], int]:
    """``device index -> raw handle of torch's current stream there`` (a C call in torch; a property otherwise)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else (lambda index: torch.cuda.current_stream(index).cuda_stream)


def default_mode() -> str:
    """``"direct"``, or ``"jit"`` when ``ADP_DIRECT_LAUNCH=0``."""
    from ascend_dualpath import _env

    return "direct" if _env.direct_launch() else "jit"


class LaunchSite:
    """One launch site: a kernel with a fixed grid and fixed compile-time constants, called with varying arguments.

    Parameters
    ----------
    kernel : triton.JITFunction
        The kernel.
    grid : int or tuple of int
        Programs along up to three axes.
    constants : dict
        Keyword arguments of every launch: ``tl.constexpr`` parameters and launch options (``num_warps``, ...).
    mode : str or None
        ``"direct"``, ``"runner"`` or ``"jit"``; default :func:`default_mode`.

    Call it with the kernel's positional (non-constexpr-keyword) arguments; ``key=`` (keyword) as described in
    the module docstring. ``bound`` says whether later calls skip Triton (then pointer arguments may be ints).
    """

    direct_ok = True  # cleared for the process when a Triton's launcher refuses the direct argument layout

    def __init__(self, kernel: Any, grid: int | tuple, constants: dict, mode: str | None = None) -> None:
        mode = default_mode() if mode is None else mode
        if mode not in MODES:
            from ascend_dualpath.errors import ConfigError

            raise ConfigError(f"launch mode {mode!r} is not one of {', '.join(MODES)}")
        self.kernel, self.constants, self.mode = kernel, constants, mode
        self.grid = tuple(grid) if isinstance(grid, tuple) else (grid,)
        self.grid3 = (*self.grid, 1, 1)[:3]
        self.key: Hashable = None
        self.tail: tuple = ()  # constexpr values the binary's launcher takes after the caller's arguments
        self._launch: Callable | None = None  # bound fast path, or None: through Triton

    @property
    def bound(self) -> bool:
        return self._launch is not None

    def __call__(self, *args: Any, key: Hashable = None) -> None:
        if self._launch is not None and key == self.key:
            try:
                self._launch(*args, *self.tail)
                return
            except TypeError:  # argument parsing, before anything was enqueued
                LaunchSite.direct_ok = False
                self._launch = None
        self._bind(self.kernel[self.grid](*args, **self.constants), len(args), key)

    def prepare(self, *args: Any, key: Hashable = None) -> bool:
        """Compile (or find) the binary for these arguments without launching it and bind the fast path;
        returns ``bound``. Use before a CUDA graph capture so that nothing compiles while capturing."""
        if self._launch is None or key != self.key:
            warmup = getattr(self.kernel, "warmup", None)
            if warmup is not None and not interpreted():
                self._bind(warmup(*args, grid=self.grid, **self.constants), len(args), key)
        return self.bound

    def _bind(self, compiled: Any, n_args: int, key: Hashable) -> None:
        self._launch = None
        if self.mode == "jit" or not LaunchSite.direct_ok or interpreted() or compiled is None:
            return
        try:
            self.tail = tuple(self.constants[name] for name in self.kernel.arg_names[n_args:])
            if self.mode == "runner" or _launch_hooks_installed():
                self._launch = compiled[self.grid3]
            else:
                self._launch = _direct_launcher(compiled, self.grid3)
            self.key = key
        except (AttributeError, KeyError, TypeError):  # a Triton without these entry points: stay on the JIT
            LaunchSite.direct_ok = False
            self._launch = None


def _direct_launcher(compiled: Any, grid3: tuple) -> Callable:
    """``launch(*args)``: the binary's launcher with everything but the arguments and the stream fixed."""
    import torch

    init = getattr(compiled, "_init_handles", None)
    if init is not None:
        init()
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    gx, gy, gz = grid3
    device = torch.cuda.current_device()
    current_stream = raw_stream_getter()

    def launch(*args: Any) -> None:
        run(gx, gy, gz, current_stream(device), function, packed, None, None, None, *args)

    return launch
