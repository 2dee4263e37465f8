"""What one DualPath instance (a PE, a DE, or a standalone store-backed instance) is configured with.

Both halves (:mod:`~ascend_dualpath.dualpath.prefill_side`, :mod:`~ascend_dualpath.dualpath.decode_side`) and the
dataplane read it; a host builds it from its own configuration (the vLLM connector from ``kv_connector_extra_config``:
:func:`ascend_dualpath.integrations.vllm.settings.from_kv_transfer_config`).
"""

from __future__ import annotations

import dataclasses

from ascend_dualpath.dualpath.side_channel import DEFAULT_MAX_FRAME_BYTES

UNCAPPED_BYTES_PER_S = 1e15  # "no storage-NIC cap": 1 PB/s, far above any disk, so reads are never paced


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """One instance's DualPath settings (validated by whoever builds them).

    Attributes
    ----------
    role : str
        ``prefill`` (the PE, ``kv_producer``), ``decode`` (the DE, ``kv_consumer``) or ``standalone``
        (``kv_both``: store-backed loading and persisting on one instance, no peer).
    store : str
        Block-store directory, shared by every instance of a deployment.
    node : str
        Name of this instance's storage NIC in metrics.
    snic_bytes_per_s : float
        Cap of this instance's storage reads (``snic_mbps`` x 10^6); ``UNCAPPED_BYTES_PER_S`` when not capped.
    side_port : int or None
        Port of the side channel (required for ``prefill`` and ``decode``).
    side_host : str
        IPv4 address the side channel binds (default 127.0.0.1; ``0.0.0.0``: every interface).
    side_advertise : str or None
        Host name or address peers reach the side channel at (None: ``side_host``; required for ``0.0.0.0``).
    side_token : bytes or None
        The deployment token every side-channel frame proves (required beyond loopback); never printed.
    side_max_bytes : int
        Largest side-channel frame taken or sent.
    fabric : str
        Name of the emulated fabric every instance's device joins (the first to start creates it).
    device_id : int
        This instance's emulated device on the fabric, unique in the deployment (default 0 for ``prefill``,
        1 for ``decode``).
    timeout_s : float
        Bound of every wait.
    hccl_buffer_mb : int
        Size of each HCCL window, one per (PE, DE) pair (the PE's layer slots and send buffers live there).
    host_buffer_mb : int
        Size of the registered host buffer (DE: leases for incoming KV; PE: storage reads).
    persist_wait_s : float
        How long a lookup that stops at a block announced for persisting waits for it
        (the vLLM host's persisting).
    hold_s : float
        How long a load read ahead of its step (:meth:`~ascend_dualpath.dualpath.prefill_side.PrefillSide.prefetch`)
        may wait for the step that takes it, on the PE (its leases) and on the DE (its plan and pusher).
    prefetch_max_mb : float
        Cap of the host-buffer bytes this instance's loads read ahead of their steps hold at once; more loads wait
        (deferred, not refused) until some are taken.
    engine : str
        What moves the KV bytes between a PE and a DE: ``emulator`` (the emulated fabric of one host, the default),
        ``mooncake`` (the Mooncake Transfer Engine: the instances may be on different hosts) or ``cuda`` (processes
        on GPUs of one host: CUDA IPC and shared host memory, :mod:`~ascend_dualpath.dualpath.dataplane_cuda`).
    mooncake_protocol : str
        Mooncake's transport (``tcp``, ``rdma``, ``ascend``) on the ``mooncake`` engine.
    mooncake_host : str or None
        Address Mooncake listens on and publishes to peers (None: the address peers reach the side channel at).
    tp_size : int
        The instance's tensor-parallel size (each rank's worker holds its :meth:`~ascend_dualpath.kv.layout.KVLayout.
        shard` of the rows and reads only those bytes of the store).
    tp_rank : int
        This worker's tensor-parallel rank in ``[0, tp_size)``; its side channel listens at the instance's base port
        + ``tp_rank`` (:func:`rank_port`).
    """

    role: str
    store: str
    node: str
    snic_bytes_per_s: float
    side_port: int | None
    fabric: str
    timeout_s: float
    device_id: int = 0
    hccl_buffer_mb: int = 64
    host_buffer_mb: int = 256
    persist_wait_s: float = 5.0
    hold_s: float = 120.0
    prefetch_max_mb: float = 128.0
    side_host: str = "127.0.0.1"
    side_advertise: str | None = None
    side_token: bytes | None = dataclasses.field(default=None, repr=False)
    side_max_bytes: int = DEFAULT_MAX_FRAME_BYTES
    engine: str = "emulator"
    mooncake_protocol: str = "tcp"
    mooncake_host: str | None = None
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def side_framing(self) -> dict:
        """The side-channel clients' ``token`` and ``max_bytes`` (keywords of ``PeerClient`` and ``request_once``)."""
        return {"token": self.side_token, "max_bytes": self.side_max_bytes}


def rank_port(base: int, tp_rank: int) -> int:
    """The side-channel port of tensor-parallel rank ``tp_rank`` of an instance whose rank 0 listens at ``base``
    (as vLLM's NIXL connector offsets its side-channel port by the rank): a peer that knows one rank's address
    finds every other rank's."""
    return base + tp_rank


def rank_address(address: str, tp_rank: int) -> str:
    """The side-channel address (``tcp://host:port``) of tensor-parallel rank ``tp_rank`` of the instance whose rank
    0 is at ``address`` (:func:`rank_port`)."""
    head, _, port = address.rpartition(":")
    if not head or not port.isdigit():
        raise ValueError(f"side-channel address {address!r} is not tcp://host:port")
    return f"{head}:{rank_port(int(port), tp_rank)}"
