"""``torch.library.opcheck`` on every ``ascend_dualpath`` op: schema (mutation annotations), fake kernel, AOT
dispatch with dynamic shapes, over several samples each, edge shapes included."""

from __future__ import annotations

import pytest
import torch

from ascend_dualpath import ops
from ascend_dualpath.errors import NotRegistered
from tests.ops.samples import has_float8, samples

ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# torch's schema check compares inputs before/after with allclose, which float8 lacks; the no-mutation property
# of those samples is checked byte for byte in test_float8_inputs_are_not_mutated instead.
FLOAT8_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

CPU_SAMPLES = samples("cpu")
CASES = [(name, i) for name, cases in CPU_SAMPLES.items() for i in range(len(cases))]


def opcheck(name: str, args: tuple) -> None:
    op = getattr(torch.ops.ascend_dualpath, name).default
    torch.library.opcheck(op, args, test_utils=FLOAT8_UTILS if has_float8(args) else ALL_UTILS)


@pytest.mark.parametrize(("name", "index"), CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_opcheck(name, index):
    opcheck(name, CPU_SAMPLES[name][index])


def test_every_stateless_op_has_samples():
    """The ``moe_*`` ops and ``aiv_post_wqe`` need a rig (a Buffer, emulated queue pairs): their opcheck runs
    in test_moe_buffer_ops.py and test_aiv_post_wqe.py."""
    moe_ops = {op.name for op in ops.OPS if op.name.startswith("moe_")}
    assert {op.name for op in ops.OPS} - set(CPU_SAMPLES) - moe_ops == {"aiv_post_wqe"}
    assert all(len(cases) >= 3 for cases in CPU_SAMPLES.values())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("name", ["fp8_dequantize", "kv_encode_rows", "kv_decode_field"])
def test_float8_inputs_are_not_mutated(name):
    for args in CPU_SAMPLES[name]:
        flat = [a for arg in args for a in (arg if isinstance(arg, list) else [arg]) if isinstance(a, torch.Tensor)]
        before = [_bytes(a).clone() for a in flat]
        getattr(torch.ops.ascend_dualpath, name)(*args)
        assert all(torch.equal(_bytes(a), b) for a, b in zip(flat, before, strict=True))


def test_mutated_arguments_are_annotated():
    """Exactly the written tensors carry ``(a!)``: the cache, the staging window, the core status."""
    written = {}
    for op in ops.OPS:
        schema = getattr(torch.ops.ascend_dualpath, op.name).default._schema
        written[op.name] = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert {k: v for k, v in written.items() if v} == {
        "kv_scatter_tokens": ["cache"],
        "hccl_stage": ["window"],
        "aiv_post_wqe": ["status"],
    }


def test_aiv_post_wqe_fake_and_unrecorded_queues():
    """The fake kernel traces (no output, status written in place); the CPU kernel refuses queues that name no
    recorded queue pair (all-zero addresses here), moving nothing."""
    args = (
        torch.zeros(64, dtype=torch.uint8),
        torch.zeros(128, dtype=torch.uint8),
        torch.zeros(32, dtype=torch.uint8),
        ops.aiv_post_tiling(2, 1, 1.0),
        2,
    )
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        assert torch.ops.ascend_dualpath.aiv_post_wqe(*fake_args) is None
    with pytest.raises(NotRegistered, match=r"queue 0 \(sq_addr 0x0\) matches no live queue pair"):
        ops.aiv_post_wqe(*args)
    assert not args[2].any()


def test_hccl_stage_copies_exactly_total_bytes():
    source, window, tiling, _ = samples("cpu")["hccl_stage"][0]
    before = window.clone()
    ops.hccl_stage(source, window, tiling, 4)
    from ascend_dualpath.ops.npu import stage_total_bytes

    total = stage_total_bytes(tiling)
    expected = torch.arange(256, dtype=torch.int32).view(torch.uint8)[:total]
    assert torch.equal(window[:total], expected)
    assert torch.equal(window[total:], before[total:])


def test_hccl_stage_rejects_a_short_window():
    from ascend_dualpath.errors import BoundsError
    from tests.ops.samples import stage_tiling

    source = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(BoundsError, match="total_bytes=64 exceeds the window's 32 bytes"):
        ops.hccl_stage(source.data_ptr(), torch.zeros(32, dtype=torch.uint8), stage_tiling(64), 1)


def test_dispatch_keys_per_op():
    """CPU and a fake everywhere; CUDA for all but the NPU launchers; PrivateUse1 only where torch_npu is."""
    import importlib.util

    with_npu = importlib.util.find_spec("torch_npu") is not None
    for op in ops.OPS:
        qualname = f"ascend_dualpath::{op.name}"
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        assert has(qualname, "CPU")
        assert has(qualname, "CUDA") == (op.name not in ("hccl_stage", "aiv_post_wqe"))
        assert has(qualname, "PrivateUse1") == with_npu
        assert torch._library.simple_registry.singleton.find(qualname).fake_impl.kernel is not None
