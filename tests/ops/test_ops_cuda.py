"""The CUDA kernels of the ops: opcheck on CUDA samples and bit-exact agreement with the CPU kernels (skipped
without a CUDA GPU and Triton, as tests/conftest.py's ``cuda_torch`` does). tools/gpu_check_ops.py runs the same
checks as a script and records the run."""

from __future__ import annotations

import pytest

from tests.conftest import cuda_torch
from tests.ops.samples import samples

pytestmark = pytest.mark.cuda

STATELESS = sorted(samples("cpu").keys() - {"hccl_stage"})


@pytest.mark.parametrize("name", STATELESS)
def test_cuda_kernel_passes_opcheck_and_matches_cpu(name):
    cuda_torch()
    from tools.gpu_check_ops import check_sample

    for index, (cpu_args, gpu_args) in enumerate(zip(samples("cpu")[name], samples("cuda")[name], strict=True)):
        assert check_sample(name, cpu_args, gpu_args) == ("ok", "ok"), f"sample {index}"


def test_launchers_have_no_cuda_kernel():
    torch = cuda_torch()
    for name in ("hccl_stage", "aiv_post_wqe"):
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(f"ascend_dualpath::{name}", "CUDA")
