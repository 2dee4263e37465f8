"""Block store: Full Blocks on a local filesystem, read straight into host buffers, behind a paced read queue.

On disk (see ``docs/kv.md``) each Full Block is one file ``<root>/blocks/<id[:2]>/<id>.kvb``: a header (magic,
version, layout fingerprint, block id, parent id, payload size, CRC-32 of the payload and of the header; from
version 2 also a CRC-32 per layer and unit, see below) padded to a multiple of 4096 bytes, followed by the
``[L, T, C]`` payload, zero-padded to a multiple of 4096 bytes so that ``O_DIRECT`` reads stay aligned.

A tensor-parallel rank reads only its bytes of a block (``read_into(..., shard=)``, :class:`ShardStore`): it cannot
check the payload's CRC, so version 2 stores one CRC-32 per (layer, unit) (GQA: a KV head; see
:class:`~ascend_dualpath.kv.layout.KVShard`), over the unit's bytes of the layer's rows in row order, and a rank
checks those of its units. A version-1 block (written before) is read whole, checked, and the rank's bytes taken. Writes go to a temporary file in the same directory, are made durable and then
renamed over the final name, and the renames made durable before the blocks are indexed, so a crash leaves either
the whole block or nothing visible. A chain written together costs one ``syncfs`` for its files and one for its
renames (Linux >= 5.8, not on FUSE), else an fsync per file and per directory (:attr:`LocalBlockStore.sync_mode`
says which and why). Temporaries left by a crash are removed when a store is
opened, once older than :data:`STALE_TEMP_S` (a younger one may be another instance's write in progress: several
instances, on several hosts, share one store). A temporary's name carries its writer's host, pid and a random part,
so two writers never share one. The index follows the disk: a block whose file was deleted behind the store's back counts as absent
(``contains``, ``longest_prefix``, ``read_into`` stat or open it) and leaves the index with its descendants.

:class:`BlockStore` is the seam for other backends (3FS through USRBIO, Mooncake Store): the read paths
only use that protocol. The read queue that paces reads to a storage NIC is :mod:`ascend_dualpath.kv.read_queue`
(its clocks: :mod:`ascend_dualpath.kv.clocks`); the test hooks are :mod:`ascend_dualpath.kv.faults`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import logging
import mmap
import os
import platform
import re
import secrets
import socket
import struct
import threading
import time
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from ascend_dualpath._checks import check_type
from ascend_dualpath.errors import (
    BoundsError,
    ChecksumMismatch,
    ConfigError,
    InvalidKey,
    QueueError,
    StorageReadError,
)
from ascend_dualpath.kv.faults import FaultInjector
from ascend_dualpath.kv.layout import BLOCK_ID_BYTES, KVLayout, KVShard
from ascend_dualpath.kv.memory import as_memoryview, buffer_address
from ascend_dualpath.kv.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

IO_ALIGN = 4096
HEADER_BYTES = IO_ALIGN
MAGIC = b"ADPKVBK1"
FORMAT_VERSION = 2  # what writes write; reads take 1 (no unit CRCs) too
READ_VERSIONS = (1, 2)
# magic, version, header size, payload bytes, payload crc32, layout fingerprint, block id, parent id, has parent
_HEADER = struct.Struct("<8sHHQI16s16s16s?3x")
_HEADER_CRC = struct.Struct("<I")
# version 2, after the fixed part and its CRC: the number of unit CRCs, then the CRCs, then the CRC of both
_UNIT_COUNT = struct.Struct("<I")
BLOCK_SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
SYNC_MODES = ("syncfs", "fsync")
STALE_TEMP_S = 600.0  # a temporary this old is a crashed write's (a block's write takes far less)
_WRITER = f"{socket.gethostname()}.{os.getpid()}"  # the host part tells two hosts' writers of one pid apart


def _aligned_scratch(nbytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory, as O_DIRECT requires."""
    return mmap.mmap(-1, max(nbytes, IO_ALIGN))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


try:
    _LIBC_SYNCFS = getattr(ctypes.CDLL(None, use_errno=True), "syncfs", None)
except OSError:  # no C library to load: per-file fsync
    _LIBC_SYNCFS = None
SYNCFS_ERRORS_SINCE = (5, 8)  # the first Linux whose syncfs(2) reports write-back errors (before: always 0)


def _syncfs(fd: int) -> None:
    """syncfs(2): write back every dirty page and inode of the file system holding ``fd`` and wait for them; raises
    the write-back errors of that file system since ``fd`` was opened (or last synced)."""
    if _LIBC_SYNCFS(fd) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"syncfs: {os.strerror(error)}")


def _fs_type(path: Path) -> str:
    """The type of the file system ``path`` lives on (``/proc/self/mounts``: its longest mount point), "" unknown."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return ""
    resolved, best, fs_type = str(path.resolve()), -1, ""
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])  # "\040" is a space
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) > best:
            best, fs_type = len(mount), fields[2]
    return fs_type


class _SyncRound:
    """The durability barriers of one chain's write. ``"syncfs"``: one syncfs after the files are written, one
    after their renames, on a descriptor opened before the first write (syncfs reports the write-back errors since
    its descriptor opened). ``"fsync"``: each file when written, each directory after the renames."""

    def __init__(self, blocks_dir: Path, mode: str) -> None:
        self.fd = os.open(blocks_dir, os.O_RDONLY | os.O_DIRECTORY) if mode == "syncfs" else None

    def file_written(self, fd: int) -> None:
        if self.fd is None:
            os.fsync(fd)

    def files_durable(self) -> None:
        if self.fd is not None:
            _syncfs(self.fd)

    def renames_durable(self, directories: set[Path]) -> None:
        if self.fd is not None:
            _syncfs(self.fd)
            return
        for directory in sorted(directories):
            _fsync_dir(directory)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)


def _pread_exact(fd: int, view: memoryview, offset: int, what: str) -> None:
    """``os.preadv`` until ``view`` is full; a short file raises :class:`StorageReadError`."""
    done = 0
    while done < view.nbytes:
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            raise StorageReadError(
                errno.EIO, f"{what}: file ended after {done} of {view.nbytes} bytes at offset {offset}"
            )
        done += count


def _gather_rows(fd: int, start: int, shard: KVShard, view: memoryview, where: str) -> int:
    """Copy ``shard``'s bytes of the Full Block at file offset ``start`` into ``view`` (its ``[L, T, C_r]``);
    returns their count.

    The rank's bytes are up to ``2 L T`` small pieces (its heads' K and V of every row), so one ``pread`` each
    costs a system call per piece (0.33 GB/s for a 16 MiB block at TP 2 here); a read-only mapping of
    the file gathers them in one strided copy per row segment (6 GB/s). The store never rewrites a published
    file in place (writes go to a temporary and are renamed), so the mapping cannot shrink under the copy; a
    file shorter than the payload is refused before it is mapped.
    """
    full = shard.full
    size = os.fstat(fd).st_size
    if size < start + full.full_block_bytes:
        raise StorageReadError(
            errno.EIO, f"{where}: file is {size} bytes, header and payload need {start + full.full_block_bytes}"
        )
    mapped = mmap.mmap(fd, 0, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), mmap.PROT_READ)
    try:
        with warnings.catch_warnings():  # torch warns that it views a read-only buffer: it is only read here
            warnings.simplefilter("ignore", UserWarning)
            rows = torch.frombuffer(mapped, dtype=torch.uint8, count=full.full_block_bytes, offset=start)
        rows = rows.view(full.num_layers, full.block_tokens, full.token_bytes)
        out = torch.frombuffer(view, dtype=torch.uint8).view(full.num_layers, full.block_tokens, -1)
        done = 0
        for offset, nbytes in shard.row_segments():
            out[..., done : done + nbytes].copy_(rows[..., offset : offset + nbytes])
            done += nbytes
        del rows, out  # the mapping closes only once no tensor views it
    finally:
        mapped.close()
    return view.nbytes


def unit_checksums(layout: KVLayout, blocks: Any) -> tuple[int, ...]:
    """CRC-32 of each (layer, unit) of one Full Block, layer-major: unit ``u``'s bytes of layer ``l``'s rows, in row
    order (``layout.unit_segments(u)`` of each row).

    Parameters
    ----------
    layout : KVLayout
        The block's layout (a tensor-parallel rank's local layout: its units, numbered from 0).
    blocks : buffer or torch.Tensor
        ``full_block_bytes`` bytes of a ``uint8 [L, T, C]`` block.
    """
    rows = torch.frombuffer(as_memoryview(blocks, writable=False), dtype=torch.uint8)
    L, T, C = layout.num_layers, layout.block_tokens, layout.token_bytes
    if layout.kind != "gqa":  # one unit: a layer's rows are its bytes
        return tuple(zlib.crc32(layer) for layer in rows.view(L, T * C).numpy())
    heads = layout.num_units
    # a GQA row is [K of each head | V of each head] (unit_segments): one copy puts each (layer, head)'s K and V
    # of every row next to each other, [L, H, T, 2, head bytes], so each CRC runs over contiguous memory
    units = rows.view(L, T, 2, heads, C // (2 * heads)).permute(0, 3, 1, 2, 4).contiguous()
    return tuple(zlib.crc32(unit) for unit in units.view(L * heads, -1).numpy())


@dataclasses.dataclass(frozen=True)
class BlockHeader:
    payload_bytes: int
    checksum: int
    layout_fingerprint: bytes
    block_id: bytes
    parent_id: bytes | None
    unit_crcs: tuple[int, ...] | None = None  # CRC-32 per (layer, unit), layer-major: written, or parsed (v2)
    header_bytes: int = HEADER_BYTES
    version: int = FORMAT_VERSION

    def pack(self) -> bytes:
        """The header's bytes (version 2 with unit CRCs, else 1), padded to :attr:`header_bytes`."""
        fixed = _HEADER.pack(
            MAGIC,
            self.version if self.unit_crcs is None else FORMAT_VERSION,
            self.header_bytes,
            self.payload_bytes,
            self.checksum,
            self.layout_fingerprint,
            self.block_id,
            self.parent_id or bytes(BLOCK_ID_BYTES),
            self.parent_id is not None,
        )
        fixed += _HEADER_CRC.pack(zlib.crc32(fixed))
        if self.unit_crcs is not None:  # version 2
            table = _UNIT_COUNT.pack(len(self.unit_crcs)) + struct.pack(f"<{len(self.unit_crcs)}I", *self.unit_crcs)
            fixed += table + _HEADER_CRC.pack(zlib.crc32(table))
        return fixed + bytes(self.header_bytes - len(fixed))

    @staticmethod
    def size_for(unit_count: int) -> int:
        """Bytes of a version-2 header with ``unit_count`` unit CRCs: a multiple of :data:`IO_ALIGN`."""
        used = _HEADER.size + _HEADER_CRC.size + _UNIT_COUNT.size + 4 * unit_count + _HEADER_CRC.size
        return -(-used // IO_ALIGN) * IO_ALIGN

    def with_unit_crcs(self, raw: bytes | memoryview, where: str) -> BlockHeader:
        """This (version-2) header with its unit CRCs, parsed from ``raw``: the whole header's bytes."""
        start = _HEADER.size + _HEADER_CRC.size
        (count,) = _UNIT_COUNT.unpack_from(raw, start)
        end = start + _UNIT_COUNT.size + 4 * count
        if end + _HEADER_CRC.size > min(len(raw), self.header_bytes):
            raise StorageReadError(
                errno.EIO, f"{where}: {count} unit CRCs do not fit a {self.header_bytes}-byte header"
            )
        table = bytes(raw[start:end])
        (stored,) = _HEADER_CRC.unpack_from(raw, end)
        if zlib.crc32(table) != stored:
            raise ChecksumMismatch(
                errno.EIO, f"{where}: unit CRC table CRC {zlib.crc32(table):#010x} != {stored:#010x}"
            )
        return dataclasses.replace(self, unit_crcs=struct.unpack_from(f"<{count}I", table, _UNIT_COUNT.size))

    @classmethod
    def unpack(cls, raw: bytes | memoryview, where: str) -> BlockHeader:
        """The fixed part of a header (version 1 or 2) from its first :data:`IO_ALIGN` bytes; a version-2 header's unit
        CRCs come from :meth:`with_unit_crcs` (``unit_crcs`` stays None here)."""
        fixed = bytes(raw[: _HEADER.size])
        (stored_crc,) = _HEADER_CRC.unpack_from(raw, _HEADER.size)
        if zlib.crc32(fixed) != stored_crc:
            raise ChecksumMismatch(
                errno.EIO, f"{where}: header CRC {zlib.crc32(fixed):#010x} != stored {stored_crc:#010x}"
            )
        magic, version, header_bytes, payload_bytes, checksum, fingerprint, block_id, parent_id, has_parent = (
            _HEADER.unpack(fixed)
        )
        sized = (
            header_bytes == HEADER_BYTES
            if version == 1
            else header_bytes >= HEADER_BYTES and not header_bytes % IO_ALIGN
        )
        if magic != MAGIC or version not in READ_VERSIONS or not sized:
            raise StorageReadError(
                errno.EIO,
                f"{where}: not a block file of version {READ_VERSIONS} "
                f"(magic {magic!r}, version {version}, header {header_bytes} bytes)",
            )
        header = cls(payload_bytes, checksum, fingerprint, block_id, parent_id if has_parent else None)
        return dataclasses.replace(header, header_bytes=header_bytes, version=version)


@runtime_checkable
class BlockStore(Protocol):
    """What the DualPath read paths need from a KV block store (local files here; 3FS or Mooncake Store later)."""

    layout: KVLayout

    def contains(self, block_id: bytes) -> bool: ...

    def longest_prefix(self, block_ids: Sequence[bytes]) -> int: ...

    def refresh(self, block_ids: Sequence[bytes]) -> int: ...

    def write_block(self, block_id: bytes, parent_id: bytes | None, payload: Any) -> bool: ...

    def write_blocks(self, chain: Sequence[tuple[bytes, bytes | None, Any]]) -> list[bool]: ...

    def read_into(self, block_id: bytes, dest: Any) -> int | None: ...

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
    sync : str, optional
        How a write is made durable: ``None`` (default) ``"syncfs"`` where Linux (>= 5.8, so that syncfs reports
        write-back errors) offers it and the store is not on FUSE (whose daemon may not persist on syncfs), else
        ``"fsync"``; ``"syncfs"`` requires it (:class:`ConfigError` otherwise); ``"fsync"`` never uses it. The
        outcome is in :attr:`sync_mode` and :attr:`sync_mode_reason`.
    faults : FaultInjector, optional
        Test hooks.

    Notes
    -----
    After :meth:`close` every call raises :class:`QueueError` naming the store.
    """

    def __init__(
        self,
        root: str | Path,
        layout: KVLayout,
        *,
        direct_io: bool | None = None,
        sync: str | None = None,
        faults: FaultInjector | None = None,
    ) -> None:
        check_type("root", root, (str, os.PathLike), where="LocalBlockStore")
        check_type("layout", layout, KVLayout, where="LocalBlockStore")
        check_type("direct_io", direct_io, (bool, type(None)), where="LocalBlockStore")
        if sync not in (None, *SYNC_MODES):
            raise ConfigError(f"sync={sync!r} is not one of {SYNC_MODES} or None (LocalBlockStore)")
        check_type("faults", faults, (FaultInjector, type(None)), where="LocalBlockStore")
        self._closed = False
        self.root = Path(root)
        self.layout = layout
        self.faults = faults or FaultInjector()
        self._blocks_dir = self.root / "blocks"
        self._blocks_dir.mkdir(parents=True, exist_ok=True)
        self._scratch = threading.local()
        self.io_mode, self.io_mode_reason = self._probe_direct_io(direct_io)
        self.sync_mode, self.sync_mode_reason = self._probe_sync(sync)
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
            probe = self._blocks_dir / f".direct-probe.{_WRITER}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
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

    def _probe_sync(self, requested: str | None) -> tuple[str, str]:
        if requested == "fsync":
            return "fsync", "per-file fsync chosen by the caller"
        found = re.match(r"(\d+)\.(\d+)", platform.release()) if platform.system() == "Linux" else None
        kernel = (int(found.group(1)), int(found.group(2))) if found else (0, 0)
        fs_type = _fs_type(self.root)
        if _LIBC_SYNCFS is None:
            reason = "the C library has no syncfs"
        elif kernel < SYNCFS_ERRORS_SINCE:
            reason = f"syncfs reports write-back errors from Linux 5.8 on; this is {platform.release() or 'unknown'}"
        elif fs_type == "fuse" or fs_type.startswith(("fuse.", "fuseblk")):
            reason = f"{self.root} is on {fs_type}, whose daemon may not persist on syncfs"
        else:
            return (
                "syncfs",
                f"one syncfs per chain's files and one per its renames ({fs_type or 'unknown'} file system)",
            )
        if requested == "syncfs":
            raise ConfigError(f"sync='syncfs' but {reason}")
        return "fsync", reason

    def _remove_temporaries(self) -> int:
        """Remove the temporaries of crashed writes: those older than :data:`STALE_TEMP_S` (by their mtime, so the
        hosts sharing a store need synchronised clocks); younger ones may belong to a live writer elsewhere."""
        removed, now = 0, time.time()
        for temporary in self._blocks_dir.glob(f"*/.*{TEMP_SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):  # its writer renamed it meanwhile
                if now - temporary.stat().st_mtime < STALE_TEMP_S:
                    continue
                temporary.unlink()
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
            log.warning(
                "block store %s: block %s was deleted behind the store; dropped it and %d descendant(s) from the index",
                self.root,
                block_id.hex(),
                len(removed) - 1,
            )

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
        """Persist one Full Block durably and atomically (:meth:`write_blocks` of one block); returns False if the
        block was already stored.

        Parameters
        ----------
        block_id, parent_id : bytes
            16-byte hash-chain ids; the parent must already be stored (``None`` for a sequence's first block).
        payload : buffer or torch.Tensor
            ``full_block_bytes`` bytes of a ``[L, T, C]`` block.
        """
        return self.write_blocks([(block_id, parent_id, payload)])[0]

    def write_blocks(self, chain: Sequence[tuple[bytes, bytes | None, Any]]) -> list[bool]:
        """Persist ``(block_id, parent_id, payload)`` blocks in order, durably and atomically, in one sync round.

        Every new block is written to a temporary file; then the files are made durable (``syncfs`` mode: one syncfs;
        ``fsync`` mode: each file's fsync, as it is written), renamed over their final names, the renames made durable
        (one syncfs; or one fsync per directory they touched: the shards ``blocks/<id[:2]>``, and ``blocks`` where a
        shard was created), and only then are the blocks indexed: 2 syncfs, or ``len(chain)`` + (directories) fsyncs.
        A crash leaves each block whole or invisible (its temporary is removed once stale); a power loss before the
        renames are durable may lose a renamed block, whose descendants are then orphans, skipped when a store opens.
        A parent must be stored or come earlier in ``chain``. Every entry is checked before anything is written (a
        bad one raises, nothing written); an I/O error writing a block stops there, the blocks before it still stored
        (durable and indexed), no temporary left. Returns, per block, whether it was newly stored (False: already
        stored, or an earlier entry of ``chain``).
        """
        self._check_open("write a block")
        stored, fresh, seen = [], [], set()
        for block_id, parent_id, data in self._checked_chain(chain):
            new = block_id not in self.index and block_id not in seen
            stored.append(new)
            seen.add(block_id)
            if new:
                fresh.append((block_id, parent_id, data))
        if not fresh:
            return stored
        sync = _SyncRound(self._blocks_dir, self.sync_mode)
        written: list[tuple[bytes, bytes | None, Path, Path]] = []
        directories: set[Path] = set()
        try:
            try:
                for block_id, parent_id, data in fresh:
                    written.append(self._write_temporary(block_id, parent_id, data, sync, directories))
            except Exception:  # not a crash (BaseException): the blocks written before it are whole, store them
                if written:
                    self._publish(written, sync, directories)
                raise
            self._publish(written, sync, directories)
        finally:
            sync.close()
        return stored

    def _checked_chain(self, chain: Sequence[tuple[bytes, bytes | None, Any]]) -> list[tuple]:
        """``chain`` with each payload as a memoryview, once every id, parent and payload size is valid."""
        where = f"block store at {self.root}"
        items, earlier = [], set()
        for block_id, parent_id, payload in chain:
            check_type("block_id", block_id, bytes, where=where)
            check_type("parent_id", parent_id, (bytes, type(None)), where=where)
            if len(block_id) != BLOCK_ID_BYTES or (parent_id is not None and len(parent_id) != BLOCK_ID_BYTES):
                raise InvalidKey(
                    f"block ids must be {BLOCK_ID_BYTES} bytes, got {len(block_id)} "
                    f"and {None if parent_id is None else len(parent_id)}"
                )
            data = as_memoryview(payload, writable=False)
            if data.nbytes != self.layout.full_block_bytes:
                raise BoundsError(
                    f"block {block_id.hex()}: payload is {data.nbytes} bytes, a Full Block is "
                    f"{self.layout.full_block_bytes}"
                )
            if parent_id is not None and parent_id not in self.index and parent_id not in earlier:
                raise InvalidKey(
                    f"parent {parent_id.hex()} of block {block_id.hex()} is not stored; write chains in order"
                )
            items.append((block_id, parent_id, data))
            earlier.add(block_id)
        return items

    def _write_temporary(
        self, block_id: bytes, parent_id: bytes | None, data: memoryview, sync: _SyncRound, directories: set[Path]
    ) -> tuple[bytes, bytes | None, Path, Path]:
        """Write one block to a temporary file beside its final name (``fsync`` mode: and fsync it); returns
        ``(block_id, parent_id, temporary, final)``. ``directories`` gets ``blocks`` when a shard was created."""
        units = unit_checksums(self.layout, data)
        header = BlockHeader(
            data.nbytes, zlib.crc32(data), self.layout.fingerprint(), block_id, parent_id, units,
            BlockHeader.size_for(len(units)),
        )  # fmt: skip
        final = self.path_of(block_id)
        if not final.parent.exists():
            final.parent.mkdir(exist_ok=True)
            directories.add(self._blocks_dir)
        temporary = final.parent / f".{final.stem}.{_WRITER}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
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
            sync.file_written(fd)
        except BaseException:
            os.close(fd)
            temporary.unlink(missing_ok=True)
            raise
        os.close(fd)
        return block_id, parent_id, temporary, final

    def _publish(self, written: list, sync: _SyncRound, directories: set[Path]) -> None:
        """Make the ``written`` temporaries durable, rename each over its final name, make the renames durable, then
        index the blocks (in chain order): a block is known only once it is durable. An error (not a crash) leaves
        no temporary: those not renamed are removed, those renamed are made durable and indexed."""
        self.faults.before_sync()  # a crash here must leave only temporaries
        pending, renamed = list(written), {}
        try:
            sync.files_durable()
            while pending:
                block_id, parent_id, temporary, final = pending[0]
                self.faults.before_rename(block_id)  # a crash here must leave this block and the later ones invisible
                os.replace(temporary, final)
                pending.pop(0)
                directories.add(final.parent)
                renamed[block_id] = parent_id
        except Exception:
            for _, _, temporary, _ in pending:
                temporary.unlink(missing_ok=True)
            if renamed:
                self._make_durable(sync, directories, renamed)
            raise
        self._make_durable(sync, directories, renamed)

    def _make_durable(self, sync: _SyncRound, directories: set[Path], renamed: dict[bytes, bytes | None]) -> None:
        """Make the renames durable, then index the renamed blocks (in chain order)."""
        sync.renames_durable(directories)
        for block_id, parent_id in renamed.items():
            self.index.add(block_id, parent_id)

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

    def read_into(
        self, block_id: bytes, dest: Any, *, preserve_on_error: bool = True, shard: KVShard | None = None
    ) -> int:
        """Read one Full Block (or a tensor-parallel rank's bytes of it) straight into ``dest`` and verify it.

        Parameters
        ----------
        block_id : bytes
            Id of a stored block.
        dest : writable buffer or torch.Tensor
            Exactly ``full_block_bytes`` bytes (e.g. a host-buffer lease); receives the ``[L, T, C]`` payload.
            With ``O_DIRECT`` and a 4096-byte-aligned ``dest`` the payload is DMA'd in place; otherwise the
            page cache copies it in. With ``shard``: ``shard.local.full_block_bytes``, the rank's ``[L, T, C_r]``.
        preserve_on_error : bool
            Keep a copy of ``dest`` first so that on any failure (I/O error, checksum mismatch) ``dest`` is
            restored to its prior bytes. Costs one memcpy; pass False for a freshly allocated destination whose
            contents do not matter.
        shard : KVShard, optional
            Read only this rank's byte ranges (``shard.byte_ranges()``, gathered from a mapping of the file, through
            the page cache) and check its units' CRCs; a corrupt byte outside them goes unnoticed by this read. A version-1 block
            has no unit CRCs: it is read whole, checked, and the rank's bytes taken.

        Returns
        -------
        int
            Payload bytes read from storage (what the storage NIC carried).

        Raises
        ------
        StorageReadError
            The block is not stored, its file vanished (ENOENT; the block and its descendants leave the index),
            or its file is short, malformed or unreadable.
        ChecksumMismatch
            The bytes read do not match the stored CRC-32 (of the payload, or of one of the rank's units).
        """
        self._check_open("read a block")
        self._check_id("block_id", block_id)
        check_type("shard", shard, (KVShard, type(None)), where=f"block store at {self.root}")
        if shard is not None and shard.full != self.layout:
            raise ConfigError(f"shard of layout {shard.full.kind!r} does not belong to this store's layout")
        ranged = shard if shard is not None and not shard.whole else None
        view = as_memoryview(dest, writable=True)
        expected = (ranged.local if ranged else self.layout).full_block_bytes
        if view.nbytes != expected:
            what = f"rank {ranged.rank} of {ranged.size}'s share of a Full Block" if ranged else "a Full Block"
            raise BoundsError(f"block {block_id.hex()}: destination is {view.nbytes} bytes, {what} is {expected}")
        if block_id not in self.index:
            raise StorageReadError(errno.ENOENT, f"block {block_id.hex()} is not in the store at {self.root}")
        path = self.path_of(block_id)
        saved = bytes(view) if preserve_on_error else None
        try:
            self.faults.before_read(block_id)
            return self._read_checked(block_id, path, view, ranged)
        except StorageReadError:
            self._restore(view, saved)
            raise
        except OSError as error:
            self._restore(view, saved)
            if error.errno == errno.ENOENT:
                self._forget(block_id)
            raise StorageReadError(
                error.errno or errno.EIO, f"reading block {block_id.hex()} from {path} failed: {error}"
            ) from error

    def _read_checked(self, block_id: bytes, path: Path, view: memoryview, shard: KVShard | None) -> int:
        """Read the header, then the payload (``shard``: the rank's ranges) into ``view``, and verify them."""
        direct = self.io_mode == "direct" and shard is None  # ranges are not aligned: the page cache reads them
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            page = memoryview(self._scratch_page())
            _pread_exact(fd, page, 0, f"{path} header")
            header = BlockHeader.unpack(page, str(path))
            if header.block_id != block_id or header.layout_fingerprint != self.layout.fingerprint():
                raise StorageReadError(
                    errno.EIO, f"{path}: header names block {header.block_id.hex()} or another layout"
                )
            if header.payload_bytes != self.layout.full_block_bytes:
                raise StorageReadError(
                    errno.EIO,
                    f"{path}: payload of {header.payload_bytes} bytes, layout needs {self.layout.full_block_bytes}",
                )
            if shard is not None and header.version > 1:
                raw = page if header.header_bytes == IO_ALIGN else bytearray(header.header_bytes)
                if raw is not page:
                    _pread_exact(fd, memoryview(raw), 0, f"{path} header")
                return self._read_units(fd, block_id, view, header.with_unit_crcs(raw, str(path)), shard)
            whole = view if shard is None else memoryview(bytearray(header.payload_bytes))
            self._read_payload(fd, whole, direct, str(path), header.header_bytes)
        finally:
            os.close(fd)
        self.faults.after_read(block_id, whole)
        actual = zlib.crc32(whole)
        if actual != header.checksum:
            raise ChecksumMismatch(
                errno.EIO,
                f"block {block_id.hex()} at {path}: CRC-32 of the payload is "
                f"{actual:#010x}, stored {header.checksum:#010x}",
            )
        if shard is not None:  # a version-1 block: read whole, its rank's bytes taken
            full = self.layout.as_full_blocks(torch.frombuffer(whole, dtype=torch.uint8), 1)
            torch.frombuffer(view, dtype=torch.uint8).copy_(shard.take(full).reshape(-1))
        return whole.nbytes

    def _read_units(self, fd: int, block_id: bytes, view: memoryview, header: BlockHeader, shard: KVShard) -> int:
        """Read ``shard``'s byte ranges of a version-2 block into ``view`` (in order) and check its units' CRCs."""
        where, units = str(self.path_of(block_id)), self.layout.num_units
        if len(header.unit_crcs) != self.layout.num_layers * units:
            raise StorageReadError(
                errno.EIO,
                f"{where}: {len(header.unit_crcs)} unit CRCs, the layout has {self.layout.num_layers} x {units}",
            )
        done = _gather_rows(fd, header.header_bytes, shard, view, where)
        self.faults.after_read(block_id, view)
        got = unit_checksums(shard.local, view)
        for index, actual in enumerate(got):
            layer, local_unit = divmod(index, len(shard.units))
            stored = header.unit_crcs[layer * units + shard.units[local_unit]]
            if actual != stored:
                raise ChecksumMismatch(
                    errno.EIO,
                    f"block {block_id.hex()} at {where}: CRC-32 of layer {layer} unit {shard.units[local_unit]} is "
                    f"{actual:#010x}, stored {stored:#010x}",
                )
        return done

    @staticmethod
    def _restore(view: memoryview, saved: bytes | None) -> None:
        if saved is not None:
            view[:] = saved

    def _read_payload(self, fd: int, view: memoryview, direct: bool, where: str, start: int) -> None:
        """Read the payload, which starts at file offset ``start`` (the header's size), into ``view``."""
        if direct and buffer_address(view) % IO_ALIGN:
            # O_DIRECT needs an aligned destination: read this one through the page cache instead.
            fd_buffered = os.open(where, os.O_RDONLY)
            try:
                _pread_exact(fd_buffered, view, start, where)
            finally:
                os.close(fd_buffered)
            return
        if not direct:
            _pread_exact(fd, view, start, where)
            return
        bulk = view.nbytes - view.nbytes % IO_ALIGN
        if bulk:
            _pread_exact(fd, view[:bulk], start, where)
        tail = view.nbytes - bulk
        if tail:  # the file is padded to IO_ALIGN, so read a whole aligned page and keep its head
            page = memoryview(self._scratch_page())
            _pread_exact(fd, page, start + bulk, where)
            view[bulk:] = page[:tail]

    def close(self) -> None:
        """Release the read scratch page of the calling thread; every later call raises :class:`QueueError`."""
        self._closed = True
        page = getattr(self._scratch, "page", None)
        if page is not None:
            page.close()
            self._scratch.page = None


class ShardStore:
    """A tensor-parallel rank's view of a :class:`LocalBlockStore`: the :class:`BlockStore` of its local layout.

    Reads take only the rank's byte ranges of each stored Full Block (``read_into(..., shard=)``); lookups, refreshes
    and removals are the store's. Writing is refused to a rank holding some heads: stored blocks hold every head
    (persisting under tensor parallelism needs the ranks' shards gathered first); a rank holding whole rows (MLA)
    writes as the store does.

    Parameters
    ----------
    store : LocalBlockStore
        The shared store of full blocks.
    shard : KVShard
        The rank's part of ``store.layout``.
    """

    def __init__(self, store: LocalBlockStore, shard: KVShard) -> None:
        check_type("store", store, LocalBlockStore, where="ShardStore")
        check_type("shard", shard, KVShard, where="ShardStore")
        if shard.full != store.layout:
            raise ConfigError(f"ShardStore: the shard's layout is not the store's ({store.root})")
        self.store, self.shard, self.layout = store, shard, shard.local

    def contains(self, block_id: bytes) -> bool:
        return self.store.contains(block_id)

    def longest_prefix(self, block_ids: Sequence[bytes]) -> int:
        return self.store.longest_prefix(block_ids)

    def refresh(self, block_ids: Sequence[bytes]) -> int:
        return self.store.refresh(block_ids)

    def remove(self, block_id: bytes) -> list[bytes]:
        return self.store.remove(block_id)

    def write_block(self, block_id: bytes, parent_id: bytes | None, payload: Any) -> bool:
        return self.write_blocks([(block_id, parent_id, payload)])[0]

    def write_blocks(self, chain: Sequence[tuple[bytes, bytes | None, Any]]) -> list[bool]:
        """The store's :meth:`LocalBlockStore.write_blocks` for a rank holding whole rows (MLA, or size 1); refused
        for a rank holding some heads."""
        if self.shard.whole:
            return self.store.write_blocks(chain)
        raise ConfigError(
            f"tensor-parallel rank {self.shard.rank} of {self.shard.size} holds only its heads: it cannot write the "
            f"full blocks of the store at {self.store.root}"
        )

    def read_into(
        self, block_id: bytes, dest: Any, *, preserve_on_error: bool = True, shard: KVShard | None = None
    ) -> int:
        """The rank's ``[L, T, C_r]`` bytes of block ``block_id`` into ``dest`` (``shard``: that rank's instead, e.g.
        a PE rank of a larger tensor-parallel size a DE rank reads for); returns the payload bytes read."""
        shard = shard or self.shard
        return self.store.read_into(block_id, dest, preserve_on_error=preserve_on_error, shard=shard)

    def close(self) -> None:
        self.store.close()


# The read queue and its clocks moved to their own modules; their old import path from here keeps working (lazily:
# read_queue imports this module, so an import at the top would be a cycle).
_MOVED = {
    "Clock": "clocks",
    "ManualClock": "clocks",
    "MonotonicClock": "clocks",
    "TokenBucket": "clocks",
    "ReadQueue": "read_queue",
    "ReadQueueStats": "read_queue",
    "ReadTicket": "read_queue",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import importlib

        return getattr(importlib.import_module(f"ascend_dualpath.kv.{_MOVED[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
