"""The CUDA calls the transfer engine makes through ctypes, on the libraries torch loaded: ``cudaMemcpyBatchAsync``
(CUDA >= 12.8), ``cudaMemcpy2DAsync`` (:class:`Memcpy2D`), ``cudaGraphLaunch`` (:func:`graph_launcher`), stream-ordered writes (:class:`StreamWrites`,
``cuStreamBatchMemOp``), a side stream that follows another (:class:`TailStream`) and where device addresses live
(:func:`memory_devices`).

The batch call enqueues many pointer-to-pointer copies with one runtime call. Its signature changed:

- CUDA 12.8 / 12.9: ``(void** dsts, void** srcs, size_t* sizes, size_t count, cudaMemcpyAttributes* attrs,
  size_t* attrsIdxs, size_t numAttrs, size_t* failIdx, cudaStream_t stream)``
- CUDA 13: the same without ``failIdx``.

Every copy needs an attribute entry: one entry (``attrsIdxs = {0}``) with ``srcAccessOrder = Stream`` (the
sources are read in stream order, like ``cudaMemcpyAsync``) and no location hints covers the whole batch.
The runtime refuses the legacy default stream (handle 0). Where the runtime has no batch call,
:class:`MemcpyBatch` enqueues one ``cudaMemcpyAsync`` per segment instead (``batched`` says which).

The library is found among the shared objects of this process (``/proc/self/maps``) so that the calls share
torch's runtime state; nothing is loaded before the first use.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from ascend_dualpath import errors as E

BATCH_MIN_VERSION = 12080  # cudaMemcpyBatchAsync appeared in CUDA 12.8
FAIL_IDX_UNTIL = 13000  # CUDA 12.8 and 12.9 take a failIdx argument; CUDA 13 dropped it
SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the unified addresses


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``struct cudaMemcpyAttributes`` (driver_types.h, same layout in CUDA 12.8 and 13): 24 bytes."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


@dataclass(frozen=True)
class Runtime:
    """The loaded CUDA runtime: its path, version (e.g. 13000) and the batch entry point if it has one."""

    path: str
    version: int
    lib: ctypes.CDLL
    batch: object  # ctypes function, or None
    fail_idx: bool  # the batch call takes the CUDA 12.8 failIdx argument

    def error(self, code: int) -> str:
        name = self.lib.cudaGetErrorName
        name.restype = ctypes.c_char_p
        return f"{name(code).decode()} ({code})"


def _loaded_library(marker: str) -> str | None:
    """Path of the shared object whose path contains ``marker`` (e.g. ``/libcudart.so``) mapped into this process,
    or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if marker in path:
                    return path
    except OSError:
        return None
    return None


def _torch_cuda_library(marker: str, purpose: str, absent: str = "") -> tuple[str, ctypes.CDLL]:
    """(path, library) of the CUDA library whose path contains ``marker`` that torch loaded, CUDA initialised through
    torch first; BackendUnavailable saying ``purpose`` needs a GPU, or that no such library is mapped (+ ``absent``)."""
    import torch

    if not torch.cuda.is_available():
        raise E.BackendUnavailable(f"{purpose} needs a CUDA GPU")
    torch.cuda.init()
    path = _loaded_library(marker)
    if path is None:
        raise E.BackendUnavailable(f"no {marker.strip('/.')} is mapped into this process{absent}")
    return path, ctypes.CDLL(path)


@functools.cache
def runtime() -> Runtime:
    """The CUDA runtime torch loaded (initialising CUDA through torch first); BackendUnavailable without one."""
    path, lib = _torch_cuda_library("/libcudart.so", "cudaMemcpyBatchAsync", " (torch may link the runtime statically)")
    version = ctypes.c_int(0)
    if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0:
        raise E.BackendUnavailable(f"cudaRuntimeGetVersion failed in {path}")
    batch = getattr(lib, "cudaMemcpyBatchAsync", None) if version.value >= BATCH_MIN_VERSION else None
    fail_idx = version.value < FAIL_IDX_UNTIL
    if batch is not None:
        head = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
        ]
        batch.argtypes = head + ([ctypes.c_void_p] if fail_idx else []) + [ctypes.c_void_p]
        batch.restype = ctypes.c_int
    lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    lib.cudaMemcpyAsync.restype = ctypes.c_int
    lib.cudaGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cudaGraphLaunch.restype = ctypes.c_int
    size = ctypes.c_size_t
    lib.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, size, ctypes.c_void_p, size, size, size, ctypes.c_int]
    lib.cudaMemcpy2DAsync.argtypes += [ctypes.c_void_p]
    lib.cudaMemcpy2DAsync.restype = ctypes.c_int
    return Runtime(path, version.value, lib, batch, fail_idx)


def graph_launcher(graph_exec: int):
    """``launch(stream)``: ``cudaGraphLaunch`` of the instantiated graph on a raw stream, ~1 µs of host time where
    ``torch.cuda.CUDAGraph.replay`` costs ~4 µs in Python. QueueError when the runtime refuses."""
    rt = runtime()
    call = rt.lib.cudaGraphLaunch
    graph_exec = ctypes.c_void_p(graph_exec)  # converted once, not on every launch

    def launch(stream: int) -> None:
        code = call(graph_exec, stream)
        if code:
            raise E.QueueError(f"cudaGraphLaunch failed: {rt.error(code)}")

    return launch


DEV_ATTR_MAX_PITCH = 11  # cudaDevAttrMaxPitch: the largest pitch cudaMemcpy2D takes


def max_pitch(device: int) -> int:
    """The largest pitch (bytes) the 2-D copies take on GPU ``device`` (``cudaDevAttrMaxPitch``, 2^31 - 1 on H200);
    BackendUnavailable when the runtime refuses."""
    rt = runtime()
    value = ctypes.c_int(0)
    code = rt.lib.cudaDeviceGetAttribute(ctypes.byref(value), DEV_ATTR_MAX_PITCH, device)
    if code:
        raise E.BackendUnavailable(f"cudaDeviceGetAttribute(cudaDevAttrMaxPitch, {device}) failed: {rt.error(code)}")
    return value.value


class Memcpy2D:
    """One ``cudaMemcpy2DAsync`` (copy engine; ``cudaMemcpyAsync`` for one row) of ``height`` rows of ``width`` bytes, row ``i`` from
    ``src + i * spitch`` to ``dst + i * dpitch``, its arguments converted once: a layer's blocks of one length at a
    constant stride (DualPath's layer ``l`` of Full Block ``b`` at ``base + b * full_block + l * layer_block``) move
    with one runtime call, on the copy engine (``cudaMemcpyBatchAsync`` took 39 µs of host time for 61 pieces).

    The pitches must be at least ``width`` (rows do not overlap) and at most :func:`max_pitch`; the runtime's refusal
    is a QueueError at the call."""

    def __init__(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int):
        if width < 1 or height < 1 or spitch < width or dpitch < width:
            raise E.ConfigError(
                f"a 2-D copy needs width >= 1, height >= 1 and pitches >= width, got width {width}, height "
                f"{height}, spitch {spitch}, dpitch {dpitch}"
            )
        self.rt = runtime()
        self.nbytes = width * height
        self.describe = f"{height} rows of {width} B ({spitch} B apart at the source, {dpitch} at the destination)"
        size = ctypes.c_size_t
        if height == 1:  # one row: a plain copy, which no pitch limit bounds
            self._call = self.rt.lib.cudaMemcpyAsync
            self._args = (ctypes.c_void_p(dst), ctypes.c_void_p(src), size(width), MEMCPY_DEFAULT)
            return
        self._call = self.rt.lib.cudaMemcpy2DAsync
        self._args = (
            ctypes.c_void_p(dst),
            size(dpitch),
            ctypes.c_void_p(src),
            size(spitch),
            size(width),
            size(height),
            MEMCPY_DEFAULT,
        )

    def __call__(self, stream: int) -> None:
        """Enqueue the copy on ``stream`` (a raw ``cudaStream_t`` handle; 0 is the legacy default stream)."""
        code = self._call(*self._args, stream)
        if code:
            raise E.QueueError(f"the copy-engine copy of {self.describe} failed: {self.rt.error(code)}")


def host_device_pointer(host_addr: int) -> int:
    """The device address of pinned host memory at ``host_addr`` (``cudaHostGetDevicePointer``; the same address
    under unified addressing). BackendUnavailable when the memory is not mapped for the GPU."""
    rt = runtime()
    device = ctypes.c_void_p()
    code = rt.lib.cudaHostGetDevicePointer(ctypes.byref(device), ctypes.c_void_p(host_addr), 0)
    if code or not device.value:
        raise E.BackendUnavailable(
            f"pinned host memory at {host_addr:#x} is not mapped for the GPU: {rt.error(code) if code else 'null'}"
        )
    return device.value


def batch_available() -> tuple[bool, str]:
    """(whether cudaMemcpyBatchAsync can be called here, why not / which runtime)."""
    try:
        rt = runtime()
    except E.BackendUnavailable as exc:
        return False, str(exc)
    if rt.batch is None:
        return False, f"CUDA runtime {rt.version} at {rt.path} has no cudaMemcpyBatchAsync (needs >= 12.8)"
    return True, f"CUDA runtime {rt.version} at {rt.path}"


class MemcpyBatch:
    """A fixed list of copies, enqueued with one ``cudaMemcpyBatchAsync`` per call (arrays built once).

    Parameters
    ----------
    dst_addrs, src_addrs : sequence of int
        Device (or pinned host) addresses, one per copy.
    nbytes : sequence of int
        Bytes per copy (>= 1).
    fallback : bool
        Where the runtime has no batch call: True enqueues one ``cudaMemcpyAsync`` per copy, False raises
        BackendUnavailable.
    """

    def __init__(
        self, dst_addrs: Sequence[int], src_addrs: Sequence[int], nbytes: Sequence[int], fallback: bool = True
    ):
        if not (len(dst_addrs) == len(src_addrs) == len(nbytes)) or not nbytes:
            raise E.ConfigError(
                f"need equal non-empty address and size lists, got {len(dst_addrs)}, {len(src_addrs)}, {len(nbytes)}"
            )
        empty = [i for i, n in enumerate(nbytes) if n < 1]
        if empty:
            raise E.EmptyTransfer(f"copy {empty[0]} has no bytes")
        self.rt = runtime()
        if self.rt.batch is None and not fallback:
            raise E.BackendUnavailable(batch_available()[1])
        self.batched = self.rt.batch is not None
        self.count = len(nbytes)
        self.copies = list(zip(dst_addrs, src_addrs, nbytes, strict=True))
        self._dsts = (ctypes.c_void_p * self.count)(*dst_addrs)
        self._srcs = (ctypes.c_void_p * self.count)(*src_addrs)
        self._sizes = (ctypes.c_size_t * self.count)(*nbytes)
        self._attrs = MemcpyAttributes(srcAccessOrder=SRC_ACCESS_ORDER_STREAM)
        self._attr_index = ctypes.c_size_t(0)
        self._fail_index = ctypes.c_size_t(0)
        head = (
            self._dsts,
            self._srcs,
            self._sizes,
            self.count,
            ctypes.byref(self._attrs),
            ctypes.byref(self._attr_index),
            1,
        )
        self._args = head + ((ctypes.byref(self._fail_index),) if self.rt.fail_idx else ())

    def __call__(self, stream: int) -> None:
        """Enqueue every copy on ``stream`` (a raw ``cudaStream_t`` handle, e.g. ``torch.cuda.Stream().cuda_stream``)."""
        if not self.batched:
            memcpy_each(self.copies, stream)
            return
        if stream == 0:
            raise E.ConfigError(
                "cudaMemcpyBatchAsync refuses the legacy default stream (handle 0); enqueue on a torch.cuda.Stream"
            )
        code = self.rt.batch(*self._args, stream)
        if code:
            where = f" at copy {self._fail_index.value}" if self.rt.fail_idx else ""
            raise E.QueueError(f"cudaMemcpyBatchAsync of {self.count} copies failed{where}: {self.rt.error(code)}")


def memcpy_each(copies: Sequence[tuple[int, int, int]], stream: int) -> None:
    """One ``cudaMemcpyAsync`` per ``(dst, src, bytes)`` on ``stream`` (the host path); QueueError naming the copy
    that the runtime refused (those before it are enqueued)."""
    rt = runtime()
    for i, (dst, src, n) in enumerate(copies):
        code = rt.lib.cudaMemcpyAsync(dst, src, n, MEMCPY_DEFAULT, stream)
        if code:
            raise E.QueueError(f"cudaMemcpyAsync of copy {i} of {len(copies)} failed: {rt.error(code)}")


# cuPointerGetAttributes (cuda.h): the attributes asked for, and CU_MEMORYTYPE_DEVICE
_POINTER_ATTRIBUTES = (2, 9, 11, 12)  # MEMORY_TYPE, DEVICE_ORDINAL, RANGE_START_ADDR, RANGE_SIZE
_MEMORYTYPE_DEVICE = 2
NOT_DEVICE_MEMORY = -1


@functools.cache
def _driver() -> ctypes.CDLL:
    """The CUDA driver library torch loaded (initialising CUDA through torch first); BackendUnavailable without."""
    _, lib = _torch_cuda_library("/libcuda.so", "asking where memory lives")
    lib.cuPointerGetAttributes.argtypes = [ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64]
    lib.cuPointerGetAttributes.restype = ctypes.c_int
    return lib


CU_STREAM_MEM_OP_WRITE_VALUE_64 = 5


class _WriteValue64(ctypes.Structure):
    """``CUstreamMemOpWriteValueParams`` (cuda.h) with the 64-bit value."""

    _fields_ = [
        ("operation", ctypes.c_int),
        ("address", ctypes.c_uint64),
        ("value64", ctypes.c_uint64),
        ("flags", ctypes.c_uint),
        ("alias", ctypes.c_uint64),
    ]


class _BatchMemOp(ctypes.Union):
    """``CUstreamBatchMemOpParams``: 48 bytes, of which a write uses the first 40."""

    _fields_ = [("write", _WriteValue64), ("pad", ctypes.c_uint64 * 6)]


@functools.cache
def _batch_mem_op():
    """``cuStreamBatchMemOp`` of the driver torch loaded (the ``_v2`` entry point where the library has it)."""
    lib = _driver()
    fn = getattr(lib, "cuStreamBatchMemOp_v2", None) or lib.cuStreamBatchMemOp
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


class StreamWrites:
    """One value written to fixed device-visible addresses (device memory, or pinned host memory at its own
    address) in a stream's order, after everything enqueued there so far, as one driver call: a request's
    notify slot and its host word after the copies, one stream operation instead of a write and an event.

    The writes are made in the order given, each after the driver's fence of the earlier work."""

    def __init__(self, addrs: Sequence[int]):
        self.addrs = list(addrs)
        self._ops = (_BatchMemOp * len(self.addrs))()
        for op, addr in zip(self._ops, self.addrs, strict=True):
            op.write.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64
            op.write.address = addr
        self._writes = [op.write for op in self._ops]  # views into the array: one attribute set per value
        self._call = _batch_mem_op()

    def __call__(self, stream: int, value: int, *values: int) -> None:
        """Enqueue the writes on ``stream``: ``value`` at every address, or ``value, *values`` one per address (a
        caller's notify value, then the host word's); QueueError naming the addresses when the driver refuses."""
        if values:
            values = (value, *values)
            if len(values) != len(self._writes):
                raise E.ConfigError(f"{len(values)} values for {len(self._writes)} stream writes")
            for write, one in zip(self._writes, values, strict=True):
                write.value64 = one
        else:
            for write in self._writes:
                write.value64 = value
        code = self._call(stream, len(self._ops), self._ops, 0)
        if code:
            where = ", ".join(f"{a:#x}" for a in self.addrs)
            raise E.QueueError(f"cuStreamBatchMemOp writing {where} failed: CUDA driver error {code}")


class TailStream:
    """A side stream for work that must follow another stream's work without holding that stream: an event
    recorded there and waited on here, two runtime calls.

    On H200 any stream operation after a copy-engine copy (a stream write, a kernel, another copy) held the
    stream ~2.7 µs longer than the copy alone, while an event record cost nothing (docs/transfer.md): the tail
    writes of the copy-engine kinds (and aicpu's batch call) run here, so the caller's next work starts when the bytes
    landed."""

    def __init__(self, torch, device):
        rt = runtime()
        self.stream = torch.cuda.Stream(device)
        self.handle = self.stream.cuda_stream
        self._events = [torch.cuda.Event() for _ in range(2)]  # torch owns (and destroys) them
        for event in self._events:
            event.record(self.stream)  # creates the event
        self._followed, self._joined = (event.cuda_event for event in self._events)
        self._record, self._wait = rt.lib.cudaEventRecord, rt.lib.cudaStreamWaitEvent
        self._record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._wait.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self._record.restype = self._wait.restype = ctypes.c_int
        self._error = rt.error

    def follow(self, stream: int) -> int:
        """The tail stream's handle, its later work ordered after everything enqueued on ``stream`` so far.

        One event serves every call: a wait binds the event's latest record when it is enqueued."""
        self._order(self._followed, stream, self.handle, "the tail stream following")
        return self.handle

    def join(self, stream: int) -> None:
        """Order ``stream``'s later work after everything enqueued on the tail stream so far."""
        self._order(self._joined, self.handle, stream, "a stream joining the tail stream")

    def _order(self, event: int, first: int, then: int, what: str) -> None:
        code = self._record(event, first) or self._wait(then, event, 0)
        if code:
            raise E.QueueError(f"{what} failed: {self._error(code)}")


def memory_devices(addrs: Sequence[int], nbytes: Sequence[int]) -> set[int]:
    """Ordinals of the GPUs whose memory holds the byte ranges ``[addr, addr + n)``: the device each range's first
    and last byte were allocated on, :data:`NOT_DEVICE_MEMORY` for host, managed or unknown memory.

    One driver query per allocation met (addresses are visited in order and those inside the allocation found last
    are skipped), so a layer pattern in one buffer costs one query.
    """
    lib = _driver()
    kinds = (ctypes.c_uint * 4)(*_POINTER_ATTRIBUTES)
    mem_type, ordinal = ctypes.c_uint(0), ctypes.c_int(0)
    start, size = ctypes.c_uint64(0), ctypes.c_uint64(0)
    data = (ctypes.c_void_p * 4)(
        *(ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in (mem_type, ordinal, start, size))
    )
    ends = [a + n - 1 for a, n in zip(addrs, nbytes, strict=True)]
    devices: set[int] = set()
    known_end = -1  # last byte of the allocation found last
    for addr in sorted(set(addrs) | set(ends)):
        if addr <= known_end:
            continue
        if lib.cuPointerGetAttributes(4, kinds, data, addr) or mem_type.value != _MEMORYTYPE_DEVICE or size.value == 0:
            devices.add(NOT_DEVICE_MEMORY)
            known_end = addr
            continue
        devices.add(ordinal.value)
        known_end = start.value + size.value - 1
    return devices


IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
IPC_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


class _IpcHandle(ctypes.Structure):
    """``cudaIpcMemHandle_t``: 64 opaque bytes."""

    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


def _check(code: int, what: str) -> None:
    if code:
        raise E.BackendUnavailable(f"{what} failed: {runtime().error(code)}")


def device_malloc(nbytes: int) -> int:
    """``cudaMalloc`` of ``nbytes`` on the current GPU: an allocation of its own, so that an IPC handle of it
    (:func:`ipc_handle`) exports exactly these bytes (torch's caching allocator carves tensors out of larger
    segments, and a handle exports a whole segment). Free it with :func:`device_free`."""
    ptr = ctypes.c_void_p()
    _check(runtime().lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes)), f"cudaMalloc of {nbytes} bytes")
    return int(ptr.value)


def device_free(addr: int) -> None:
    _check(runtime().lib.cudaFree(ctypes.c_void_p(addr)), f"cudaFree of {addr:#x}")


def ipc_handle(addr: int) -> bytes:
    """The ``cudaIpcMemHandle_t`` (64 bytes) of the allocation at ``addr`` (from :func:`device_malloc`)."""
    handle = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
    _check(runtime().lib.cudaIpcGetMemHandle(handle, ctypes.c_void_p(addr)), f"cudaIpcGetMemHandle of {addr:#x}")
    return handle.raw


def ipc_open(handle: bytes) -> int:
    """The address here of another process's allocation named by ``handle`` (``cudaIpcOpenMemHandle``, peer access
    enabled lazily where it lies on another GPU); close it with :func:`ipc_close`."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise E.ConfigError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    raw = _IpcHandle.from_buffer_copy(handle)  # a struct, passed by value as the runtime takes it
    ptr = ctypes.c_void_p()
    lib = runtime().lib
    lib.cudaIpcOpenMemHandle.argtypes = [ctypes.c_void_p, _IpcHandle, ctypes.c_uint]
    _check(lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), raw, IPC_LAZY_ENABLE_PEER_ACCESS), "cudaIpcOpenMemHandle")
    return int(ptr.value)


def ipc_close(addr: int) -> None:
    _check(runtime().lib.cudaIpcCloseMemHandle(ctypes.c_void_p(addr)), f"cudaIpcCloseMemHandle of {addr:#x}")


def host_register(addr: int, nbytes: int) -> None:
    """Pin ``nbytes`` of host memory at ``addr`` (``cudaHostRegister``, portable and mapped for every GPU): a
    registered source, or destination, of the transfer engine. Undo with :func:`host_unregister`."""
    lib = runtime().lib
    code = lib.cudaHostRegister(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), HOST_REGISTER_PORTABLE_MAPPED)
    _check(code, f"cudaHostRegister of {nbytes} bytes at {addr:#x}")


def host_unregister(addr: int) -> None:
    _check(runtime().lib.cudaHostUnregister(ctypes.c_void_p(addr)), f"cudaHostUnregister of {addr:#x}")
