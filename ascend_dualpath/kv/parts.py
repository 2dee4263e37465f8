"""Persisting Full Blocks from tensor-parallel ranks: each rank writes its part, the rank that completes the set
publishes the whole block.

A rank holds only its heads (:class:`~ascend_dualpath.kv.layout.KVShard`) but the store holds full blocks (every
head), so that a block stored at one tensor-parallel size is read at any other. :class:`PartStore` is a rank's
writing view of a :class:`~ascend_dualpath.kv.store.LocalBlockStore`:

- the rank writes only the units it is the owner of (the lowest rank holding each unit,
  :meth:`KVShard.sources`): with replicated heads the other holders write nothing, and with MLA only rank 0 writes
  (every rank holds the whole latent), straight into the store;
- a part is a file ``<root>/parts/<block id hex>.s<size>/r<rank>.part`` (its ``[L, T, C_r]`` bytes), written to a
  temporary, fsynced and renamed, so a part is whole or absent;
- after writing its parts in chain order, a rank publishes each block whose parts are all there (the store's own
  atomic write: temporary, durable, rename) and removes the parts. Two ranks that both find the set complete both
  publish the same bytes (the rename of the second replaces identical bytes; a part removed under a rank's feet
  means another rank published). A missing part leaves the block invisible: nothing of a block is visible before
  every head is. A rank that completes a block whose parent another rank is still publishing waits for the parent
  (bounded, :data:`PARENT_WAIT_S`): without the wait, both ranks could pass the block by and leave it unpublished.

Crash leftovers: part directories older than :data:`~ascend_dualpath.kv.store.STALE_TEMP_S` (a crashed rank's,
whose block can no longer complete) are removed when a :class:`PartStore` opens.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ascend_dualpath.errors import BoundsError
from ascend_dualpath.kv.layout import KVShard
from ascend_dualpath.kv.memory import as_memoryview
from ascend_dualpath.kv.store import _WRITER, STALE_TEMP_S, TEMP_SUFFIX, LocalBlockStore, ShardStore, _fsync_dir

log = logging.getLogger(__name__)

PARTS_DIR = "parts"
PART_SUFFIX = ".part"
PARENT_WAIT_S = 10.0  # how long a rank that completed a block's parts waits for another rank to publish its parent
PARENT_POLL_S = 0.005


def owner_ranks(shard: KVShard) -> tuple[int, ...]:
    """The ranks of ``shard.size`` that write parts: the lowest holder of each unit (MLA: rank 0)."""
    return tuple(rank for rank, _ in shard.full.shard(1, 0).sources(shard.size))


def assemble(shard: KVShard, parts: dict[int, torch.Tensor]) -> torch.Tensor:
    """The Full Block ``uint8 [L, T, C]`` of every owner's part (``{rank: uint8 [L, T, C_r]}``), a fresh tensor."""
    full = shard.full
    block = torch.empty((full.num_layers, full.block_tokens, full.token_bytes), dtype=torch.uint8)
    for rank, part in parts.items():
        column = 0
        for offset, nbytes in full.shard(shard.size, rank).row_segments():
            block[..., offset : offset + nbytes] = part[..., column : column + nbytes]
            column += nbytes
    return block


class PartStore(ShardStore):
    """Tensor-parallel rank ``shard.rank``'s view of the full-block ``store`` that also writes (module docstring):
    reads as :class:`~ascend_dualpath.kv.store.ShardStore`; ``write_blocks`` takes the rank's local ``[L, T, C_r]``
    payloads and returns, per block, whether this rank published it; ``contains`` sees blocks any rank published."""

    def __init__(self, store: LocalBlockStore, shard: KVShard) -> None:
        super().__init__(store, shard)
        self.owners = owner_ranks(shard)
        self.owns = shard.rank in self.owners
        self._dir = store.root / PARTS_DIR
        self._dir.mkdir(exist_ok=True)
        self.removed_leftovers = self._remove_leftovers()

    def _remove_leftovers(self) -> int:
        """Remove part directories untouched for :data:`STALE_TEMP_S` (a crashed rank's); younger ones may be a
        live rank's, waiting for the others."""
        removed, now = 0, time.time()
        for directory in self._dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if now - directory.stat().st_mtime >= STALE_TEMP_S:
                    shutil.rmtree(directory)
                    removed += 1
        if removed:
            log.warning("block store %s: removed %d part sets left by an interrupted persist", self.store.root, removed)
        return removed

    def _part_dir(self, block_id: bytes) -> Path:
        return self._dir / f"{block_id.hex()}.s{self.shard.size}"

    def write_blocks(self, chain: Sequence[tuple[bytes, bytes | None, Any]]) -> list[bool]:
        """Write this rank's part of each ``(block_id, parent_id, payload [L, T, C_r])`` in chain order, then publish
        the blocks whose parts are complete. A non-owner writes nothing; a single owner (MLA, size 1) writes the
        store's blocks directly."""
        if not self.owns:
            return [False] * len(chain)
        if len(self.owners) == 1:
            return self.store.write_blocks(chain)
        for block_id, _, payload in chain:
            self._write_part(block_id, payload)
        published = []
        for index, (block_id, parent_id, _) in enumerate(chain):
            parts = self._complete_parts(block_id)
            if parts is None and self.adopt(block_id):  # another rank published it and removed the parts
                published.append(False)
                continue
            if parts is None:
                published += [False] * (len(chain) - index)  # a part is missing: its rank publishes when it writes it
                break
            if parent_id is not None and not self._parent_visible(parent_id):
                log.warning("block %s: its parent %s was not published within %.0f s; the block stays invisible",
                            block_id.hex(), parent_id.hex(), PARENT_WAIT_S)  # fmt: skip
                published += [False] * (len(chain) - index)
                break
            published.append(self.store.write_blocks([(block_id, parent_id, assemble(self.shard, parts))])[0])
            shutil.rmtree(self._part_dir(block_id), ignore_errors=True)
        return published

    def contains(self, block_id: bytes) -> bool:
        """Whether the whole block is stored (published by any rank)."""
        return self.adopt(block_id)

    def adopt(self, block_id: bytes) -> bool:
        """Whether ``block_id`` is stored, indexing it and its ancestors that other processes published (walking
        the parents in the files' headers up to an indexed block or a chain's first)."""
        store, pending, current = self.store, [], block_id
        while current is not None and current not in store.index:
            path = store.path_of(current)
            header = store._valid_header(path) if path.exists() else None
            if header is None:
                return False
            pending.append((current, header.parent_id))
            current = header.parent_id
        for child, parent in reversed(pending):
            store.index.add(child, parent)
        return True

    def _parent_visible(self, parent_id: bytes) -> bool:
        """Whether ``parent_id`` is stored, waiting up to :data:`PARENT_WAIT_S` for it: when this rank completes a
        block's parts, the rank that completed its parent's may be publishing the parent right now (the store refuses
        a child before its parent), and nobody would come back to this block if this rank gave up at once."""
        deadline = time.monotonic() + PARENT_WAIT_S
        while not self.adopt(parent_id):
            if time.monotonic() >= deadline:
                return False
            time.sleep(PARENT_POLL_S)
        return True

    def _write_part(self, block_id: bytes, payload: Any) -> None:
        data = as_memoryview(payload, writable=False)
        if data.nbytes != self.layout.full_block_bytes:
            raise BoundsError(
                f"block {block_id.hex()}: part is {data.nbytes} bytes, rank {self.shard.rank}'s is "
                f"{self.layout.full_block_bytes}"
            )
        directory = self._part_dir(block_id)
        directory.mkdir(exist_ok=True)
        final = directory / f"r{self.shard.rank}{PART_SUFFIX}"
        temporary = directory / f".r{self.shard.rank}.{_WRITER}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, final)
        _fsync_dir(directory)

    def _complete_parts(self, block_id: bytes) -> dict[int, torch.Tensor] | None:
        """Every owner's part of ``block_id`` (``{rank: uint8 [L, T, C_r]}``), or None while one is missing (or
        another rank published the block and removed them)."""
        directory, parts = self._part_dir(block_id), {}
        for rank in self.owners:
            try:
                raw = (directory / f"r{rank}{PART_SUFFIX}").read_bytes()
            except FileNotFoundError:
                return None
            layout = self.shard.full.shard(self.shard.size, rank).local
            parts[rank] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(
                layout.num_layers, layout.block_tokens, layout.token_bytes
            )
        return parts
