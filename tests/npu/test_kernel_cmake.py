"""op_kernels/CMakeLists.txt configured against a fake ascendc.cmake (tests/npu/data/fake_ascendc) that
records the ascendc_library calls: the targets, their sources and include paths, and what setup.py
reads back. Needs cmake (and a C++ compiler for the project's language probe); nothing is compiled."""

import shutil
import subprocess
from pathlib import Path

import pytest

from ascend_dualpath.backends import cann

ROOT = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).parent / "data" / "fake_ascendc" / "ascendc.cmake"
LAUNCHED = ("aiv_post_wqe", "hccl_stage")  # the kernels csrc/npu launches through ACLRT_LAUNCH_KERNEL
MC2 = ("aicpu_batch_write", "moe_dispatch", "moe_combine")  # need GetHcclContext: aclnn/MC2 launch only

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")


def fake_cann(tmp_path: Path) -> Path:
    toolkit = tmp_path / "cann"
    (toolkit / "compiler/tikcpp/ascendc_kernel_cmake").mkdir(parents=True)
    shutil.copy(FAKE, toolkit / "compiler/tikcpp/ascendc_kernel_cmake/ascendc.cmake")
    return toolkit


def configure(tmp_path: Path, toolkit: Path, soc: str = "Ascend910B3") -> subprocess.CompletedProcess:
    args = cann.kernel_cmake_args(ROOT / "op_kernels", tmp_path / "build", toolkit, soc)
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def calls(build: Path) -> list[list[str]]:
    return [line.split("|") for line in (build / "ascendc_calls.txt").read_text().splitlines()]


def kernel_source(kernel: str) -> str:
    return str(ROOT / "op_kernels" / kernel / "op_kernel" / f"{kernel}.cpp")


def test_targets_sources_and_include_paths(tmp_path):
    toolkit = fake_cann(tmp_path)
    out = configure(tmp_path, toolkit)
    assert out.returncode == 0, out.stdout + out.stderr
    recorded = calls(tmp_path / "build")
    assert recorded[0] == ["include", f"ASCEND_CANN_PACKAGE_PATH={toolkit}", "SOC_VERSION=Ascend910B3", "RUN_MODE=npu"]
    libraries = {c[1]: (c[2], c[3:]) for c in recorded if c[0] == "ascendc_library"}
    assert libraries == {
        "adp_kernels": ("SHARED", [kernel_source(k) for k in LAUNCHED]),
        "adp_mc2_kernels": ("STATIC", [kernel_source(k) for k in MC2]),
    }
    includes = {c[1]: c[3:] for c in recorded if c[0] == "ascendc_include_directories"}
    # the shared headers, never the emulator's AscendC stand-ins nor the clang check's declarations
    assert includes == {t: [str(ROOT / "op_kernels" / "include")] for t in libraries}


def test_setup_reads_the_library_and_launch_headers(tmp_path):
    out = configure(tmp_path, fake_cann(tmp_path), soc="Ascend910_9391")
    assert out.returncode == 0, out.stdout + out.stderr
    build = tmp_path / "build"
    # where ascendc_library puts lib<target>.so and include/<target>/aclrtlaunch_<kernel>.h
    assert cann.read_kernel_build(build) == {
        "library": str(build / "lib" / "libadp_kernels.so"),
        "include": str(build / "include" / "adp_kernels"),
        "kernels": ";".join(LAUNCHED),
        "soc": "Ascend910_9391",
    }


def test_every_kernel_source_is_in_one_target(tmp_path):
    out = configure(tmp_path, fake_cann(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    listed = [s for c in calls(tmp_path / "build") if c[0] == "ascendc_library" for s in c[3:]]
    on_disk = sorted(str(p) for p in (ROOT / "op_kernels").glob("*/op_kernel/*.cpp"))
    assert sorted(listed) == on_disk and len(set(listed)) == len(listed)


def test_missing_soc_or_toolkit_stops_configure(tmp_path):
    out = configure(tmp_path, fake_cann(tmp_path), soc="")
    assert out.returncode != 0 and "SOC_VERSION is not set" in out.stderr
    out = configure(tmp_path / "other", tmp_path / "no-such-cann")
    assert out.returncode != 0 and "ASCEND_CANN_PACKAGE_PATH" in out.stderr
    (tmp_path / "empty-cann").mkdir()
    out = configure(tmp_path / "third", tmp_path / "empty-cann")
    assert out.returncode != 0 and "ascendc.cmake not found" in out.stderr
