"""The NPU host code compiles against the real torch_npu headers (no CANN needed; nothing is linked or run).

Headers come from ``$ADP_TORCH_NPU_INCLUDE`` where set, else from the cache that ``tools/fetch_torch_npu_headers.sh``
fills from PyPI before the tests (``$ADP_TORCH_NPU_CACHE``, else ``.cache/torch_npu`` in the repository; the wheel
is unzipped, never installed). The tests download nothing and skip without the headers.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORWARDED = ("ADP_TORCH_NPU_INCLUDE", "ADP_TORCH_NPU_VERSION", "ADP_TORCH_NPU_CACHE", "HOME")
# a call with the wrong arity into ACL: what the check exists to catch
PLANTED = """#include "acl/acl.h"
void adp_planted() { aclrtRecordEvent(nullptr); }
"""


def _check(extra_env=None):
    env = {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
    env.update({k: os.environ[k] for k in FORWARDED if k in os.environ})
    env.update(extra_env or {})
    out = subprocess.run(
        ["bash", str(ROOT / "tools/check_npu_host_compile.sh")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    if out.returncode == 2 and "fetch_torch_npu_headers.sh" in out.stderr:
        pytest.skip(out.stderr.strip()[-200:])
    return out


@pytest.mark.slow
def test_npu_host_code_compiles_against_torch_npu_headers():
    out = _check()
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    assert "ok: csrc/npu/transfer_npu.cpp" in out.stdout


@pytest.mark.slow
def test_the_check_fails_on_a_planted_error(tmp_path):
    planted = tmp_path / "planted.cpp"
    planted.write_text(PLANTED)
    out = _check({"ADP_NPU_HOST_SOURCES": str(planted)})
    assert out.returncode != 0 and "aclrtRecordEvent" in out.stderr, out.stdout + out.stderr[-2000:]
