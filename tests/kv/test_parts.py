"""Persisting from tensor-parallel ranks (kv/parts.py): each owner rank writes its part, the rank completing the set
publishes the full block, byte-identical to a size-1 persist; a missing part leaves the block invisible."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dualpath.errors import BoundsError
from ascend_dualpath.kv import parts as parts_mod
from ascend_dualpath.kv.layout import KVLayout, block_hashes
from ascend_dualpath.kv.parts import PartStore, owner_ranks
from ascend_dualpath.kv.store import LocalBlockStore

LAYOUTS = {
    "gqa4": KVLayout.gqa(2, 4, 8, torch.bfloat16, block_tokens=4),
    "gqa8": KVLayout.gqa(2, 8, 4, torch.float16, block_tokens=4),
    "gqa2": KVLayout.gqa(2, 2, 8, torch.bfloat16, block_tokens=4),  # over 4 ranks: replicated heads
    "mla": KVLayout.mla(2, 16, torch.bfloat16, block_tokens=4),
}
BLOCKS = 3


def _chain(layout: KVLayout, seed: int) -> tuple[list[bytes], torch.Tensor]:
    ids = block_hashes(list(range(seed, seed + BLOCKS * layout.block_tokens)), layout.block_tokens, namespace=b"t")
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (BLOCKS, *layout.empty_full_blocks(1).shape[1:]), dtype=torch.uint8,
                           generator=generator)  # fmt: skip
    return ids, blocks


def _files(root, ids: list[bytes], layout: KVLayout) -> list[bytes]:
    store = LocalBlockStore(root, layout)
    try:
        return [store.path_of(block_id).read_bytes() for block_id in ids]
    finally:
        store.close()


def _reference(root, layout: KVLayout, ids: list[bytes], blocks: torch.Tensor) -> list[bytes]:
    """The block files a size-1 persist writes."""
    store = LocalBlockStore(root, layout)
    store.write_blocks([(b, ids[i - 1] if i else None, blocks[i]) for i, b in enumerate(ids)])
    store.close()
    return _files(root, ids, layout)


def _rank_write(root, layout: KVLayout, size: int, rank: int, ids: list[bytes], blocks: torch.Tensor, first: int):
    """What one rank's worker does: its own store (its own index, as in its own process), its local bytes."""
    shard = layout.shard(size, rank)
    store = LocalBlockStore(root, layout)
    writer = PartStore(store, shard)
    try:
        chain = [(ids[i], ids[i - 1] if i else None, shard.take(blocks[i]).contiguous()) for i in range(first, BLOCKS)]
        return writer.write_blocks(chain)
    finally:
        store.close()


@pytest.mark.parametrize(("size", "owners"), [(1, (0,)), (2, (0, 1)), (4, (0, 1, 2, 3))])
def test_every_rank_owns_its_heads_when_heads_are_not_replicated(size, owners):
    assert owner_ranks(LAYOUTS["gqa8"].shard(size, 0)) == owners


def test_replicated_heads_and_the_latent_have_one_owner_each():
    assert owner_ranks(LAYOUTS["gqa2"].shard(4, 3)) == (0, 2)
    assert owner_ranks(LAYOUTS["mla"].shard(4, 1)) == (0,)


@settings(max_examples=12, deadline=None)
@given(
    name=st.sampled_from(sorted(LAYOUTS)),
    size=st.sampled_from([2, 4]),
    order=st.randoms(use_true_random=False),
    first=st.integers(0, BLOCKS - 1),
)
def test_ranks_persisting_in_any_order_give_the_size_one_blocks(tmp_path_factory, name, size, order, first):
    """The ranks of size 2 or 4 write their parts one after the other in any order, the request's blocks after
    ``first`` (the ones before stored by an earlier turn at size 1): the block files are byte-identical to a size-1
    persist, exactly one rank published each, and no part is left."""
    layout = LAYOUTS[name]
    ids, blocks = _chain(layout, seed=size + first)
    expected = _reference(tmp_path_factory.mktemp("ref"), layout, ids, blocks)
    root = tmp_path_factory.mktemp("tp")
    _reference(root, layout, ids[:first], blocks[:first])
    ranks = list(range(size))
    order.shuffle(ranks)
    published = [_rank_write(root, layout, size, rank, ids, blocks, first) for rank in ranks]
    assert _files(root, ids, layout) == expected
    assert [sum(column) for column in zip(*published, strict=True)] == [1] * (BLOCKS - first)
    assert not any((root / parts_mod.PARTS_DIR).iterdir())


@pytest.mark.parametrize(("name", "size"), [("gqa8", 4), ("gqa4", 2), ("gqa2", 4)])
def test_ranks_persisting_at_once_give_the_size_one_blocks(tmp_path, name, size):
    """The ranks' threads race (parts, completion checks, publishing, removing parts): still the size-1 files."""
    layout = LAYOUTS[name]
    ids, blocks = _chain(layout, seed=7)
    expected = _reference(tmp_path / "ref", layout, ids, blocks)
    for attempt in range(3):
        root = tmp_path / f"tp{attempt}"
        threads = [
            threading.Thread(target=_rank_write, args=(root, layout, size, rank, ids, blocks, 0))
            for rank in range(size)
        ]
        LocalBlockStore(root, layout).close()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
            assert not thread.is_alive(), "a rank's persist did not end"
        assert _files(root, ids, layout) == expected


def test_a_missing_part_leaves_the_block_invisible_and_stale_parts_are_removed(tmp_path):
    layout = LAYOUTS["gqa4"]
    ids, blocks = _chain(layout, seed=3)
    for rank in (0, 1, 3):  # rank 2 died before writing
        assert _rank_write(tmp_path, layout, 4, rank, ids, blocks, 0) == [False] * BLOCKS
    store = LocalBlockStore(tmp_path, layout)
    assert store.longest_prefix(ids) == 0 and not any(store.path_of(b).exists() for b in ids)
    leftovers = list((tmp_path / parts_mod.PARTS_DIR).iterdir())
    assert len(leftovers) == BLOCKS
    assert PartStore(store, layout.shard(4, 0)).removed_leftovers == 0  # young: a live rank may still write its part
    for directory in leftovers:
        os.utime(directory, (0, 0))
    assert PartStore(store, layout.shard(4, 0)).removed_leftovers == BLOCKS
    assert not any((tmp_path / parts_mod.PARTS_DIR).iterdir())
    store.close()


def test_a_part_of_the_wrong_size_is_refused(tmp_path):
    layout = LAYOUTS["gqa4"]
    store = LocalBlockStore(tmp_path, layout)
    with pytest.raises(BoundsError, match="part is 8 bytes"):
        PartStore(store, layout.shard(2, 1)).write_blocks([(b"\1" * 16, None, torch.zeros(8, dtype=torch.uint8))])
    store.close()
