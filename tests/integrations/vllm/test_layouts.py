"""Paged-KV layout adapters: bit-exact round trips, untouched bytes, and vLLM's own cache writers as reference.

The pure-torch tests need no vLLM. The tests marked ``vllm`` import it (skipped without it) and prove the
adapters against vLLM itself: the CPU backend's C++ ``cpu_attn_reshape_and_cache`` for every ISA, the CPU MLA
backend's ``do_kv_cache_update``, and caches cut by vLLM's ``create_kv_cache_views`` in each physical layout.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dualpath.errors import BoundsError, ConfigError
from ascend_dualpath.integrations.vllm.layouts import (
    CPU_ISAS,
    AscendAttnAdapter,
    AscendMlaAdapter,
    CpuAttnAdapter,
    FlashAttnAdapter,
    MlaAdapter,
    adapter_for,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def random_bytes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)


def random_values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Finite random values (vLLM's CPU op converts through float registers, so no NaN payloads)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A cache full of random bytes: every byte a write must leave alone has a known value."""
    itemsize = dtype.itemsize
    raw = random_bytes((*shape[:-1], shape[-1] * itemsize), seed)
    return raw.view(dtype)


def as_bytes(cache) -> torch.Tensor:
    parts = cache if isinstance(cache, tuple) else (cache,)
    return torch.cat([part.contiguous().view(torch.uint8).reshape(-1) for part in parts])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (random bytes make NaNs, which ``torch.equal`` calls unequal to themselves)."""
    return a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def clone(cache):
    return tuple(part.clone() for part in cache) if isinstance(cache, tuple) else cache.clone()


@st.composite
def requests(draw, num_blocks: int, block_size: int):
    """A block table (distinct ids in any order) and a token range that need not be block-aligned."""
    length = draw(st.integers(1, num_blocks))
    table = draw(st.permutations(range(num_blocks)))[:length]
    start = draw(st.integers(0, length * block_size - 1))
    end = draw(st.integers(start, length * block_size))
    return table, start, end


# -- a per-token reference writer for each backend (plain indexing, one token at a time) ---------------------
def reference_write(adapter, cache, table, start, typed) -> None:
    """Write typed rows ``[n, *row_shape]`` token by token, the way each backend's layout is documented."""
    for i in range(typed.shape[0]):
        block, offset = divmod(start + i, adapter.block_size)
        block = table[block]
        if isinstance(adapter, FlashAttnAdapter):
            head_size = adapter.row_shape[2]
            cache[block, :, offset, :head_size] = typed[i, 0]
            cache[block, :, offset, head_size:] = typed[i, 1]
        elif isinstance(adapter, MlaAdapter):
            (cache.squeeze(1) if cache.dim() == 4 else cache)[block, offset] = typed[i]
        elif isinstance(adapter, AscendAttnAdapter):
            cache[0][block, offset] = typed[i, 0]
            cache[1][block, offset] = typed[i, 1]
        elif isinstance(adapter, AscendMlaAdapter):
            cache[0][block, offset, 0] = typed[i, : adapter.nope_dim]
            cache[1][block, offset, 0] = typed[i, adapter.nope_dim :]
        else:
            raise AssertionError(f"no reference writer for {type(adapter).__name__}")


@st.composite
def caches(draw):
    """(backend name, one layer's poisoned cache, seed) for every backend but CPU_ATTN (tested against vLLM)."""
    backend = draw(st.sampled_from(["FLASH_ATTN", "FLASH_ATTN_NHD", "MLA", "MLA_3D", "CUSTOM", "ASCEND_MLA"]))
    dtype = draw(st.sampled_from(DTYPES))
    num_blocks = draw(st.integers(1, 5))
    block_size = draw(st.sampled_from([1, 3, 16]))
    heads = draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([1, 4, 8]))
    seed = draw(st.integers(0, 2**31))
    if backend == "FLASH_ATTN":  # HND: physical order equals the logical view
        return "FLASH_ATTN", poisoned((num_blocks, heads, block_size, 2 * head_dim), dtype, seed)
    if backend == "FLASH_ATTN_NHD":  # NHD: physical [B, N, H, 2D], logical view permuted (not contiguous)
        physical = poisoned((num_blocks, block_size, heads, 2 * head_dim), dtype, seed)
        return "FLASH_ATTN", physical.permute(0, 2, 1, 3)
    if backend == "MLA":
        return "CPU_MLA", poisoned((num_blocks, 1, block_size, 8 * head_dim), dtype, seed)
    if backend == "MLA_3D":
        return "FLASHMLA", poisoned((num_blocks, block_size, 8 * head_dim), dtype, seed)
    if backend == "CUSTOM":
        shape = (num_blocks, block_size, heads, head_dim)
        return "CUSTOM", (poisoned(shape, dtype, seed), poisoned(shape, dtype, seed + 1))
    nope = poisoned((num_blocks, block_size, 1, 8 * head_dim), dtype, seed)
    return "ASCEND_MLA", (nope, poisoned((num_blocks, block_size, 1, head_dim), dtype, seed + 1))


@settings(max_examples=150)
@given(case=caches(), data=st.data())
def test_write_then_read_is_bit_exact_and_touches_only_the_written_tokens(case, data):
    backend, cache = case
    adapter = adapter_for(backend, cache)
    table, start, end = data.draw(requests(adapter.num_blocks, adapter.block_size))
    rows = random_bytes((end - start, adapter.token_bytes), data.draw(st.integers(0, 2**31)))
    before = clone(cache)

    adapter.write_tokens(cache, table, start, rows)

    assert torch.equal(adapter.read_tokens(cache, table, start, end), rows)
    # The reference writer, one token at a time into the untouched copy, gives the same bytes everywhere:
    # right placement, and no byte outside the written tokens changed.
    typed = adapter.kv_layout(1).field_view(rows, adapter.kv_layout(1).fields[0].name)
    reference_write(adapter, before, table, start, typed)
    assert torch.equal(as_bytes(cache), as_bytes(before))


@settings(max_examples=60)
@given(case=caches(), data=st.data())
def test_read_returns_what_the_reference_wrote(case, data):
    backend, cache = case
    adapter = adapter_for(backend, cache)
    table, start, end = data.draw(requests(adapter.num_blocks, adapter.block_size))
    rows = random_bytes((end - start, adapter.token_bytes), data.draw(st.integers(0, 2**31)))
    layout = adapter.kv_layout(1)
    reference_write(adapter, cache, table, start, layout.field_view(rows, layout.fields[0].name))
    assert torch.equal(adapter.read_tokens(cache, table, start, end), rows)


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_round_trip_leaves_other_tokens_alone(isa, dtype):
    num_blocks, heads, block_size, head_dim = 5, 2, 32, 64
    cache = poisoned((num_blocks, heads, block_size, 2 * head_dim), dtype, seed=7)
    adapter = adapter_for("CPU_ATTN", cache, isa=isa)
    table = [4, 1, 3]
    everything = [0, 1, 2, 3, 4]
    before = adapter.read_tokens(cache, everything, 0, num_blocks * block_size)
    before_bytes = as_bytes(cache)
    rows = random_bytes((45, adapter.token_bytes), seed=8)

    adapter.write_tokens(cache, table, 13, rows)  # tokens [13, 58): the tail of block 4 and most of block 1

    assert torch.equal(adapter.read_tokens(cache, table, 13, 58), rows)
    after = adapter.read_tokens(cache, everything, 0, num_blocks * block_size)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for t in range(13, 58):
        written[table[t // block_size] * block_size + t % block_size] = True
    assert torch.equal(after[~written], before[~written])
    # The positions are a bijection of the page: the byte count changed is at most the written rows' bytes.
    changed = (as_bytes(cache) != before_bytes).sum().item()
    assert changed <= rows.numel()


def test_kv_layouts_match_the_cache_geometry():
    cpu = adapter_for("CPU_ATTN", torch.zeros(3, 4, 32, 2 * 64, dtype=torch.bfloat16), isa="vec")
    layout = cpu.kv_layout(28)
    assert (layout.kind, layout.num_layers, layout.block_tokens) == ("gqa", 28, 32)
    assert layout.fields[0].shape == (2, 4, 64) and layout.fields[0].dtype == torch.bfloat16
    assert cpu.token_bytes == 2 * 4 * 64 * 2
    mla = adapter_for("CPU_MLA", torch.zeros(3, 1, 16, 576, dtype=torch.bfloat16))
    assert mla.kv_layout(61).fields[0].name == "latent" and mla.token_bytes == 576 * 2 and mla.block_size == 16
    ascend = adapter_for("ASCEND_MLA", (torch.zeros(2, 128, 1, 512), torch.zeros(2, 128, 1, 64)))
    assert ascend.kv_layout(1).fields[0].shape == (576,) and ascend.block_size == 128
    pair = adapter_for("CUSTOM", (torch.zeros(2, 128, 8, 128, dtype=torch.float16),) * 2)
    assert pair.kv_layout(1).fields[0].shape == (2, 8, 128)


def test_rows_may_be_a_strided_slice():
    cache = torch.zeros(2, 2, 3, 8, dtype=torch.float16)
    adapter = adapter_for("FLASH_ATTN", cache)
    wide = random_bytes((4, 2 * adapter.token_bytes), seed=3)
    adapter.write_tokens(cache, [1, 0], 1, wide[:, : adapter.token_bytes])
    assert torch.equal(adapter.read_tokens(cache, [1, 0], 1, 5), wide[:, : adapter.token_bytes])


# -- refusals -------------------------------------------------------------------------------------------------
def test_unknown_backend_is_refused_with_the_known_names():
    with pytest.raises(ConfigError, match="'XFORMERS'.*CPU_ATTN"):
        adapter_for("XFORMERS", torch.zeros(1, 1, 32, 64))


@pytest.mark.parametrize(
    ("backend", "cache", "options", "match"),
    [
        ("CPU_ATTN", torch.zeros(2, 32, 64), {"isa": "vec"}, r"\[num_blocks, kv_heads, block_size, 2 \* head_size\]"),
        ("CPU_ATTN", torch.zeros(2, 1, 32, 64, dtype=torch.int8), {"isa": "vec"}, "dtype must be one of"),
        ("CPU_ATTN", torch.zeros(2, 1, 32, 63), {"isa": "vec"}, "even"),
        ("CPU_ATTN", torch.zeros(2, 1, 32, 64), {"isa": "neon"}, "isa must be one of"),
        ("CPU_ATTN", torch.zeros(2, 1, 16, 64, dtype=torch.bfloat16), {"isa": "amx"}, "block_size % 32"),
        ("CPU_ATTN", torch.zeros(2, 1, 64, 32).transpose(2, 3), {"isa": "vec"}, "dense"),
        ("CPU_ATTN", (torch.zeros(2, 1, 32, 64),), {"isa": "vec"}, "one tensor"),
        ("FLASH_ATTN", torch.zeros(2, 2, 1, 32, 8), {}, "4 dims"),
        ("CPU_MLA", torch.zeros(2, 2, 16, 576), {}, "1 head slot"),
        ("CUSTOM", torch.zeros(2, 16, 1, 64), {}, r"\(k_cache, v_cache\) pair"),
        ("CUSTOM", (torch.zeros(2, 16, 1, 64), torch.zeros(2, 16, 1, 32)), {}, "must match k_cache"),
        ("ASCEND_MLA", (torch.zeros(2, 16, 1, 512), torch.zeros(2, 8, 1, 64)), {}, "must share"),
    ],
)
def test_caches_that_do_not_match_the_backend_are_refused(backend, cache, options, match):
    with pytest.raises(ConfigError, match=match):
        adapter_for(backend, cache, **options)


def test_bad_block_tables_ranges_and_rows_are_refused():
    cache = torch.zeros(3, 2, 4, 8)
    adapter = adapter_for("FLASH_ATTN", cache)
    with pytest.raises(BoundsError, match=r"block id 3 out of range \[0, 3\)"):
        adapter.read_tokens(cache, [0, 3], 0, 5)
    with pytest.raises(BoundsError, match=r"token range \[2, 9\) must lie in \[0, 8\)"):
        adapter.read_tokens(cache, [0, 1], 2, 9)
    with pytest.raises(ConfigError, match="repeats a block id"):
        adapter.read_tokens(cache, [1, 1], 0, 8)
    with pytest.raises(ConfigError, match=r"rows must be uint8 \[n, 64\]"):
        adapter.write_tokens(cache, [0], 0, torch.zeros(2, 63, dtype=torch.uint8))
    with pytest.raises(ConfigError, match="like the cache this adapter was built from"):
        adapter.read_tokens(torch.zeros(3, 2, 4, 8, dtype=torch.float16), [0], 0, 1)
    assert adapter.read_tokens(cache, [2], 4, 4).shape == (0, 64)  # an empty range is fine


# -- against vLLM itself ----------------------------------------------------------------------------------------
@st.composite
def cpu_geometries(draw):
    # vLLM's op runs the AMX layout only where the CPU has AMX tiles ("Unsupported CPU attention configuration"
    # elsewhere); the adapter's AMX layout still round-trips bit-exact in the tests above
    isas = [isa for isa in CPU_ISAS if isa != "amx" or torch.cpu._is_amx_tile_supported()]
    isa = draw(st.sampled_from(isas))
    dtype = draw(st.sampled_from(DTYPES))
    head_dims = [32, 64, 80] if isa == "vec16" else [32, 64, 128]
    return isa, dtype, draw(st.integers(1, 4)), draw(st.sampled_from([32, 64])), draw(st.sampled_from(head_dims))


@settings(max_examples=60)
@given(geometry=cpu_geometries(), data=st.data())
def test_cpu_adapter_matches_vllms_cpu_cache_write_op(geometry, data):
    """vLLM's ``cpu_attn_reshape_and_cache`` (the op CPU_ATTN's ``do_kv_cache_update`` calls) writes K/V of
    tokens at their slots; the adapter must read those K/V back and, writing the same rows into an equally
    poisoned cache, produce the same bytes everywhere."""
    pytest.importorskip("vllm")
    from vllm import _custom_ops as ops

    isa, dtype, heads, block_size, head_dim = geometry
    num_blocks = 4
    seed = data.draw(st.integers(0, 2**31))
    cache = poisoned((num_blocks, heads, block_size, 2 * head_dim), dtype, seed)
    ours = cache.clone()
    adapter = CpuAttnAdapter.from_cache(cache, isa=isa)
    table, start, end = data.draw(requests(num_blocks, block_size))
    key = random_values((end - start, heads, head_dim), dtype, seed + 1)
    value = random_values((end - start, heads, head_dim), dtype, seed + 2)
    positions = torch.arange(start, end)
    slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size

    # Exactly the views CPUAttentionBackendImpl.do_kv_cache_update builds before calling the op.
    key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    rows = adapter.kv_layout(1).encode_rows(kv=torch.stack((key, value), dim=1))
    assert torch.equal(adapter.read_tokens(cache, table, start, end), rows)
    adapter.write_tokens(ours, table, start, rows)
    assert torch.equal(as_bytes(ours), as_bytes(cache))


def test_cpu_isas_are_the_ones_vllm_picks():
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa

    assert CPUAttentionBackend.get_name() in CpuAttnAdapter.backend_names
    for dtype in DTYPES:
        for head_size in (64, 80, 128):
            isa = _get_attn_isa(dtype, 32, head_size, "auto")
            adapter_for("CPU_ATTN", torch.zeros(2, 1, 32, 2 * head_size, dtype=dtype), isa=isa)
            assert isa in CPU_ISAS


@pytest.mark.parametrize("dtype", DTYPES)
def test_mla_adapter_matches_vllms_cpu_mla_cache_update(dtype):
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

    assert CPUMLABackend.get_name() in MlaAdapter.backend_names
    num_blocks, block_size, rank, rope = 4, 16, 512, 64
    cache = poisoned((num_blocks, 1, block_size, rank + rope), dtype, seed=11)
    ours = cache.clone()
    table, start, end = [2, 0, 3], 5, 40
    kv_c = random_values((end - start, rank), dtype, 12)
    k_pe = random_values((end - start, 1, rope), dtype, 13)
    positions = torch.arange(start, end)
    slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
    # The update is pure torch and reads nothing from the instance; the MLA layer binds the squeezed view.
    impl = object.__new__(CPUMLAImpl)
    impl.do_kv_cache_update(kv_c, k_pe, cache.squeeze(1), slots, "auto", torch.ones(()))

    adapter = adapter_for("CPU_MLA", cache)
    rows = adapter.kv_layout(1).encode_rows(latent=torch.cat((kv_c, k_pe.squeeze(1)), dim=-1))
    assert torch.equal(adapter.read_tokens(cache, table, start, end), rows)
    adapter.write_tokens(ours, table, start, rows)
    assert torch.equal(as_bytes(ours), as_bytes(cache))


@pytest.mark.parametrize("layout_name", ["LBNHC", "LBHNC", "BLNHC", "BLHNC"])
def test_flash_adapter_on_caches_cut_by_vllm_in_each_layout(layout_name):
    """Per-layer views exactly as vLLM's allocator makes them (two layers sharing one buffer); the adapter
    addresses the logical view, and the K/V views flash-attn splits off see what the adapter wrote."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheLayout,
        KVCacheTensor,
        create_kv_cache_views,
    )

    assert FlashAttentionBackend.get_name() in FlashAttnAdapter.backend_names
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    num_blocks, layout = 5, KVCacheLayout[layout_name]
    raw = random_bytes((2 * num_blocks * spec.page_size_bytes,), seed=21).view(torch.int8)
    if layout.is_layer_compact:
        layer_stride, block_stride = num_blocks * spec.page_size_bytes, spec.page_size_bytes
    else:
        layer_stride, block_stride = spec.page_size_bytes, 2 * spec.page_size_bytes
    tensor = KVCacheTensor(
        size=raw.numel(),
        layers=["l0", "l1"],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    views = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    before = raw.clone()
    adapter = adapter_for("FLASH_ATTN", views[1])
    table, start = [3, 1, 4], 7
    rows = random_bytes((30, adapter.token_bytes), seed=22)

    adapter.write_tokens(views[1], table, start, rows)

    assert torch.equal(adapter.read_tokens(views[1], table, start, start + 30), rows)
    key_cache, value_cache = views[1].transpose(1, 2).split(spec.head_size, dim=-1)  # FlashAttentionImpl's split
    kv = adapter.kv_layout(1).field_view(rows, "kv")
    for i in range(30):
        block, offset = table[(start + i) // 16], (start + i) % 16
        assert same_bits(key_cache[block, offset], kv[i, 0]) and same_bits(value_cache[block, offset], kv[i, 1])
    assert (raw != before).sum().item() <= rows.numel()
    untouched = create_kv_cache_views(before, spec, num_blocks, layout, tensor)[0]
    everything = list(range(num_blocks))
    reader = adapter_for("FLASH_ATTN", views[0])
    assert torch.equal(
        reader.read_tokens(views[0], everything, 0, 80), reader.read_tokens(untouched, everything, 0, 80)
    )


def test_cpu_adapter_on_the_cache_vllm_allocates_for_the_cpu_backend():
    """The per-layer view vLLM's allocator hands the CPU backend (LBHNC, two layers in one buffer), written by
    vLLM's op through the backend's own views, read back by the adapter; the other layer is untouched."""
    pytest.importorskip("vllm")
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views

    (layout,) = CPUAttentionBackend.supported_kv_cache_layouts()
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    num_blocks = 4
    raw = random_bytes((2 * num_blocks * spec.page_size_bytes,), seed=31).view(torch.int8)
    tensor = KVCacheTensor(
        size=raw.numel(),
        layers=["l0", "l1"],
        layer_stride=num_blocks * spec.page_size_bytes,
        block_stride=spec.page_size_bytes,
    )
    views = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    before = raw.clone()
    isa = _get_attn_isa(torch.bfloat16, 32, 64, "auto")
    adapter = adapter_for(CPUAttentionBackend.get_name(), views[1], isa=isa)
    table, start, end = [2, 0, 3], 20, 90
    key = random_values((end - start, 2, 64), torch.bfloat16, 32)
    value = random_values((end - start, 2, 64), torch.bfloat16, 33)
    positions = torch.arange(start, end)
    slots = torch.tensor(table)[positions // 32] * 32 + positions % 32
    key_cache, value_cache = views[1].view(num_blocks, 2, 64, 64).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)

    rows = adapter.kv_layout(1).encode_rows(kv=torch.stack((key, value), dim=1))
    assert torch.equal(adapter.read_tokens(views[1], table, start, end), rows)
    layer0 = slice(0, num_blocks * spec.page_size_bytes)
    assert torch.equal(raw[layer0], before[layer0])


@pytest.mark.parametrize(
    ("tp", "pp", "match"),
    [
        (1, 2, r"pipeline parallelism \(pipeline_parallel_size 2, supported: 1\): a stage holds only its own layers"),
        (2, 2, r"pipeline_parallel_size 2"),
    ],
)
def test_parallel_layouts_the_connector_cannot_serve_are_refused_with_the_reason(tp, pp, match):
    """Pipeline parallelism stays refused, naming why, with or without tensor parallelism."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from ascend_dualpath.integrations.vllm.connector import model_kv_layout

    config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
                             model_config=None, cache_config=None)  # fmt: skip
    with pytest.raises(ConfigError, match=match):
        model_kv_layout(config)


def _vllm_config(tp: int, *, mla: bool = False, snic: float | None = None):
    from types import SimpleNamespace

    model = SimpleNamespace(
        dtype=torch.bfloat16, use_mla=mla, get_num_layers=lambda parallel: 2, get_head_size=lambda: 16,
        get_total_num_kv_heads=lambda: 8, get_num_kv_heads=lambda parallel: 8 // parallel.tensor_parallel_size,
    )  # fmt: skip
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        model_config=model, cache_config=SimpleNamespace(cache_dtype="auto", block_size=16),
    )  # fmt: skip


@pytest.mark.parametrize("mla", [False, True])
def test_the_store_layout_is_the_whole_model_at_every_tensor_parallel_size(mla):
    """Every KV head (MLA: the latent) whatever the size: one fingerprint, so a store written at one size is read at
    another; a rank's rows are its shard of it."""
    pytest.importorskip("vllm")
    from ascend_dualpath.integrations.vllm.connector import model_kv_layout

    layouts = [model_kv_layout(_vllm_config(tp, mla=mla)) for tp in (1, 2, 4)]
    assert len({layout.fingerprint() for layout in layouts}) == 1
    if not mla:
        assert layouts[0].num_units == 8 and layouts[0].shard(4, 3).units == range(6, 8)


def test_a_rank_listens_at_its_port_on_its_device_with_its_share_of_the_storage_nic(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.distributed import parallel_state

    from ascend_dualpath.dualpath.settings import UNCAPPED_BYTES_PER_S, ConnectorSettings
    from ascend_dualpath.integrations.vllm.connector import worker_settings

    base = ConnectorSettings(role="decode", store="/s", node="de0", snic_bytes_per_s=4e9, side_port=7600,
                             fabric="f", timeout_s=5.0, device_id=2)  # fmt: skip
    one = SimpleNamespace(tensor_parallel_size=1, data_parallel_index=0)
    assert worker_settings(base, one) == base
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 3)
    rank = worker_settings(base, SimpleNamespace(tensor_parallel_size=4, data_parallel_index=0))
    assert (rank.tp_size, rank.tp_rank, rank.side_port, rank.device_id, rank.node) == (4, 3, 7603, 5, "de0.tp3")
    assert rank.snic_bytes_per_s == 1e9
    uncapped = dataclasses.replace(base, snic_bytes_per_s=UNCAPPED_BYTES_PER_S)
    assert worker_settings(
        uncapped, SimpleNamespace(tensor_parallel_size=2, data_parallel_index=0)
    ).snic_bytes_per_s == (UNCAPPED_BYTES_PER_S)
