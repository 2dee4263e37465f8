"""Lower the MoE ``dispatch_layout`` Triton kernel for Ascend with triton-ascend + ascendnpu-ir, as far as
possible without CANN: Triton IR -> linalg (``ttadapter``, triton-ascend) -> HFusion/HIVM (``bishengir-compile``,
ascendnpu-ir) -> CANN's ``hivmc``, which only a CANN install has. Run by ``tools/check_triton_ascend.sh`` with the
Python of a separate venv holding the two packages (no torch needed: the kernel file is loaded by path).

Prints one ``stage: result`` line per step; exit 0 when the pipeline got to ``hivmc`` (or past it, with CANN).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

# dispatch_layout's arguments as the cuda strategy launches it (one node of 8 ranks, top-8)
SIGNATURE = {
    "topk_idx": "*i64",
    "counts": "*i32",
    "in_rank": "*u8",
    "num_tokens": "i32",
    "num_topk": "i32",
    "experts_per_rank": "i32",
    "num_experts": "i32",
}
CONSTANTS = {
    "NUM_RANKS": 8,
    "RANKS_PAD": 8,
    "RANKS_PER_NODE": 8,
    "NUM_NODES": 1,
    "NODES_PAD": 1,
    "TOPK_PAD": 8,
    "BLOCK_T": 64,
}


def load_kernel(path: str):
    spec = importlib.util.spec_from_file_location("adp_moe_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dispatch_layout


def to_linalg(kernel, soc: str, cache: str) -> str:
    """The ``.ttadapter`` (linalg) module triton-ascend writes before its binary stage; that stage needs CANN
    (ASCEND_HOME_PATH) and is expected to fail here, so only the IR it left in the cache is used."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    os.environ["TRITON_CACHE_DIR"] = cache
    source = ASTSource(kernel, {**SIGNATURE, **{name: "constexpr" for name in CONSTANTS}}, constants=CONSTANTS)
    try:
        triton.compile(source, target=GPUTarget("npu", soc, 0))
        print("npubin: ok (triton-ascend compiled the kernel: CANN is installed)")
    except Exception as exc:  # the binary stage's error names what is missing
        lines = [line for line in str(exc).splitlines() if line.strip() and not line.startswith(("///", "[INFO]"))]
        print(f"npubin (triton-ascend): stopped: {' '.join(lines[:2])}")
    found = glob.glob(os.path.join(cache, "*", "dispatch_layout.ttir"))
    print(f"ttir: {'ok' if found else 'MISSING'}")
    linalg = glob.glob(os.path.join(cache, "*", "dispatch_layout.ttadapter"))
    if not linalg:
        print("ttadapter: MISSING (triton-ascend did not lower the kernel to linalg)")
        sys.exit(1)
    print(f"ttadapter: ok ({os.path.getsize(linalg[0])} bytes of linalg)")
    return linalg[0]


def to_hivm(linalg: str, soc: str, temps: str) -> int:
    """bishengir-compile with the options triton-ascend passes for A2/A3; returns the exit status."""
    compiler = shutil.which("bishengir-compile")
    if compiler is None:
        print("bishengir-compile: MISSING (is ascendnpu-ir's bin/ on PATH?)")
        sys.exit(1)
    run = subprocess.run(
        [
            compiler,
            linalg,
            f"--target={soc}",
            "--enable-hfusion-compile=true",
            "--enable-hivm-compile=true",
            "--enable-triton-kernel-compile=true",
            f"--save-temps={temps}",
            "-o",
            os.path.join(temps, "kernel"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    hivm = glob.glob(os.path.join(temps, "*.hivm*.mlir"))
    text = open(hivm[0]).read() if hivm else ""
    ops = len(re.findall(r"hivm\.hir\.\w+", text))
    entry = "func.func @dispatch_layout" in text or "@dispatch_layout" in text
    where = os.path.basename(hivm[0]) if hivm else "-"
    print(f"hivm: {'ok' if ops and entry else 'MISSING'} ({ops} hivm.hir ops in {where})")
    if run.returncode == 0:
        print("hivmc: ok (the kernel binary was built)")
    elif "Cannot find hivmc" in run.stderr or "External hivmc run fails" in run.stderr:
        print("hivmc: stopped as expected: CANN's hivmc is not installed")
    else:
        print(f"hivmc: not reached: {run.stderr.strip()[-800:]}")
        return 1
    return 0 if ops and entry else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernels", help="path of ascend_dualpath/ops/_layout_kernel.py")
    parser.add_argument("--soc", default="Ascend910B1", help="bishengir target (A2: Ascend910B1..B4)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        linalg = to_linalg(load_kernel(args.kernels), args.soc, os.path.join(work, "cache"))
        temps = os.path.join(work, "temps")
        os.makedirs(temps)
        return to_hivm(linalg, args.soc, temps)


if __name__ == "__main__":
    sys.exit(main())
