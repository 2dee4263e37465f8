"""Where the connector's KV bytes move: one instance's device and host buffer, and one link per peer.

On the ``emulator`` backend every instance of a deployment (any number of PEs and DEs) opens one emulated device,
with its own ``device_id``, on one shared RoCE fabric: the first instance to start creates the fabric, the others
attach (:func:`open_fabric`; creation is exclusive, so two instances starting together never make two fabrics).
Each (PE, DE) pair that works together gets its own two-rank communicator, a :class:`PairLink`, made lazily at
the pair's first ``hello`` (the PE is rank 0 and the DE rank 1 of every pair; rank infos are exchanged over the
side channel instead of a process group). A device holds several communicators, so a PE has one link per DE it
talks to and a DE one per PE. Layer blocks move through the link's
:class:`~ascend_dualpath.dualpath.transfer_leg.TransportTransferLeg`, i.e. through the transfer engine's gates
(``aiv`` from the PE's HCCL window, ``staging`` from a host buffer).

On the ``mooncake`` engine (``ConnectorSettings.engine``) the instances may live on different hosts: each link is a
:class:`MooncakeLink`, one :class:`~ascend_dualpath.transport.mooncake.MooncakeTransferEngine` (its own session,
its own notify area) that registers the instance's host region and, on the PE, the link's window; the hello
carries a :class:`~ascend_dualpath.dualpath.messages.MooncakeRank` (the session, the registered buffers, the
window) instead of the emulator's rank info. On the ``cuda`` engine the PE and DE are processes on GPUs of one
host: each link is a :class:`~ascend_dualpath.dualpath.dataplane_cuda.CudaLink` (its window and notify words in
device memory the peer opens through CUDA IPC, host regions in ``/dev/shm`` files both map; that module says
more). The halves see one interface, :class:`PairLink`'s: its ``comm`` is what they poll notifies on and draw
magics from, its leg writes through the link's engine, :meth:`PairLink.window_tensor` is a window range as a
tensor (on the host, or on the GPU on ``cuda``). The ``npu`` engine is not wired into the connector yet:
:func:`open_dataplane` refuses it by name.

Memory of one instance:

- ``host`` (one per instance): a registered host-DRAM region carved by a
  :class:`~ascend_dualpath.kv.buffers.HostBuffer` into per-request leases (DE: incoming KV and its own storage
  reads, shared by all its PEs: every PE's link adds the region as the DE's remote memory; PE: its storage reads);
- ``window`` (one per link): the link's HCCL ``windows_in``, carved by a first-fit pool; on the PE it holds the two
  layer slots of each request whose hit layers the DE pushes and the send buffers of each step's layer saves.
"""

from __future__ import annotations

import itertools
import os
import secrets
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ascend_dualpath.backends import Backend, get_backend
from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.settings import ConnectorSettings
from ascend_dualpath.dualpath.transfer_leg import ABORT_SLOT, KV_COMM_FIELDS, TransportTransferLeg
from ascend_dualpath.errors import BackendUnavailable, BoundsError, CapacityError, ConfigError, ProtocolError
from ascend_dualpath.kv.buffers import HostBuffer
from ascend_dualpath.kv.layout import KVLayout
from ascend_dualpath.transport.engine import StagingPool

PE_RANK, DE_RANK = 0, 1  # in every pair's communicator
NOTIFY_SLOTS_PER_XFER = 3  # two layer slots and one abort flag per request whose hit layers the DE pushes
NUM_NOTIFY_SLOTS = ABORT_SLOT  # slots [0, ABORT_SLOT) are ours; ABORT_SLOT is the engines' own
SHM_DIR = "/dev/shm"
EngineFactory = Callable[[Any, int], Any]  # (communicator, rank) -> the TransferEngine writing to that rank
ENGINE_KIND = "emulator"  # the transfer engine of the default dataplane (one host, the emulated fabric)
ENGINES = ("emulator", "mooncake", "cuda")  # the engines the connector's dataplane moves KV bytes with
UNWIRED_ENGINES = ("npu",)  # transfer engines of the library the connector does not use yet


def check_engine(engine: object, where: str) -> str:
    """``engine`` if the connector can move KV with it; ConfigError naming the value otherwise (``where``: whose)."""
    if engine in UNWIRED_ENGINES:
        raise ConfigError(
            f"{where} {engine!r}: the {engine} engine is not wired into the connector yet (use one of {', '.join(ENGINES)})"
        )
    if engine not in ENGINES:
        raise ConfigError(f"{where} must be one of {', '.join(ENGINES)}, got {engine!r}")
    return str(engine)


def open_fabric(name: str, timeout_s: float):
    """The emulated fabric ``name``: created when absent, else attached (waiting, bounded, for its creator).

    ``Fabric.create`` opens its shared memory with ``O_EXCL``: of several instances starting together exactly one
    creates it; the others see it exist and attach, and ``attach`` waits until the creator has initialised it.
    """
    from ascend_dualpath.backends import emulator as emu

    try:
        return emu.create_fabric(name)
    except ConfigError:
        if not os.path.exists(os.path.join(SHM_DIR, f"adp.{name}")):
            raise  # not "it exists": a bad name or a full /dev/shm
    return emu.attach_fabric(name, timeout_s)


class PairLink:
    """This instance's side of one (PE, DE) pair: a two-rank communicator, its window pool, notify slots and leg.

    Made by :meth:`Dataplane.link`; :meth:`connect` joins it with the peer's rank info.
    """

    def __init__(self, dataplane: Dataplane, peer_device: int) -> None:
        from ascend_dualpath.backends import emulator as emu

        self.dataplane, self.peer_device = dataplane, peer_device
        settings = dataplane.settings
        self.rank = dataplane.rank
        self.peer = 1 - self.rank
        self.comm = dataplane.C.HcclComm(
            dataplane.device, self.rank, 2, emu.comm_config(hcclBufferSize=settings.hccl_buffer_mb, **KV_COMM_FIELDS)
        )
        window = self.comm.windows_in
        self._pools(window.addr, window.size, memoryview(window))

    def _pools(self, window_addr: int, window_size: int, window_bytes: memoryview) -> None:
        """The window's pool, the notify-slot groups, and no leg yet (every link's state beside its transport)."""
        self.window = StagingPool(window_addr, window_size)
        self.window_bytes = window_bytes
        self._lock = threading.Lock()
        self._notify_free = list(range(0, NUM_NOTIFY_SLOTS - NOTIFY_SLOTS_PER_XFER + 1, NOTIFY_SLOTS_PER_XFER))
        self.leg: TransportTransferLeg | None = None
        self.peer_host = (0, 0)  # the peer's registered host region (addr, size), once connected

    def local_info(self) -> bytes:
        return bytes(self.comm.local_info().serialize())

    def connect(self, peer_info: bytes, peer_host_mem: tuple[int, int, int]) -> None:
        """Join the pair's communicator; the peer's host region (``(addr, size, rkey)``) becomes writable."""
        C, mine = self.dataplane.C, self.comm.local_info().serialize()
        infos = [mine, peer_info] if self.rank == PE_RANK else [peer_info, mine]
        self.comm.connect([C.RankInfo.deserialize(b) for b in infos])
        self.comm.add_remote_mem(self.peer, C.RemoteMem(*peer_host_mem))
        self.peer_host = (int(peer_host_mem[0]), int(peer_host_mem[1]))
        engines = self.dataplane.engines
        bound = None if engines is None else (lambda rank: engines(self.comm, rank))
        self.leg = TransportTransferLeg(self.comm, self.dataplane.settings.timeout_s, engines=bound)
        self.leg.register_local(self.dataplane.host_region)

    @property
    def connected(self) -> bool:
        return self.leg is not None

    def check_peer_lease(self, addr: int, nbytes: int, what: str) -> int:
        """``addr`` if ``nbytes`` from it lie inside the peer's registered host region (a lease the peer named for
        this instance's writes); BoundsError naming both otherwise, before anything is written there."""
        base, size = self.peer_host
        if not base <= addr <= base + size - nbytes:
            raise BoundsError(
                f"{what}: the peer named a lease of {nbytes} bytes at {addr:#x}, outside its host region "
                f"[{base:#x}, {base + size:#x})"
            )
        return addr

    def peer_window(self) -> tuple[int, int]:
        """``(addr, size)`` of the peer's HCCL window (the PE's layer slots live there), from its rank info."""
        window = self.comm.peer_info(self.peer).windows_in
        return int(window.addr), int(window.size)

    # -- the window (the PE's layer slots and send buffers) --------------------------------------------------------
    def window_alloc(self, nbytes: int) -> int:
        """Address of ``nbytes`` in the HCCL window; CapacityError names the request and the free space."""
        with self._lock:
            return self.window.allocate(max(1, nbytes))

    def window_free(self, addr: int) -> None:
        with self._lock:
            self.window.release(addr)

    def window_view(self, addr: int, nbytes: int) -> memoryview:
        offset = addr - self.window.base_addr
        return self.window_bytes[offset : offset + nbytes]

    def window_tensor(self, addr: int, nbytes: int):
        """``uint8 [nbytes]`` tensor over the window's bytes at ``addr`` (where the window lives: host memory here)."""
        import torch

        return torch.frombuffer(self.window_view(addr, nbytes), dtype=torch.uint8)

    def window_read_done(self) -> None:
        """Before the peer may overwrite window bytes this instance read: reads of a host window are done already
        (a device window's reads are queued work, :class:`~ascend_dualpath.dualpath.dataplane_cuda.CudaLink`)."""

    def notify_alloc(self) -> int:
        """First of ``NOTIFY_SLOTS_PER_XFER`` consecutive notify slots for one request."""
        with self._lock:
            if not self._notify_free:
                raise CapacityError(
                    f"all {NUM_NOTIFY_SLOTS // NOTIFY_SLOTS_PER_XFER} notify-slot groups of the link to device "
                    f"{self.peer_device} are held by requests in flight"
                )
            return self._notify_free.pop()

    def notify_free(self, base: int) -> None:
        with self._lock:
            self._notify_free.append(base)

    def close(self) -> None:
        if self.leg is not None:
            self.leg.close()
        self.comm.close()


class Dataplane:
    """One instance's device on the shared fabric and its host buffer. Use :func:`open_dataplane`; close it on
    shutdown (closes every link). ``engines(comm, rank)`` makes the TransferEngine a link's leg writes to ``rank``
    with (None: the emulator's engines of the link's communicator)."""

    link_type: type[PairLink] = PairLink
    shared_fabric = True  # every instance's device is on one fabric: device ids must differ

    def __init__(self, settings: ConnectorSettings, rank: int, engines: EngineFactory | None = None) -> None:
        from ascend_dualpath import _ext
        from ascend_dualpath.backends import emulator as emu

        self.settings, self.rank, self.engines = settings, rank, engines
        self.C = _ext.load()
        self.fabric = open_fabric(settings.fabric, settings.timeout_s)
        self.device = emu.open_device(self.fabric, device_id=settings.device_id)
        self.host_region = self.device.alloc_region(settings.host_buffer_mb << 20, self.C.MemKind.HOST_DRAM, 7)
        self.host = HostBuffer(
            backing=self.host_region, role="pe_buffer" if rank == PE_RANK else "de_buffer", timeout_s=settings.timeout_s
        )
        self.links: dict[str, PairLink] = {}
        self._lock = threading.Lock()

    @property
    def device_id(self) -> int:
        return self.settings.device_id

    def compat(self, layout: KVLayout) -> m.Compat:
        """What a peer must share with this instance for ``layout``'s bytes to mean the same (checked at hello)."""
        return m.Compat.of(layout, ENGINE_KIND)

    def host_mem(self) -> tuple[int, int, int]:
        """``(addr, size, rkey)`` of the host region, for a peer's ``add_remote_mem``."""
        region = self.host_region
        return int(region.addr), int(region.size), int(region.rkey)

    def new_link(self, peer: str, peer_device: int) -> PairLink:
        """A fresh, unconnected link to the instance whose side channel is ``peer``; it replaces (and closes) an
        older link to that address, which belonged to a process that has since restarted.

        ConfigError when ``peer_device`` is this device's id or another peer's: device ids must be unique.
        """
        with self._lock:
            taken = {key: other.peer_device for key, other in self.links.items() if key != peer}
            if self.shared_fabric and (peer_device == self.device_id or peer_device in taken.values()):
                raise ConfigError(
                    f"device_id {peer_device} of {peer} is not unique: this instance is device {self.device_id}, "
                    f"its other peers are {taken}"
                )
            old = self.links.pop(peer, None)
            if old is not None:
                old.close()
            link = self.links[peer] = self.link_type(self, peer_device)
            return link

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links.clear()
        for closable in (self.host_region, self.device, self.fabric):
            closable.close()


class LinkNotify:
    """What the halves use of a Mooncake or CUDA link's ``comm``: ``read(slot)``, the value in the link's notify area
    (where the peer's notifies land), and fresh magics. Magics count up from a random start, so a value left in a
    reused slot by an earlier request, or by an earlier process of this link's address, never equals a fresh one."""

    def __init__(self, read: Callable[[int], int]) -> None:
        self.read = read
        self._magics = itertools.count(secrets.randbits(48) + 1)

    def notify_value(self, slot: int) -> int:
        return self.read(slot)

    def next_magic(self) -> int:
        return next(self._magics)


class MooncakeLink(PairLink):
    """A :class:`PairLink` over one :class:`~ascend_dualpath.transport.mooncake.MooncakeTransferEngine`: the peer
    may be on another host. The engine registers the instance's host region and, on the PE, this link's window
    (a host array of ``hccl_buffer_mb``: the layer slots the DE pushes into and the send buffers of layer saves);
    the DE has no window. :meth:`local_info` is the :class:`~ascend_dualpath.dualpath.messages.MooncakeRank` the
    hello carries."""

    def __init__(self, dataplane: MooncakeDataplane, peer_device: int) -> None:
        from ascend_dualpath.transport.mooncake import MooncakeTransferEngine

        self.dataplane, self.peer_device = dataplane, peer_device
        settings = dataplane.settings
        self.rank, self.peer = dataplane.rank, 1 - dataplane.rank
        self.engine = MooncakeTransferEngine(
            self.peer,
            hostname=dataplane.local_address,
            protocol=settings.mooncake_protocol,
            timeout_s=settings.timeout_s,
        )
        # the DE's window is one unused page: only the PE's layer slots and send buffers live in a window
        window_bytes = settings.hccl_buffer_mb << 20 if self.rank == PE_RANK else 4096
        self._window = np.zeros(window_bytes, np.uint8)
        try:
            addr, size, _ = dataplane.host_mem()
            self.engine.register(addr, size)
            self.engine.register(self._window)
        except BaseException:
            self.engine.close()
            raise
        self.comm = LinkNotify(self.engine.notify_value)
        self._pools(self._window.ctypes.data, self._window.nbytes, memoryview(self._window))
        self._peer_window = (0, 0)

    def local_info(self) -> m.MooncakeRank:
        return m.MooncakeRank(self.engine.info(), (self.window.base_addr, self._window.nbytes))

    def connect(self, peer_info: Any, peer_host_mem: tuple[int, int, int]) -> None:
        """Write to the peer's Mooncake engine (``peer_info``: its :class:`~ascend_dualpath.dualpath.messages.
        MooncakeRank`; probed now, so an unreachable peer fails the hello); its host region becomes writable."""
        if not isinstance(peer_info, m.MooncakeRank):
            raise ProtocolError(
                f"the peer sent the rank info of another engine ({type(peer_info).__name__}); this link moves KV "
                f"over Mooncake"
            )
        self.engine.connect(peer_info.engine)
        self._peer_window = (int(peer_info.window[0]), int(peer_info.window[1]))
        self.peer_host = (int(peer_host_mem[0]), int(peer_host_mem[1]))
        self.leg = TransportTransferLeg(None, self.dataplane.settings.timeout_s, engines=self._engine_to)

    def _engine_to(self, rank: int) -> Any:
        if rank != self.peer:
            raise ConfigError(f"a Mooncake link writes only to its peer, rank {self.peer}, not to rank {rank}")
        return self.engine

    def peer_window(self) -> tuple[int, int]:
        """``(addr, size)`` of the peer's window (the PE's layer slots), as its hello named it."""
        return self._peer_window

    def close(self) -> None:
        try:
            if self.leg is not None:
                self.leg.close()
        finally:
            self.engine.close()


class MooncakeDataplane(Dataplane):
    """One instance's host buffer and its :class:`MooncakeLink` s: no device, no fabric, nothing in ``/dev/shm``.
    Mooncake listens on ``settings.mooncake_host`` (None: the address peers reach the side channel at)."""

    link_type = MooncakeLink
    shared_fabric = False  # device ids name no memory here; peers on other hosts may share one

    def __init__(self, settings: ConnectorSettings, rank: int) -> None:
        from ascend_dualpath.transport.mooncake import load_mooncake

        load_mooncake()  # BackendUnavailable naming what is missing, before anything is allocated
        self.settings, self.rank, self.engines = settings, rank, None
        self.local_address = settings.mooncake_host or settings.side_advertise or settings.side_host
        self.host = HostBuffer(
            settings.host_buffer_mb << 20,
            role="pe_buffer" if rank == PE_RANK else "de_buffer",
            timeout_s=settings.timeout_s,
        )
        self.host_region = self.host.backing
        self.links: dict[str, PairLink] = {}
        self._lock = threading.Lock()

    def compat(self, layout: KVLayout) -> m.Compat:
        return m.Compat.of(layout, f"mooncake-{self.settings.mooncake_protocol}")

    def host_mem(self) -> tuple[int, int, int]:
        """``(addr, size, 0)`` of the host buffer's backing (Mooncake needs no key)."""
        registration = self.host.registration
        return int(registration.addr), int(registration.size), 0

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links.clear()


def open_dataplane(
    settings: ConnectorSettings, rank: int, backend: str | Backend = "auto", engines: EngineFactory | None = None
) -> Dataplane:
    """The dataplane of ``settings.engine``: ``mooncake`` (any hosts), ``cuda`` (GPUs of one host), else the
    emulator's on ``backend`` (``auto`` through :func:`~ascend_dualpath.backends.get_backend`); ``engines`` as
    :class:`Dataplane` takes it (emulator only)."""
    if rank not in (PE_RANK, DE_RANK):
        raise ConfigError(f"rank must be {PE_RANK} (PE) or {DE_RANK} (DE), got {rank}")
    engine = check_engine(settings.engine, "engine")
    if engine != ENGINE_KIND and engines is not None:
        raise ConfigError(f"the {engine} dataplane makes its own engines (one per link); engines= is emulator-only")
    if engine == "mooncake":
        return MooncakeDataplane(settings, rank)
    if engine == "cuda":
        from ascend_dualpath.dualpath.dataplane_cuda import CudaDataplane

        return CudaDataplane(settings, rank)
    chosen = get_backend(backend) if isinstance(backend, str) else backend
    if chosen is not Backend.EMULATOR:
        raise BackendUnavailable(
            f"the vLLM connector's emulator engine moves KV over the emulator's fabric only; backend "
            f"{chosen.value!r} has no connector dataplane yet"
        )
    return Dataplane(settings, rank, engines)
