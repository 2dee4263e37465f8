"""Announcements of blocks being persisted: bounded waits, and the worker withdraws each once it is written."""

from __future__ import annotations

import math
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from ascend_dualpath.errors import AdpError, ArgumentTypeError, ConfigError
from ascend_dualpath.integrations.vllm.metadata import PersistSpec
from ascend_dualpath.integrations.vllm.persisting import PersistAnnouncements, Persister
from ascend_dualpath.kv import store as store_mod
from ascend_dualpath.kv.faults import FaultInjector
from ascend_dualpath.kv.layout import KVLayout, block_hashes
from ascend_dualpath.kv.store import LocalBlockStore

IDS = [bytes([i]) * 16 for i in range(4)]


@pytest.mark.parametrize("wait_s", [0, -1.0, math.nan, math.inf])
def test_the_wait_bound_is_finite_and_positive(tmp_path, wait_s):
    with pytest.raises(ConfigError, match="wait_s"):
        PersistAnnouncements(tmp_path, wait_s)


def test_the_wait_bound_is_a_number(tmp_path):
    with pytest.raises(ArgumentTypeError, match="wait_s"):
        PersistAnnouncements(tmp_path, "5")


def test_an_announcement_is_pending_until_withdrawn_or_stale(tmp_path):
    announcements = PersistAnnouncements(tmp_path, 60.0)
    announcements.announce(IDS[:2])
    assert [announcements.pending(i) for i in IDS] == [True, True, False, False]
    announcements.withdraw(IDS[:1])
    assert [announcements.pending(i) for i in IDS] == [False, True, False, False]
    assert not PersistAnnouncements(tmp_path, 1e-9).pending(IDS[1])  # older than the bound: its writer died


class _Store:
    """Writes succeed unless the chain holds ``failing`` (refused whole, as the store checks a chain before writing
    any of it); records what was written."""

    def __init__(self, failing: bytes | None = None, error: type = AdpError) -> None:
        self.failing, self.error, self.written = failing, error, []

    def write_blocks(self, chain: list) -> list[bool]:
        if any(block_id == self.failing for block_id, _, _ in chain):
            raise self.error(f"injected write failure of {self.failing.hex()}")
        self.written += [block_id for block_id, _, _ in chain]
        return [True] * len(chain)

    def contains(self, block_id: bytes) -> bool:
        return block_id in self.written

    def refresh(self, block_ids: list) -> int:
        return 0


@pytest.mark.parametrize(("failing", "error"), [(None, AdpError), (IDS[2], AdpError), (IDS[2], OSError)])
def test_the_worker_withdraws_every_announcement_written_or_not(tmp_path, failing, error):
    """A refused chain and a disk error (ENOSPC, EIO: an OSError) alike end the request's persisting, counted."""
    announcements = PersistAnnouncements(tmp_path, 60.0)
    spec = PersistSpec("r", 1, IDS, [0, 1, 2, 3])
    announcements.announce(IDS[1:])
    counters = SimpleNamespace(persisted_blocks=0, failures=0)
    persister = Persister(_Store(failing, error), announcements, counters)
    try:
        persister.persist(spec, lambda i: b"")
        deadline = time.monotonic() + 10
        while not (done := persister.finished()):
            assert time.monotonic() < deadline, "the writes did not end"
            time.sleep(0.01)
    finally:
        persister.close()
    assert done == {"r"}
    assert persister.store.written == (IDS[1:] if failing is None else [])
    assert (counters.persisted_blocks, counters.failures) == ((3, 0) if failing is None else (0, 1))
    assert not any(announcements.pending(i) for i in IDS)


def _persist_and_wait(persister: Persister, spec: PersistSpec, block) -> None:
    persister.persist(spec, block)
    deadline = time.monotonic() + 10
    while not persister.finished():
        assert time.monotonic() < deadline, "the writes did not end"
        time.sleep(0.01)


@pytest.mark.parametrize("mode", ["syncfs", "fsync"])
@pytest.mark.parametrize("blocks", [1, 6])
def test_a_request_is_persisted_with_one_sync_round(tmp_path, monkeypatch, blocks, mode):
    """A request of N new blocks costs one syncfs for its files and one for their renames (``syncfs`` mode), or N
    fsyncs (each block's file) plus one per directory its blocks went to (``fsync`` mode: their ``blocks/<id[:2]>``
    shards, and ``blocks`` itself when a shard was created): about two per block, as blocks land in different
    shards; the blocks read back bit-exact and no announcement is left."""
    layout = KVLayout.mla_fp8(num_layers=2, block_tokens=4)
    store = LocalBlockStore(tmp_path, layout, sync=mode)
    ids = block_hashes(list(range(4 * blocks)), 4, namespace=layout.fingerprint())
    payloads = torch.randint(0, 256, (blocks, layout.full_block_bytes), dtype=torch.uint8)
    announcements = PersistAnnouncements(tmp_path, 60.0)
    announcements.announce(ids)
    fsyncs, syncfs = [], []
    real_fsync, real_syncfs = os.fsync, store_mod._syncfs
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd))[1])
    monkeypatch.setattr(store_mod, "_syncfs", lambda fd: (syncfs.append(fd), real_syncfs(fd))[1])
    persister = Persister(store, announcements, SimpleNamespace(persisted_blocks=0, failures=0))
    try:
        _persist_and_wait(persister, PersistSpec("r", 0, ids, list(range(blocks))), lambda i: payloads[i].clone())
    finally:
        persister.close()
    shards = {store.path_of(block_id).parent for block_id in ids}
    if mode == "syncfs":
        assert (len(fsyncs), len(syncfs)) == (0, 2)
    else:  # + 1: ``blocks``, where every shard was new
        assert (len(fsyncs), len(syncfs)) == (blocks + len(shards) + 1, 0)
    assert persister.counters.persisted_blocks == blocks and store.longest_prefix(ids) == blocks
    out = torch.empty(layout.full_block_bytes, dtype=torch.uint8)
    for block_id, payload in zip(ids, payloads, strict=True):
        store.read_into(block_id, out)
        assert torch.equal(out, payload)
    assert not any(announcements.pending(block_id) for block_id in ids)
    store.close()


def test_a_crash_between_writing_and_syncing_a_request_leaves_none_of_its_blocks_stored(tmp_path):
    """The writer dies after a request's block files are written, before they are made durable: none of its blocks
    is indexed or visible, so no lookup (here or in a restarted instance) finds one; only temporaries remain (removed
    once stale, tests/kv/test_store.py)."""
    layout = KVLayout.mla_fp8(num_layers=2, block_tokens=4)
    faults = FaultInjector()
    store = LocalBlockStore(tmp_path, layout, faults=faults)
    ids = block_hashes(list(range(12)), 4, namespace=layout.fingerprint())
    announcements = PersistAnnouncements(tmp_path, 60.0)
    persister = Persister(store, announcements, SimpleNamespace(persisted_blocks=0, failures=0))
    faults.crash_next_write_before_sync()
    try:
        block = lambda i: torch.full((layout.full_block_bytes,), i, dtype=torch.uint8)  # noqa: E731
        _persist_and_wait(persister, PersistSpec("r", 0, ids, [0, 1, 2]), block)
    finally:
        persister.close()
    assert persister.counters.persisted_blocks == 0 and store.longest_prefix(ids) == 0
    assert not any(store.path_of(block_id).exists() for block_id in ids)
    assert LocalBlockStore(tmp_path, layout).longest_prefix(ids) == 0
    assert len(list((tmp_path / "blocks").rglob(".*.tmp"))) == 3


@pytest.mark.parametrize("parent", ["written", "being written", "missing"])
def test_a_chain_whose_parent_another_instance_writes_waits_for_it(tmp_path, parent):
    """Two instances on one store (data-parallel engines, two DEs): a conversation's turn persisted by instance A,
    its next turn by instance B, whose store opened before A wrote. B adopts a parent A wrote meanwhile, waits
    (bounded) for one A has announced and is still writing, and refuses a chain whose parent nobody writes at once
    (counted, nothing stored)."""
    layout = KVLayout.mla_fp8(num_layers=2, block_tokens=4)
    ids = block_hashes(list(range(12)), 4, namespace=layout.fingerprint())
    payloads = torch.randint(0, 256, (3, layout.full_block_bytes), dtype=torch.uint8)
    a, b = LocalBlockStore(tmp_path, layout), LocalBlockStore(tmp_path, layout)
    announcements = PersistAnnouncements(tmp_path, 60.0)
    announcements.announce(ids)
    if parent == "written":
        a.write_blocks([(ids[0], None, payloads[0]), (ids[1], ids[0], payloads[1])])
    elif parent == "being written":
        a.write_blocks([(ids[0], None, payloads[0])])
        writer = threading.Timer(0.5, lambda: a.write_blocks([(ids[1], ids[0], payloads[1])]))
        writer.start()
    else:
        announcements.withdraw(ids[:2])
    persister = Persister(b, announcements, SimpleNamespace(persisted_blocks=0, failures=0))
    start = time.monotonic()
    try:
        _persist_and_wait(persister, PersistSpec("r", 2, ids, [0, 1, 2]), lambda i: payloads[i].clone())
    finally:
        persister.close()
        if parent == "being written":
            writer.join()
    counters = persister.counters
    if parent == "missing":
        assert (counters.persisted_blocks, counters.failures) == (0, 1) and not b.contains(ids[2])
        assert time.monotonic() - start < 5  # not announced: nothing to wait for
    else:
        assert (counters.persisted_blocks, counters.failures) == (1, 0) and b.longest_prefix(ids) == 3
    a.close()
    b.close()
