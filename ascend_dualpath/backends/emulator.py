"""The emulated Ascend device, for tests and development without hardware.

The runtime itself is C++ (``csrc/emulator``) exposed through ``ascend_dualpath._C``; this module is
its Python face: the real wire formats (48-byte WQE+SGE, 64-bit SQ doorbell, 32-byte CQE), status
codes, and helpers that create fabrics, devices and communicators with explicit lifetimes.

People debugging real hardware can use the encoders directly; they are the ones the emulator uses::

    >>> from ascend_dualpath.backends import emulator as emu
    >>> wqe = emu.encode_rdma_wqe(emu.Opcode.WRITE, owner=0, signaled=True, length=4096,
    ...                           rkey=0x80000101, remote_addr=0x1000, lkey=0x101, local_addr=0x2000)
    >>> len(wqe), emu.decode_rdma_wqe(wqe)["length"]
    (48, 4096)
    >>> hex(emu.encode_sq_doorbell(qpn=7, pi=1, sl=4))
    '0x4000100000007'
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import os
from collections.abc import Iterator
from typing import Any

from ascend_dualpath import _env, _ext
from ascend_dualpath import errors as E
from ascend_dualpath._checks import check_bound, check_type

WQE_BYTES = 48
CQE_BYTES = 32


class Opcode(enum.IntEnum):
    WRITE = 3
    WRITE_WITH_IMM = 4
    READ = 5
    RECV_WRITE_IMM = 0x10  # receive-side completion of WRITE_WITH_IMM (CQE only)


class CqeStatus(enum.IntEnum):
    """hns RoCE v2 CQE status codes."""

    SUCCESS = 0x00
    LOCAL_LENGTH_ERROR = 0x01
    LOCAL_QP_OPERATION_ERROR = 0x02
    LOCAL_PROTECTION_ERROR = 0x04
    WR_FLUSH_ERROR = 0x05
    MW_BIND_ERROR = 0x06
    BAD_RESPONSE_ERROR = 0x10
    LOCAL_ACCESS_ERROR = 0x11
    REMOTE_INVALID_REQUEST_ERROR = 0x12
    REMOTE_ACCESS_ERROR = 0x13
    REMOTE_OPERATION_ERROR = 0x14
    TRANSPORT_RETRY_EXCEEDED = 0x15
    RNR_RETRY_EXCEEDED = 0x16
    REMOTE_ABORTED_ERROR = 0x22


class Syndrome(enum.IntEnum):
    """Emulator-only: which check a failed WQE broke (real CQEs do not carry this)."""

    NONE = 0
    BAD_LKEY = 1
    LOCAL_OUT_OF_BOUNDS = 2
    LOCAL_PERMISSION = 3
    BAD_RKEY = 4
    REMOTE_OUT_OF_BOUNDS = 5
    REMOTE_PERMISSION = 6
    ZERO_LENGTH = 7
    SL_MISMATCH = 8
    BAD_OPCODE = 9
    BAD_NUM_SGE = 10
    OWNER_MISMATCH = 11
    UNFLUSHED_WQE = 12
    LENGTH_MISMATCH = 13
    NO_REMOTE_QP = 14
    REMOTE_CQ_OVERRUN = 15
    FLUSHED = 16
    MESSAGE_TOO_LARGE = 17
    BAD_DOORBELL = 18


class Access(enum.IntFlag):
    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    ALL = 7


_SYNDROME_ERRORS: dict[Syndrome, type[E.AdpError]] = {
    Syndrome.BAD_LKEY: E.NotRegistered,
    Syndrome.LOCAL_OUT_OF_BOUNDS: E.BoundsError,
    Syndrome.LOCAL_PERMISSION: E.AccessDenied,
    Syndrome.BAD_RKEY: E.InvalidKey,
    Syndrome.REMOTE_OUT_OF_BOUNDS: E.BoundsError,
    Syndrome.REMOTE_PERMISSION: E.AccessDenied,
    Syndrome.ZERO_LENGTH: E.EmptyTransfer,
    Syndrome.MESSAGE_TOO_LARGE: E.PayloadTooLarge,
    Syndrome.SL_MISMATCH: E.ConfigError,
    Syndrome.UNFLUSHED_WQE: E.ProtocolError,
    Syndrome.OWNER_MISMATCH: E.ProtocolError,
}


def completion_error(completion: Any) -> E.AdpError | None:
    """The exception a failed completion stands for (None on success); its message is the NIC's detail."""
    if completion.status == CqeStatus.SUCCESS:
        return None
    syndrome = Syndrome(completion.syndrome)
    cls = _SYNDROME_ERRORS.get(syndrome, E.QueueError)
    status = CqeStatus(completion.status)
    return cls(
        f"{status.name} ({syndrome.name}) on qpn {completion.qpn} WQE {completion.wqe_index}: {completion.detail}"
    )


# ---- wire formats ------------------------------------------------------------------------------


def encode_rdma_wqe(
    opcode: int,
    owner: int,
    signaled: bool,
    length: int,
    rkey: int,
    remote_addr: int,
    lkey: int,
    local_addr: int,
    imm: int = 0,
) -> bytes:
    """48-byte RoCE v2 RC WQE with one SGE, little-endian, as the AIV-direct kernels write it.

    ``owner`` is ``(head >> shift) & 1`` for producer index ``head``; bit 7 of the first word holds
    its inverse. ``signaled`` sets bit 8 (request a CQE on success).
    """
    return _ext.load().encode_rdma_wqe(int(opcode), owner, signaled, length, rkey, remote_addr, lkey, local_addr, imm)


def decode_rdma_wqe(data: bytes) -> dict:
    """Fields of a 48-byte WQE: opcode, owner, owner_bit, signaled, length, imm, num_sge, rkey,
    remote_addr, sge_length, lkey, local_addr."""
    return _ext.load().decode_rdma_wqe(bytes(data))


def encode_sq_doorbell(qpn: int, pi: int, sl: int) -> int:
    """64-bit SQ doorbell: ``qpn[0:23] | cmd 0 [24:27] | (pi mod 65536)[32:47] | sl[48:50]``.

    ``pi`` is the producer index after the increment, i.e. the count of WQEs posted so far.
    """
    return _ext.load().encode_sq_doorbell(qpn, pi, sl)


def decode_sq_doorbell(value: int) -> dict:
    return _ext.load().decode_sq_doorbell(value)


# ---- devices -------------------------------------------------------------------------------------

_fabric_counter = itertools.count()


def new_fabric_name(prefix: str = "fab") -> str:
    """A fabric name unique on this machine (pid + counter)."""
    return f"{prefix}{os.getpid()}x{next(_fabric_counter)}"


def product_profile(product: str | None = None, **overrides: Any):
    """The emulated product profile (``A2`` default, or ``ADP_EMU_PRODUCT``), with field overrides."""
    check_type("product", product, (str, type(None)), where="product_profile")
    name = (product or _env.emu_product() or "A2").upper()
    if name not in ("A2", "A3"):
        raise E.ConfigError(f"unknown emulated product {name!r}; choose A2 or A3")
    profile = _with_fields(_ext.load().ProductProfile(name), overrides)
    profile.check()  # ConfigError naming a field a device cannot run with (sq_depth 0, vector_cores 0, ...)
    return profile


def cost_model(**overrides: Any):
    """The virtual-clock cost model (docs/cost_model.md), with field overrides.

    Bandwidths and latencies must be finite and > 0, per-operation costs finite and >= 0 (ConfigError naming the
    field and value otherwise; ``Device`` checks a model built by hand the same way).
    """
    cost = _with_fields(_ext.load().CostModel(), overrides)
    cost.check()
    return cost


def _with_fields(obj, fields: dict):
    """``obj`` with ``fields`` set; an unknown name raises ConfigError instead of adding an attribute."""
    for key, value in fields.items():
        if not hasattr(obj, key):
            raise E.ConfigError(f"{type(obj).__name__} has no field {key!r}")
        try:
            setattr(obj, key, value)
        except TypeError:  # pybind11's message names neither the field nor the type received
            expected = type(getattr(obj, key)).__name__
            raise E.ArgumentTypeError(
                f"{type(obj).__name__}.{key} must be {expected}, got {type(value).__name__} {value!r}"
            ) from None
    return obj


_stale_shm_reaped = False


def reap_stale_shm() -> list[str]:
    """Remove what dead processes left in ``/dev/shm``: every fabric there is reaped (:meth:`reap_dead_owners`:
    dead owners' regions and QPs, and the fabric's name when its creator died), then region objects named by a dead
    process are unlinked. Returns the names removed.

    :func:`create_fabric` runs it once per process, so a crash (``kill -9``, a segfault) leaves nothing behind
    past the next start. A fabric a live process claimed (:func:`claim_fabric`) is left alone. Fabrics still in use by a live process keep working: only their name goes when their
    creator is dead. Processes sharing a fabric must share a pid namespace (the liveness test is ``kill(pid, 0)``).
    """
    global _stale_shm_reaped
    _stale_shm_reaped = True
    return list(_ext.load().Fabric.reap_stale_shm())


def create_fabric(name: str | None = None, max_regions: int = 4096, max_qps: int = 4096):
    """A new fabric (registry of regions and QPs in shared memory); other processes ``attach_fabric`` it.

    The first call in a process also runs :func:`reap_stale_shm`. After ``fabric.close()`` the fabric refuses new
    devices, regions and queue pairs with :class:`~ascend_dualpath.errors.QueueError`.
    """
    check_type("name", name, (str, type(None)), where="create_fabric")
    max_regions = check_bound("max_regions", max_regions, integer=True, where="create_fabric")
    max_qps = check_bound("max_qps", max_qps, integer=True, where="create_fabric")
    if not _stale_shm_reaped:
        reap_stale_shm()
    return _ext.load().Fabric.create(name or new_fabric_name(), max_regions, max_qps)


SHM_DIR = "/dev/shm"
CLAIM_PREFIX = "adpclaim."  # /dev/shm/adpclaim.<fabric>.<pid>: what reap_stale_shm leaves alone while <pid> lives


@contextlib.contextmanager
def claim_fabric(name: str):
    """While the block runs, :func:`reap_stale_shm` (any process's) leaves fabric ``name`` and its region objects
    alone, even if its creator died: a process about to attach to it, or to inspect what a dead one left, is never
    raced. A claim left by a process that died is removed by the next reap."""
    check_type("name", name, str, where="claim_fabric")
    path = os.path.join(SHM_DIR, f"{CLAIM_PREFIX}{name}.{os.getpid()}")
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def attach_fabric(name: str, timeout_s: float | None = None):
    """The fabric another process created as ``name``, waiting up to ``timeout_s`` for it to appear (claimed
    meanwhile, :func:`claim_fabric`)."""
    check_type("name", name, str, where="attach_fabric")
    timeout = _env.timeout_s() if timeout_s is None else check_bound("timeout_s", timeout_s, where="attach_fabric")
    with claim_fabric(name):
        return _ext.load().Fabric.attach(name, timeout)


# The arbitration weight per service level 0..7 (index = SL) that open_device gives an emulated NIC: the ETS weights
# of a DualPath cluster's NICs, model collectives at SL 4 with weight 99 and KV at SL 3 with weight 1. They are
# ascend_dualpath.dualpath.traffic.QosPolicy().nic_sl_weights(), which this layer may not import;
# tests/dualpath/test_traffic.py checks the two agree.
NIC_SL_WEIGHTS = (1, 1, 1, 1, 99, 1, 1, 1)


def open_device(
    fabric,
    device_id: int = 0,
    product: str | None = None,
    cost=None,
    *,
    sl_weights: tuple[int, ...] = NIC_SL_WEIGHTS,
    **profile_overrides: Any,
):
    """An emulated NPU on ``fabric``: protection domain, registered memory, queues and a NIC thread.

    Its NIC arbitrates the service levels by ``sl_weights`` (one int in [1, 1000] per SL 0..7; default
    :data:`NIC_SL_WEIGHTS`, DualPath's model/KV classes). Close it (or use it as a context manager) to stop its NIC.
    """
    C = _ext.load()
    check_type("fabric", fabric, C.Fabric, where="open_device")
    check_bound("device_id", device_id, integer=True, zero_ok=True, where="open_device")
    check_type("product", product, (str, type(None)), where="open_device")
    check_type("cost", cost, (C.CostModel, type(None)), where="open_device")
    device = C.Device(fabric, device_id, product_profile(product, **profile_overrides), cost or cost_model())
    try:
        device.nic.sl_weights = list(sl_weights)  # ConfigError naming the SL and its weight when one is off
    except BaseException:
        device.close()
        raise
    return device


def device_profile_summary(product: str | None = None) -> dict:
    """The fields ``python -m ascend_dualpath info`` prints for the emulated device."""
    p = product_profile(product)
    return {
        "product": p.name,
        "soc_version": p.soc_version,
        "vector_cores": p.vector_cores,
        "cube_cores": p.cube_cores,
        "ub_bytes": p.ub_bytes,
        "hccl_buffer_mb": p.hccl_buffsize_mb,
        "aiv_dataplane_bit": f"0x04 {'set' if p.capability_bitmap & 0x04 else 'clear'} (bitmap {p.capability_bitmap:#x})",
        "rdma_tc": p.rdma_tc,
        "rdma_sl": p.rdma_sl,
        "sq_depth": p.sq_depth,
    }


@contextlib.contextmanager
def emulated_devices(num_devices: int = 1, product: str | None = None, **profile_overrides: Any) -> Iterator[list]:
    """A private fabric with ``num_devices`` emulated NPUs (:func:`open_device`'s NIC weights), all closed on exit."""
    fabric = create_fabric()
    devices = [open_device(fabric, i, product, **profile_overrides) for i in range(num_devices)]
    try:
        yield devices
    finally:
        for device in devices:
            device.close()  # closes their regions and queues too: nothing stays in /dev/shm
        fabric.close()


# ---- HCCL communicator ---------------------------------------------------------------------------


def comm_config(**fields: Any):
    """An ``HcclCommConfig`` with every field "not set" (0xffffffff) except those given."""
    return _with_fields(_ext.load().HcclCommConfig(), fields)


def init_comm(device, group=None, config=None):
    """An emulated HCCL communicator over ``device`` for every rank of ``group`` (torch.distributed).

    Ranks exchange their windows, notify area and queue-pair numbers through the process group
    (``all_gather_object``), the way HCCL exchanges them at communicator init. With ``group=None``
    and no initialized default group, a single-rank communicator is returned.
    """
    C = _ext.load()
    check_type("device", device, C.Device, where="init_comm")
    import torch.distributed as dist

    if group is None and not (dist.is_available() and dist.is_initialized()):
        rank, world = 0, 1
    else:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    comm = C.HcclComm(device, rank, world, config or comm_config())
    mine = comm.local_info().serialize()
    if world == 1:
        infos = [mine]
    else:
        infos = [None] * world
        dist.all_gather_object(infos, mine, group=group)
    comm.connect([C.RankInfo.deserialize(b) for b in infos])
    return comm
