"""The NPU host code compiles against the real torch_npu headers (no CANN needed; nothing is linked or run).

The headers come from ``tools/fetch_torch_npu_headers.sh`` (a download from PyPI, run before the tests, e.g. in CI);
this test only uses them, and skips when they were not fetched. Where they are: ``$ADP_TORCH_NPU_CACHE``, else
``.cache/torch_npu`` in the repository.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _headers() -> Path:
    import torch

    cache = Path(os.environ.get("ADP_TORCH_NPU_CACHE", ROOT / ".cache" / "torch_npu"))
    return cache / torch.__version__.split("+")[0] / "torch_npu" / "include"


@pytest.mark.slow
def test_npu_host_code_compiles_against_torch_npu_headers():
    include = _headers()
    if not include.is_dir():
        pytest.skip(f"no torch_npu headers at {include}: run tools/fetch_torch_npu_headers.sh first")
    cache = include.parents[2]  # <cache>/<torch version>/torch_npu/include
    out = subprocess.run(["bash", str(ROOT / "tools/check_npu_host_compile.sh"), str(cache)], capture_output=True,
                         text=True, timeout=600, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert "ok: csrc/npu/" in out.stdout
