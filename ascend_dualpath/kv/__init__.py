"""KV cache foundation of DualPath loading: block layouts, the block store with its prefix index and paced
per-node read queue, and the bounded PE/DE host buffers. See ``docs/kv.md``.

Modules: ``layout``, ``store`` (block files), ``read_queue`` (one node's storage NIC), ``clocks`` (wall and
manual clock, token bucket), ``faults`` (test hooks), ``memory`` (byte views), ``prefix_index``, ``buffers``.
Every name below is importable from ``ascend_dualpath.kv`` itself, the public path.
"""

from __future__ import annotations

from ascend_dualpath.kv.buffers import HostBuffer, Lease, Region, Registration, de_buffer, pe_buffer
from ascend_dualpath.kv.clocks import ManualClock, MonotonicClock, TokenBucket
from ascend_dualpath.kv.faults import FaultInjector
from ascend_dualpath.kv.layout import DEFAULT_BLOCK_TOKENS, KVField, KVLayout, block_hashes
from ascend_dualpath.kv.prefix_index import PrefixIndex
from ascend_dualpath.kv.read_queue import ReadQueue, ReadQueueStats, ReadTicket
from ascend_dualpath.kv.store import BlockStore, LocalBlockStore

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "BlockStore",
    "FaultInjector",
    "HostBuffer",
    "KVField",
    "KVLayout",
    "Lease",
    "LocalBlockStore",
    "ManualClock",
    "MonotonicClock",
    "PrefixIndex",
    "ReadQueue",
    "ReadQueueStats",
    "ReadTicket",
    "Region",
    "Registration",
    "TokenBucket",
    "block_hashes",
    "de_buffer",
    "pe_buffer",
]
