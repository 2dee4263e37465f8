"""Fault injection for the block store's tests: failed reads, corrupted payloads, a crash before a write's sync or
rename."""

from __future__ import annotations

import errno
import os
import threading
import time


class FaultInjector:
    """Test hooks: make chosen reads fail, corrupt the bytes a read delivers, slow every read, or crash a write before
    its files are made durable (its sync) or before a block's rename.

    Each armed fault fires once per matching call (``block_id=None`` matches any block).
    """

    class SimulatedCrash(BaseException):
        """Raised where a process would have died; BaseException so no ``except Exception`` swallows it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._read_errors: list[tuple[bytes | None, int]] = []
        self._corruptions: list[tuple[bytes | None, int]] = []
        self._crashes: list[tuple[bytes | None]] = []
        self._sync_crashes = 0
        self.read_delay_s = 0.0

    def fail_next_read(self, block_id: bytes | None = None, error: int = errno.EIO) -> None:
        with self._lock:
            self._read_errors.append((block_id, error))

    def corrupt_next_read(self, block_id: bytes | None = None, byte_offset: int = 0) -> None:
        """Flip every bit of payload byte ``byte_offset`` after the read, before verification (media corruption)."""
        with self._lock:
            self._corruptions.append((block_id, byte_offset))

    def delay_reads(self, seconds: float) -> None:
        """Every read from now on holds its destination ``seconds`` before it writes (slow media behind the capped
        NIC); 0 ends it."""
        self.read_delay_s = seconds

    def crash_next_write_before_rename(self, block_id: bytes | None = None) -> None:
        with self._lock:
            self._crashes.append((block_id,))

    def crash_next_write_before_sync(self) -> None:
        """The next write's files are written, not yet made durable nor renamed, when its process dies."""
        with self._lock:
            self._sync_crashes += 1

    def _take(self, armed: list[tuple], block_id: bytes) -> tuple | None:
        with self._lock:
            for index, entry in enumerate(armed):
                if entry[0] is None or entry[0] == block_id:
                    return armed.pop(index)
        return None

    def before_read(self, block_id: bytes) -> None:
        if self.read_delay_s:
            time.sleep(self.read_delay_s)
        fault = self._take(self._read_errors, block_id)
        if fault is not None:
            raise OSError(fault[1], f"injected read error ({os.strerror(fault[1])})")

    def after_read(self, block_id: bytes, payload: memoryview) -> None:
        fault = self._take(self._corruptions, block_id)
        if fault is not None:
            payload[fault[1]] ^= 0xFF

    def before_rename(self, block_id: bytes) -> None:
        if self._take(self._crashes, block_id) is not None:
            raise FaultInjector.SimulatedCrash(f"simulated crash before renaming block {block_id.hex()}")

    def before_sync(self) -> None:
        with self._lock:
            armed, self._sync_crashes = self._sync_crashes > 0, max(0, self._sync_crashes - 1)
        if armed:
            raise FaultInjector.SimulatedCrash("simulated crash after writing the files, before making them durable")
