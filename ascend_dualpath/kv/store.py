"""Block store: Full Blocks on a local filesystem, read straight into host buffers, behind a paced read queue.

On disk (see ``docs/kv.md``) each Full Block is one file ``<root>/blocks/<id[:2]>/<id>.kvb``: a 4096-byte
header (magic, version, layout fingerprint, block id, parent id, payload size, CRC-32 of the payload and of
the header) followed by the ``[L, T, C]`` payload, zero-padded to a multiple of 4096 bytes so that
``O_DIRECT`` reads stay aligned. Writes go to a temporary file in the same directory, are fsync'ed and then
renamed over the final name (and the directory fsync'ed), so a crash leaves either the whole block or
nothing visible; temporaries left by a crash are removed when the store is opened. The index follows the disk:
a block whose file was deleted behind the store's back counts as absent (``contains``, ``longest_prefix``,
``read_into`` stat or open it) and leaves the index with its descendants.

:class:`BlockStore` is the seam for other backends (3FS through USRBIO, Mooncake Store): the read paths
only use that protocol. :class:`ReadQueue` models one node's storage NIC: a FIFO of block reads paced by a
token bucket at a configurable bandwidth, reporting its queue length in requests and bytes (the
scheduler's ``read_q``).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import errno
import logging
import mmap
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from ascend_dualpath import _env
from ascend_dualpath._checks import check_bound, check_type
from ascend_dualpath.errors import (
    BoundsError,
    CapacityError,
    ChecksumMismatch,
    ConfigError,
    InvalidKey,
    QueueError,
    StorageReadError,
    WaitTimeout,
)
from ascend_dualpath.kv.layout import BLOCK_ID_BYTES, KVLayout
from ascend_dualpath.kv.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

IO_ALIGN = 4096
HEADER_BYTES = IO_ALIGN
MAGIC = b"ADPKVBK1"
FORMAT_VERSION = 1
# magic, version, header size, payload bytes, payload crc32, layout fingerprint, block id, parent id, has parent
_HEADER = struct.Struct("<8sHHQI16s16s16s?3x")
_HEADER_CRC = struct.Struct("<I")
BLOCK_SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
_TOKEN_SLACK = 1e-9


def as_memoryview(buffer: Any, *, writable: bool) -> memoryview:
    """Flat byte view of a buffer-protocol object or CPU torch tensor, without copying."""
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError(f"tensor buffers must be contiguous CPU tensors, got {buffer.device} "
                             f"contiguous={buffer.is_contiguous()}")
        buffer = buffer.detach().reshape(-1).view(torch.uint8).numpy()
    view = memoryview(buffer)
    if not view.contiguous:
        raise ValueError("buffers must be C-contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if writable and view.readonly:
        raise ValueError("destination buffer is read-only")
    return view


def buffer_address(view: memoryview) -> int:
    """Virtual address of a writable memoryview's first byte (for alignment decisions)."""
    if view.nbytes == 0:
        return 0
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _aligned_scratch(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory, as O_DIRECT requires."""
    return mmap.mmap(-1, max(nbytes, IO_ALIGN))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pread_exact(fd: int, view: memoryview, offset: int, what: str) -> None:
    """``os.preadv`` until ``view`` is full; a short file raises :class:`StorageReadError`."""
    done = 0
    while done < view.nbytes:
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            raise StorageReadError(errno.EIO, f"{what}: file ended after {done} of {view.nbytes} bytes "
                                              f"at offset {offset}")
        done += count


@dataclasses.dataclass(frozen=True)
class BlockHeader:
    payload_bytes: int
    checksum: int
    layout_fingerprint: bytes
    block_id: bytes
    parent_id: bytes | None

    def pack(self) -> bytes:
        fixed = _HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, self.payload_bytes, self.checksum,
                             self.layout_fingerprint, self.block_id, self.parent_id or bytes(BLOCK_ID_BYTES),
                             self.parent_id is not None)
        fixed += _HEADER_CRC.pack(zlib.crc32(fixed))
        return fixed + bytes(HEADER_BYTES - len(fixed))

    @classmethod
    def unpack(cls, raw: bytes | memoryview, where: str) -> BlockHeader:
        fixed = bytes(raw[: _HEADER.size])
        (stored_crc,) = _HEADER_CRC.unpack_from(raw, _HEADER.size)
        if zlib.crc32(fixed) != stored_crc:
            raise ChecksumMismatch(errno.EIO, f"{where}: header CRC {zlib.crc32(fixed):#010x} "
                                              f"!= stored {stored_crc:#010x}")
        magic, version, header_bytes, payload_bytes, checksum, fingerprint, block_id, parent_id, has_parent = (
            _HEADER.unpack(fixed)
        )
        if magic != MAGIC or version != FORMAT_VERSION or header_bytes != HEADER_BYTES:
            raise StorageReadError(errno.EIO, f"{where}: not a v{FORMAT_VERSION} block file "
                                              f"(magic {magic!r}, version {version}, header {header_bytes} bytes)")
        return cls(payload_bytes, checksum, fingerprint, block_id, parent_id if has_parent else None)


class FaultInjector:
    """Test hooks: make chosen reads fail, corrupt the bytes a read delivers, or crash a write before its rename.

    Each armed fault fires once per matching call (``block_id=None`` matches any block).
    """

    class SimulatedCrash(BaseException):
        """Raised where a process would have died; BaseException so no ``except Exception`` swallows it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._read_errors: list[tuple[bytes | None, int]] = []
        self._corruptions: list[tuple[bytes | None, int]] = []
        self._crashes: list[tuple[bytes | None]] = []

    def fail_next_read(self, block_id: bytes | None = None, error: int = errno.EIO) -> None:
        with self._lock:
            self._read_errors.append((block_id, error))

    def corrupt_next_read(self, block_id: bytes | None = None, byte_offset: int = 0) -> None:
        """Flip every bit of payload byte ``byte_offset`` after the read, before verification (media corruption)."""
        with self._lock:
            self._corruptions.append((block_id, byte_offset))

    def crash_next_write_before_rename(self, block_id: bytes | None = None) -> None:
        with self._lock:
            self._crashes.append((block_id,))

    def _take(self, armed: list[tuple], block_id: bytes) -> tuple | None:
        with self._lock:
            for index, entry in enumerate(armed):
                if entry[0] is None or entry[0] == block_id:
                    return armed.pop(index)
        return None

    def before_read(self, block_id: bytes) -> None:
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


@runtime_checkable
class BlockStore(Protocol):
    """What the DualPath read paths need from a KV block store (local files here; 3FS or Mooncake Store later)."""

    layout: KVLayout

    def contains(self, block_id: bytes) -> bool: ...

    def longest_prefix(self, block_ids: Sequence[bytes]) -> int: ...

    def refresh(self, block_ids: Sequence[bytes]) -> int: ...

    def write_block(self, block_id: bytes, parent_id: bytes | None, payload: Any) -> bool: ...

    def read_into(self, block_id: bytes, dest: Any) -> None: ...

    def close(self) -> None: ...


class LocalBlockStore:
    """Full Blocks as checksummed files under ``root``, with a prefix index rebuilt from them on open.

    Parameters
    ----------
    root : str or Path
        Directory of the store (created if missing).
    layout : KVLayout
        Layout of every block; blocks written with another layout are rejected on read.
    direct_io : bool, optional
        ``None`` (default) uses ``O_DIRECT`` when a probe at open shows the filesystem accepts it, else falls back
        to buffered reads; ``True`` requires it (:class:`ConfigError` otherwise); ``False`` never uses it.
        The outcome is in :attr:`io_mode` and :attr:`io_mode_reason`.
    faults : FaultInjector, optional
        Test hooks.

    After :meth:`close` every call raises :class:`QueueError` naming the store.
    """

    def __init__(self, root: str | Path, layout: KVLayout, *, direct_io: bool | None = None,
                 faults: FaultInjector | None = None) -> None:
        check_type("root", root, (str, os.PathLike), where="LocalBlockStore")
        check_type("layout", layout, KVLayout, where="LocalBlockStore")
        check_type("direct_io", direct_io, (bool, type(None)), where="LocalBlockStore")
        check_type("faults", faults, (FaultInjector, type(None)), where="LocalBlockStore")
        self._closed = False
        self.root = Path(root)
        self.layout = layout
        self.faults = faults or FaultInjector()
        self._blocks_dir = self.root / "blocks"
        self._blocks_dir.mkdir(parents=True, exist_ok=True)
        self._scratch = threading.local()
        self.io_mode, self.io_mode_reason = self._probe_direct_io(direct_io)
        if self.io_mode != "direct" and direct_io is None:
            log.info("block store %s reads buffered: %s", self.root, self.io_mode_reason)
        self.removed_temporaries = self._remove_temporaries()
        self.skipped_files = 0
        self.index = PrefixIndex.from_edges(self._scan_edges())

    # -- open-time work -------------------------------------------------------------------------------------------
    def _probe_direct_io(self, requested: bool | None) -> tuple[str, str]:
        if requested is False:
            return "buffered", "O_DIRECT disabled by the caller"
        if not hasattr(os, "O_DIRECT"):
            reason = "this platform has no O_DIRECT"
        else:
            probe = self._blocks_dir / f".direct-probe.{os.getpid()}.{threading.get_ident()}{TEMP_SUFFIX}"
            scratch = _aligned_scratch(IO_ALIGN)
            try:
                with open(probe, "wb") as handle:
                    handle.write(bytes(IO_ALIGN))
                fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
                try:
                    os.preadv(fd, [memoryview(scratch)], 0)
                finally:
                    os.close(fd)
                return "direct", f"O_DIRECT accepted by the filesystem under {self.root}"
            except OSError as error:
                reason = f"O_DIRECT refused under {self.root}: {error.strerror} (errno {error.errno})"
            finally:
                scratch.close()
                probe.unlink(missing_ok=True)
        if requested:
            raise ConfigError(f"direct_io=True but {reason}")
        return "buffered", reason

    def _remove_temporaries(self) -> int:
        removed = 0
        for temporary in self._blocks_dir.glob(f"*/.*{TEMP_SUFFIX}"):
            temporary.unlink(missing_ok=True)
            removed += 1
        if removed:
            log.warning("block store %s: removed %d temporaries left by an interrupted write", self.root, removed)
        return removed

    def _scan_edges(self) -> list[tuple[bytes, bytes | None]]:
        edges = []
        for path in self._blocks_dir.glob(f"*/*{BLOCK_SUFFIX}"):
            header = self._valid_header(path)
            if header is None:
                self.skipped_files += 1
            else:
                edges.append((header.block_id, header.parent_id))
        return edges

    def _valid_header(self, path: Path) -> BlockHeader | None:
        """The header of a block file of this layout named after its id; None (logged) for anything else."""
        try:
            with open(path, "rb") as handle:
                header = BlockHeader.unpack(handle.read(HEADER_BYTES), str(path))
        except (OSError, struct.error) as error:
            log.warning("block store %s: skipping unreadable block file %s (%s)", self.root, path, error)
            return None
        if header.layout_fingerprint != self.layout.fingerprint() or path.stem != header.block_id.hex():
            log.warning("block store %s: skipping %s (other layout or misnamed)", self.root, path)
            return None
        return header

    def refresh(self, block_ids: Sequence[bytes]) -> int:
        """Adopt blocks of a hash chain that another process sharing ``root`` persisted after this store opened.

        Walks ``block_ids`` in chain order and indexes each missing block whose file is present and valid, with
        the parent recorded in its header; stops at the first block that is absent (its descendants would be
        unreachable). Returns the number of blocks adopted.
        """
        self._check_open("refresh")
        adopted = 0
        for block_id in block_ids:
            if block_id in self.index:
                continue
            path = self.path_of(block_id)
            header = self._valid_header(path) if path.exists() else None
            if header is None or (header.parent_id is not None and header.parent_id not in self.index):
                break
            self.index.add(block_id, header.parent_id)
            adopted += 1
        return adopted

    # -- queries --------------------------------------------------------------------------------------------------
    def path_of(self, block_id: bytes) -> Path:
        name = block_id.hex()
        return self._blocks_dir / name[:2] / f"{name}{BLOCK_SUFFIX}"

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise QueueError(f"block store at {self.root} is closed: cannot {what}")

    def _check_id(self, name: str, block_id: Any) -> None:
        check_type(name, block_id, bytes, where=f"block store at {self.root}")
        if len(block_id) != BLOCK_ID_BYTES:
            raise InvalidKey(f"{name} must be {BLOCK_ID_BYTES} bytes, got {len(block_id)}")

    def _on_disk(self, block_id: bytes) -> bool:
        """Whether an indexed block's file still exists; a vanished one leaves the index with its descendants."""
        if self.path_of(block_id).exists():
            return True
        self._forget(block_id)
        return False

    def _forget(self, block_id: bytes) -> None:
        with contextlib.suppress(InvalidKey):  # another thread forgot it first
            removed = self.index.remove(block_id)
            log.warning("block store %s: block %s was deleted behind the store; dropped it and %d descendant(s) "
                        "from the index", self.root, block_id.hex(), len(removed) - 1)

    def contains(self, block_id: bytes) -> bool:
        """Whether the block is indexed and its file is still on disk."""
        self._check_open("look up a block")
        self._check_id("block_id", block_id)
        return block_id in self.index and self._on_disk(block_id)

    def longest_prefix(self, block_ids: Sequence[bytes]) -> int:
        """Number of leading blocks of ``block_ids`` (a hash chain) that the store holds, their files checked."""
        self._check_open("match a prefix")
        matched = self.index.longest_prefix(block_ids)
        for position, block_id in enumerate(block_ids[:matched]):
            if not self._on_disk(block_id):
                return position
        return matched

    # -- writes ---------------------------------------------------------------------------------------------------
    def write_block(self, block_id: bytes, parent_id: bytes | None, payload: Any) -> bool:
        """Persist one Full Block durably and atomically; returns False if the block was already stored.

        Parameters
        ----------
        block_id, parent_id : bytes
            16-byte hash-chain ids; the parent must already be stored (``None`` for a sequence's first block).
        payload : buffer or torch.Tensor
            ``full_block_bytes`` bytes of a ``[L, T, C]`` block.
        """
        self._check_open("write a block")
        check_type("block_id", block_id, bytes, where=f"block store at {self.root}")
        check_type("parent_id", parent_id, (bytes, type(None)), where=f"block store at {self.root}")
        if len(block_id) != BLOCK_ID_BYTES or (parent_id is not None and len(parent_id) != BLOCK_ID_BYTES):
            raise InvalidKey(f"block ids must be {BLOCK_ID_BYTES} bytes, got {len(block_id)} "
                             f"and {None if parent_id is None else len(parent_id)}")
        data = as_memoryview(payload, writable=False)
        if data.nbytes != self.layout.full_block_bytes:
            raise BoundsError(f"block {block_id.hex()}: payload is {data.nbytes} bytes, a Full Block is "
                              f"{self.layout.full_block_bytes}")
        if parent_id is not None and parent_id not in self.index:
            raise InvalidKey(f"parent {parent_id.hex()} of block {block_id.hex()} is not stored; write chains in order")
        if block_id in self.index:
            return False
        header = BlockHeader(data.nbytes, zlib.crc32(data), self.layout.fingerprint(), block_id, parent_id)
        final = self.path_of(block_id)
        if not final.parent.exists():
            final.parent.mkdir(exist_ok=True)
            _fsync_dir(self._blocks_dir)
        temporary = final.parent / f".{final.stem}.{os.getpid()}.{threading.get_ident()}{TEMP_SUFFIX}"
        padding = bytes(-data.nbytes % IO_ALIGN)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            chunks = [memoryview(header.pack()), data, memoryview(padding)]
            total = sum(chunk.nbytes for chunk in chunks)
            written = 0
            while written < total:  # pwritev may write less than asked
                skip, pending = written, []
                for chunk in chunks:
                    if skip >= chunk.nbytes:
                        skip -= chunk.nbytes
                        continue
                    pending.append(chunk[skip:])
                    skip = 0
                written += os.pwritev(fd, pending, written)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            temporary.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.faults.before_rename(block_id)  # a crash here must leave no visible block
        os.replace(temporary, final)
        _fsync_dir(final.parent)
        self.index.add(block_id, parent_id)
        return True

    def remove(self, block_id: bytes) -> list[bytes]:
        """Delete a block and its descendants (unreachable without it); returns the removed ids."""
        self._check_open("remove a block")
        self._check_id("block_id", block_id)
        removed = self.index.remove(block_id)
        for current in removed:
            self.path_of(current).unlink(missing_ok=True)
        return removed

    # -- reads ----------------------------------------------------------------------------------------------------
    def _scratch_page(self) -> mmap.mmap:
        page = getattr(self._scratch, "page", None)
        if page is None:
            page = self._scratch.page = _aligned_scratch(IO_ALIGN)
        return page

    def read_into(self, block_id: bytes, dest: Any, *, preserve_on_error: bool = True) -> None:
        """Read one Full Block straight into ``dest`` and verify its checksum.

        Parameters
        ----------
        block_id : bytes
            Id of a stored block.
        dest : writable buffer or torch.Tensor
            Exactly ``full_block_bytes`` bytes (e.g. a host-buffer lease); receives the ``[L, T, C]`` payload.
            With ``O_DIRECT`` and a 4096-byte-aligned ``dest`` the payload is DMA'd in place; otherwise the
            page cache copies it in.
        preserve_on_error : bool
            Keep a copy of ``dest`` first so that on any failure (I/O error, checksum mismatch) ``dest`` is
            restored to its prior bytes. Costs one memcpy; pass False for a freshly allocated destination whose
            contents do not matter.

        Raises
        ------
        StorageReadError
            The block is not stored, its file vanished (ENOENT; the block and its descendants leave the index),
            or its file is short, malformed or unreadable.
        ChecksumMismatch
            The bytes read do not match the stored CRC-32.
        """
        self._check_open("read a block")
        self._check_id("block_id", block_id)
        view = as_memoryview(dest, writable=True)
        expected = self.layout.full_block_bytes
        if view.nbytes != expected:
            raise BoundsError(f"block {block_id.hex()}: destination is {view.nbytes} bytes, a Full Block is {expected}")
        if block_id not in self.index:
            raise StorageReadError(errno.ENOENT, f"block {block_id.hex()} is not in the store at {self.root}")
        path = self.path_of(block_id)
        saved = bytes(view) if preserve_on_error else None
        try:
            self.faults.before_read(block_id)
            direct = self.io_mode == "direct"
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
            try:
                page = memoryview(self._scratch_page())
                _pread_exact(fd, page, 0, f"{path} header")
                header = BlockHeader.unpack(page, str(path))
                if header.block_id != block_id or header.layout_fingerprint != self.layout.fingerprint():
                    raise StorageReadError(errno.EIO, f"{path}: header names block {header.block_id.hex()} "
                                                      f"or another layout")
                if header.payload_bytes != expected:
                    raise StorageReadError(errno.EIO, f"{path}: payload of {header.payload_bytes} bytes, "
                                                      f"layout needs {expected}")
                self._read_payload(fd, view, direct, str(path))
            finally:
                os.close(fd)
            self.faults.after_read(block_id, view)
            actual = zlib.crc32(view)
            if actual != header.checksum:
                raise ChecksumMismatch(errno.EIO, f"block {block_id.hex()} at {path}: CRC-32 of the payload is "
                                                  f"{actual:#010x}, stored {header.checksum:#010x}")
        except StorageReadError:
            self._restore(view, saved)
            raise
        except OSError as error:
            self._restore(view, saved)
            if error.errno == errno.ENOENT:
                self._forget(block_id)
            raise StorageReadError(error.errno or errno.EIO,
                                   f"reading block {block_id.hex()} from {path} failed: {error}") from error

    @staticmethod
    def _restore(view: memoryview, saved: bytes | None) -> None:
        if saved is not None:
            view[:] = saved

    def _read_payload(self, fd: int, view: memoryview, direct: bool, where: str) -> None:
        if direct and buffer_address(view) % IO_ALIGN:
            # O_DIRECT needs an aligned destination: read this one through the page cache instead.
            fd_buffered = os.open(where, os.O_RDONLY)
            try:
                _pread_exact(fd_buffered, view, HEADER_BYTES, where)
            finally:
                os.close(fd_buffered)
            return
        if not direct:
            _pread_exact(fd, view, HEADER_BYTES, where)
            return
        bulk = view.nbytes - view.nbytes % IO_ALIGN
        if bulk:
            _pread_exact(fd, view[:bulk], HEADER_BYTES, where)
        tail = view.nbytes - bulk
        if tail:  # the file is padded to IO_ALIGN, so read a whole aligned page and keep its head
            page = memoryview(self._scratch_page())
            _pread_exact(fd, page, HEADER_BYTES + bulk, where)
            view[bulk:] = page[:tail]

    def close(self) -> None:
        """Release the read scratch page of the calling thread; every later call raises :class:`QueueError`."""
        self._closed = True
        page = getattr(self._scratch, "page", None)
        if page is not None:
            page.close()
            self._scratch.page = None


# -- per-node read queue ------------------------------------------------------------------------------------------
class Clock(Protocol):
    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """Wall clock: ``time.monotonic`` and ``time.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class ManualClock:
    """Virtual clock for tests and simulation.

    With ``auto_advance=True`` a ``sleep`` moves time forward at once (time passes only through sleeps). Without
    it a ``sleep`` blocks until :meth:`advance` moves time past its deadline, bounded by ``timeout_s`` of real
    time so a test that forgets to advance fails instead of hanging.
    """

    def __init__(self, start: float = 0.0, *, auto_advance: bool = False, timeout_s: float | None = None) -> None:
        self._now = start
        self._auto = auto_advance
        self._timeout_s = check_bound("timeout_s", timeout_s, where="manual clock") if timeout_s is not None \
            else _env.timeout_s()
        self._cond = threading.Condition()
        self._sleepers = 0
        self.sleeps: list[float] = []

    def now(self) -> float:
        with self._cond:
            return self._now

    def sleep(self, seconds: float) -> None:
        with self._cond:
            self.sleeps.append(seconds)
            deadline = self._now + seconds
            if self._auto:
                self._now = deadline
                return
            self._sleepers += 1
            self._cond.notify_all()
            try:
                if not self._cond.wait_for(lambda: self._now >= deadline, self._timeout_s):
                    raise WaitTimeout(f"manual clock: sleep until t={deadline} but time stayed at {self._now} "
                                      f"for {self._timeout_s} s of real time")
            finally:
                self._sleepers -= 1

    def advance(self, seconds: float) -> None:
        with self._cond:
            self._now += seconds
            self._cond.notify_all()

    def wait_for_sleepers(self, count: int = 1, timeout_s: float | None = None) -> None:
        """Block until ``count`` threads sleep on this clock (bounded by real time)."""
        timeout = check_bound("timeout_s", timeout_s, where="manual clock") if timeout_s is not None \
            else self._timeout_s
        with self._cond:
            if not self._cond.wait_for(lambda: self._sleepers >= count, timeout):
                raise WaitTimeout(f"manual clock: waited {timeout} s for {count} sleeper(s), saw {self._sleepers}")


class TokenBucket:
    """Byte pacing: ``rate`` bytes/s refill up to ``burst`` bytes.

    A request of ``n`` bytes may start once the bucket holds ``min(n, burst)`` tokens and then takes ``n``
    (the balance may go negative for ``n > burst``). Bytes started in any window of length ``w`` are thus at
    most ``burst + rate * w`` for requests no larger than ``burst``.
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: int, now: float) -> None:
        self.rate = check_bound("bandwidth_bytes_per_s", rate_bytes_per_s, where="token bucket")
        self.burst = float(check_bound("burst_bytes", burst_bytes, integer=True, where="token bucket"))
        self._tokens = float(burst_bytes)
        self._last = now

    def _refill(self, now: float) -> None:
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now

    def delay_for(self, nbytes: int, now: float) -> float:
        """Seconds until a request of ``nbytes`` may start (0 when it may start now)."""
        self._refill(now)
        need = min(float(nbytes), self.burst)
        missing = need - self._tokens
        # Rounding after a sleep of exactly the computed delay can leave a sliver missing whose delay is below the
        # clock's resolution; waiting for it would never finish.
        if missing <= need * _TOKEN_SLACK:
            return 0.0
        return missing / self.rate

    def take(self, nbytes: int, now: float) -> None:
        self._refill(now)
        self._tokens -= nbytes


@dataclasses.dataclass
class ReadTicket:
    """One queued block read; :meth:`wait` bounds the wait and re-raises the read's error."""

    block_id: bytes
    nbytes: int
    submitted_at: float
    started_at: float | None = None
    finished_at: float | None = None
    _done: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)
    _error: BaseException | None = dataclasses.field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> None:
        timeout = check_bound("timeout_s", timeout_s, zero_ok=True, where=f"read of block {self.block_id.hex()}") \
            if timeout_s is not None else _env.timeout_s()
        if not self._done.wait(timeout):
            state = "queued" if self.started_at is None else "reading"
            raise WaitTimeout(f"read of block {self.block_id.hex()} ({self.nbytes} bytes) not done after "
                              f"{timeout} s; last state: {state}")
        if self._error is not None:
            raise self._error

    def _finish(self, now: float, error: BaseException | None = None) -> None:
        self.finished_at = now
        self._error = error
        self._done.set()


@dataclasses.dataclass(frozen=True)
class ReadQueueStats:
    """Queue length of one node's storage reads: waiting (paced, not started) and in flight."""

    queued_requests: int
    queued_bytes: int
    inflight_requests: int
    inflight_bytes: int
    completed_requests: int
    completed_bytes: int
    failed_requests: int

    @property
    def requests(self) -> int:
        return self.queued_requests + self.inflight_requests

    @property
    def bytes(self) -> int:
        return self.queued_bytes + self.inflight_bytes


class ReadQueue:
    """FIFO of block reads for one node, paced to a storage-NIC bandwidth cap.

    A dispatcher thread starts reads in submission order once the token bucket allows their bytes, and hands
    them to ``io_depth`` reader threads. Reads go to ``store.read_into``.

    Parameters
    ----------
    store : BlockStore
        Where blocks come from.
    bandwidth_bytes_per_s : float
        The cap (e.g. a 400 Gb/s SNIC is 50e9).
    burst_bytes : int, optional
        Bucket size; default one Full Block, so reads are spread evenly.
    io_depth : int
        Reads in flight at once.
    max_queued_bytes : int, optional
        Bound on bytes waiting; :meth:`submit` raises :class:`CapacityError` beyond it.
    clock : Clock, optional
        Time source; a :class:`ManualClock` makes pacing deterministic in tests.
    node : str
        Name used in reports and errors.
    """

    def __init__(self, store: BlockStore, bandwidth_bytes_per_s: float, *, burst_bytes: int | None = None,
                 io_depth: int = 4, max_queued_bytes: int | None = None, clock: Clock | None = None,
                 node: str = "node0") -> None:
        where = f"read queue of {node}"
        check_type("store", store, BlockStore, where=where)
        check_bound("bandwidth_bytes_per_s", bandwidth_bytes_per_s, where=where)
        if burst_bytes is not None:
            check_bound("burst_bytes", burst_bytes, integer=True, where=where)
        io_depth = check_bound("io_depth", io_depth, integer=True, where=where)
        if max_queued_bytes is not None:
            check_bound("max_queued_bytes", max_queued_bytes, integer=True, where=where)
        self.store = store
        self.node = node
        self.clock = clock or MonotonicClock()
        self.bucket = TokenBucket(bandwidth_bytes_per_s, burst_bytes or store.layout.full_block_bytes,
                                  self.clock.now())
        self.max_queued_bytes = max_queued_bytes
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[ReadTicket, Callable[[], None]]] = collections.deque()
        self._queued_bytes = 0
        self._inflight_requests = 0
        self._inflight_bytes = 0
        self._completed_requests = 0
        self._completed_bytes = 0
        self._failed_requests = 0
        self._closed = False
        self._readers = ThreadPoolExecutor(max_workers=io_depth, thread_name_prefix=f"adp-read-{node}")
        self._dispatcher = threading.Thread(target=self._dispatch, name=f"adp-readq-{node}", daemon=True)
        self._dispatcher.start()

    def submit(self, block_id: bytes, dest: Any) -> ReadTicket:
        """Queue a read of one Full Block into ``dest`` (``full_block_bytes`` bytes); returns its ticket."""
        nbytes = as_memoryview(dest, writable=True).nbytes
        if nbytes != self.store.layout.full_block_bytes:
            raise BoundsError(f"block {block_id.hex()}: destination is {nbytes} bytes, a Full Block is "
                              f"{self.store.layout.full_block_bytes}")
        with self._cond:
            if self._closed:
                raise QueueError(f"read queue of {self.node} is closed")
            if self.max_queued_bytes is not None and self._queued_bytes + nbytes > self.max_queued_bytes:
                raise CapacityError(f"read queue of {self.node}: {self._queued_bytes} bytes queued + {nbytes} "
                                    f"exceeds max_queued_bytes={self.max_queued_bytes}")
            ticket = ReadTicket(block_id, nbytes, self.clock.now())
            self._queue.append((ticket, lambda: self.store.read_into(block_id, dest)))
            self._queued_bytes += nbytes
            self._cond.notify_all()
        return ticket

    def submit_many(self, block_ids: Sequence[bytes], dests: Sequence[Any]) -> list[ReadTicket]:
        if len(block_ids) != len(dests):
            raise ValueError(f"{len(block_ids)} block ids but {len(dests)} destinations")
        return [self.submit(block_id, dest) for block_id, dest in zip(block_ids, dests, strict=True)]

    def stats(self) -> ReadQueueStats:
        with self._cond:
            return ReadQueueStats(len(self._queue), self._queued_bytes, self._inflight_requests, self._inflight_bytes,
                                  self._completed_requests, self._completed_bytes, self._failed_requests)

    def _dispatch(self) -> None:
        try:
            self._pace_and_start()
        except BaseException as error:  # e.g. a ManualClock nobody advanced: fail every waiter, loudly
            with self._cond:
                self._closed = True
                abandoned = list(self._queue)
                self._queue.clear()
                self._queued_bytes = 0
            for ticket, _ in abandoned:
                ticket._finish(self.clock.now(), QueueError(f"read queue of {self.node} stopped: {error!r}"))
            raise

    def _pace_and_start(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                ticket, _ = self._queue[0]
                delay = self.bucket.delay_for(ticket.nbytes, self.clock.now())
            if delay > 0:
                self.clock.sleep(delay)  # outside the lock: submitters and stats() stay responsive
                continue
            with self._cond:
                if self._closed:
                    return
                ticket, read = self._queue.popleft()
                now = self.clock.now()
                self.bucket.take(ticket.nbytes, now)
                ticket.started_at = now
                self._queued_bytes -= ticket.nbytes
                self._inflight_requests += 1
                self._inflight_bytes += ticket.nbytes
            self._readers.submit(self._run, ticket, read)

    def _run(self, ticket: ReadTicket, read: Callable[[], None]) -> None:
        error: BaseException | None = None
        try:
            read()
        except Exception as caught:  # handed to the waiter through the ticket
            error = caught
        with self._cond:
            self._inflight_requests -= 1
            self._inflight_bytes -= ticket.nbytes
            if error is None:
                self._completed_requests += 1
                self._completed_bytes += ticket.nbytes
            else:
                self._failed_requests += 1
        ticket._finish(self.clock.now(), error)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the queue: queued reads fail with :class:`QueueError`, in-flight reads finish first."""
        timeout = check_bound("timeout_s", timeout_s, where=f"read queue of {self.node}") if timeout_s is not None \
            else _env.timeout_s()
        with self._cond:
            if self._closed:
                return
            self._closed = True
            abandoned = list(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        for ticket, _ in abandoned:
            ticket._finish(self.clock.now(), QueueError(f"read queue of {self.node} closed before block "
                                                        f"{ticket.block_id.hex()} was read"))
        self._readers.shutdown(wait=True)
        self._dispatcher.join(timeout)
        if self._dispatcher.is_alive():
            raise WaitTimeout(f"read queue of {self.node}: dispatcher still pacing after {timeout} s")

    def __enter__(self) -> ReadQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
