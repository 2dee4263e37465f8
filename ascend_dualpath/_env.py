"""Every ``ADP_*`` environment variable the library reads, in one place.

Explicit arguments always beat these: each accessor returns ``None`` (or the documented default)
when the variable is unset, and callers use the value only when the caller passed nothing.

=============================  =====================================================================
variable                       meaning
=============================  =====================================================================
``ADP_BACKEND``                default backend for ``get_backend("auto")``: ``npu``, ``cuda``, ``emulator``
``ADP_EMU_PRODUCT``            emulated product profile: ``A2`` (default) or ``A3``
``ADP_EMU_CAPABILITY_BITMAP``  capability bitmap of the ``aiv`` MoE strategy's emulated devices (``0`` clears
                               the AIV dataplane bit 0x04: the AICPU BatchWrite path); default: the product's
``ADP_EMU_MTE2_STALL_US``      tests only: every GM -> UB copy of the emulated vector cores of this process takes that
                               many more microseconds (a slow core; widens cross-rank ordering races), read by the
                               emulator at each kernel launch (default 0)
``ADP_TIMEOUT_S``              default bound, in seconds, for every wait (default 30; finite and > 0)
``ADP_FAST_DEBUG``             ``1`` shortens every default wait to 2 s, to fail fast while debugging
``ADP_MOE_FUSED``              ``0`` runs the cuda MoE strategy's send and receive halves as two launches (default 1: one)
``ADP_DIRECT_LAUNCH``          ``0`` sends every Triton launch through ``kernel[grid](...)`` instead of calling the
                               compiled binary's launcher directly after a site's first launch (default 1;
                               ``ascend_dualpath._triton_launch``)
``ADP_MOE_DIRECT_LAUNCH``      the same for the cuda MoE strategy alone; when set it wins over ``ADP_DIRECT_LAUNCH``
``ADP_TRACE_DIR``              where the simulator finds shared traces (default: the ones shipped in ``ascend_dualpath/sim/data``)
``ADP_SIDE_TOKEN``             the deployment token every side-channel frame proves (the vLLM connector's and the
                               proxy's; their ``side_token_file`` / ``--side-token-file`` wins)
``ADP_VLLM_SERVE_CMD``         tests only: the command ``serve`` runs instead of vLLM's OpenAI API server (split like
                               a shell would)
``ADP_WITH_NPU``               build flag read by ``setup.py``: ``0`` skips the NPU part, ``1`` requires it
``ADP_DEBUG``                  build flag read by ``setup.py``: ``1`` builds with ``-O0 -g``
``ADP_SANITIZE``               build flag read by ``setup.py``: ``1`` builds with AddressSanitizer and
                               UndefinedBehaviorSanitizer (``tools/sanitize.sh`` builds and runs it)
=============================  =====================================================================

HCCL's own variables (``HCCL_BUFFSIZE``, ``HCCL_RDMA_TC``, ``HCCL_RDMA_SL``,
``HCCL_OP_EXPANSION_MODE``) are not ours: the emulated communicator reads them exactly where HCCL
does, as the fallback for ``HcclCommConfig`` fields left "not set".
"""

from __future__ import annotations

import os

DEFAULT_TIMEOUT_S = 30.0
FAST_DEBUG_TIMEOUT_S = 2.0


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


def backend() -> str | None:
    return _get("ADP_BACKEND")


def emu_product() -> str | None:
    return _get("ADP_EMU_PRODUCT")


def emu_capability_bitmap() -> int | None:
    """``ADP_EMU_CAPABILITY_BITMAP`` as an int (decimal or ``0x`` hex), or None when unset."""
    raw = _get("ADP_EMU_CAPABILITY_BITMAP")
    if raw is None:
        return None
    try:
        value = int(raw, 0)
    except ValueError:
        raise ValueError(f"ADP_EMU_CAPABILITY_BITMAP must be an integer, got {raw!r}") from None
    if not 0 <= value <= 0xFFFFFFFF:
        raise ValueError(f"ADP_EMU_CAPABILITY_BITMAP={raw} is outside [0, 0xffffffff]")
    return value


def trace_dir() -> str | None:
    return _get("ADP_TRACE_DIR")


def vllm_serve_cmd() -> str | None:
    return _get("ADP_VLLM_SERVE_CMD")


def fast_debug() -> bool:
    return _get("ADP_FAST_DEBUG") == "1"


def timeout_s() -> float:
    """Default bound for waits; ``ADP_TIMEOUT_S`` if set, else 2 s under ``ADP_FAST_DEBUG``, else 30 s."""
    raw = _get("ADP_TIMEOUT_S")
    if raw is not None:
        # imported here: setup.py imports this module without the package
        from ascend_dualpath._checks import check_bound
        from ascend_dualpath.errors import ConfigError

        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"ADP_TIMEOUT_S must be a number of seconds, got {raw!r}") from None
        return check_bound("ADP_TIMEOUT_S", value)
    return FAST_DEBUG_TIMEOUT_S if fast_debug() else DEFAULT_TIMEOUT_S


def moe_fused() -> bool:
    """Whether the cuda MoE strategy fuses send and receive halves into one launch (``ADP_MOE_FUSED``, default 1).

    Kept (not a Config field): it is a property of the machine, not a tuning; the split launches are the safe path
    where the SMs are shared (MPS, green contexts) and a fused grid's waiting CTAs may not all be resident."""
    raw = _get("ADP_MOE_FUSED")
    if raw not in (None, "0", "1"):
        raise ValueError(f"ADP_MOE_FUSED must be 0 or 1, got {raw!r}")
    return raw != "0"


def direct_launch(override: str | None = None) -> bool:
    """Whether Triton launch sites call the compiled binary's launcher directly after their first launch
    (``ADP_DIRECT_LAUNCH``, default 1; 0 sends every launch through Triton's ``kernel[grid](...)``).

    ``override`` names a narrower variable (e.g. ``ADP_MOE_DIRECT_LAUNCH``) that wins when it is set.
    """
    for name in (override, "ADP_DIRECT_LAUNCH"):
        raw = _get(name) if name else None
        if raw is not None:
            if raw not in ("0", "1"):
                raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
            return raw == "1"
    return True


def moe_direct_launch() -> bool:
    """:func:`direct_launch` for the cuda MoE strategy: ``ADP_MOE_DIRECT_LAUNCH`` if set, else ``ADP_DIRECT_LAUNCH``.

    Kept: the direct call relies on Triton's compiled launcher (no public API); this switch puts the MoE kernels
    alone back on ``kernel[grid]`` when a Triton version breaks it silently (``tools/gpu_moe.sh`` does so after a
    failed eager check) without slowing the transfer engine's launches."""
    return direct_launch("ADP_MOE_DIRECT_LAUNCH")


def build_flag(name: str) -> bool | None:
    """Tri-state build flag ``ADP_<name>``: True for 1, False for 0, None when unset."""
    raw = _get(f"ADP_{name}")
    if raw is None:
        return None
    if raw not in ("0", "1"):
        raise ValueError(f"ADP_{name} must be 0 or 1, got {raw!r}")
    return raw == "1"


def side_token() -> str | None:
    """``ADP_SIDE_TOKEN``, or None when unset (``dualpath.side_channel.load_token`` checks it)."""
    return _get("ADP_SIDE_TOKEN")
