"""Blocks announced for persisting: the read-your-writes rule between one turn and the next.

vLLM sends a request's answer as soon as the request finishes, while its new full blocks are still being written
to the store (the blocks stay allocated until the worker reports them in ``finished_sending``). A client that
sends its next turn at once would reach a PE whose store lookup misses them. So the finishing instance's
scheduler announces the blocks before the answer leaves the engine (``request_finished`` runs before the outputs
are sent), its worker withdraws each announcement once the block is written (or its write failed), and a
lookup that stops at an announced block answers "not yet" (vLLM retries the request at the next step) for at
most ``wait_s``: an announcement older than that is stale (its writer died) and is ignored.

An announcement is an empty file ``<store>/persisting/<block id hex>`` beside the store's blocks, so every
instance sharing the store sees it.

:class:`Persister` writes the blocks: their bytes are copied out of vLLM's cache when the request finishes (the
blocks may be reused afterwards), then written in chain order on one writer thread, one request's blocks in one
sync round (one syncfs for their files and one for their renames; where syncfs is not used, each file's fsync and
each directory's once); their announcements are withdrawn when the writing ends, however it ends: a block is indexed
and its announcement withdrawn only once it is durable.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ascend_dualpath._checks import check_bound
from ascend_dualpath.errors import AdpError

log = logging.getLogger(__name__)

DIR_NAME = "persisting"
PARENT_WAIT_S = 10.0  # how long a chain waits for its parent another instance is still writing
PARENT_POLL_S = 0.05


class PersistAnnouncements:
    """Announcements under ``store_root/persisting``; ``wait_s`` bounds how long one holds back a lookup.

    Parameters
    ----------
    store_root : str or Path
        The block store's directory (shared by every instance of a deployment).
    wait_s : float
        Age after which an announcement no longer holds back a lookup (finite, > 0).
    """

    def __init__(self, store_root: str | Path, wait_s: float) -> None:
        self.wait_s = check_bound("wait_s", wait_s, where="PersistAnnouncements")
        self.root = Path(store_root) / DIR_NAME
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, block_id: bytes) -> Path:
        return self.root / block_id.hex()

    def announce(self, block_ids: Iterable[bytes]) -> None:
        """Mark ``block_ids`` as about to be written (touching refreshes an older mark's age)."""
        for block_id in block_ids:
            self._path(block_id).touch()

    def withdraw(self, block_ids: Iterable[bytes]) -> None:
        """The blocks are written (or will not be): lookups stop waiting for them."""
        for block_id in block_ids:
            self._path(block_id).unlink(missing_ok=True)

    def announced(self, block_id: bytes) -> bool:
        """True while ``block_id`` is announced, however old the announcement (its writer has not ended)."""
        return self._path(block_id).exists()

    def pending(self, block_id: bytes) -> bool:
        """True while ``block_id`` is announced and the announcement is younger than ``wait_s``."""
        try:
            age = time.time() - os.stat(self._path(block_id)).st_mtime
        except FileNotFoundError:
            return False
        return age < self.wait_s


class Persister:
    """Writes finished requests' new full blocks to ``store`` behind the engine, one writer thread.

    ``counters`` gets ``persisted_blocks`` (blocks newly stored) and ``failures`` (a request's chain the store
    refused, none of its blocks written; or a disk error part-way, the blocks before it stored).
    """

    def __init__(self, store: Any, announcements: PersistAnnouncements, counters: Any) -> None:
        self.store, self.announcements, self.counters = store, announcements, counters
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="adp-persist")
        self._writes: list[tuple[str, concurrent.futures.Future]] = []

    def persist(self, spec: Any, block: Callable[[int], Any]) -> None:
        """Copy blocks ``[spec.first_block, len(spec.store_ids))`` now (``block(i)``: block ``i``'s bytes, a
        copy, ``[L, T, C]`` uint8), then write them behind."""
        payloads = [(i, block(i)) for i in range(spec.first_block, len(spec.store_ids))]
        self._writes.append((spec.req_id, self._writer.submit(self.write_blocks, spec, payloads)))

    def write_blocks(self, spec: Any, payloads: list) -> None:
        """Write ``payloads`` ``[(block index, bytes)]`` of ``spec`` as one chain, each block chained to the one
        before, in the store's one sync round (:meth:`~ascend_dualpath.kv.store.LocalBlockStore.write_blocks`: two
        syncfs calls whatever the request's length, instead of about two fsyncs per block); the announcements are
        withdrawn once the blocks are durable (or the write failed)."""
        chain = [(spec.store_ids[i], spec.store_ids[i - 1] if i > 0 else None, payload) for i, payload in payloads]
        announced = spec.store_ids[spec.first_block :]
        try:
            if payloads:
                self._await_parent(spec.store_ids[: payloads[0][0]])
            self.counters.persisted_blocks += sum(self.store.write_blocks(chain))
            # a tensor-parallel rank's part leaves its block invisible until the last rank's part is there: that
            # rank withdraws the announcement (a rank that died leaves it to go stale)
            announced = [block_id for block_id in announced if self.store.contains(block_id)]
        except (AdpError, OSError) as error:  # a chain refused before any write, or the disk failed part-way
            self.counters.failures += 1
            log.warning("DualPath: persisting request %s failed: %s: %s", spec.req_id, type(error).__name__, error)
        finally:
            self.announcements.withdraw(announced)  # none is awaited any longer

    def _await_parent(self, prefix: list[bytes]) -> None:
        """Until the chain's parent (``prefix[-1]``) is stored here, bounded by ``PARENT_WAIT_S``: another instance
        (a data-parallel engine, another DE) may have written it after this store last looked (adopted from disk), or
        still be writing it (announced: its request's next turn came here after the announcement went stale). A
        parent still missing then makes the write refuse the chain, as before."""
        deadline = time.monotonic() + PARENT_WAIT_S
        while prefix and not self.store.contains(prefix[-1]):
            self.store.refresh(prefix)
            if self.store.contains(prefix[-1]) or not self.announcements.announced(prefix[-1]):
                return
            if time.monotonic() > deadline:
                log.warning("DualPath: block %s is still being written by another instance after %s s",
                            prefix[-1].hex(), PARENT_WAIT_S)  # fmt: skip
                return
            time.sleep(PARENT_POLL_S)

    def writing(self) -> bool:
        """Whether a write is queued or running."""
        return any(not future.done() for _, future in self._writes)

    def wait(self, timeout_s: float) -> None:
        """Block until a write ends or ``timeout_s`` passes (an idle engine step waits here, see the worker)."""
        concurrent.futures.wait([f for _, f in self._writes], timeout_s, concurrent.futures.FIRST_COMPLETED)

    def finished(self) -> set[str]:
        """The requests whose writes ended since the last call (vLLM may then free their blocks)."""
        done = {req_id for req_id, future in self._writes if future.done()}
        self._writes = [(req_id, future) for req_id, future in self._writes if not future.done()]
        return done

    def close(self) -> None:
        """Let the writes in flight end (each bounded by the store's own waits)."""
        self._writer.shutdown(wait=True)
