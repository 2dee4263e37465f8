from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dualpath.errors import BoundsError, ConfigError
from ascend_dualpath.kv.layout import BLOCK_ID_BYTES, KVField, KVLayout, block_hashes

GQA_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]


@st.composite
def layouts(draw) -> KVLayout:
    kind = draw(st.sampled_from(["gqa", "mla", "mla_fp8"]))
    num_layers = draw(st.integers(1, 5))
    block_tokens = draw(st.integers(1, 9))
    if kind == "gqa":
        return KVLayout.gqa(
            num_layers,
            draw(st.integers(1, 4)),
            draw(st.integers(1, 12)),
            draw(st.sampled_from(GQA_DTYPES)),
            block_tokens,
        )
    if kind == "mla":
        return KVLayout.mla(num_layers, draw(st.integers(1, 40)), draw(st.sampled_from(GQA_DTYPES)), block_tokens)
    group = draw(st.sampled_from([4, 8]))
    return KVLayout.mla_fp8(
        num_layers, group * draw(st.integers(1, 4)), 2 * draw(st.integers(1, 8)), group, block_tokens
    )


def random_bytes(numel: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=generator)


def test_sizes_of_the_named_formats():
    mla = KVLayout.mla(61)
    assert mla.token_bytes == 576 * 2
    assert mla.full_block_bytes == 61 * 64 * 1152
    fp8 = KVLayout.mla_fp8(61)
    assert fp8.token_bytes == 512 + 4 * 4 + 64 * 2 == 656
    assert [(f.name, f.offset) for f in fp8.fields] == [("nope", 0), ("scale", 512), ("rope", 528)]
    gqa = KVLayout.gqa(64, num_kv_heads=8, head_dim=128)
    assert gqa.token_bytes == 2 * 8 * 128 * 2
    assert gqa.layer_block_bytes == 64 * 4096
    assert gqa.kv_bytes(1000) == 1000 * 64 * 4096


@settings(max_examples=60, deadline=None)
@given(layout=layouts(), num_blocks=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_layer_blocks_are_views_that_concatenate_to_the_full_block(layout, num_blocks, seed):
    raw = random_bytes(num_blocks * layout.full_block_bytes, seed)
    blocks = layout.as_full_blocks(raw)
    assert blocks.shape == (num_blocks, layout.num_layers, layout.block_tokens, layout.token_bytes)
    for block_index in range(num_blocks):
        full = blocks[block_index]
        layer_blocks = [layout.layer_block(full, layer) for layer in range(layout.num_layers)]
        for layer, layer_block in enumerate(layer_blocks):
            assert layer_block.shape == (layout.block_tokens, layout.token_bytes)
            assert layer_block.data_ptr() == full.data_ptr() + layer * layout.layer_block_bytes  # no copy
        # Concatenating the L Layer Blocks' bytes gives the Full Block's bytes: no layout conversion.
        assert torch.equal(torch.cat([lb.reshape(-1) for lb in layer_blocks]), full.reshape(-1))
        assert torch.equal(torch.stack(layer_blocks), full)
    batched = layout.layer_block(blocks, layout.num_layers - 1)
    assert batched.shape == (num_blocks, layout.block_tokens, layout.token_bytes)
    assert batched.data_ptr() == raw.data_ptr() + (layout.num_layers - 1) * layout.layer_block_bytes
    batched.fill_(7)  # writes through to the backing bytes
    assert torch.equal(blocks[:, -1], torch.full_like(blocks[:, -1], 7))


@settings(max_examples=60, deadline=None)
@given(layout=layouts(), tokens=st.integers(1, 7), seed=st.integers(0, 2**31))
def test_encode_then_field_view_round_trips_bit_exactly(layout, tokens, seed):
    # Typed fields made from random bytes, so NaNs and odd float8 patterns are covered too.
    fields = {}
    for index, field in enumerate(layout.fields):
        raw = random_bytes(tokens * field.nbytes, seed + index)
        fields[field.name] = raw.view(field.dtype).reshape(tokens, *field.shape)
    rows = layout.encode_rows(**fields)
    assert rows.shape == (tokens, layout.token_bytes) and rows.dtype == torch.uint8
    for field in layout.fields:
        view = layout.field_view(rows, field.name)
        assert view.dtype == field.dtype and tuple(view.shape) == (tokens, *field.shape)
        assert view.data_ptr() == rows.data_ptr() + field.offset
        assert torch.equal(view.contiguous().view(torch.uint8), fields[field.name].contiguous().view(torch.uint8))
    # and back: rows rebuilt from the views are the same bytes
    again = layout.encode_rows(**{f.name: layout.field_view(rows, f.name) for f in layout.fields})
    assert torch.equal(again, rows)


def test_gqa_kv_views_k_and_v():
    layout = KVLayout.gqa(2, num_kv_heads=3, head_dim=4, dtype=torch.float32, block_tokens=5)
    keys = torch.randn(5, 3, 4)
    values = torch.randn(5, 3, 4)
    rows = layout.encode_rows(kv=torch.stack([keys, values], dim=1))
    got_k, got_v = layout.gqa_kv(rows)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    with pytest.raises(ConfigError, match="gqa layout"):
        KVLayout.mla(1).gqa_kv(torch.zeros(1, 1152, dtype=torch.uint8))


def test_bad_shapes_and_fields_are_rejected_by_name():
    layout = KVLayout.gqa(2, 1, 4, torch.float16, block_tokens=4)
    with pytest.raises(BoundsError, match="layer 2 out of range"):
        layout.layer_block(layout.empty_full_blocks(1)[0], 2)
    with pytest.raises(BoundsError, match="whole number of Full Blocks"):
        layout.as_full_blocks(torch.zeros(layout.full_block_bytes + 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        layout.as_full_blocks(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"uint8 \[\.\.\., 16\]"):
        layout.field_view(torch.zeros(3, 15, dtype=torch.uint8), "kv")
    with pytest.raises(KeyError, match="no field 'latent'"):
        layout.field("latent")
    with pytest.raises(TypeError, match="must be torch.float16"):
        layout.encode_rows(kv=torch.zeros(3, 2, 1, 4))
    with pytest.raises(ConfigError, match="not aligned"):
        KVLayout("x", 1, (KVField("a", torch.uint8, (1,), 0), KVField("b", torch.float32, (1,), 1)))
    with pytest.raises(ConfigError, match="multiple of scale_group"):
        KVLayout.mla_fp8(1, nope_dim=100)
    with pytest.raises(ConfigError, match="num_layers"):
        KVLayout.mla(0)


def test_fingerprints_differ_between_layouts():
    prints = {
        KVLayout.mla(61).fingerprint(),
        KVLayout.mla_fp8(61).fingerprint(),
        KVLayout.mla(60).fingerprint(),
        KVLayout.gqa(61, 8, 72, torch.float16).fingerprint(),
        KVLayout.gqa(61, 8, 72).fingerprint(),
    }
    assert len(prints) == 5


@settings(max_examples=80, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    block_tokens=st.integers(1, 6),
    cut=st.integers(0, 40),
    flip=st.integers(0, 39),
)
def test_block_hashes_form_a_prefix_chain(tokens, block_tokens, cut, flip):
    ids = block_hashes(tokens, block_tokens)
    assert len(ids) == len(tokens) // block_tokens
    assert all(len(block_id) == BLOCK_ID_BYTES for block_id in ids)
    assert len(set(ids)) == len(ids)
    # a prefix of the tokens gives a prefix of the chain (the trailing partial block has no id)
    assert block_hashes(tokens[:cut], block_tokens) == ids[: min(cut, len(tokens)) // block_tokens]
    assert block_hashes(torch.tensor(tokens, dtype=torch.int32), block_tokens) == ids
    if flip < len(tokens):
        changed = list(tokens)
        changed[flip] += 1
        other = block_hashes(changed, block_tokens)
        first_changed_block = flip // block_tokens
        assert other[:first_changed_block] == ids[:first_changed_block]
        assert all(a != b for a, b in zip(other[first_changed_block:], ids[first_changed_block:], strict=True))
    if ids:
        assert block_hashes(tokens, block_tokens, namespace=b"other model")[0] != ids[0]


@settings(max_examples=30, deadline=None)
@given(layout=layouts(), num_blocks=st.integers(1, 3), seed=st.integers(0, 2**31))
def test_full_blocks_from_layers_inverts_layer_rows(layout, num_blocks, seed):
    tokens = num_blocks * layout.block_tokens
    rows = [
        random_bytes(tokens * layout.token_bytes, seed + layer).view(tokens, layout.token_bytes)
        for layer in range(layout.num_layers)
    ]
    blocks = layout.full_blocks_from_layers(rows)
    assert blocks.shape == (num_blocks, layout.num_layers, layout.block_tokens, layout.token_bytes)
    for layer in range(layout.num_layers):
        assert torch.equal(layout.layer_rows(blocks, layer), rows[layer])
        for block in range(num_blocks):  # block b, layer l = tokens [b*T, (b+1)*T) of layer l
            span = slice(block * layout.block_tokens, (block + 1) * layout.block_tokens)
            assert torch.equal(blocks[block, layer], rows[layer][span])
    if layout.block_tokens > 1:
        with pytest.raises(BoundsError, match="whole number"):
            layout.full_blocks_from_layers([r[:-1] for r in rows])


# -- tensor-parallel shards ----------------------------------------------------------------------------------------
@st.composite
def gqa_layouts(draw, min_heads: int = 1) -> KVLayout:
    return KVLayout.gqa(
        draw(st.integers(1, 4)),
        draw(st.sampled_from([h for h in (1, 2, 4, 8) if h >= min_heads])),
        draw(st.integers(1, 9)),
        draw(st.sampled_from(GQA_DTYPES)),
        draw(st.integers(1, 6)),
    )


def shard_bytes(layout: KVLayout, size: int, rank: int) -> torch.Tensor:
    """Every byte index of a Full Block that rank ``rank`` of ``size`` holds, from its byte ranges."""
    ranges = layout.shard(size, rank).byte_ranges()
    return torch.cat([torch.arange(offset, offset + nbytes) for offset, nbytes in ranges])


@settings(max_examples=40, deadline=None)
@given(layout=gqa_layouts(min_heads=4), size=st.sampled_from([1, 2, 4]))
def test_the_ranks_of_a_gqa_tp_size_tile_every_byte_of_a_block_once(layout, size):
    held = torch.cat([shard_bytes(layout, size, rank) for rank in range(size)])
    counts = torch.bincount(held, minlength=layout.full_block_bytes)
    assert counts.numel() == layout.full_block_bytes
    assert bool((counts == 1).all()), f"bytes held {counts.min()}..{counts.max()} times"
    heads = [list(layout.shard(size, rank).units) for rank in range(size)]
    assert sum(heads, []) == list(range(layout.num_units))


@settings(max_examples=40, deadline=None)
@given(layout=gqa_layouts(), size=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_a_ranks_bytes_are_its_heads_k_and_v_in_its_local_layout(layout, size, seed):
    """The rank's byte ranges, gathered, are its local Full Block: its heads' K and V of every row, bit for bit."""
    full = layout.as_full_blocks(random_bytes(layout.full_block_bytes, seed), 1)
    for rank in range(size):
        shard = layout.shard(size, rank)
        flat = full.reshape(-1)
        gathered = torch.cat([flat[off : off + n] for off, n in shard.byte_ranges()])
        local = shard.local.as_full_blocks(gathered, 1)
        assert torch.equal(local, shard.take(full))
        k_full, v_full = layout.gqa_kv(full)
        k_local, v_local = shard.local.gqa_kv(local)
        heads = slice(shard.units.start, shard.units.stop)
        assert torch.equal(k_local.view(torch.uint8), k_full[..., heads, :].contiguous().view(torch.uint8))
        assert torch.equal(v_local.view(torch.uint8), v_full[..., heads, :].contiguous().view(torch.uint8))


@pytest.mark.parametrize(("heads", "size", "expected"), [(1, 2, [0, 0]), (2, 4, [0, 0, 1, 1]), (1, 4, [0] * 4)])
def test_fewer_kv_heads_than_ranks_replicate_heads_as_vllm_does(heads, size, expected):
    layout = KVLayout.gqa(2, heads, 4, block_tokens=3)
    shards = [layout.shard(size, rank) for rank in range(size)]
    assert [list(s.units) for s in shards] == [[h] for h in expected]
    for shard in shards:  # a replica holds its one head's K and V of every row, nothing else
        assert shard.local == KVLayout.gqa(2, 1, 4, block_tokens=3)
        assert sum(n for _, n in shard.byte_ranges()) == shard.local.full_block_bytes


@settings(max_examples=20, deadline=None)
@given(layout=layouts().filter(lambda lay: lay.kind != "gqa"), size=st.sampled_from([1, 2, 4]))
def test_every_mla_rank_holds_the_whole_latent(layout, size):
    for rank in range(size):
        shard = layout.shard(size, rank)
        assert shard.whole and shard.local == layout
        assert shard.byte_ranges() == ((0, layout.full_block_bytes),)


def test_the_fingerprint_does_not_depend_on_the_parallel_layout():
    layout = KVLayout.gqa(3, 8, 16)
    assert layout.shard(2, 1).full.fingerprint() == layout.fingerprint()
    assert layout.shard(1, 0).local.fingerprint() == layout.fingerprint()


@pytest.mark.parametrize(
    ("heads", "size", "rank", "match"),
    [(3, 2, 0, "3 KV heads cannot be sharded over tensor-parallel size 2"), (4, 2, 2, r"rank 2 out of range \[0, 2\)"),
     (4, 0, 0, r"size must be in \[1, 1024\], got 0")],
)  # fmt: skip
def test_bad_shards_are_refused_naming_the_value(heads, size, rank, match):
    with pytest.raises(ConfigError, match=match):
        KVLayout.gqa(1, heads, 4).shard(size, rank)


@settings(max_examples=60, deadline=None)
@given(
    layout=st.one_of(gqa_layouts(), layouts().filter(lambda lay: lay.kind != "gqa")),
    sizes=st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4])),
    seed=st.integers(0, 2**16),
)
def test_a_rank_gets_each_of_its_bytes_once_from_the_ranks_of_another_size(layout, sizes, seed):
    """Different tensor-parallel sizes on the two sides: the overlaps with the sending side's ranks tile each
    receiving rank's row exactly once, and copying them rebuilds its share bit for bit."""
    size_from, size_to = sizes
    if layout.kind == "gqa" and (layout.num_units % size_from and size_from % layout.num_units):
        return
    if layout.kind == "gqa" and (layout.num_units % size_to and size_to % layout.num_units):
        return
    full = layout.as_full_blocks(random_bytes(layout.full_block_bytes, seed), 1)
    for rank in range(size_to):
        shard = layout.shard(size_to, rank)
        rebuilt = torch.zeros_like(shard.take(full))
        writes = torch.zeros(shard.local.token_bytes, dtype=torch.int64)
        for source, segments in shard.sources(size_from):
            sent = layout.shard(size_from, source).take(full)
            for mine, theirs, nbytes in segments:
                rebuilt[..., mine : mine + nbytes] = sent[..., theirs : theirs + nbytes]
                writes[mine : mine + nbytes] += 1
        assert bool((writes == 1).all()), f"row bytes written {writes.tolist()} times"
        assert torch.equal(rebuilt, shard.take(full))


def test_overlaps_name_the_common_heads_of_two_sizes():
    layout = KVLayout.gqa(1, 4, 2, torch.float16, 1)  # a head is 4 bytes; a row K0..K3 V0..V3
    pe, de = layout.shard(2, 1), layout.shard(4, 3)  # heads 2-3 and head 3
    assert de.overlap(pe) == ((0, 4, 4), (4, 12, 4))  # its K3 and V3 from the PE rank's second K and second V
    assert de.sources(2) == ((1, ((0, 4, 4), (4, 12, 4))),)
    assert layout.shard(1, 0).sources(4) == tuple((r, ((4 * r, 0, 4), (16 + 4 * r, 4, 4))) for r in range(4))
    with pytest.raises(ConfigError, match="different layouts"):
        pe.overlap(KVLayout.gqa(1, 8, 2, torch.float16, 1).shard(2, 0))
