"""Per-node read queue: one node's storage NIC, a FIFO of block reads paced by a token bucket at a configurable
bandwidth, reporting its queue length in requests and bytes (the scheduler's ``read_q``)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ascend_dualpath import _env
from ascend_dualpath._checks import check_bound, check_type
from ascend_dualpath.errors import BoundsError, CapacityError, QueueError, WaitTimeout
from ascend_dualpath.kv.clocks import Clock, MonotonicClock, TokenBucket
from ascend_dualpath.kv.layout import KVShard
from ascend_dualpath.kv.memory import as_memoryview
from ascend_dualpath.kv.store import BlockStore


@dataclasses.dataclass
class ReadTicket:
    """One queued block read; :meth:`wait` bounds the wait and re-raises the read's error."""

    block_id: bytes
    nbytes: int
    submitted_at: float
    block: bool = True  # counts as a block read (completed_blocks); a further share of a block counted already not
    started_at: float | None = None
    finished_at: float | None = None
    _done: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)
    _error: BaseException | None = dataclasses.field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> BaseException | None:
        """The read's error once it is done (None while queued or reading, and after a good read)."""
        return self._error if self._done.is_set() else None

    def wait(self, timeout_s: float | None = None) -> None:
        timeout = (
            check_bound("timeout_s", timeout_s, zero_ok=True, where=f"read of block {self.block_id.hex()}")
            if timeout_s is not None
            else _env.timeout_s()
        )
        if not self._done.wait(timeout):
            state = "queued" if self.started_at is None else "reading"
            raise WaitTimeout(
                f"read of block {self.block_id.hex()} ({self.nbytes} bytes) not done after "
                f"{timeout} s; last state: {state}"
            )
        if self._error is not None:
            raise self._error

    def _finish(self, now: float, error: BaseException | None = None) -> None:
        self.finished_at = now
        self._error = error
        self._done.set()


@dataclasses.dataclass(frozen=True)
class ReadQueueStats:
    """Queue length of one node's storage reads: waiting (paced, not started) and in flight; what completed (reads,
    bytes, and blocks: reads submitted as one, not as a further share of a block another read counts)."""

    queued_requests: int
    queued_bytes: int
    inflight_requests: int
    inflight_bytes: int
    completed_requests: int
    completed_bytes: int
    failed_requests: int
    completed_blocks: int = 0

    @property
    def requests(self) -> int:
        return self.queued_requests + self.inflight_requests

    @property
    def bytes(self) -> int:
        return self.queued_bytes + self.inflight_bytes


class ReadQueue:
    """FIFO of block reads for one node, paced to a storage-NIC bandwidth cap.

    A dispatcher thread starts reads in submission order once the token bucket allows their bytes, and hands
    them to ``io_depth`` reader threads. Reads go to ``store.read_into``. A read is paced by its destination's size;
    where the store reports having read more (a tensor-parallel rank's read of a version-1 block reads it whole), the
    excess is taken from the bucket after it and counted in ``completed_bytes``, which is what the NIC carried.

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

    def __init__(
        self,
        store: BlockStore,
        bandwidth_bytes_per_s: float,
        *,
        burst_bytes: int | None = None,
        io_depth: int = 4,
        max_queued_bytes: int | None = None,
        clock: Clock | None = None,
        node: str = "node0",
    ) -> None:
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
        self.bucket = TokenBucket(bandwidth_bytes_per_s, burst_bytes or store.layout.full_block_bytes, self.clock.now())
        self.max_queued_bytes = max_queued_bytes
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[ReadTicket, Callable[[], None]]] = collections.deque()
        self._queued_bytes = 0
        self._inflight_requests = 0
        self._inflight_bytes = 0
        self._completed_requests = 0
        self._completed_blocks = 0
        self._completed_bytes = 0
        self._failed_requests = 0
        self._closed = False
        self._readers = ThreadPoolExecutor(max_workers=io_depth, thread_name_prefix=f"adp-read-{node}")
        self._dispatcher = threading.Thread(target=self._dispatch, name=f"adp-readq-{node}", daemon=True)
        self._dispatcher.start()

    def submit(self, block_id: bytes, dest: Any, shard: KVShard | None = None, block: bool = True) -> ReadTicket:
        """Queue a read of one Full Block into ``dest`` (the store layout's ``full_block_bytes`` bytes); returns its
        ticket. ``shard``: read only that tensor-parallel rank's bytes (``shard.local.full_block_bytes``; a DE rank
        reading for a PE rank of a larger size reads that rank's heads only). ``block``: False for a further share
        of a block another read of the same request counts (``completed_blocks``)."""
        nbytes = as_memoryview(dest, writable=True).nbytes
        expected = (shard.local if shard is not None else self.store.layout).full_block_bytes
        if nbytes != expected:
            raise BoundsError(f"block {block_id.hex()}: destination is {nbytes} bytes, a Full Block is {expected}")
        read = functools.partial(self.store.read_into, block_id, dest, **({"shard": shard} if shard else {}))
        with self._cond:
            if self._closed:
                raise QueueError(f"read queue of {self.node} is closed")
            if self.max_queued_bytes is not None and self._queued_bytes + nbytes > self.max_queued_bytes:
                raise CapacityError(
                    f"read queue of {self.node}: {self._queued_bytes} bytes queued + {nbytes} "
                    f"exceeds max_queued_bytes={self.max_queued_bytes}"
                )
            ticket = ReadTicket(block_id, nbytes, self.clock.now(), block)
            self._queue.append((ticket, read))
            self._queued_bytes += nbytes
            self._cond.notify_all()
        return ticket

    def submit_many(self, block_ids: Sequence[bytes], dests: Sequence[Any]) -> list[ReadTicket]:
        if len(block_ids) != len(dests):
            raise ValueError(f"{len(block_ids)} block ids but {len(dests)} destinations")
        return [self.submit(block_id, dest) for block_id, dest in zip(block_ids, dests, strict=True)]

    def cancel(self, tickets: Sequence[ReadTicket]) -> int:
        """Take ``tickets`` still queued off the queue (they end with QueueError, nothing is read into their
        destinations); reads already started run to their end. Returns how many were cancelled."""
        wanted = {id(t) for t in tickets}
        with self._cond:
            cancelled = [(t, r) for t, r in self._queue if id(t) in wanted]
            if cancelled:
                self._queue = collections.deque((t, r) for t, r in self._queue if id(t) not in wanted)
                self._queued_bytes -= sum(t.nbytes for t, _ in cancelled)
        for ticket, _ in cancelled:
            ticket._finish(self.clock.now(), QueueError(f"read of block {ticket.block_id.hex()} cancelled"))
        return len(cancelled)

    def stats(self) -> ReadQueueStats:
        with self._cond:
            return ReadQueueStats(
                len(self._queue),
                self._queued_bytes,
                self._inflight_requests,
                self._inflight_bytes,
                self._completed_requests,
                self._completed_bytes,
                self._failed_requests,
                self._completed_blocks,
            )

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

    def _run(self, ticket: ReadTicket, read: Callable[[], int | None]) -> None:
        """One read on a reader thread; ``read`` returns the payload bytes it read (None: the ticket's)."""
        error: BaseException | None = None
        carried = ticket.nbytes
        try:
            reported = read()
            carried = reported if isinstance(reported, int) else ticket.nbytes
        except Exception as caught:  # handed to the waiter through the ticket
            error = caught
        with self._cond:
            self._inflight_requests -= 1
            self._inflight_bytes -= ticket.nbytes
            if carried > ticket.nbytes:  # the NIC carried more than was paced: later reads wait for it
                self.bucket.take(carried - ticket.nbytes, self.clock.now())
            if error is None:
                self._completed_requests += 1
                self._completed_blocks += ticket.block
                self._completed_bytes += carried
            else:
                self._failed_requests += 1
        ticket._finish(self.clock.now(), error)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop the queue: queued reads fail with :class:`QueueError`, in-flight reads finish first."""
        timeout = (
            check_bound("timeout_s", timeout_s, where=f"read queue of {self.node}")
            if timeout_s is not None
            else _env.timeout_s()
        )
        with self._cond:
            if self._closed:
                return
            self._closed = True
            abandoned = list(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        for ticket, _ in abandoned:
            ticket._finish(
                self.clock.now(),
                QueueError(f"read queue of {self.node} closed before block {ticket.block_id.hex()} was read"),
            )
        self._readers.shutdown(wait=True)
        self._dispatcher.join(timeout)
        if self._dispatcher.is_alive():
            raise WaitTimeout(f"read queue of {self.node}: dispatcher still pacing after {timeout} s")

    def __enter__(self) -> ReadQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
