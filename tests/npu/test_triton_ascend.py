"""The MoE ``dispatch_layout`` Triton kernel lowers for Ascend (triton-ascend + ascendnpu-ir) up to CANN's hivmc.

Skips unless a Python with triton-ascend 3.2.0 and ascendnpu-ir 1.2.0 is found (``$ADP_TRITON_ASCEND_PYTHON``, or
the repo-local venv ``tools/check_triton_ascend.sh --setup`` makes). Nothing is compiled to a binary or run: the
last step, ``hivmc``, ships with CANN only.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SKIP = 3  # the script's exit status when the packages are missing


@pytest.mark.slow
def test_dispatch_layout_lowers_through_hfusion_hivm_to_hivmc():
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    if "ADP_TRITON_ASCEND_PYTHON" in os.environ:
        env["ADP_TRITON_ASCEND_PYTHON"] = os.environ["ADP_TRITON_ASCEND_PYTHON"]
    out = subprocess.run(
        ["bash", str(ROOT / "tools/check_triton_ascend.sh")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    if out.returncode == SKIP:
        pytest.skip(out.stderr.strip())
    report = out.stdout + out.stderr[-3000:]
    assert out.returncode == 0, report
    for stage in ("ttir: ok", "ttadapter: ok", "hivm: ok"):
        assert stage in out.stdout, report
    assert "hivmc: stopped as expected" in out.stdout or "hivmc: ok" in out.stdout, report


def test_the_lowering_script_loads_without_triton():
    """The driver script itself imports nothing outside the standard library at module level."""
    code = (
        f"import importlib.util, sys; spec = importlib.util.spec_from_file_location('m', "
        f"{str(ROOT / 'tools/triton_ascend_lower.py')!r}); m = importlib.util.module_from_spec(spec); "
        f"spec.loader.exec_module(m); assert 'triton' not in sys.modules; print(sorted(m.CONSTANTS))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "BLOCK_T" in out.stdout, out.stderr
