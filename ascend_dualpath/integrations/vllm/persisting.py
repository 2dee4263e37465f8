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
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from ascend_dualpath._checks import check_bound

DIR_NAME = "persisting"


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

    def pending(self, block_id: bytes) -> bool:
        """True while ``block_id`` is announced and the announcement is younger than ``wait_s``."""
        try:
            age = time.time() - os.stat(self._path(block_id)).st_mtime
        except FileNotFoundError:
            return False
        return age < self.wait_s
