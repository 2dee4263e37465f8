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


def soc_from_board(board: str) -> str | None:
    """The SOC_VERSION named by ``npu-smi info -t board -i <npu> -c <chip>``, or None without a chip name.

    The fields are ``Chip Name`` (A2: ``910B3``; A3: ``Ascend910``) and, on A3 only, ``NPU Name``
    (``9391``), as vllm-ascend's ``get_chip_type`` reads them: A2 gives ``Ascend910B3``, A3
    ``Ascend910_9391``. ``Chip Type`` (``Ascend``) is not the chip: reading it gave ``AscendAscend``.
    """
    fields = {}
    for line in board.splitlines():
        key, sep, value = line.partition(":")
        if sep and value.strip() and value.strip().upper() != "NA":
            fields.setdefault(key.strip(), value.strip())
    chip = fields.get("Chip Name")
    if chip is None:
        return None
    if chip.lower().startswith("ascend"):
        chip = chip[len("ascend") :]
    npu_name = fields.get("NPU Name")
    return f"Ascend{chip}_{npu_name}" if npu_name else f"Ascend{chip}"


def npu_ids(listing: str) -> list[int]:
    """The NPU IDs of ``npu-smi info -l`` (a container may expose NPU 4 alone)."""
    ids = []
    for line in listing.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "NPU ID" and value.strip().isdigit():
            ids.append(int(value.strip()))
    return ids


def find_soc_version(environ: dict | None = None, timeout_s: float = 20.0) -> tuple[str | None, str]:
    """``SOC_VERSION`` from the environment, else the chip of the first NPU that ``npu-smi`` lists.

    Returns ``(soc, origin)``, or ``(None, reason)``; every ``npu-smi`` call is bounded by ``timeout_s``.
    """
    environ = os.environ if environ is None else environ
    if environ.get("SOC_VERSION"):
        return environ["SOC_VERSION"], "$SOC_VERSION"
    npu_smi = shutil.which("npu-smi", path=environ.get("PATH"))
    if npu_smi is None:
        return None, "SOC_VERSION is unset and npu-smi is absent"
    try:
        listing = subprocess.run([npu_smi, "info", "-l"], capture_output=True, text=True, timeout=timeout_s).stdout
        ids = npu_ids(listing)
        if not ids:
            return None, "npu-smi info -l listed no NPU"
        board = subprocess.run(
            [npu_smi, "info", "-t", "board", "-i", str(ids[0]), "-c", "0"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"npu-smi failed: {exc}"
    soc = soc_from_board(board)
    if soc is None:
        return None, f"npu-smi printed no chip name for NPU {ids[0]}"
    return soc, f"npu-smi (NPU {ids[0]})"


def kernel_cmake_args(
    source_dir: Path, build_dir: Path, cann: Path, soc: str, build_type: str = "Release"
) -> list[str]:
    """The ``cmake`` configure command of ``op_kernels/`` (CANN's ascendc_library needs
    ``ASCEND_CANN_PACKAGE_PATH``; op_kernels/CMakeLists.txt finds ascendc.cmake under it)."""
    return [
        "cmake",
        "-S",
        str(source_dir),
        "-B",
        str(build_dir),
        f"-DASCEND_CANN_PACKAGE_PATH={cann}",
        f"-DSOC_VERSION={soc}",
        f"-DCMAKE_BUILD_TYPE={build_type}",
    ]


def read_kernel_build(build_dir: Path) -> dict[str, str]:
    """What the configure of ``op_kernels/`` wrote to ``adp_kernels_build.txt``: ``library`` (the shared
    library of the launched kernels), ``include`` (its aclrtlaunch_*.h), ``kernels``, ``soc``."""
    info = {}
    for line in (build_dir / "adp_kernels_build.txt").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            info[key] = value
    return info
