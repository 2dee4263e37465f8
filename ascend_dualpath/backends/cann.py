"""Finding a CANN toolkit and the SoC to build for, without importing torch or torch_npu.

Used by ``setup.py`` (loaded by path, before the package is installed) and by ``info``. The order
follows how Ascend projects do it (vllm-ascend, sgl-kernel-npu, the hccl examples).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

CANN_ENV_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_CANN_PACKAGE_PATH")
CANN_DEFAULT_DIRS = ("/usr/local/Ascend/ascend-toolkit/latest", "/usr/local/Ascend/cann")
ASCENDC_CMAKE_SUBDIRS = ("tools/tikcpp/ascendc_kernel_cmake", "compiler/tikcpp/ascendc_kernel_cmake",
                         "ascendc_devkit/tikcpp/samples/cmake")


def find_cann(environ: dict | None = None, default_dirs=CANN_DEFAULT_DIRS) -> tuple[Path | None, str]:
    """The CANN root and where it came from: the first of ``CANN_ENV_VARS`` naming a directory, else
    the first existing default directory; ``(None, reason)`` when there is none."""
    environ = os.environ if environ is None else environ
    for var in CANN_ENV_VARS:
        value = environ.get(var)
        if value and Path(value).is_dir():
            return Path(value), f"${var}"
    for candidate in default_dirs:
        if Path(candidate).is_dir():
            return Path(candidate), candidate
    return None, "not found (set ASCEND_HOME_PATH, or `source <cann>/set_env.sh`)"


def find_soc_version(environ: dict | None = None, timeout_s: float = 20.0) -> tuple[str | None, str]:
    """``SOC_VERSION`` from the environment, else the chip name that ``npu-smi`` reports for NPU 0."""
    environ = os.environ if environ is None else environ
    if environ.get("SOC_VERSION"):
        return environ["SOC_VERSION"], "$SOC_VERSION"
    npu_smi = shutil.which("npu-smi", path=environ.get("PATH"))
    if npu_smi is None:
        return None, "SOC_VERSION is unset and npu-smi is absent"
    try:
        out = subprocess.run([npu_smi, "info", "-t", "board", "-i", "0", "-c", "0"], capture_output=True, text=True,
                             timeout=timeout_s).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"npu-smi failed: {exc}"
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Chip Name", "Chip Type") and value.strip():
            return "Ascend" + value.strip(), "npu-smi"
    return None, "npu-smi printed no chip name"


def ascendc_cmake_dir(cann: Path) -> Path | None:
    """The directory holding CANN's ``ascendc.cmake`` (defines ``ascendc_library``)."""
    for sub in ASCENDC_CMAKE_SUBDIRS:
        if (cann / sub).is_dir():
            return cann / sub
    return None
