"""``import ascend_dualpath`` registers no op; ``import ascend_dualpath.ops`` registers them all yet loads no
extension, imports neither Triton nor torch_npu and touches no device."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import ascend_dualpath
assert "ascend_dualpath.ops" not in sys.modules and "torch" not in sys.modules
import torch
assert not torch._C._dispatch_has_kernel("ascend_dualpath::dispatch_layout")
from ascend_dualpath import ops
assert torch._C._dispatch_has_kernel_for_dispatch_key("ascend_dualpath::dispatch_layout", "CPU")
for name in ("ascend_dualpath._C", "triton", "torch_npu"):
    assert name not in sys.modules, name
assert not torch.cuda.is_initialized()
print("lean")
"""


def test_ops_import_is_lean():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "lean"
