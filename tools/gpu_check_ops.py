"""GPU check of the ``ascend_dualpath`` ops' CUDA kernels: opcheck on CUDA samples, then bit-exact agreement of
every CUDA kernel with the CPU kernel on the same inputs (outputs, their strides, and in-place writes).

Run from the repository root on a machine with a CUDA GPU (and Triton, for the layout kernel)::

    python3 tools/gpu_check_ops.py

Prints one line per op and writes ``$OUT/gpu_check_ops.json`` when ``OUT`` is set. Exit status 0 when every
check passed, 1 otherwise, 2 when there is no GPU. The ``moe_*`` ops are not covered (they need a multi-rank
CUDA ``Buffer``; tests/moe covers the Buffer itself on GPUs).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.ops.samples

import torch  # noqa: E402

from ascend_dualpath import ops  # noqa: E402
from ascend_dualpath.ops import cuda as cuda_kernels  # noqa: E402
from tests.ops.samples import has_float8, samples  # noqa: E402

ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
FLOAT8_UTILS = ALL_UTILS[1:]  # torch's schema check has no float8 allclose


def _flat(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _flat(item)]
    return []


def _clone(value):
    """``value`` with every tensor in it (nested in lists and tuples) cloned; other items as they are."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list | tuple):
        return type(value)(_clone(item) for item in value)
    return value


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _same(cpu: torch.Tensor, gpu: torch.Tensor) -> bool:
    if cpu.dtype != gpu.dtype or cpu.shape != gpu.shape or (cpu.numel() and cpu.stride() != gpu.stride()):
        return False
    return torch.equal(_bits(cpu), _bits(gpu.cpu()))


def check_sample(name: str, cpu_args: tuple, gpu_args: tuple) -> tuple[str, str]:
    """(opcheck result, bit-exact result) of one sample: "ok" or the first failure."""
    op = getattr(torch.ops.ascend_dualpath, name).default
    try:
        torch.library.opcheck(op, _clone(gpu_args), test_utils=FLOAT8_UTILS if has_float8(gpu_args) else ALL_UTILS)
        opcheck = "ok"
    except Exception as exc:  # reported, not raised: the table shows every op
        opcheck = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    cpu_args, gpu_args = _clone(cpu_args), _clone(gpu_args)
    want, have = op(*cpu_args), op(*gpu_args)
    torch.cuda.synchronize()
    pairs = list(zip(_flat(want), _flat(have), strict=True)) + list(zip(_flat(cpu_args), _flat(gpu_args), strict=True))
    bad = [i for i, (w, h) in enumerate(pairs) if not _same(w, h)]
    return opcheck, "ok" if not bad else f"tensors {bad} differ (outputs first, then arguments after the call)"


def check_op(name: str, cpu_cases: list, gpu_cases: list) -> tuple[dict, bool]:
    """(report entry, failed) of every sample of one op; prints the op's line and each failing sample."""
    results = [check_sample(name, c, g) for c, g in zip(cpu_cases, gpu_cases, strict=True)]
    kernel = "triton" if name == "dispatch_layout" and cuda_kernels.has_triton() else "torch"
    ok_check = sum(r[0] == "ok" for r in results)
    ok_exact = sum(r[1] == "ok" for r in results)
    failed = ok_check < len(results) or ok_exact < len(results)
    print(f"{name:<20} {kernel:<12} {len(results):>7}  {ok_check:>3}/{len(results):<3}  {ok_exact:>3}/{len(results)}")
    for index, (check, exact) in enumerate(results):
        for what, value in (("opcheck", check), ("bit-exact", exact)):
            if value != "ok":
                print(f"    sample {index} {what}: {value}")
    return {"kernel": kernel, "samples": [{"opcheck": c, "bit_exact": e} for c, e in results]}, failed


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing checked")
        return 2
    cpu_samples, gpu_samples = samples("cpu"), samples("cuda")
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": cuda_kernels.has_triton(),
        "registered": [op.name for op in ops.OPS],
        "ops": {},
    }
    print(f"{'op':<20} {'kernel':<12} {'samples':>7}  opcheck  bit-exact")
    failed = False
    for name, gpu_cases in gpu_samples.items():
        report["ops"][name], op_failed = check_op(name, cpu_samples[name], gpu_cases)
        failed |= op_failed
    report["passed"] = not failed
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_check_ops.json").write_text(json.dumps(report, indent=2))
    print("PASS" if not failed else "FAIL")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
