"""CUDA analogues: the tile table (anywhere) and the device-initiated copy with its ready flag (GPU only)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ascend_dualpath import errors
from ascend_dualpath.transport.cuda import element_bytes, tile_table


@given(k=st.integers(1, 20), extra=st.sampled_from([0, 16]), tile_kib=st.sampled_from([1, 4, 64]))
def test_tiles_are_exact_at_k_tiles_and_one_more_element(k, extra, tile_kib):
    tile = tile_kib * 1024
    n = k * tile + extra
    table = tile_table([0x1000], [0x900000], [n], 16, tile)
    assert table.shape == (k + (extra > 0), 3)
    assert (table[:, 2] * 16).sum() == n
    assert (table[:, 1] - table[:, 0] == 0x900000 - 0x1000).all()
    assert (np.diff(table[:, 0]) == tile).all()


@given(sizes=st.lists(st.integers(1, 300000), min_size=1, max_size=30))
def test_tiles_cover_every_byte_once(sizes):
    src = np.cumsum([0] + sizes[:-1]) + 7
    dst = src * 3
    table = tile_table(src, dst, sizes, 1, 4096)
    covered = np.zeros(sum(sizes) + 7, np.int64)
    for s, _, n in table:
        covered[s : s + n] += 1
    assert (covered[7:] == 1).all() and (covered[:7] == 0).all()


def test_element_width_and_alignment_errors():
    assert element_bytes([0x100], [0x200], [4096]) == 16
    assert element_bytes([0x104], [0x200], [4096]) == 4
    assert element_bytes([0x101], [0x200], [4096]) == 1
    with pytest.raises(errors.AlignmentError, match="segment 1 .* not 16-byte aligned"):
        tile_table([0, 8], [0, 0], [16, 16], 16)
    with pytest.raises(errors.EmptyTransfer, match="segment 0 has no bytes"):
        tile_table([0], [0], [0], 1)


@pytest.mark.cuda
@pytest.mark.parametrize("count,size", [(1, 1), (61, 42 * 1024), (300, 4096 + 16), (7, 3 * 65536 + 1)])
def test_device_initiated_copy_is_exact_and_flags_ready(count, size):
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from ascend_dualpath.transport.cuda import DeviceCopier

    dev = torch.device("cuda:0")
    src = torch.randint(0, 256, (count * size + 64,), dtype=torch.uint8, device=dev)
    dst = torch.full((count * size + 64,), 0xA5, dtype=torch.uint8, device=dev)
    flag = torch.zeros(1, dtype=torch.int64, device=dev)
    copier = DeviceCopier(dev, flag)
    copier.copy(
        [src.data_ptr() + i * size for i in range(count)],
        [dst.data_ptr() + 32 + i * size for i in range(count)],
        [size] * count,
        77,
    )
    torch.cuda.synchronize()
    assert int(flag.item()) == 77
    assert torch.equal(dst[32 : 32 + count * size], src[: count * size])
    assert (dst[:32] == 0xA5).all() and (dst[32 + count * size :] == 0xA5).all()


def test_device_copy_kernel_compiles_to_vectorized_ptx_with_a_system_scope_release_flag(monkeypatch):
    """Without a GPU: Triton compiles the kernel for sm_90; copies are 16-byte vectors and the flag is a release."""
    triton = pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # silences Triton 3.9's notice; the kernel has no floats
    from triton.backends.compiler import GPUTarget

    from ascend_dualpath.transport.cuda import _copy_kernel

    words, _ = _copy_kernel()
    signature = {
        "table": "*i64",
        "n_tiles": "i32",
        "counter": "*i32",
        "flag": "*i64",
        "flag_value": "i64",
        "TILE": "constexpr",
        "WORDS": "constexpr",
    }
    source = triton.compiler.ASTSource(fn=words, signature=signature, constexprs={"TILE": 16384, "WORDS": 4})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx
    assert "atom.global.sys.acq_rel.add" in ptx and "atom.global.sys.release.exch.b64" in ptx
    assert ptx.index("bar.sync") < ptx.index("atom.global.sys.acq_rel.add")  # every thread's stores first
