"""Bounded host buffers for KV in flight: the PE buffer and the DE buffer (one class, two roles).

A :class:`HostBuffer` hands out :class:`Lease` s, byte ranges of one backing allocation, each owned by a
request id. The backing is any writable buffer-protocol object: by default a torch ``uint8`` tensor (pinned
when CUDA is available); the emulator passes its registered shared-memory region, whose ``addr``, ``size``
and ``lkey`` attributes are picked up as registration metadata so a transfer engine can turn a lease's byte
offset into a remote address.

Admission is FIFO with back-pressure: an allocation that does not fit waits until earlier leases are released
or its deadline passes, then raises :class:`AdmissionDeferred`; a request larger than the whole buffer fails
at once with :class:`CapacityError`. Every lease is released exactly once (double release raises
:class:`InvalidKey`), by hand, by ``with``, or when its :meth:`HostBuffer.request` scope exits, error or not.

A released lease can no longer reach the buffer through the library: its ``tensor``, ``view``, ``addr``,
``slice`` and ``full_blocks`` (and those of its slices) raise :class:`InvalidKey`, and every tensor and
memoryview they handed out is invalidated at release (tensors are re-pointed at empty storage, memoryviews
released), so a late write through them raises instead of overwriting the next lease at that offset. What
the library cannot take back: raw addresses (``addr``, ``data_ptr()``) copied before the release, views a caller
derived from a handed-out tensor (``t[1:]``, ``t.view(...)``), and objects exported from a handed-out
memoryview (``numpy.frombuffer(view)``) keep pointing at the bytes.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ascend_dualpath import _env
from ascend_dualpath._checks import check_bound, check_type
from ascend_dualpath.errors import (
    AdmissionDeferred,
    ArgumentTypeError,
    BoundsError,
    CapacityError,
    ConfigError,
    InvalidKey,
)
from ascend_dualpath.kv.layout import KVLayout
from ascend_dualpath.kv.memory import as_memoryview, buffer_address

ROLES = ("pe_buffer", "de_buffer")
DEFAULT_ALIGNMENT = 4096  # O_DIRECT reads and RDMA-friendly placement


@dataclasses.dataclass(frozen=True)
class Registration:
    """Where a buffer lives for a transfer engine: its base address, size and local key (if registered)."""

    addr: int
    size: int
    lkey: int | None = None


@dataclasses.dataclass(frozen=True)
class Region:
    """A byte range ``[offset, offset + nbytes)`` of a host buffer's backing, with its registration address.

    ``owner`` is the lease the range belongs to (None for a range the caller built by hand): once it is released,
    every accessor raises :class:`InvalidKey` and what they handed out is invalidated (module docstring).
    """

    buffer: HostBuffer
    offset: int
    nbytes: int
    owner: Lease | None = dataclasses.field(default=None, repr=False, compare=False)

    def _lease(self) -> Lease | None:
        return self.owner

    def _handed_out(self, obj: Any) -> Any:
        """``obj`` (a tensor or memoryview of this range), remembered so that the owner's release invalidates it."""
        lease = self._lease()
        if lease is not None:
            self.buffer._track(lease, obj)
        return obj

    @property
    def addr(self) -> int:
        """Address of the first byte in the registration's address space."""
        lease = self._lease()
        if lease is not None:
            self.buffer._check_live(lease)
        return self.buffer.registration.addr + self.offset

    @property
    def lkey(self) -> int | None:
        return self.buffer.registration.lkey

    @property
    def tensor(self) -> torch.Tensor:
        """``uint8 [nbytes]`` view of the range (shares memory with the backing)."""
        return self._handed_out(self.buffer.bytes[self.offset : self.offset + self.nbytes])

    @property
    def view(self) -> memoryview:
        """Writable memoryview of the range, e.g. a destination for ``LocalBlockStore.read_into``."""
        return self._handed_out(self.buffer.memory[self.offset : self.offset + self.nbytes])

    def slice(self, offset: int, nbytes: int) -> Region:
        """Sub-range at ``offset`` (relative to this range) of ``nbytes`` bytes; out of bounds raises BoundsError."""
        lease = self._lease()
        if lease is not None:
            self.buffer._check_live(lease)
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise BoundsError(
                f"slice [{offset}, {offset + nbytes}) is outside a region of {self.nbytes} bytes "
                f"(at byte {self.offset} of {self.buffer.role})"
            )
        return Region(self.buffer, self.offset + offset, nbytes, owner=lease)

    def full_blocks(self, layout: KVLayout, num_blocks: int | None = None) -> torch.Tensor:
        """``uint8 [n, L, T, C]`` view of the first ``n`` Full Blocks of the range (default: as many as fit)."""
        if num_blocks is None:
            num_blocks = self.nbytes // layout.full_block_bytes
        needed = num_blocks * layout.full_block_bytes
        if needed > self.nbytes:
            raise BoundsError(f"{num_blocks} Full Blocks need {needed} bytes, the region has {self.nbytes}")
        return self._handed_out(layout.as_full_blocks(self.tensor[:needed], num_blocks))


@dataclasses.dataclass(frozen=True)
class Lease(Region):
    """A region owned by one request until released."""

    request_id: Any = None
    lease_id: int = -1

    def _lease(self) -> Lease:
        return self

    def release(self) -> None:
        self.buffer.release(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.buffer.release(self)


@dataclasses.dataclass(frozen=True)
class HostBufferStats:
    capacity_bytes: int
    used_bytes: int
    live_leases: int
    live_requests: int
    waiting_allocations: int
    largest_free_extent: int

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes


class HostBuffer:
    """Bounded, request-owned allocator over one backing byte allocation.

    Parameters
    ----------
    capacity_bytes : int, optional
        Usable bytes. Required without ``backing``; with it, defaults to all of the backing (after alignment).
    backing : buffer-protocol object or torch.Tensor, optional
        Writable, contiguous memory to carve leases from. Objects with ``addr``/``size``/``lkey`` attributes (a
        registered region) provide the registration metadata. Default: a fresh ``uint8`` tensor, pinned when
        CUDA is available.
    registration : Registration, optional
        Explicit registration metadata (beats the backing's attributes).
    role : str
        ``"pe_buffer"`` or ``"de_buffer"``; used in messages and stats.
    alignment : int
        Every lease starts at an address that is a multiple of this (a power of two).
    timeout_s : float, optional
        Default admission deadline (finite, > 0); ``ADP_TIMEOUT_S`` (30 s) when omitted.

    Every argument is checked by name: a wrong type raises :class:`~ascend_dualpath.errors.ArgumentTypeError`,
    a NaN, infinite or non-positive bound :class:`ConfigError`.
    """

    def __init__(
        self,
        capacity_bytes: int | None = None,
        *,
        backing: Any = None,
        registration: Registration | None = None,
        role: str = "de_buffer",
        alignment: int = DEFAULT_ALIGNMENT,
        timeout_s: float | None = None,
    ) -> None:
        self._check_arguments(capacity_bytes, registration, role, alignment)
        self.role = role
        self.alignment = int(alignment)
        self.default_timeout_s = None if timeout_s is None else check_bound("timeout_s", timeout_s, where=role)
        if backing is None:
            if capacity_bytes is None or capacity_bytes < 1:
                raise ConfigError(f"{role}: capacity_bytes must be >= 1 without a backing, got {capacity_bytes}")
            backing = torch.empty(
                capacity_bytes + alignment - 1, dtype=torch.uint8, pin_memory=torch.cuda.is_available()
            )
        self.backing = backing
        try:
            self.memory = as_memoryview(backing, writable=True)
        except TypeError:
            raise ArgumentTypeError(
                f"{role}: backing must be a writable buffer-protocol object or CPU tensor, got {type(backing).__name__}"
            ) from None
        self.bytes = (
            torch.frombuffer(self.memory, dtype=torch.uint8)
            if self.memory.nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
        base_addr = buffer_address(self.memory)
        if registration is None:
            if isinstance(backing, torch.Tensor) or not hasattr(backing, "addr"):
                registration = Registration(base_addr, self.memory.nbytes)
            else:  # a registered region: its own address space and key
                registration = Registration(int(backing.addr), int(backing.size), getattr(backing, "lkey", None))
        if registration.size < self.memory.nbytes:
            raise ConfigError(
                f"{role}: registration covers {registration.size} bytes, backing has {self.memory.nbytes}"
            )
        self.registration = registration
        # Leases are aligned in the registration's address space, which is what a NIC or O_DIRECT sees.
        self._start = -registration.addr % alignment
        usable = max(0, self.memory.nbytes - self._start)
        if capacity_bytes is None:
            capacity_bytes = usable
        if not 1 <= capacity_bytes <= usable:
            raise ConfigError(
                f"{role}: capacity_bytes={capacity_bytes} must be in [1, {usable}] "
                f"(backing of {self.memory.nbytes} bytes, {self._start} skipped for alignment)"
            )
        self.capacity_bytes = capacity_bytes
        self._cond = threading.Condition()
        self._free: list[list[int]] = [[self._start, self._start + capacity_bytes]]  # sorted [start, end)
        self._leases: dict[int, Lease] = {}
        self._extent_bytes: dict[int, int] = {}
        self._by_request: dict[Any, set[int]] = {}
        self._waiters: list[object] = []
        self._used = 0
        self._ids = itertools.count()
        self._handed: dict[int, list[weakref.ref]] = {}  # lease id -> tensors / memoryviews handed out for it

    @staticmethod
    def _check_arguments(capacity_bytes: Any, registration: Any, role: Any, alignment: Any) -> None:
        if role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {role!r}")
        if check_bound("alignment", alignment, integer=True, where=role) & (alignment - 1):
            raise ConfigError(f"alignment must be a power of two, got {alignment}")
        if capacity_bytes is not None:
            check_type("capacity_bytes", capacity_bytes, int, where=role)
        check_type("registration", registration, (Registration, type(None)), where=role)

    # -- allocation -----------------------------------------------------------------------------------------------
    def _round(self, nbytes: int) -> int:
        return -(-nbytes // self.alignment) * self.alignment

    def _find_extent(self, size: int) -> int | None:
        for index, (start, end) in enumerate(self._free):
            if end - start >= size:
                return index
        return None

    def _largest_free(self) -> int:
        return max((end - start for start, end in self._free), default=0)

    def allocate(self, request_id: Any, nbytes: int, *, timeout_s: float | None = None) -> Lease:
        """Reserve ``nbytes`` for ``request_id``, waiting (FIFO) up to ``timeout_s`` for space.

        Parameters
        ----------
        request_id : hashable
            Owner of the lease.
        nbytes : int
            Bytes wanted (>= 1); the extent taken is rounded up to ``alignment``.
        timeout_s : float, optional
            Admission deadline (finite, >= 0); 0 means do not wait. Default: the buffer's ``timeout_s`` or
            ``ADP_TIMEOUT_S``.

        Raises
        ------
        CapacityError
            ``nbytes`` exceeds the whole buffer, so waiting cannot help.
        AdmissionDeferred
            No space became free before the deadline; nothing was allocated.
        """
        check_type("nbytes", nbytes, int, where=f"{self.role} allocate")
        if nbytes < 1:
            raise BoundsError(f"{self.role}: allocation of {nbytes} bytes for request {request_id!r}; needs >= 1")
        size = self._round(nbytes)
        if size > self.capacity_bytes:
            raise CapacityError(
                f"{self.role}: request {request_id!r} needs {nbytes} bytes ({size} aligned), "
                f"capacity is {self.capacity_bytes}"
            )
        if timeout_s is None:
            timeout_s = self.default_timeout_s if self.default_timeout_s is not None else _env.timeout_s()
        else:
            timeout_s = check_bound("timeout_s", timeout_s, zero_ok=True, where=f"{self.role} allocate")
        turn = object()
        with self._cond:
            self._waiters.append(turn)
            try:
                admitted = self._cond.wait_for(
                    lambda: self._waiters[0] is turn and self._find_extent(size) is not None, timeout_s
                )
                if not admitted:
                    ahead = self._waiters.index(turn)
                    raise AdmissionDeferred(
                        f"{self.role}: request {request_id!r} waited {timeout_s} s for {nbytes} bytes ({size} aligned);"
                        f" {self.capacity_bytes - self._used} of {self.capacity_bytes} bytes free, largest free extent"
                        f" {self._largest_free()}, {ahead} allocation(s) ahead"
                    )
                index = self._find_extent(size)
                assert index is not None
                start, end = self._free[index]
                if end - start == size:
                    del self._free[index]
                else:
                    self._free[index][0] = start + size
                lease = Lease(self, start, nbytes, request_id=request_id, lease_id=next(self._ids))
                self._leases[lease.lease_id] = lease
                self._extent_bytes[lease.lease_id] = size
                self._by_request.setdefault(request_id, set()).add(lease.lease_id)
                self._used += size
                return lease
            finally:
                self._waiters.remove(turn)
                self._cond.notify_all()  # the next waiter in line may fit now

    def release(self, lease: Lease) -> None:
        """Return a lease's bytes; a second release of the same lease raises :class:`InvalidKey`."""
        with self._cond:
            if lease.buffer is not self:
                raise InvalidKey(f"lease {lease.lease_id} belongs to another buffer, not this {self.role}")
            if self._leases.get(lease.lease_id) is not lease:
                raise InvalidKey(
                    f"{self.role}: lease {lease.lease_id} of request {lease.request_id!r} "
                    f"({lease.nbytes} bytes at {lease.offset}) is not live: already released"
                )
            del self._leases[lease.lease_id]
            size = self._extent_bytes.pop(lease.lease_id)
            owned = self._by_request[lease.request_id]
            owned.discard(lease.lease_id)
            if not owned:
                del self._by_request[lease.request_id]
            self._used -= size
            self._insert_free(lease.offset, lease.offset + size)
            self._invalidate(self._handed.pop(lease.lease_id, []))
            self._cond.notify_all()

    def _check_live(self, lease: Lease) -> None:
        if self._leases.get(lease.lease_id) is not lease:
            raise InvalidKey(
                f"{self.role}: lease {lease.lease_id} of request {lease.request_id!r} ({lease.nbytes} "
                f"bytes at {lease.offset}) was released; its bytes may belong to another lease now"
            )

    def _track(self, lease: Lease, obj: Any) -> None:
        with self._cond:
            self._check_live(lease)
            self._handed.setdefault(lease.lease_id, []).append(weakref.ref(obj))

    @staticmethod
    def _invalidate(handed: list[weakref.ref]) -> None:
        """Cut what a released lease handed out off the backing, so that late writes raise instead of landing."""
        for ref in handed:
            obj = ref()
            if isinstance(obj, torch.Tensor):
                with torch.no_grad():
                    obj.set_(torch.empty(0, dtype=obj.dtype))  # 0 elements: any index or copy_ now raises
            elif isinstance(obj, memoryview):
                with contextlib.suppress(BufferError):  # exported further (numpy.frombuffer): cannot be taken back
                    obj.release()

    def _insert_free(self, start: int, end: int) -> None:
        index = bisect.bisect_left(self._free, [start, end])
        if index > 0 and self._free[index - 1][1] == start:  # merge with the extent before
            index -= 1
            self._free[index][1] = end
        else:
            self._free.insert(index, [start, end])
        if index + 1 < len(self._free) and self._free[index + 1][0] == self._free[index][1]:  # and the one after
            self._free[index][1] = self._free.pop(index + 1)[1]

    def release_request(self, request_id: Any) -> int:
        """Release every live lease of ``request_id``; returns how many there were."""
        with self._cond:
            leases = [self._leases[lease_id] for lease_id in self._by_request.get(request_id, ())]
        for lease in leases:
            self.release(lease)
        return len(leases)

    @contextlib.contextmanager
    def request(self, request_id: Any) -> Iterator[RequestScope]:
        """Scope whose leases are all released on exit, normal or not."""
        scope = RequestScope(self, request_id)
        try:
            yield scope
        finally:
            scope.release_all()

    # -- accounting -----------------------------------------------------------------------------------------------
    def stats(self) -> HostBufferStats:
        with self._cond:
            return HostBufferStats(
                self.capacity_bytes,
                self._used,
                len(self._leases),
                len(self._by_request),
                len(self._waiters),
                self._largest_free(),
            )

    def leases_of(self, request_id: Any) -> list[Lease]:
        with self._cond:
            return sorted((self._leases[i] for i in self._by_request.get(request_id, ())), key=lambda x: x.offset)

    def check_invariants(self) -> None:
        """Raise AssertionError unless free extents and live leases tile the buffer exactly, with no overlap."""
        with self._cond:
            pieces = [(start, end, "free") for start, end in self._free]
            pieces += [
                (lease.offset, lease.offset + self._extent_bytes[i], "lease") for i, lease in self._leases.items()
            ]
            pieces.sort()
            cursor = self._start
            for start, end, _ in pieces:
                assert start == cursor and end > start, f"{self.role}: gap or overlap at byte {cursor}: {pieces}"
                cursor = end
            assert cursor == self._start + self.capacity_bytes, f"{self.role}: extents end at {cursor}"
            for (_, end_a), (start_b, _) in itertools.pairwise(self._free):
                assert end_a < start_b, f"{self.role}: adjacent free extents were not merged: {self._free}"
            assert self._used == sum(self._extent_bytes.values()), f"{self.role}: used bytes drifted"


class RequestScope:
    """Allocations of one request within :meth:`HostBuffer.request`; released together."""

    def __init__(self, buffer: HostBuffer, request_id: Any) -> None:
        self.buffer = buffer
        self.request_id = request_id
        self.leases: list[Lease] = []

    def allocate(self, nbytes: int, *, timeout_s: float | None = None) -> Lease:
        lease = self.buffer.allocate(self.request_id, nbytes, timeout_s=timeout_s)
        self.leases.append(lease)
        return lease

    def release(self, lease: Lease) -> None:
        self.leases.remove(lease)
        self.buffer.release(lease)

    def release_all(self) -> None:
        while self.leases:
            self.buffer.release(self.leases.pop())


def pe_buffer(capacity_bytes: int | None = None, **kwargs: Any) -> HostBuffer:
    """Prefill-engine host buffer: hit KV read from storage, streamed layer by layer to PE HBM."""
    return HostBuffer(capacity_bytes, role="pe_buffer", **kwargs)


def de_buffer(capacity_bytes: int | None = None, **kwargs: Any) -> HostBuffer:
    """Decode-engine host buffer: the whole prompt KV (hit read + miss merged) until its H2D completes."""
    return HostBuffer(capacity_bytes, role="de_buffer", **kwargs)
