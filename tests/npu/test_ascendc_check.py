"""tools/check_ascendc.sh: every kernel under op_kernels/ passes the strict device-rule check, and the
check fails on planted violations (written to a temp dir). Skips without clang-14 (apt-get install clang-14)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tools" / "check_ascendc.sh"
CLANG = os.environ.get("CLANG", "clang-14")

pytestmark = pytest.mark.skipif(shutil.which(CLANG) is None, reason=f"{CLANG} is not installed")

HEADER = """#include "adp/transfer_kernels.h"
#include "kernel_operator.h"
using namespace AscendC;
"""

# Each planted kernel breaks one rule; `rule` is what the check's FAIL line names.
PLANTED = {
    "host_call": (
        "call rule",
        """
inline uint64_t host_only(uint64_t x) { return x + 1; }  // no __aicore__: a host function
extern "C" __global__ __aicore__ void planted(GM_ADDR out) {
    GlobalTensor<uint64_t> t;
    t.SetGlobalBuffer(reinterpret_cast<__gm__ uint64_t*>(out), 1);
    t.SetValue(0, host_only(uint64_t(GetBlockIdx())));
}
""",
    ),
    "gm_as_plain_pointer": (
        "address spaces",
        """
__aicore__ inline uint32_t first_length(const adp::xfer::Segment* segs) { return segs[0].length; }
extern "C" __global__ __aicore__ void planted(GM_ADDR segments, GM_ADDR out) {
    const __gm__ adp::xfer::Segment* segs = reinterpret_cast<__gm__ adp::xfer::Segment*>(segments);
    GlobalTensor<uint32_t> t;
    t.SetGlobalBuffer(reinterpret_cast<__gm__ uint32_t*>(out), 1);
    t.SetValue(0, first_length(segs));  // a __gm__ pointer where a plain one is expected
}
""",
    ),
    "struct_copied_out_of_gm": (
        "address spaces",
        """
extern "C" __global__ __aicore__ void planted(GM_ADDR tiling) {
    const adp::xfer::StageTiling t = *reinterpret_cast<__gm__ adp::xfer::StageTiling*>(tiling);
    (void)t;
}
""",
    ),
    "double_in_device_code": (
        "call rule",
        """
extern "C" __global__ __aicore__ void planted(GM_ADDR out) {
    double scale = 0.5;
    (void)scale;
}
""",
    ),
    "sync_all_without_mix_type": (
        "kernel type",
        """
extern "C" __global__ __aicore__ void planted(GM_ADDR out) {
    SyncAll();
}
""",
    ),
    "lambda": (
        "lambda",
        """
extern "C" __global__ __aicore__ void planted(GM_ADDR out) {
    auto twice = [](uint32_t x) { return 2 * x; };
    (void)twice(1);
}
""",
    ),
    "deprecated_hccl_init": (
        "call rule",
        """
#include "lib/hccl/hccl.h"
extern "C" __global__ __aicore__ void planted(GM_ADDR out) {
    Hccl<HCCL_SERVER_TYPE_AICPU> hccl;
    hccl.Init(GetHcclContext<0>());
}
""",
    ),
}


def run_check(*kernels: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(CHECK), *map(str, kernels)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CLANG": CLANG},
    )


def test_every_kernel_passes():
    out = run_check()
    assert out.returncode == 0, out.stdout + out.stderr
    kernels = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "op_kernels").glob("*/op_kernel/*.cpp"))
    kernels.append("op_kernels/emu/emu_probe.cpp")  # the emulator's self-test kernel follows the same rules
    passed = [line.removeprefix("ok: ") for line in out.stdout.splitlines() if line.startswith("ok: ")]
    assert sorted(passed) == sorted(kernels)


def test_a_clean_planted_kernel_passes(tmp_path):
    # the control case: the planted kernels below differ from this one only by their violation
    source = tmp_path / "clean.cpp"
    source.write_text(
        HEADER
        + """
extern "C" __global__ __aicore__ void planted(GM_ADDR out) {
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIV_1_0);
    uint64_t begin, end;
    adp::xfer::core_share(64, uint64_t(GetBlockIdx()), uint64_t(GetBlockNum()), &begin, &end);
    GlobalTensor<uint64_t> t;
    t.SetGlobalBuffer(reinterpret_cast<__gm__ uint64_t*>(out), 1);
    t.SetValue(0, end - begin);
    SyncAll();
}
"""
    )
    out = run_check(source)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_violation_fails(tmp_path, name):
    rule, body = PLANTED[name]
    source = tmp_path / f"{name}.cpp"
    source.write_text(HEADER + body)
    out = run_check(source)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"FAIL ({rule}): {source}" in out.stdout, out.stdout + out.stderr
