"""Each op equals, bit for bit, the Python path it replaced (frozen in tests/ops/replaced.py), on CPU; and the
library functions that now call the ops keep their results."""

from __future__ import annotations

import pytest
import torch

from ascend_dualpath import ops
from ascend_dualpath.integrations.vllm.layouts import AscendMlaAdapter, FlashAttnAdapter, MlaAdapter
from ascend_dualpath.kv.layout import KVLayout
from ascend_dualpath.moe import quant
from ascend_dualpath.moe.layout import compute_dispatch_layout
from ascend_dualpath.reference import moe as reference
from tests.ops import replaced
from tests.ops.samples import float_samples, topk_samples


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, dtype, shape and strides (float8 compared as bytes; an empty tensor's strides mean nothing)."""
    if a.dtype != b.dtype or a.shape != b.shape or (a.numel() and a.stride() != b.stride()):
        return False
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def random_floats(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-8, 4, 6)[seed % 6]
    x = torch.randn(1 + seed % 9, 512 * (1 + seed % 2), generator=g) * scale
    return [x, x.to(torch.bfloat16), x.to(torch.float16)]


@pytest.mark.parametrize("seed", range(8))
def test_dispatch_layout_matches_replaced_and_reference(seed):
    g = torch.Generator().manual_seed(seed)
    cases = topk_samples("cpu") + [(torch.randint(-1, 32, (1 + 13 * seed, 6), generator=g), 32, 8, 2)]
    for topk_idx, experts, ranks, per_node in cases:
        got = compute_dispatch_layout(topk_idx, experts, ranks, per_node)
        old = replaced.compute_dispatch_layout(topk_idx, experts, ranks, per_node)
        ref = reference.dispatch_layout(topk_idx, experts, ranks, per_node)
        for a, b, c in zip(got, old, ref, strict=True):
            assert (a is None) == (b is None) == (c is None)
            if a is not None:
                assert same(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("seed", range(6))
def test_quantisation_matches_replaced(seed):
    for x in random_floats(seed) + float_samples("cpu"):
        for round_scale, use_ue8m0 in ((False, False), (True, False), (True, True)):
            new = ops.fp8_quantize(x, round_scale, use_ue8m0)
            old = replaced.per_token_cast_to_fp8(x, round_scale, use_ue8m0)
            assert all(same(a, b) for a, b in zip(new, old, strict=True))
            assert all(
                same(a, b) for a, b in zip(quant.per_token_cast_to_fp8(x, round_scale, use_ue8m0), old, strict=True)
            )
            assert same(ops.fp8_dequantize(*new), replaced.per_token_cast_back(*old))
            assert same(quant.per_token_cast_back(*new), replaced.per_token_cast_back(*old))
        new8, old8 = ops.int8_quantize(x), replaced.per_token_cast_to_int8(x)
        assert all(same(a, b) for a, b in zip(new8, old8, strict=True))
        assert all(same(a, b) for a, b in zip(quant.per_token_cast_to_int8(x), old8, strict=True))
        assert same(ops.int8_dequantize(*new8), replaced.per_token_cast_back_int8(*old8))


def test_ue8m0_matches_replaced():
    g = torch.Generator().manual_seed(3)
    scales = (torch.randint(1, 255, (7, 16), generator=g, dtype=torch.int32) << 23).view(torch.float32)
    assert same(quant.pack_ue8m0(scales), replaced.pack_ue8m0(scales))
    packed = replaced.pack_ue8m0(scales)
    assert same(quant.unpack_ue8m0(packed), replaced.unpack_ue8m0(packed))
    with pytest.raises(Exception, match="power-of-two scales"):
        quant.pack_ue8m0(scales * 1.5)


LAYOUTS = [
    KVLayout.gqa(2, 2, 8, torch.bfloat16, block_tokens=4),
    KVLayout.gqa(1, 4, 16, torch.float32, block_tokens=4),
    KVLayout.mla(2, 576, torch.float16, block_tokens=4),
    KVLayout.mla_fp8(1, block_tokens=4),
]


def _fields(layout: KVLayout, leading: tuple[int, ...], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f.name: torch.randn(*leading, *f.shape, generator=g).to(f.dtype) for f in layout.fields}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.kind)
@pytest.mark.parametrize("leading", [(0,), (1,), (7,), (2, 3)])
def test_kv_encode_and_decode_match_replaced(layout, leading):
    fields = _fields(layout, leading, sum(leading))
    rows = layout.encode_rows(**fields)
    assert same(rows, replaced.encode_rows(layout, **fields))
    for field in layout.fields:
        decoded = ops.kv_decode_field(rows, field.offset, field.dtype, list(field.shape))
        assert same(decoded, layout.field_view(rows, field.name).contiguous())


def test_flash_attn_adapter_matches_replaced():
    g = torch.Generator().manual_seed(5)
    cache = torch.randn(6, 2, 4, 16, generator=g).to(torch.bfloat16)
    adapter = FlashAttnAdapter.from_cache(cache)
    blocks, offsets = torch.tensor([4, 4, 1, 0]), torch.tensor([3, 0, 2, 1])
    assert same(
        adapter._gather(cache, blocks, offsets).contiguous(),
        replaced.flash_attn_gather(cache, blocks, offsets).contiguous(),
    )
    typed = torch.randn(4, 2, 2, 8, generator=g).to(torch.bfloat16)
    old = cache.clone()
    replaced.flash_attn_scatter(old, blocks, offsets, typed)
    adapter._scatter(cache, blocks, offsets, typed)
    assert same(cache, old)


def test_mla_adapters_round_trip_exactly():
    g = torch.Generator().manual_seed(6)
    cache = torch.randn(4, 1, 8, 72, generator=g).to(torch.float16)
    adapter = MlaAdapter.from_cache(cache)
    table = [2, 0]
    rows = adapter.read_tokens(cache, table, 3, 12)
    assert same(
        rows,
        cache.squeeze(1)[torch.tensor([2] * 5 + [0] * 4), torch.tensor([3, 4, 5, 6, 7, 0, 1, 2, 3])]
        .contiguous()
        .view(torch.uint8),
    )
    nope, rope = torch.zeros(4, 8, 1, 64, dtype=torch.bfloat16), torch.zeros(4, 8, 1, 8, dtype=torch.bfloat16)
    ascend = AscendMlaAdapter.from_cache((nope, rope))
    latent = torch.randn(5, 72, generator=g).to(torch.bfloat16)
    ascend.write_tokens((nope, rope), [3, 1], 6, latent.view(torch.uint8))
    assert same(ascend.read_tokens((nope, rope), [3, 1], 6, 11), latent.view(torch.uint8))
    assert int((nope != 0).sum()) + int((rope != 0).sum()) == int((latent != 0).sum())
