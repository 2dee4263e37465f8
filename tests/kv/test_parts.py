"""Persisting from tensor-parallel ranks (kv/parts.py): each owner rank writes its part, the rank completing the set
publishes the full block, byte-identical to a size-1 persist; a missing part leaves the block invisible."""

from __future__ import annotations

import os
import threading
import time

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


def test_a_block_whose_parent_another_rank_is_publishing_waits_for_it(tmp_path, monkeypatch):
    """Turn 1's block A: both parts written, rank 0 still publishing it (slow storage), when rank 1 completes turn
    2's block B (parent A): rank 1 waits for A and publishes B; giving up at once would leave B's complete part set
    unpublished, with no rank coming back to it. A parent that never comes is waited for only PARENT_WAIT_S."""
    layout, size = LAYOUTS["gqa4"], 2
    ids, blocks = _chain(layout, seed=11)
    LocalBlockStore(tmp_path, layout).close()
    ranks = [PartStore(LocalBlockStore(tmp_path, layout), layout.shard(size, r)) for r in range(size)]
    local = [[ranks[r].shard.take(blocks[i]).contiguous() for i in range(BLOCKS)] for r in range(size)]
    ranks[1]._write_part(ids[0], local[1][0])  # rank 1's turn 1 found A incomplete and went on
    slow = ranks[0].store.write_blocks

    def publishing_slowly(chain):
        time.sleep(0.3)
        return slow(chain)

    monkeypatch.setattr(ranks[0].store, "write_blocks", publishing_slowly)
    turn1 = threading.Thread(target=ranks[0].write_blocks, args=([(ids[0], None, local[0][0])],))
    turn1.start()
    ranks[0]._write_part(ids[1], local[0][1])  # rank 0's part of B, as its turn 2 would write it
    assert ranks[1].write_blocks([(ids[1], ids[0], local[1][1])]) == [True]
    turn1.join(timeout=10)
    expected = _reference(tmp_path / "ref", layout, ids[:2], blocks[:2])
    assert _files(tmp_path, ids[:2], layout) == expected
    assert not any((tmp_path / parts_mod.PARTS_DIR).iterdir())
    monkeypatch.setattr(parts_mod, "PARENT_WAIT_S", 0.2)  # a parent whose parts never complete: bounded
    ranks[0]._write_part(ids[2], local[0][2])
    orphan = block_hashes(list(range(500, 500 + layout.block_tokens)), layout.block_tokens, namespace=b"o")[0]
    start = time.monotonic()
    assert ranks[1].write_blocks([(ids[2], orphan, local[1][2])]) == [False]
    assert time.monotonic() - start < 2.0
    for rank in ranks:
        rank.close()
