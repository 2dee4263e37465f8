"""The one lease layout: placing a request's rows by :class:`LeaseLayout` and reading them back by it gives the
complete prompt KV bit-exact, on both read paths, for any split of hit and new tokens; nothing outside it moves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dualpath.dualpath.lease import LeaseLayout
from ascend_dualpath.dualpath.scheduler import ReadPath
from ascend_dualpath.errors import BoundsError
from ascend_dualpath.kv.layout import KVLayout

LAYOUT = KVLayout.gqa(3, 2, 4, torch.bfloat16, block_tokens=8)
L, T, C = LAYOUT.num_layers, LAYOUT.block_tokens, LAYOUT.token_bytes
POISON = 0xA5


def _lease_bytes(complete: torch.Tensor, hit_tokens: int) -> torch.Tensor:
    """What the lease must hold, built from the layout's definition (not from LeaseLayout): ``[L, P, C]``, or the
    hit Full Blocks ``[H / T, L, T, C]`` then ``[L, P - H, C]``."""
    if hit_tokens == 0:
        return complete.clone().reshape(-1)
    blocks = LAYOUT.full_blocks_from_layers([complete[layer, :hit_tokens] for layer in range(L)])
    return torch.cat([blocks.reshape(-1), complete[:, hit_tokens:].reshape(-1)])


@settings(max_examples=60)
@given(hit_blocks=st.integers(0, 4), new=st.integers(0, 20), seed=st.integers(0, 2**16), data=st.data())
def test_rows_placed_and_read_by_the_layout_are_the_prompt_kv(hit_blocks, new, seed, data):
    H, P = hit_blocks * T, hit_blocks * T + new
    lease = LeaseLayout(LAYOUT, P, H)
    complete = torch.randint(0, 256, (L, P, C), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    expected = _lease_bytes(complete, H)
    assert lease.nbytes == max(1, expected.numel())
    buffer = torch.full((lease.nbytes,), POISON, dtype=torch.uint8)
    for b in range(hit_blocks):  # hit blocks at their offsets, as storage reads land
        buffer[lease.block_offset(b) : lease.block_offset(b + 1)] = expected[b * LAYOUT.full_block_bytes :][
            : LAYOUT.full_block_bytes
        ]
    start = data.draw(st.integers(H, P))
    for layer in range(L):  # the PE's rows [H, P) in two sends, as layer saves of two steps land
        for a, z in ((H, start), (start, P)):
            offset = lease.rows_offset(layer, a)
            buffer[offset : offset + (z - a) * C] = complete[layer, a:z].reshape(-1)
    if P:
        assert torch.equal(buffer, expected)
    for layer in range(L):
        assert torch.equal(lease.hit_rows(buffer, layer), complete[layer, :H])
        assert torch.equal(lease.new_rows(buffer, layer, H, P), complete[layer, H:])


@settings(max_examples=40)
@given(
    hit_blocks=st.integers(0, 4),
    new=st.integers(1, 20),
    path=st.sampled_from(list(ReadPath)),
    seed=st.integers(0, 2**16),
)
def test_layer_copies_merge_hit_and_new_rows_in_token_and_layer_order(hit_blocks, new, path, seed):
    base = 1 << 40  # the lease's registration address
    lease = LeaseLayout(LAYOUT, hit_blocks * T + new, 0 if path is ReadPath.PE else hit_blocks * T)
    P = hit_blocks * T + new
    assert lease.prompt_tokens == P and lease.hit_tokens == (0 if path is ReadPath.PE else hit_blocks * T)
    complete = torch.randint(0, 256, (L, P, C), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    source = _lease_bytes(complete, lease.hit_tokens)
    hbm_tokens, hbm_base = P + 5, 1 << 44
    hbm = torch.full((L, hbm_tokens, C), POISON, dtype=torch.uint8)
    for src, dst, n in lease.layer_copies(base, hbm_base, hbm_tokens):
        hbm.view(-1)[dst - hbm_base : dst - hbm_base + n] = source[src - base :][:n]
    assert torch.equal(hbm[:, :P], complete)
    assert bool((hbm[:, P:] == POISON).all()), "the copies wrote past the prompt rows"


def test_hit_layer_segments_select_one_layer_of_each_full_block():
    blocks = torch.randint(0, 256, (3, *LAYOUT.empty_full_blocks(1).shape[1:]), dtype=torch.uint8)
    flat, lease = blocks.reshape(-1), LeaseLayout.blocks(LAYOUT, 3)
    for layer in range(L):
        rows = torch.cat([flat[s.src_addr : s.src_addr + s.nbytes] for s in lease.hit_layer_segments(0, layer)])
        assert torch.equal(rows, LAYOUT.layer_rows(blocks, layer).reshape(-1))
        part = lease.hit_layer_segments(0, layer, 1, 3)  # a split's DE half: packed from 0 at the destination
        assert [s.dst_offset for s in part] == [0, LAYOUT.layer_block_bytes]
        assert torch.equal(torch.cat([flat[s.src_addr : s.src_addr + s.nbytes] for s in part]), rows[T * C :])


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: LeaseLayout(LAYOUT, 10, 4), "cannot hold 4 hit tokens"),
        (lambda: LeaseLayout(LAYOUT, 8, 16), "cannot hold 16 hit tokens"),
        (lambda: LeaseLayout(LAYOUT, 20, 8).rows_offset(0, 7), r"rows \[8, 20\)"),
        (lambda: LeaseLayout(LAYOUT, 20, 8).rows_offset(L, 8), r"layers \[0, 3\)"),
        (lambda: LeaseLayout(LAYOUT, 20, 8).block_offset(2), "hit block 2"),
        (lambda: LeaseLayout(LAYOUT, 20, 8).new_rows(torch.zeros(1), 0, 8, 21), r"rows \[8, 21\)"),
        (lambda: LeaseLayout(LAYOUT, 20, 8).layer_copies(0, 0, 19), "19 tokens"),
    ],
)
def test_out_of_range_questions_are_refused_naming_the_range(make, match):
    with pytest.raises(BoundsError, match=match):
        make()
