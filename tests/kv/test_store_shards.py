"""Tensor-parallel ranks reading their byte ranges of stored Full Blocks: exact, verified per unit, counted."""

from __future__ import annotations

import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dualpath.errors import ChecksumMismatch, ConfigError
from ascend_dualpath.kv.clocks import ManualClock
from ascend_dualpath.kv.layout import KVLayout, block_hashes
from ascend_dualpath.kv.read_queue import ReadQueue
from ascend_dualpath.kv.store import HEADER_BYTES, IO_ALIGN, BlockHeader, BlockStore, LocalBlockStore, ShardStore

POISON = 0xA5
GQA8 = KVLayout.gqa(num_layers=3, num_kv_heads=8, head_dim=4, dtype=torch.float16, block_tokens=5)


def make_blocks(layout: KVLayout, count: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, layout.full_block_bytes), dtype=torch.uint8, generator=generator)


def write_chain(store: LocalBlockStore, blocks: torch.Tensor) -> list[bytes]:
    ids = block_hashes(range(len(blocks) * store.layout.block_tokens), store.layout.block_tokens, b"shards")
    store.write_blocks([(ids[i], ids[i - 1] if i else None, blocks[i]) for i in range(len(blocks))])
    return ids


def write_version1(root, layout: KVLayout, blocks: torch.Tensor) -> list[bytes]:
    """Blocks as a version-1 writer left them (no unit CRCs); returns their ids."""
    store = LocalBlockStore(root, layout)
    ids = write_chain(store, blocks)
    for block_id, (i, block) in zip(ids, enumerate(blocks), strict=True):
        payload = block.numpy().tobytes()
        header = BlockHeader(
            len(payload), zlib.crc32(payload), layout.fingerprint(), block_id, ids[i - 1] if i else None
        )
        header = BlockHeader(**{**header.__dict__, "version": 1})
        padding = bytes(-len(payload) % IO_ALIGN)
        store.path_of(block_id).write_bytes(header.pack() + payload + padding)
    store.close()
    return ids


def flip_on_disk(store: LocalBlockStore, block_id: bytes, offset: int) -> None:
    """Flip one payload byte of a block's file (``offset`` into the payload)."""
    with open(store.path_of(block_id), "r+b") as handle:
        start = BlockHeader.unpack(handle.read(HEADER_BYTES), "test").header_bytes
        handle.seek(start + offset)
        value = handle.read(1)[0]
        handle.seek(start + offset)
        handle.write(bytes([value ^ 0x01]))


@settings(max_examples=25, deadline=None)
@given(
    heads=st.sampled_from([1, 2, 4, 8]),
    size=st.sampled_from([1, 2, 4]),
    layers=st.integers(1, 3),
    tokens=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_every_rank_reads_exactly_its_bytes_and_only_those(tmp_path_factory, heads, size, layers, tokens, seed):
    layout = KVLayout.gqa(layers, heads, 3, torch.bfloat16, tokens)
    store = LocalBlockStore(tmp_path_factory.mktemp("store"), layout)
    blocks = make_blocks(layout, 2, seed)
    ids = write_chain(store, blocks)
    total = 0
    for rank in range(size):
        shard = layout.shard(size, rank)
        dest = torch.full((shard.local.full_block_bytes,), POISON, dtype=torch.uint8)
        for block_id, block in zip(ids, blocks, strict=True):
            read = store.read_into(block_id, dest, shard=shard)
            assert read == shard.local.full_block_bytes
            assert torch.equal(dest, shard.take(layout.as_full_blocks(block, 1)).reshape(-1))
            total += read
    copies = max(1, size // heads)  # fewer heads than ranks: each head read by size // heads replicas
    assert total == 2 * layout.full_block_bytes * copies
    store.close()


@pytest.mark.parametrize("version", [2, 1])
def test_a_corrupt_byte_fails_the_ranks_holding_it_and_no_other(tmp_path, version):
    blocks = make_blocks(GQA8, 1)
    if version == 1:
        ids = write_version1(tmp_path, GQA8, blocks)
    store = LocalBlockStore(tmp_path, GQA8)
    if version == 2:
        ids = write_chain(store, blocks)
    shards = [GQA8.shard(4, rank) for rank in range(4)]
    offset, _ = shards[2].byte_ranges()[3]  # rank 2 holds heads 4 and 5: this is head 4 of layer 0, row 1, its V
    flip_on_disk(store, ids[0], offset + 1)
    for shard in shards:
        dest = torch.full((shard.local.full_block_bytes,), POISON, dtype=torch.uint8)
        if shard.rank == 2 or version == 1:  # a version-1 block has one CRC: every rank reads it whole
            with pytest.raises(ChecksumMismatch, match="layer 0 unit 4" if version == 2 else "of the payload"):
                store.read_into(ids[0], dest, shard=shard)
            assert torch.all(dest == POISON)
        else:
            assert store.read_into(ids[0], dest, shard=shard) == shard.local.full_block_bytes
            assert torch.equal(dest, shard.take(GQA8.as_full_blocks(blocks[0], 1)).reshape(-1))
    with pytest.raises(ChecksumMismatch, match="of the payload"):  # a full read checks the payload's CRC
        store.read_into(ids[0], torch.empty(GQA8.full_block_bytes, dtype=torch.uint8))
    store.close()


def test_a_version1_block_is_read_whole_for_a_rank_and_counted_so(tmp_path):
    blocks = make_blocks(GQA8, 3, seed=4)
    ids = write_version1(tmp_path, GQA8, blocks)
    store = LocalBlockStore(tmp_path, GQA8)
    shard = GQA8.shard(2, 1)
    dest = torch.empty(shard.local.full_block_bytes, dtype=torch.uint8)
    assert store.read_into(ids[1], dest, shard=shard) == GQA8.full_block_bytes
    assert torch.equal(dest, shard.take(GQA8.as_full_blocks(blocks[1], 1)).reshape(-1))
    full = torch.empty(GQA8.full_block_bytes, dtype=torch.uint8)
    assert store.read_into(ids[2], full) == GQA8.full_block_bytes and torch.equal(full, blocks[2])
    # the NIC's accounting: what was read, not what was asked for
    view = ShardStore(store, shard)
    queue = ReadQueue(view, bandwidth_bytes_per_s=1e12, node="pe0.tp1")
    dests = list(torch.empty(3, shard.local.full_block_bytes, dtype=torch.uint8))
    for ticket in queue.submit_many(ids, dests):
        ticket.wait(10.0)
    assert queue.stats().completed_bytes == 3 * GQA8.full_block_bytes
    queue.close()
    store.close()


def test_the_read_queue_of_a_rank_paces_and_counts_its_bytes(tmp_path):
    store = LocalBlockStore(tmp_path, GQA8)
    blocks = make_blocks(GQA8, 4, seed=2)
    ids = write_chain(store, blocks)
    view = ShardStore(store, GQA8.shard(4, 3))
    assert isinstance(view, BlockStore)
    share = view.layout.full_block_bytes
    assert share * 4 == GQA8.full_block_bytes
    clock = ManualClock(timeout_s=10)
    queue = ReadQueue(view, bandwidth_bytes_per_s=share, clock=clock, node="de0.tp3")  # one share per second
    dests = torch.empty(4, share, dtype=torch.uint8)
    tickets = queue.submit_many(ids, list(dests))
    tickets[0].wait()
    clock.wait_for_sleepers(1)
    assert queue.stats().queued_bytes == 3 * share
    for ticket in tickets[1:]:
        clock.advance(1.0)
        ticket.wait()
    assert [t.started_at for t in tickets] == [0.0, 1.0, 2.0, 3.0]
    assert queue.stats().completed_bytes == 4 * share
    expected = torch.stack([view.shard.take(GQA8.as_full_blocks(b, 1)).reshape(-1) for b in blocks])
    assert torch.equal(dests, expected)
    queue.close()
    store.close()


def test_unit_crcs_beyond_one_page_grow_the_header(tmp_path):
    layout = KVLayout.gqa(num_layers=130, num_kv_heads=8, head_dim=2, dtype=torch.float16, block_tokens=2)
    store = LocalBlockStore(tmp_path, layout)
    blocks = make_blocks(layout, 1, seed=9)
    ids = write_chain(store, blocks)
    with open(store.path_of(ids[0]), "rb") as handle:
        assert BlockHeader.unpack(handle.read(HEADER_BYTES), "test").header_bytes == 2 * IO_ALIGN
    full = torch.empty(layout.full_block_bytes, dtype=torch.uint8)
    store.read_into(ids[0], full)
    assert torch.equal(full, blocks[0])
    shard = layout.shard(2, 1)
    dest = torch.empty(shard.local.full_block_bytes, dtype=torch.uint8)
    store.read_into(ids[0], dest, shard=shard)
    assert torch.equal(dest, shard.take(layout.as_full_blocks(blocks[0], 1)).reshape(-1))
    store.close()


def test_a_tampered_unit_crc_table_is_detected(tmp_path):
    store = LocalBlockStore(tmp_path, GQA8)
    ids = write_chain(store, make_blocks(GQA8, 1))
    with open(store.path_of(ids[0]), "r+b") as handle:
        handle.seek(100)  # inside the unit CRCs, after the fixed part (its own CRC still good)
        handle.write(b"\x00\x01")
    shard = GQA8.shard(2, 0)
    with pytest.raises(ChecksumMismatch, match="unit CRC table"):
        store.read_into(ids[0], torch.empty(shard.local.full_block_bytes, dtype=torch.uint8), shard=shard)
    store.close()


def test_a_rank_view_refuses_writes_and_foreign_shards(tmp_path):
    store = LocalBlockStore(tmp_path, GQA8)
    view = ShardStore(store, GQA8.shard(2, 0))
    with pytest.raises(ConfigError, match="rank 0 of 2 holds only its heads"):
        view.write_block(bytes(16), None, torch.empty(view.layout.full_block_bytes, dtype=torch.uint8))
    other = KVLayout.gqa(3, 4, 4, torch.float16, 5).shard(2, 0)
    with pytest.raises(ConfigError, match="not the store's"):
        ShardStore(store, other)
    with pytest.raises(ConfigError, match="does not belong"):
        store.read_into(bytes(16), torch.empty(other.local.full_block_bytes, dtype=torch.uint8), shard=other)
    store.close()


def test_a_rank_holding_whole_rows_writes_and_reads_as_the_store(tmp_path):
    layout = KVLayout.mla(num_layers=2, latent_dim=12, dtype=torch.float16, block_tokens=3)
    store = LocalBlockStore(tmp_path, layout)
    view = ShardStore(store, layout.shard(4, 3))
    block = make_blocks(layout, 1, seed=5)[0]
    assert view.write_block(bytes(16), None, block) and not view.write_block(bytes(16), None, block)
    dest = torch.empty(layout.full_block_bytes, dtype=torch.uint8)
    assert view.read_into(bytes(16), dest) == layout.full_block_bytes and torch.equal(dest, block)
    store.close()
