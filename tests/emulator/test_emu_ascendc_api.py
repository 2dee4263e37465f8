"""The emulator's AscendC stand-ins (op_kernels/emu) reject what bisheng rejects, at compile time: the
deprecated Hccl::Init, Hccl without lib/hccl/hccl.h, a kernel type that is not a KernelMetaType, and a
build without ADP_EMULATOR. Compile-only (g++ -fsyntax-only with setup.py's flags); nothing runs."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CXX = shutil.which("c++") or shutil.which("g++")

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")

CLEAN = """#include "kernel_operator.h"
#include "lib/hccl/hccl.h"
using namespace AscendC;
extern "C" __global__ __aicore__ void k(GM_ADDR items) {
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIV_1_0);
    uint64_t tiling[43] = {};
    Hccl<HCCL_SERVER_TYPE_AICPU> hccl;  // unscoped, as in the real header
    hccl.InitV2(GetHcclContext<0>(), tiling);
    if (hccl.SetCcTilingV2(64) == 0) hccl.Wait(hccl.BatchWrite<true>(items, 1));
    hccl.Finalize();
}
"""

BROKEN = {
    "deprecated_init": (
        CLEAN.replace("hccl.InitV2(GetHcclContext<0>(), tiling);", "hccl.Init(GetHcclContext<0>());"),
        "deprecated",
    ),
    "hccl_header_missing": (CLEAN.replace('#include "lib/hccl/hccl.h"\n', ""), "Hccl"),
    "kernel_type_not_an_enum": (CLEAN.replace("KERNEL_TYPE_MIX_AIV_1_0", "2"), "KernelMetaType"),
}


def compile_kernel(tmp_path: Path, source: str, emulator: bool = True) -> subprocess.CompletedProcess:
    path = tmp_path / "kernel.cpp"
    path.write_text(source)
    args = [
        CXX,
        "-std=c++17",
        "-fsyntax-only",
        "-Werror=deprecated-declarations",
        f"-I{ROOT / 'csrc'}",
        f"-I{ROOT / 'op_kernels' / 'include'}",
        f"-I{ROOT / 'op_kernels' / 'emu'}",
        str(path),
    ]
    if emulator:
        args.insert(1, "-DADP_EMULATOR=1")
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def test_the_documented_calls_compile(tmp_path):
    out = compile_kernel(tmp_path, CLEAN)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_what_bisheng_rejects_does_not_compile(tmp_path, name):
    source, message = BROKEN[name]
    out = compile_kernel(tmp_path, source)
    assert out.returncode != 0 and message in out.stderr, out.stderr


def test_the_emulator_headers_need_adp_emulator(tmp_path):
    out = compile_kernel(tmp_path, CLEAN, emulator=False)
    assert out.returncode != 0 and "ADP_EMULATOR" in out.stderr, out.stderr
