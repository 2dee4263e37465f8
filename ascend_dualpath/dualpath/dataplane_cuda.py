"""The connector's ``cuda`` engine: a PE and a DE in separate processes on GPUs of one host.

Each (PE, DE) link is a :class:`CudaLink` with one :class:`~ascend_dualpath.transport.cuda_engine.CudaTransferEngine`
(this process's GPU to the peer's GPU, the same one or another of the host). What a peer writes lives where both
processes can reach it:

- the link's **window** (on the PE: the layer slots the DE pushes hit layers into and the send buffers of layer
  saves) and its **notify words** (where the peer's notifies land) are one ``cudaMalloc`` allocation of this
  process's GPU (:class:`DeviceMemory`), exported by its CUDA IPC handle; the peer opens it
  (``cudaIpcOpenMemHandle``) and its engine writes there. The allocation is the library's own, not a tensor of
  torch's caching allocator, whose IPC handle would export the whole segment the tensor was carved from (and whose
  ``_share_cuda_`` puts a reference-count file in ``/dev/shm`` that a crash leaves behind);
- each instance's **host region** (its :class:`~ascend_dualpath.kv.buffers.HostBuffer`: the DE's leases, which the
  PE writes layer rows into; the PE's storage reads) is a ``/dev/shm`` file both processes map
  (:class:`SharedHostRegion`), pinned in each with ``cudaHostRegister`` so the engine's copies read and write it at
  the link's rate. The creator removes the file at close; a crashed instance's file is removed by the next
  dataplane to open on the host (the file name carries the creator's pid).

The hello carries a :class:`~ascend_dualpath.dualpath.messages.CudaRank`: the host's boot id, the GPU's UUID, the
IPC handle, the window in the sender's addresses and the host region's file. A peer on another host, or on a GPU
this process cannot see (``CUDA_VISIBLE_DEVICES``), is refused at hello with a ConfigError naming it. The halves
name peer memory in the peer's addresses (its window slots, its leases): the link's engine turns them into the
addresses the memory is mapped at here (:class:`LinkEngine`), and refuses, before any byte moves, a range outside
the peer's window and host region; the peer's leases are checked by :meth:`~.dataplane.PairLink.check_peer_lease`.

The PE polls its notify words with a copy on a stream of its own (the forward's stream may hold queued work), and
before it tells the DE a window slot is free again (``consumed``, the slot's release) it waits for the work that
reads the slot (:meth:`CudaLink.window_read_done`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import threading
from typing import Any

import torch

from ascend_dualpath._process import reap_dead_owners
from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.dataplane import PE_RANK, SHM_DIR, Dataplane, LinkNotify, PairLink
from ascend_dualpath.dualpath.settings import ConnectorSettings
from ascend_dualpath.dualpath.transfer_leg import ABORT_SLOT, TransportTransferLeg
from ascend_dualpath.errors import BackendUnavailable, BoundsError, ConfigError, ProtocolError, QueueError
from ascend_dualpath.kv.buffers import HostBuffer
from ascend_dualpath.kv.layout import KVLayout
from ascend_dualpath.transport import cudart
from ascend_dualpath.transport.cuda_engine import CudaTransferEngine
from ascend_dualpath.transport.segments import RemoteSlot

ENGINE_KIND = "cuda"
SHM_PREFIX = "adpcuda."  # /dev/shm/adpcuda.<pid>x<hex>: an instance's host region (not adp.*: no fabric's)
SHM_NAME = re.compile(r"adpcuda\.[0-9]+x[0-9a-f]{16}")
NOTIFY_WORDS = ABORT_SLOT + 1  # every slot a leg may write, the engines' abort slot included
DE_WINDOW_BYTES = 4096  # the DE's window is unused: only the PE's layer slots and send buffers live in a window
ALIGN = 256


def host_id() -> str:
    """This host's boot id: two processes that read the same one share ``/dev/shm`` and the GPUs."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_gpu(uuid: str) -> int | None:
    """The index here of the GPU whose UUID is ``uuid``, None when this process cannot see it."""
    return next((i for i in range(torch.cuda.device_count()) if gpu_uuid(i) == uuid), None)


class _CudaArray:
    """``__cuda_array_interface__`` of ``nbytes`` bytes at device address ``addr``: torch wraps it without a copy."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 2}


def _wrap(addr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(_CudaArray(addr, nbytes), device=device)


class SharedHostRegion:
    """``nbytes`` of host memory in the ``/dev/shm`` file ``name``, mapped and pinned here (``cudaHostRegister``,
    mapped for every GPU): :meth:`create` makes the file (and removes it at :meth:`close`), :meth:`open` maps a
    peer's. ``tensor`` is the region as ``uint8 [nbytes]``, ``addr`` its address here."""

    def __init__(self, name: str, nbytes: int, owner: bool) -> None:
        self.name, self.nbytes, self.owner = name, nbytes, owner
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if owner else 0), 0o600)
        self._map: mmap.mmap | None = None
        try:
            if owner:
                os.ftruncate(fd, nbytes)
            elif os.fstat(fd).st_size != nbytes:
                raise ConfigError(
                    f"host region {name}: the peer named {nbytes} bytes, the file has {os.fstat(fd).st_size}"
                )
            self._map = mmap.mmap(fd, nbytes)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
            self.addr = self.tensor.data_ptr()
            cudart.host_register(self.addr, nbytes)
        except BaseException:
            self._unmap()
            raise
        finally:
            os.close(fd)
        self._registered = True

    @classmethod
    def create(cls, nbytes: int) -> SharedHostRegion:
        return cls(f"{SHM_PREFIX}{os.getpid()}x{secrets.token_hex(8)}", nbytes, owner=True)

    @classmethod
    def open(cls, name: str, nbytes: int) -> SharedHostRegion:
        """A peer's region; ConfigError for a name that is no instance's host region or whose file is gone."""
        if not SHM_NAME.fullmatch(name):
            raise ConfigError(f"the peer named host region {name!r}, which is no /dev/shm/{SHM_PREFIX}<pid>x<id> file")
        try:
            return cls(name, nbytes, owner=False)
        except FileNotFoundError:
            raise ConfigError(
                f"the peer's host region /dev/shm/{name} does not exist here: the peer runs on another host, or "
                f"in another /dev/shm (a container without the host's IPC namespace)"
            ) from None

    def _unmap(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still exported: the mapping goes with its last view
                self._map.close()
            self._map = None
        if self.owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, self.name))

    def close(self) -> None:
        if getattr(self, "_registered", False):
            self._registered = False
            cudart.host_unregister(self.addr)
        self._unmap()


class DeviceMemory:
    """One link's window (``window_bytes``) then ``NOTIFY_WORDS`` int64 notify words, in one ``cudaMalloc``
    allocation of GPU ``device`` exported by its IPC ``handle``; zeroed. Free it with :meth:`close`."""

    def __init__(self, window_bytes: int, device: torch.device) -> None:
        self.window_bytes = -(-window_bytes // ALIGN) * ALIGN
        nbytes = self.window_bytes + NOTIFY_WORDS * 8
        self.device = device
        with torch.cuda.device(device):
            self.addr = cudart.device_malloc(nbytes)
            try:
                self.handle = cudart.ipc_handle(self.addr)
                self.bytes = _wrap(self.addr, nbytes, device)
                self.bytes.zero_()
            except BaseException:
                cudart.device_free(self.addr)
                raise
        self.window = self.bytes[: self.window_bytes]
        self.notify = self.bytes[self.window_bytes :].view(torch.int64)
        self._poll_stream = torch.cuda.Stream(device)
        self._word = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self._poll_lock = threading.Lock()
        self.closed = False

    def check_open(self, what: str) -> None:
        if self.closed:
            raise QueueError(f"the link's device memory was freed (the link is closed): cannot {what}")

    def notify_value(self, slot: int) -> int:
        """The value in notify word ``slot`` now, read on a stream of its own (not behind the forward's work)."""
        self.check_open(f"read notify slot {slot}")
        with self._poll_lock, torch.cuda.stream(self._poll_stream):
            self._word.copy_(self.notify[slot], non_blocking=True)
            self._poll_stream.synchronize()
            return int(self._word[0])

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        torch.cuda.synchronize(self.device)  # nothing queued here still touches the memory
        self.window = self.notify = self.bytes = torch.empty(0, dtype=torch.uint8)
        cudart.device_free(self.addr)


class PeerMemory:
    """A peer's :class:`DeviceMemory`, opened here from its IPC handle (``CudaRank``): its ``window`` (``uint8``) at
    ``addr`` (the peer names it from ``peer_window[0]``) and its ``notify`` words (``int64``), as tensors."""

    def __init__(self, rank: m.CudaRank, device: torch.device) -> None:
        window_addr, window_bytes = rank.window
        if window_bytes < 1 or window_bytes % ALIGN or rank.notify_slots != NOTIFY_WORDS:
            raise ProtocolError(
                f"the peer's CUDA rank info names a window of {window_bytes} bytes (a multiple of {ALIGN} needed) "
                f"and {rank.notify_slots} notify words ({NOTIFY_WORDS} needed)"
            )
        self.peer_window = (int(window_addr), int(window_bytes))
        with torch.cuda.device(device):
            self.addr = cudart.ipc_open(rank.handle)
        self.window = _wrap(self.addr, window_bytes, device)
        self.notify = _wrap(self.addr + window_bytes, NOTIFY_WORDS * 8, device).view(torch.int64)

    def close(self) -> None:
        self.window = self.notify = None
        cudart.ipc_close(self.addr)


class LinkEngine(CudaTransferEngine):
    """The link's CUDA engine: remote addresses are the peer's (its window slots, its leases) and go where that
    memory is mapped here; ``regions`` are ``(peer_addr, nbytes, local_addr)``. A range outside them is a
    BoundsError before anything moves."""

    def __init__(self, device, peer_device, notify, regions: list[tuple[int, int, int]], timeout_s: float) -> None:
        super().__init__(device, peer_device, notify, timeout_s=timeout_s)
        self.regions = regions

    def remote_slot(self, addr: int, nbytes: int) -> RemoteSlot:
        for base, size, local in self.regions:
            if base <= addr and addr + nbytes <= base + size:
                return RemoteSlot(self.peer_device.index, local + addr - base, nbytes)
        where = ", ".join(f"[{base:#x}, +{size})" for base, size, _ in self.regions)
        raise BoundsError(f"[{addr:#x}, +{nbytes}) lies outside the peer's window and host region ({where})")


class CudaLink(PairLink):
    """A :class:`~.dataplane.PairLink` to a peer process on this host: the window and notify words in device memory
    (:class:`DeviceMemory`), the peer's opened through IPC at :meth:`connect`, and a :class:`LinkEngine`.
    :meth:`local_info` is the :class:`~ascend_dualpath.dualpath.messages.CudaRank` the hello carries."""

    def __init__(self, dataplane: CudaDataplane, peer_device: int) -> None:
        self.dataplane, self.peer_device = dataplane, peer_device
        self.rank, self.peer = dataplane.rank, 1 - dataplane.rank
        window_bytes = dataplane.settings.hccl_buffer_mb << 20 if self.rank == PE_RANK else DE_WINDOW_BYTES
        self.memory = DeviceMemory(window_bytes, dataplane.device)
        self.comm = LinkNotify(self.memory.notify_value)
        self._pools(self.memory.addr, self.memory.window_bytes, memoryview(b""))
        self.peer_memory: PeerMemory | None = None
        self._peer_region: SharedHostRegion | None = None
        self.engine: LinkEngine | None = None

    def local_info(self) -> m.CudaRank:
        dp = self.dataplane
        window = (self.memory.addr, self.memory.window_bytes)
        return m.CudaRank(host_id(), gpu_uuid(dp.device.index), self.memory.handle, window, NOTIFY_WORDS, dp.shm_name)

    def connect(self, peer_info: Any, peer_host_mem: tuple[int, int, int]) -> None:
        """Open the peer's device memory and host region (``peer_info``: its CudaRank; ``peer_host_mem``: its host
        region ``(addr, size, _)`` in its addresses); ConfigError for a peer on another host or an unseen GPU."""
        if not isinstance(peer_info, m.CudaRank):
            raise ProtocolError(
                f"the peer sent the rank info of another engine ({type(peer_info).__name__}); this link moves KV "
                f"over CUDA IPC"
            )
        if peer_info.host_id != host_id():
            raise ConfigError(
                f"the peer runs on another host (boot id {peer_info.host_id}, here {host_id()}): the cuda engine "
                f"joins GPUs of one host; use engine 'mooncake' across hosts"
            )
        peer_gpu = local_gpu(peer_info.gpu)
        if peer_gpu is None:
            raise ConfigError(
                f"the peer's GPU {peer_info.gpu} is not visible to this process (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}): both must see each other's GPU"
            )
        try:
            self._open_peer(peer_info, peer_host_mem, torch.device("cuda", peer_gpu))
        except BaseException:
            self._close_peer()
            raise

    def _open_peer(self, info: m.CudaRank, peer_host_mem: tuple[int, int, int], peer_gpu: torch.device) -> None:
        settings, host = self.dataplane.settings, self.dataplane.host_region
        self.peer_memory = memory = PeerMemory(info, peer_gpu)
        self._peer_region = region = SharedHostRegion.open(info.host_shm, int(peer_host_mem[1]))
        self.peer_host = (int(peer_host_mem[0]), int(peer_host_mem[1]))
        regions = [(*memory.peer_window, memory.addr), (*self.peer_host, region.addr)]
        self.engine = LinkEngine(self.dataplane.device, peer_gpu, memory.notify, regions, settings.timeout_s)
        self.engine.register(host.tensor)  # a source: this instance's leases
        self.engine.register(region.tensor)  # a destination: the peer's leases
        self.leg = TransportTransferLeg(None, settings.timeout_s, engines=self._engine_to)

    def _engine_to(self, rank: int) -> Any:
        if rank != self.peer:
            raise ConfigError(f"a CUDA link writes only to its peer, rank {self.peer}, not to rank {rank}")
        return self.engine

    def peer_window(self) -> tuple[int, int]:
        """``(addr, size)`` of the peer's window (the PE's layer slots) in the peer's addresses."""
        return (0, 0) if self.peer_memory is None else self.peer_memory.peer_window

    def window_view(self, addr: int, nbytes: int) -> memoryview:
        raise ConfigError("a CUDA link's window is device memory: use window_tensor")

    def window_tensor(self, addr: int, nbytes: int) -> torch.Tensor:
        """``uint8 [nbytes]`` CUDA tensor over the window's bytes at ``addr``."""
        self.memory.check_open(f"reach {nbytes} window bytes at {addr:#x}")
        offset = addr - self.window.base_addr
        return self.memory.window[offset : offset + nbytes]

    def window_read_done(self) -> None:
        """Wait (the GPU's queue, bounded by it) for the work queued so far on this GPU's current stream: the
        copies that read window slots the peer is about to be told it may overwrite."""
        torch.cuda.current_stream(self.dataplane.device).synchronize()

    def _close_peer(self) -> None:
        self.engine = None
        for opened in (self.peer_memory, self._peer_region):
            if opened is not None:
                opened.close()
        self.peer_memory = self._peer_region = None

    def close(self) -> None:
        try:
            if self.leg is not None:
                self.leg.close()
            torch.cuda.synchronize(self.dataplane.device)
        finally:
            self._close_peer()
            self.memory.close()


class CudaDataplane(Dataplane):
    """One instance's host region (a :class:`SharedHostRegion`) and its :class:`CudaLink` s, on the current GPU
    (vLLM makes each worker's GPU current). BackendUnavailable without a CUDA GPU."""

    link_type = CudaLink
    shared_fabric = False  # device ids name no memory here; the GPU is the current one

    def __init__(self, settings: ConnectorSettings, rank: int) -> None:
        reap_dead_owners(SHM_DIR, SHM_PREFIX, "x")  # what crashed instances of this host left
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                "engine 'cuda': the connector's cuda engine needs a CUDA GPU and a CUDA build of torch "
                "(torch.cuda.is_available() is False here); use engine 'emulator' or 'mooncake'"
            )
        self.settings, self.rank, self.engines = settings, rank, None
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.host_region = SharedHostRegion.create(settings.host_buffer_mb << 20)
        self.shm_name = self.host_region.name
        try:
            self.host = HostBuffer(
                backing=self.host_region.tensor,
                role="pe_buffer" if rank == PE_RANK else "de_buffer",
                timeout_s=settings.timeout_s,
            )
        except BaseException:
            self.host_region.close()
            raise
        self.links: dict[str, PairLink] = {}
        self._lock = threading.Lock()

    def compat(self, layout: KVLayout) -> m.Compat:
        return m.Compat.of(layout, ENGINE_KIND)

    def host_mem(self) -> tuple[int, int, int]:
        """``(addr, size, 0)`` of the host region in this process's addresses (no key: the peer maps the file)."""
        return self.host_region.addr, self.host_region.nbytes, 0

    def close(self) -> None:
        try:
            for link in self.links.values():
                link.close()
            self.links.clear()
        finally:
            self.host_region.close()
