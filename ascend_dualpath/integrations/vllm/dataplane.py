"""Where the connector's KV bytes move: one instance's device, communicator, transfer leg and buffers.

On the ``emulator`` backend both instances' devices join one emulated RoCE fabric (the PE creates it, the DE
attaches at the first handshake); the PE is rank 0 and the DE rank 1 of a two-rank communicator whose rank
infos are exchanged over the side channel instead of a process group. Layer blocks move through
:class:`~ascend_dualpath.dualpath.transfer_leg.TransportTransferLeg`, i.e. through the transfer engine's gates
(``aiv`` from the PE's HCCL window, ``staging`` from the DE's host buffer). The ``cuda`` and ``npu`` engines are
not wired into the connector yet: :func:`open_dataplane` refuses them by name.

Memory of one instance:

- ``host``: a registered host-DRAM region carved by a :class:`~ascend_dualpath.kv.buffers.HostBuffer` into
  per-request leases (DE: incoming KV and its own storage reads; PE: its storage reads);
- ``window``: the PE's HCCL ``windows_in``, carved by a first-fit pool into the two layer slots of each DE-path
  request (the DE pushes hit layers there) and the send buffers of each step's layer saves.
"""

from __future__ import annotations

import threading

from ascend_dualpath.backends import Backend, get_backend
from ascend_dualpath.dualpath.transfer_leg import ABORT_SLOT, KV_COMM_FIELDS, TransportTransferLeg
from ascend_dualpath.errors import BackendUnavailable, CapacityError, ConfigError
from ascend_dualpath.integrations.vllm.settings import ConnectorSettings
from ascend_dualpath.kv.buffers import HostBuffer
from ascend_dualpath.transport.engine import StagingPool

PE_RANK, DE_RANK = 0, 1
NOTIFY_SLOTS_PER_XFER = 3  # two layer slots and one abort flag per DE-path request
NUM_NOTIFY_SLOTS = ABORT_SLOT  # slots [0, ABORT_SLOT) are ours; ABORT_SLOT is the engines' own


class Dataplane:
    """One instance's side of the fabric. Use :func:`open_dataplane`; close it on shutdown."""

    def __init__(self, settings: ConnectorSettings, rank: int) -> None:
        from ascend_dualpath import _ext
        from ascend_dualpath.backends import emulator as emu

        self.settings, self.rank, self.peer = settings, rank, 1 - rank
        self.C = _ext.load()
        if rank == PE_RANK:
            self.fabric = emu.create_fabric(settings.fabric)
        else:
            self.fabric = emu.attach_fabric(settings.fabric, settings.timeout_s)
        self.device = emu.open_device(self.fabric, device_id=rank)
        self.comm = self.C.HcclComm(
            self.device, rank, 2, emu.comm_config(hcclBufferSize=settings.hccl_buffer_mb, **KV_COMM_FIELDS)
        )
        self.host_region = self.device.alloc_region(settings.host_buffer_mb << 20, self.C.MemKind.HOST_DRAM, 7)
        self.host = HostBuffer(
            backing=self.host_region, role="pe_buffer" if rank == PE_RANK else "de_buffer", timeout_s=settings.timeout_s
        )
        window = self.comm.windows_in
        self.window = StagingPool(window.addr, window.size)
        self.window_bytes = memoryview(window)
        self._window_lock = threading.Lock()
        self._notify_free = list(range(0, NUM_NOTIFY_SLOTS - NOTIFY_SLOTS_PER_XFER + 1, NOTIFY_SLOTS_PER_XFER))
        self.leg: TransportTransferLeg | None = None

    # -- the handshake ----------------------------------------------------------------------------------------------
    def local_info(self) -> bytes:
        return bytes(self.comm.local_info().serialize())

    def host_mem(self) -> tuple[int, int, int]:
        """``(addr, size, rkey)`` of the host region, for the peer's ``add_remote_mem``."""
        region = self.host_region
        return int(region.addr), int(region.size), int(region.rkey)

    def connect(self, peer_info: bytes, peer_host_mem: tuple[int, int, int] | None) -> None:
        """Join the two-rank communicator; with ``peer_host_mem`` the peer's host region becomes writable."""
        mine = self.comm.local_info().serialize()
        infos = [mine, peer_info] if self.rank == PE_RANK else [peer_info, mine]
        self.comm.connect([self.C.RankInfo.deserialize(b) for b in infos])
        if peer_host_mem is not None:
            self.comm.add_remote_mem(self.peer, self.C.RemoteMem(*peer_host_mem))
        self.leg = TransportTransferLeg(self.comm, self.settings.timeout_s)
        self.leg.register_local(self.host_region)

    @property
    def connected(self) -> bool:
        return self.leg is not None

    # -- the PE's window ------------------------------------------------------------------------------------------
    def window_alloc(self, nbytes: int) -> int:
        """Address of ``nbytes`` in the HCCL window; CapacityError names the request and the free space."""
        with self._window_lock:
            return self.window.allocate(max(1, nbytes))

    def window_free(self, addr: int) -> None:
        with self._window_lock:
            self.window.release(addr)

    def window_view(self, addr: int, nbytes: int) -> memoryview:
        offset = addr - self.window.base_addr
        return self.window_bytes[offset : offset + nbytes]

    def notify_alloc(self) -> int:
        """First of ``NOTIFY_SLOTS_PER_XFER`` consecutive notify slots for one request."""
        with self._window_lock:
            if not self._notify_free:
                raise CapacityError(
                    f"all {NUM_NOTIFY_SLOTS // NOTIFY_SLOTS_PER_XFER} notify-slot groups are held by requests in flight"
                )
            return self._notify_free.pop()

    def notify_free(self, base: int) -> None:
        with self._window_lock:
            self._notify_free.append(base)

    def close(self) -> None:
        if self.leg is not None:
            self.leg.close()
        for closable in (self.comm, self.host_region, self.device, self.fabric):
            closable.close()


def open_dataplane(settings: ConnectorSettings, rank: int, backend: str | Backend = "auto") -> Dataplane:
    """The dataplane of ``backend`` (``auto`` through :func:`~ascend_dualpath.backends.get_backend`)."""
    chosen = get_backend(backend) if isinstance(backend, str) else backend
    if chosen is not Backend.EMULATOR:
        raise BackendUnavailable(
            f"the vLLM connector moves KV over the emulator's fabric only; backend "
            f"{chosen.value!r} has no connector dataplane yet"
        )
    if rank not in (PE_RANK, DE_RANK):
        raise ConfigError(f"rank must be {PE_RANK} (PE) or {DE_RANK} (DE), got {rank}")
    return Dataplane(settings, rank)
