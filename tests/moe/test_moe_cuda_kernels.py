"""The ``cuda`` strategy's Triton kernels on the CPU, under the Triton interpreter (see cuda_kernel_harness)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HARNESS_TIMEOUT_S = 240


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (interpreter mode)")
@pytest.mark.parametrize("world", [2, 3, 4])
def test_kernels_under_the_triton_interpreter(world: int) -> None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    done = subprocess.run(
        [sys.executable, "-m", "tests.moe.cuda_kernel_harness", str(world)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=HARNESS_TIMEOUT_S,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-3000:] + done.stderr[-3000:]
