from __future__ import annotations

import errno
import os
import socket
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dualpath.errors import (
    BoundsError,
    CapacityError,
    ChecksumMismatch,
    ConfigError,
    InvalidKey,
    QueueError,
    StorageReadError,
)
from ascend_dualpath.kv import store as store_mod
from ascend_dualpath.kv.buffers import de_buffer
from ascend_dualpath.kv.clocks import ManualClock, TokenBucket
from ascend_dualpath.kv.faults import FaultInjector
from ascend_dualpath.kv.layout import KVLayout, block_hashes
from ascend_dualpath.kv.read_queue import ReadQueue
from ascend_dualpath.kv.store import HEADER_BYTES, IO_ALIGN, STALE_TEMP_S, BlockStore, LocalBlockStore

POISON = 0xA5
# 2 layers x 4 tokens x 656 bytes = 5248 bytes: not a multiple of 4096, so O_DIRECT reads need the tail path.
FP8_LAYOUT = KVLayout.mla_fp8(num_layers=2, block_tokens=4)
GQA_LAYOUT = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16, block_tokens=64)


def make_blocks(layout: KVLayout, count: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (count, layout.full_block_bytes), dtype=torch.uint8, generator=generator)


def write_chain(store: LocalBlockStore, blocks: torch.Tensor, tokens: list[int] | None = None) -> list[bytes]:
    layout = store.layout
    tokens = tokens if tokens is not None else list(range(len(blocks) * layout.block_tokens))
    ids = block_hashes(tokens, layout.block_tokens, namespace=layout.fingerprint())
    parent = None
    for block_id, block in zip(ids, blocks, strict=True):
        assert store.write_block(block_id, parent, block)
        parent = block_id
    return ids


def poisoned(nbytes: int, guard: int = 0) -> torch.Tensor:
    return torch.full((nbytes + 2 * guard,), POISON, dtype=torch.uint8)


@pytest.fixture(params=["auto", "buffered"])
def store(request, tmp_path):
    direct = None if request.param == "auto" else False
    opened = LocalBlockStore(tmp_path / "store", FP8_LAYOUT, direct_io=direct)
    yield opened
    opened.close()


def test_local_store_satisfies_the_protocol(store):
    assert isinstance(store, BlockStore)


@pytest.mark.parametrize("layout", [FP8_LAYOUT, GQA_LAYOUT], ids=["mla_fp8", "gqa"])
@pytest.mark.parametrize("direct_io", [None, False], ids=["auto", "buffered"])
def test_write_read_round_trip_is_bit_exact(tmp_path, layout, direct_io):
    store = LocalBlockStore(tmp_path, layout, direct_io=direct_io)
    blocks = make_blocks(layout, 3)
    ids = write_chain(store, blocks)
    nbytes = layout.full_block_bytes
    # an aligned destination (a host-buffer lease) and a deliberately misaligned one
    buffer = de_buffer(3 * nbytes + IO_ALIGN)
    with buffer.allocate("req", 3 * nbytes) as lease:
        lease.tensor.fill_(POISON)
        for index, block_id in enumerate(ids):
            store.read_into(block_id, lease.slice(index * nbytes, nbytes).view)
        assert torch.equal(lease.tensor.view(3, nbytes), blocks)
    misaligned = poisoned(nbytes, guard=1)
    store.read_into(ids[1], misaligned[1:-1])
    assert torch.equal(misaligned[1:-1], blocks[1])
    assert misaligned[0] == POISON and misaligned[-1] == POISON
    # file format: padded header + payload to a multiple of IO_ALIGN
    assert os.path.getsize(store.path_of(ids[0])) == HEADER_BYTES + -(-nbytes // IO_ALIGN) * IO_ALIGN
    # a reopened store finds the same chain and the same bytes
    reopened = LocalBlockStore(tmp_path, layout, direct_io=direct_io)
    assert reopened.longest_prefix(ids) == 3 and reopened.skipped_files == 0
    out = torch.empty(nbytes, dtype=torch.uint8)
    reopened.read_into(ids[2], out)
    assert torch.equal(out, blocks[2])


@settings(max_examples=15, deadline=None)
@given(
    num_layers=st.integers(1, 3),
    block_tokens=st.integers(1, 8),
    heads=st.integers(1, 3),
    head_dim=st.sampled_from([1, 3, 64]),
    seed=st.integers(0, 1000),
)
def test_round_trip_over_layout_shapes(tmp_path_factory, num_layers, block_tokens, heads, head_dim, seed):
    layout = KVLayout.gqa(num_layers, heads, head_dim, torch.float16, block_tokens)
    store = LocalBlockStore(tmp_path_factory.mktemp("s"), layout)
    blocks = make_blocks(layout, 2, seed)
    ids = write_chain(store, blocks)
    out = poisoned(layout.full_block_bytes)
    for block_id, block in zip(ids, blocks, strict=True):
        store.read_into(block_id, out)
        assert torch.equal(out, block)


def _age_temporaries(root) -> None:
    """Make every temporary under ``root`` older than a crashed write's (as after a restart much later)."""
    old = time.time() - STALE_TEMP_S - 1
    for temporary in root.rglob(".*.tmp"):
        os.utime(temporary, (old, old))


class _HeldRename(FaultInjector):
    """Holds each write between its fsync and its rename until ``go`` is set (another instance opens meanwhile)."""

    def __init__(self) -> None:
        super().__init__()
        self.at_rename, self.go = threading.Event(), threading.Event()

    def before_rename(self, block_id: bytes) -> None:
        self.at_rename.set()
        assert self.go.wait(10.0), "the test never let the rename go"
        super().before_rename(block_id)


def test_an_instance_opening_the_store_keeps_another_ones_write_in_progress(tmp_path):
    """Instances (on several hosts) share one store: one opening it while another's block is between its fsync and its
    rename must leave that temporary alone, so the write completes and both see the block."""
    held = _HeldRename()
    writer = LocalBlockStore(tmp_path, FP8_LAYOUT, faults=held)
    block = make_blocks(FP8_LAYOUT, 1)[0]
    block_id = block_hashes(list(range(8)), FP8_LAYOUT.block_tokens, namespace=FP8_LAYOUT.fingerprint())[0]
    result: list = []
    thread = threading.Thread(target=lambda: result.append(writer.write_block(block_id, None, block)))
    thread.start()
    assert held.at_rename.wait(10.0)
    temporaries = list(tmp_path.rglob(".*.tmp"))
    assert len(temporaries) == 1, temporaries
    (temporary,) = temporaries
    assert f".{socket.gethostname()}.{os.getpid()}." in temporary.name  # two hosts' writers never share a name
    other = LocalBlockStore(tmp_path, FP8_LAYOUT)  # another instance starts now
    assert other.removed_temporaries == 0 and temporary.exists()
    held.go.set()
    thread.join(10.0)
    assert result == [True]
    out = torch.empty(FP8_LAYOUT.full_block_bytes, dtype=torch.uint8)
    other.refresh([block_id])
    other.read_into(block_id, out)
    assert torch.equal(out, block.reshape(-1).view(torch.uint8)) and list(tmp_path.rglob("*.tmp")) == []


def test_crash_between_write_and_rename_leaves_no_visible_block(tmp_path):
    faults = FaultInjector()
    store = LocalBlockStore(tmp_path, FP8_LAYOUT, faults=faults)
    blocks = make_blocks(FP8_LAYOUT, 2)
    first, second = block_hashes(list(range(8)), FP8_LAYOUT.block_tokens, namespace=FP8_LAYOUT.fingerprint())
    store.write_block(first, None, blocks[0])
    faults.crash_next_write_before_rename(second)
    with pytest.raises(FaultInjector.SimulatedCrash):
        store.write_block(second, first, blocks[1])
    # the fully written, fsync'ed temporary exists, but no block is visible under its name
    assert not store.path_of(second).exists()
    assert len(list(store.path_of(second).parent.glob(".*.tmp"))) == 1
    assert not store.contains(second) and store.longest_prefix([first, second]) == 1
    with pytest.raises(StorageReadError, match="not in the store"):
        store.read_into(second, torch.empty(FP8_LAYOUT.full_block_bytes, dtype=torch.uint8))
    # "restart" once the temporary is stale: it is cleaned up, the earlier block survives, the write can be redone
    _age_temporaries(tmp_path)
    restarted = LocalBlockStore(tmp_path, FP8_LAYOUT)
    assert restarted.removed_temporaries == 1
    assert list(tmp_path.rglob("*.tmp")) == []
    assert restarted.longest_prefix([first, second]) == 1
    assert restarted.write_block(second, first, blocks[1])
    out = torch.empty(FP8_LAYOUT.full_block_bytes, dtype=torch.uint8)
    restarted.read_into(second, out)
    assert torch.equal(out, blocks[1])


def chain_of(layout: KVLayout, blocks: torch.Tensor) -> list[tuple[bytes, bytes | None, torch.Tensor]]:
    """``(block id, parent id, payload)`` of each block of one hash chain."""
    tokens = list(range(len(blocks) * layout.block_tokens))
    ids = block_hashes(tokens, layout.block_tokens, namespace=layout.fingerprint())
    return [(block_id, ids[b - 1] if b else None, blocks[b]) for b, block_id in enumerate(ids)]


class SyncCalls:
    """Counts ``os.fsync`` and the store's ``syncfs`` calls while entered (hypothesis and monkeypatch do not mix)."""

    def __enter__(self) -> SyncCalls:
        self.fsyncs, self.syncfs = [], []
        self._fsync, self._syncfs = os.fsync, store_mod._syncfs
        os.fsync = lambda fd: (self.fsyncs.append(fd), self._fsync(fd))[1]
        store_mod._syncfs = lambda fd: (self.syncfs.append(fd), self._syncfs(fd))[1]
        return self

    def __exit__(self, *exc: object) -> None:
        os.fsync, store_mod._syncfs = self._fsync, self._syncfs


@settings(max_examples=20, deadline=None)
@given(
    count=st.integers(1, 8),
    stored_before=st.integers(0, 8),
    seed=st.integers(0, 2**16),
    mode=st.sampled_from(["syncfs", "fsync"]),
)
def test_a_chain_costs_two_syncfs_or_one_fsync_per_new_block_and_directory(
    tmp_path_factory, count, stored_before, seed, mode
):
    """``write_blocks``: ``syncfs`` mode, one syncfs for the chain's files and one for its renames, whatever its
    length (the blocks' shards differ: per-file and per-directory fsyncs came to about two per block); ``fsync``
    mode, one fsync per new block's file, then one per directory its renames touched (its shards, and ``blocks``
    where a shard was new). Blocks already stored cost nothing and return False; every block reads back bit-exact."""
    store = LocalBlockStore(tmp_path_factory.mktemp("s"), FP8_LAYOUT, sync=mode)
    assert store.sync_mode == mode
    chain = chain_of(FP8_LAYOUT, make_blocks(FP8_LAYOUT, count, seed))
    stored_before = min(stored_before, count)
    assert store.write_blocks(chain[:stored_before]) == [True] * stored_before
    old_shards = {store.path_of(block_id).parent for block_id, _, _ in chain[:stored_before]}
    new_shards = {store.path_of(block_id).parent for block_id, _, _ in chain[stored_before:]}
    with SyncCalls() as calls:
        assert store.write_blocks(chain) == [False] * stored_before + [True] * (count - stored_before)
    new = count - stored_before
    if mode == "syncfs":
        assert (len(calls.fsyncs), len(calls.syncfs)) == (0, 2 if new else 0)
    else:
        assert len(calls.syncfs) == 0
        assert len(calls.fsyncs) == new + len(new_shards) + bool(new_shards - old_shards)
    out = poisoned(FP8_LAYOUT.full_block_bytes)
    for block_id, _, block in chain:
        store.read_into(block_id, out)
        assert torch.equal(out, block)
    store.close()


def test_the_sync_mode_is_chosen_at_open_and_says_why(tmp_path, monkeypatch):
    assert LocalBlockStore(tmp_path / "a", FP8_LAYOUT).sync_mode == "syncfs"  # Linux >= 5.8 on a local disk
    fsync = LocalBlockStore(tmp_path / "b", FP8_LAYOUT, sync="fsync")
    assert (fsync.sync_mode, fsync.sync_mode_reason) == ("fsync", "per-file fsync chosen by the caller")
    with pytest.raises(ConfigError, match="sync='always' is not one of"):
        LocalBlockStore(tmp_path / "c", FP8_LAYOUT, sync="always")
    monkeypatch.setattr(store_mod, "_fs_type", lambda path: "fuse.3fs")
    fuse = LocalBlockStore(tmp_path / "d", FP8_LAYOUT)
    assert fuse.sync_mode == "fsync" and "fuse.3fs" in fuse.sync_mode_reason
    monkeypatch.setattr(store_mod, "_fs_type", lambda path: "ext4")
    monkeypatch.setattr(store_mod.platform, "release", lambda: "5.4.0-150-generic")
    assert (
        "from Linux 5.8 on; this is 5.4.0-150-generic" in LocalBlockStore(tmp_path / "e", FP8_LAYOUT).sync_mode_reason
    )
    monkeypatch.setattr(store_mod, "_LIBC_SYNCFS", None)
    with pytest.raises(ConfigError, match="sync='syncfs' but the C library has no syncfs"):
        LocalBlockStore(tmp_path / "f", FP8_LAYOUT, sync="syncfs")


def test_the_file_system_of_a_path_is_its_longest_mount_point(tmp_path, monkeypatch):
    mounts = "/dev/vda / ext4 rw 0 0\nfs0 /mnt/my\\040store fuse.3fs rw 0 0\nx /mnt/my xfs rw 0 0\n"
    real_read_text = store_mod.Path.read_text
    monkeypatch.setattr(
        store_mod.Path, "read_text", lambda p: mounts if str(p) == "/proc/self/mounts" else real_read_text(p)
    )
    assert store_mod._fs_type(store_mod.Path("/mnt/my store/blocks")) == "fuse.3fs"
    assert store_mod._fs_type(store_mod.Path("/mnt/my/blocks")) == "xfs"
    assert store_mod._fs_type(store_mod.Path("/mnt/mystore")) == "ext4"


@pytest.mark.parametrize("mode", ["syncfs", "fsync"])
def test_a_crash_before_the_files_are_durable_leaves_no_block_known_or_visible(tmp_path, mode):
    """A process dying after a chain's files are written, before they are made durable: no block is indexed or
    visible under its name (a lookup, a restart find none), only temporaries, removed once stale; the chain is
    written again whole."""
    faults = FaultInjector()
    store = LocalBlockStore(tmp_path, FP8_LAYOUT, sync=mode, faults=faults)
    chain = chain_of(FP8_LAYOUT, make_blocks(FP8_LAYOUT, 3))
    ids = [block_id for block_id, _, _ in chain]
    faults.crash_next_write_before_sync()
    with pytest.raises(FaultInjector.SimulatedCrash):
        store.write_blocks(chain)
    assert store.longest_prefix(ids) == 0 and not any(store.path_of(block_id).exists() for block_id in ids)
    assert len(list(tmp_path.rglob(".*.tmp"))) == 3
    assert LocalBlockStore(tmp_path, FP8_LAYOUT).longest_prefix(ids) == 0  # another instance, or a restart
    _age_temporaries(tmp_path)
    restarted = LocalBlockStore(tmp_path, FP8_LAYOUT)
    assert restarted.removed_temporaries == 3 and list(tmp_path.rglob("*.tmp")) == []
    assert restarted.write_blocks(chain) == [True] * 3
    out = torch.empty(FP8_LAYOUT.full_block_bytes, dtype=torch.uint8)
    for block_id, _, block in chain:
        restarted.read_into(block_id, out)
        assert torch.equal(out, block)


@pytest.mark.parametrize("failing", ["files", "renames"])
def test_a_failed_syncfs_stores_nothing_and_leaves_no_temporary(tmp_path, monkeypatch, failing):
    """syncfs reporting a write-back error (EIO): on the files, nothing is renamed and the temporaries go; on the
    renames, the blocks are visible but not indexed (not known durable). Either way the error reaches the caller."""
    store = LocalBlockStore(tmp_path, FP8_LAYOUT, sync="syncfs")
    chain = chain_of(FP8_LAYOUT, make_blocks(FP8_LAYOUT, 3))
    ids = [block_id for block_id, _, _ in chain]
    calls, real_syncfs = [], store_mod._syncfs

    def syncfs(fd):
        calls.append(fd)
        if len(calls) == (1 if failing == "files" else 2):
            raise OSError(errno.EIO, "syncfs: injected write-back error")
        real_syncfs(fd)

    monkeypatch.setattr(store_mod, "_syncfs", syncfs)
    with pytest.raises(OSError, match="injected write-back error"):
        store.write_blocks(chain)
    assert store.index.longest_prefix(ids) == 0 and list(tmp_path.rglob("*.tmp")) == []
    assert [store.path_of(block_id).exists() for block_id in ids] == [failing == "renames"] * 3


def test_a_crash_inside_a_chain_leaves_the_blocks_before_whole_and_the_rest_invisible(tmp_path):
    faults = FaultInjector()
    store = LocalBlockStore(tmp_path, FP8_LAYOUT, faults=faults)
    chain = chain_of(FP8_LAYOUT, make_blocks(FP8_LAYOUT, 4))
    ids = [block_id for block_id, _, _ in chain]
    faults.crash_next_write_before_rename(ids[2])
    with pytest.raises(FaultInjector.SimulatedCrash):
        store.write_blocks(chain)
    # blocks 0 and 1 were renamed whole (their files durable); blocks 2 and 3 are durable temporaries, not renamed
    assert [store.path_of(block_id).exists() for block_id in ids] == [True, True, False, False]
    assert len(list(tmp_path.rglob(".*.tmp"))) == 2
    _age_temporaries(tmp_path)
    restarted = LocalBlockStore(tmp_path, FP8_LAYOUT)
    assert restarted.removed_temporaries == 2 and list(tmp_path.rglob("*.tmp")) == []
    assert restarted.longest_prefix(ids) == 2
    out = torch.empty(FP8_LAYOUT.full_block_bytes, dtype=torch.uint8)
    for block_id, _, block in chain[:2]:
        restarted.read_into(block_id, out)
        assert torch.equal(out, block)
    assert restarted.write_blocks(chain) == [False, False, True, True]
    assert restarted.longest_prefix(ids) == 4


@pytest.mark.parametrize("failing", [1, 3])
def test_an_io_error_inside_a_chain_keeps_the_blocks_before_durable_and_known(tmp_path, monkeypatch, failing):
    store = LocalBlockStore(tmp_path, FP8_LAYOUT)
    chain = chain_of(FP8_LAYOUT, make_blocks(FP8_LAYOUT, 4))
    ids = [block_id for block_id, _, _ in chain]
    real_pwritev, calls = os.pwritev, []

    def pwritev(fd, buffers, offset):
        calls.append(fd)
        if len(calls) == failing:  # that block's file
            raise OSError(errno.ENOSPC, "injected: no space left")
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    with pytest.raises(OSError, match="no space left"):
        store.write_blocks(chain)
    assert store.longest_prefix(ids) == failing - 1 and list(tmp_path.rglob("*.tmp")) == []
    assert LocalBlockStore(tmp_path, FP8_LAYOUT).longest_prefix(ids) == failing - 1


def test_a_bad_entry_refuses_the_whole_chain_before_anything_is_written(store):
    chain = chain_of(FP8_LAYOUT, make_blocks(FP8_LAYOUT, 3))
    short = [*chain[:2], (chain[2][0], chain[2][1], chain[2][2][:-1])]
    with pytest.raises(BoundsError, match="a Full Block is"):
        store.write_blocks(short)
    with pytest.raises(InvalidKey, match="is not stored; write chains in order"):
        store.write_blocks(chain[1:])  # its first block's parent is neither stored nor in the chain
    assert store.longest_prefix([block_id for block_id, _, _ in chain]) == 0
    assert list(store.root.rglob("*.kvb")) == []


def flip_payload_byte_on_disk(store: LocalBlockStore, block_id: bytes, offset: int) -> None:
    with open(store.path_of(block_id), "r+b") as handle:
        handle.seek(HEADER_BYTES + offset)
        value = handle.read(1)[0]
        handle.seek(HEADER_BYTES + offset)
        handle.write(bytes([value ^ 0x01]))


@pytest.mark.parametrize("where", ["on_disk", "injected"])
def test_checksum_mismatch_raises_and_leaves_destination_untouched(store, where):
    blocks = make_blocks(FP8_LAYOUT, 2)
    ids = write_chain(store, blocks)
    if where == "on_disk":
        flip_payload_byte_on_disk(store, ids[1], FP8_LAYOUT.full_block_bytes - 1)  # the tail page
    else:
        store.faults.corrupt_next_read(ids[1], byte_offset=17)
    dest = poisoned(FP8_LAYOUT.full_block_bytes, guard=64)
    with pytest.raises(ChecksumMismatch, match=f"block {ids[1].hex()}.*CRC-32"):
        store.read_into(ids[1], dest[64:-64])
    assert torch.equal(dest, poisoned(FP8_LAYOUT.full_block_bytes, guard=64))
    # the neighbour block is fine; after an injected (transient) corruption the block reads cleanly again
    store.read_into(ids[0], dest[64:-64])
    assert torch.equal(dest[64:-64], blocks[0])
    if where == "injected":
        store.read_into(ids[1], dest[64:-64])
        assert torch.equal(dest[64:-64], blocks[1])


def test_checksum_mismatch_without_preservation_still_stays_inside_the_destination(store):
    ids = write_chain(store, make_blocks(FP8_LAYOUT, 1))
    flip_payload_byte_on_disk(store, ids[0], 0)
    guard = 128
    dest = poisoned(FP8_LAYOUT.full_block_bytes, guard=guard)
    with pytest.raises(ChecksumMismatch):
        store.read_into(ids[0], dest[guard:-guard], preserve_on_error=False)
    assert torch.all(dest[:guard] == POISON) and torch.all(dest[-guard:] == POISON)


def test_corrupted_header_is_detected(store):
    ids = write_chain(store, make_blocks(FP8_LAYOUT, 1))
    with open(store.path_of(ids[0]), "r+b") as handle:
        handle.seek(20)
        handle.write(b"\xff")
    dest = poisoned(FP8_LAYOUT.full_block_bytes)
    with pytest.raises(ChecksumMismatch, match="header CRC"):
        store.read_into(ids[0], dest)
    assert torch.all(dest == POISON)
    assert LocalBlockStore(store.root, FP8_LAYOUT).skipped_files == 1  # not indexed on reopen


def test_injected_read_error_raises_storage_read_error_and_keeps_destination(store):
    blocks = make_blocks(FP8_LAYOUT, 1)
    ids = write_chain(store, blocks)
    store.faults.fail_next_read(ids[0], errno.EIO)
    dest = poisoned(FP8_LAYOUT.full_block_bytes)
    with pytest.raises(StorageReadError, match="injected read error") as caught:
        store.read_into(ids[0], dest)
    assert caught.value.errno == errno.EIO and not isinstance(caught.value, ChecksumMismatch)
    assert torch.all(dest == POISON)
    store.read_into(ids[0], dest)  # the fault fired once
    assert torch.equal(dest, blocks[0])


def test_truncated_file_is_a_read_error(store):
    ids = write_chain(store, make_blocks(FP8_LAYOUT, 1))
    os.truncate(store.path_of(ids[0]), HEADER_BYTES + 100)
    dest = poisoned(FP8_LAYOUT.full_block_bytes)
    with pytest.raises(StorageReadError, match="file ended"):
        store.read_into(ids[0], dest)
    assert torch.all(dest == POISON)


def test_bad_writes_and_reads_are_rejected(store):
    blocks = make_blocks(FP8_LAYOUT, 2)
    ids = block_hashes(list(range(8)), FP8_LAYOUT.block_tokens)
    with pytest.raises(InvalidKey, match="not stored; write chains in order"):
        store.write_block(ids[1], ids[0], blocks[1])
    with pytest.raises(BoundsError, match=f"payload is 5247 bytes, a Full Block is {FP8_LAYOUT.full_block_bytes}"):
        store.write_block(ids[0], None, blocks[0][:-1])
    assert store.write_block(ids[0], None, blocks[0]) and not store.write_block(ids[0], None, blocks[0])
    dest = poisoned(FP8_LAYOUT.full_block_bytes + 1)
    with pytest.raises(BoundsError, match="destination is 5249 bytes"):
        store.read_into(ids[0], dest)
    assert torch.all(dest == POISON)
    with pytest.raises(StorageReadError, match="not in the store") as caught:
        store.read_into(ids[1], dest[:-1])
    assert caught.value.errno == errno.ENOENT
    with pytest.raises(ValueError, match="read-only"):
        store.read_into(ids[0], bytes(FP8_LAYOUT.full_block_bytes))


def test_blocks_of_another_layout_are_not_indexed(tmp_path):
    store = LocalBlockStore(tmp_path, FP8_LAYOUT)
    ids = write_chain(store, make_blocks(FP8_LAYOUT, 1))
    other = LocalBlockStore(tmp_path, KVLayout.mla_fp8(num_layers=2, block_tokens=8))
    assert not other.contains(ids[0]) and other.skipped_files == 1


def test_refresh_adopts_blocks_another_store_wrote_after_open(tmp_path):
    reader = LocalBlockStore(tmp_path, FP8_LAYOUT)
    writer = LocalBlockStore(tmp_path, FP8_LAYOUT)
    blocks = make_blocks(FP8_LAYOUT, 4)
    ids = write_chain(writer, blocks)
    assert reader.longest_prefix(ids) == 0  # the index is built at open
    os.unlink(writer.path_of(ids[2]))  # a gap: the blocks after it stay unreachable
    assert reader.refresh(ids) == 2
    assert reader.longest_prefix(ids) == 2 and not reader.contains(ids[3])
    assert reader.refresh(ids) == 0  # idempotent
    out = poisoned(FP8_LAYOUT.full_block_bytes)
    reader.read_into(ids[1], out.numpy())
    assert torch.equal(out, blocks[1])


def test_refresh_ignores_files_of_another_layout(tmp_path):
    other = LocalBlockStore(tmp_path, GQA_LAYOUT)
    ids = write_chain(other, make_blocks(GQA_LAYOUT, 2))
    reader = LocalBlockStore(tmp_path, FP8_LAYOUT)
    assert reader.refresh(ids) == 0 and reader.longest_prefix(ids) == 0


def test_remove_deletes_the_subtree(store):
    ids = write_chain(store, make_blocks(FP8_LAYOUT, 3))
    assert sorted(store.remove(ids[1])) == sorted(ids[1:])
    assert store.longest_prefix(ids) == 1 and not store.path_of(ids[2]).exists()


def test_direct_io_fallback_is_detected_at_open_and_reported(tmp_path, monkeypatch):
    real_open = os.open

    def open_without_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_without_direct)
    store = LocalBlockStore(tmp_path, FP8_LAYOUT)
    assert store.io_mode == "buffered"
    assert "O_DIRECT refused" in store.io_mode_reason and "errno 22" in store.io_mode_reason
    blocks = make_blocks(FP8_LAYOUT, 1)
    ids = write_chain(store, blocks)
    out = torch.empty(FP8_LAYOUT.full_block_bytes, dtype=torch.uint8)
    store.read_into(ids[0], out)  # every read goes buffered, never asks for O_DIRECT
    assert torch.equal(out, blocks[0])
    with pytest.raises(ConfigError, match="direct_io=True but O_DIRECT refused"):
        LocalBlockStore(tmp_path, FP8_LAYOUT, direct_io=True)
    assert LocalBlockStore(tmp_path, FP8_LAYOUT, direct_io=False).io_mode_reason == "O_DIRECT disabled by the caller"


# -- read queue --------------------------------------------------------------------------------------------------
def reference_start_times(sizes: list[int], rate: float, burst: float) -> list[float]:
    """Start times of FIFO requests under the bucket rule, computed in closed form per step."""
    tokens, last, starts = burst, 0.0, []
    for size in sizes:
        need = min(size, burst)
        start = last if tokens >= need else last + (need - tokens) / rate
        tokens = min(burst, tokens + (start - last) * rate) - size
        last = start
        starts.append(start)
    return starts


@settings(max_examples=10, deadline=None)
@given(count=st.integers(1, 8), burst_blocks=st.sampled_from([0.5, 1, 2, 3]), rate=st.sampled_from([1e3, 4096.0, 1e6]))
def test_read_queue_paces_to_the_bandwidth_cap(tmp_path_factory, count, burst_blocks, rate):
    store = LocalBlockStore(tmp_path_factory.mktemp("q"), FP8_LAYOUT)
    blocks = make_blocks(FP8_LAYOUT, count)
    ids = write_chain(store, blocks)
    nbytes = FP8_LAYOUT.full_block_bytes
    burst = int(burst_blocks * nbytes)
    clock = ManualClock(auto_advance=True)  # time passes only through the pacer's sleeps
    dests = torch.full((count, nbytes), POISON, dtype=torch.uint8)
    with ReadQueue(store, rate, burst_bytes=burst, clock=clock, io_depth=2) as queue:
        tickets = queue.submit_many(ids, list(dests))
        for ticket in tickets:
            ticket.wait()
        stats = queue.stats()
    assert torch.equal(dests, blocks)
    starts = [ticket.started_at for ticket in tickets]
    assert starts == pytest.approx(reference_start_times([nbytes] * count, rate, burst), rel=1e-12, abs=1e-12)
    for index, start in enumerate(starts):  # the cap: bytes started by t <= burst + rate * t (+ one oversized read)
        assert (index + 1) * nbytes <= burst + rate * start + max(0, nbytes - burst) + 1e-6
    assert (stats.completed_requests, stats.completed_bytes, stats.completed_blocks) == (count, count * nbytes, count)
    assert (stats.requests, stats.bytes) == (0, 0)


def test_a_further_share_of_a_block_is_a_read_but_not_a_block(tmp_path):
    store = LocalBlockStore(tmp_path, FP8_LAYOUT)
    ids = write_chain(store, make_blocks(FP8_LAYOUT, 2))
    dests = torch.empty((3, FP8_LAYOUT.full_block_bytes), dtype=torch.uint8)
    with ReadQueue(store, 1e12) as queue:
        tickets = [queue.submit(ids[0], dests[0]), queue.submit(ids[0], dests[1], block=False)]
        tickets.append(queue.submit(ids[1], dests[2]))
        for ticket in tickets:
            ticket.wait(10)
        stats = queue.stats()
    assert (stats.completed_requests, stats.completed_blocks) == (3, 2)


def test_token_bucket_rules():
    bucket = TokenBucket(100.0, 50, now=0.0)
    assert bucket.delay_for(50, 0.0) == 0.0
    bucket.take(50, 0.0)
    assert bucket.delay_for(20, 0.0) == pytest.approx(0.2)
    assert bucket.delay_for(500, 0.1) == pytest.approx(0.4)  # oversized: waits for a full bucket only
    bucket.take(500, 0.5)
    assert bucket.delay_for(1, 0.5) == pytest.approx(4.51)
    with pytest.raises(ConfigError, match="bandwidth_bytes_per_s must be > 0"):
        TokenBucket(0, 1, 0.0)


def test_read_queue_reports_its_length_in_requests_and_bytes(tmp_path):
    store = LocalBlockStore(tmp_path, FP8_LAYOUT)
    blocks = make_blocks(FP8_LAYOUT, 4)
    ids = write_chain(store, blocks)
    nbytes = FP8_LAYOUT.full_block_bytes
    clock = ManualClock(timeout_s=10)
    queue = ReadQueue(store, bandwidth_bytes_per_s=nbytes, clock=clock, node="de3")  # one block per virtual second
    assert queue.stats().requests == 0
    dests = torch.empty(4, nbytes, dtype=torch.uint8)
    tickets = queue.submit_many(ids, list(dests))
    tickets[0].wait()  # the first read fits the initial burst
    clock.wait_for_sleepers(1)  # the pacer now waits for tokens for read 2
    stats = queue.stats()
    assert (stats.queued_requests, stats.queued_bytes) == (3, 3 * nbytes)
    assert (stats.completed_requests, stats.inflight_requests, stats.requests, stats.bytes) == (1, 0, 3, 3 * nbytes)
    assert not tickets[1].done
    clock.advance(1.0)
    tickets[1].wait()
    clock.wait_for_sleepers(1)
    assert (queue.stats().queued_requests, queue.stats().queued_bytes) == (2, 2 * nbytes)
    assert tickets[1].started_at == 1.0
    clock.advance(2.0)  # read 3 may start at t=3; read 4 then needs one more second
    tickets[2].wait()
    clock.wait_for_sleepers(1)
    assert (queue.stats().queued_requests, queue.stats().queued_bytes) == (1, nbytes)
    clock.advance(1.0)
    tickets[3].wait()
    assert [t.started_at for t in tickets] == [0.0, 1.0, 3.0, 4.0]
    assert torch.equal(dests, blocks)
    queue.close()


def test_read_queue_failures_reach_the_waiter(tmp_path):
    store = LocalBlockStore(tmp_path, FP8_LAYOUT)
    ids = write_chain(store, make_blocks(FP8_LAYOUT, 2))
    store.faults.corrupt_next_read(ids[1])
    nbytes = FP8_LAYOUT.full_block_bytes
    with ReadQueue(store, 1e12, clock=ManualClock(auto_advance=True), max_queued_bytes=2 * nbytes) as queue:
        good, bad = queue.submit_many(ids, [torch.empty(nbytes, dtype=torch.uint8) for _ in ids])
        good.wait()
        with pytest.raises(ChecksumMismatch):
            bad.wait()
        assert queue.stats().failed_requests == 1
        with pytest.raises(BoundsError, match="destination is 1 bytes"):
            queue.submit(ids[0], torch.empty(1, dtype=torch.uint8))


def test_read_queue_bounds_and_close(tmp_path):
    store = LocalBlockStore(tmp_path, FP8_LAYOUT)
    ids = write_chain(store, make_blocks(FP8_LAYOUT, 3))
    nbytes = FP8_LAYOUT.full_block_bytes
    clock = ManualClock(timeout_s=10)
    queue = ReadQueue(store, 1.0, burst_bytes=nbytes, clock=clock, max_queued_bytes=nbytes)
    first = queue.submit(ids[0], torch.empty(nbytes, dtype=torch.uint8))
    first.wait()
    second = queue.submit(ids[1], torch.empty(nbytes, dtype=torch.uint8))
    clock.wait_for_sleepers(1)
    with pytest.raises(CapacityError, match="max_queued_bytes"):
        queue.submit(ids[2], torch.empty(nbytes, dtype=torch.uint8))
    clock.advance(1e9)  # let the pacer wake so close() can join it
    queue.close()
    with pytest.raises(QueueError, match="closed"):
        queue.submit(ids[2], torch.empty(nbytes, dtype=torch.uint8))
    try:  # read before the close, or failed with QueueError by it: never left hanging
        second.wait()
    except QueueError:
        pass
    assert second.done
