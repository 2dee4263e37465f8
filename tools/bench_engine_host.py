"""The CUDA transfer engine's own host work per request, on any machine: every CUDA call is a no-op.

    PYTHONPATH=. python3 tools/bench_engine_host.py

What a GPU run adds to these figures is the driver's time (graph launch, kernel launch) and the GPU's; what is left
here is the engine's Python between the caller and the driver: a prepared ``submit().wait()`` of 61 layer blocks,
and a repeated plain ``submit`` of 256 / 1024 / 4096 segments (per segment). The engine is built without its
constructor (which needs a GPU) and its device work is replaced by stand-ins that publish at once.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections import OrderedDict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ascend_dualpath.transport import cuda_engine  # noqa: E402
from ascend_dualpath.transport.kinds import AIV_DATAPLANE_BIT, ChannelCapabilities, MemoryKind  # noqa: E402
from ascend_dualpath.transport.segments import MemorySegment, RemoteSlot  # noqa: E402


class _Word:
    """A host word in ordinary memory."""

    def __init__(self):
        self._view = np.zeros(1, np.int64)

    def reached(self, value: int) -> bool:
        return self._view[0] >= value


class _Plan:
    def __init__(self):
        self.host_word = _Word()


class _Graph:
    """A captured request whose replay publishes at once."""

    def __init__(self, first: int):
        self.next_value, self.host_word = first, _Word()

    def replay(self, stream: int) -> int:
        self.host_word._view[0] = self.next_value
        self.next_value += 1
        return self.next_value - 1


class _Copier:
    def run(self, plan: _Plan, value: int) -> None:
        plan.host_word._view[0] = value

    def capture(self, plan: _Plan, first: int) -> _Graph:
        return _Graph(first)


class _Device:
    index = 0


class _TorchC:
    @staticmethod
    def _cuda_getDevice() -> int:
        return 0


class _Torch:
    _C = _TorchC()


def engine() -> cuda_engine.CudaTransferEngine:
    """The engine's state as its constructor leaves it, with the GPU parts replaced."""
    e = cuda_engine.CudaTransferEngine.__new__(cuda_engine.CudaTransferEngine)
    e.timeout_s, e.graphs, e._graph_magic = 10.0, True, cuda_engine.GRAPH_FIRST_MAGIC
    e.torch, e.device, e.peer_device, e.notify = _Torch(), _Device(), _Device(), None
    e.caps = ChannelCapabilities(AIV_DATAPLANE_BIT, "local", cuda_engine.DEFAULT_MAX_SINGLE_PIECE)
    e.copy_engine_min_bytes = cuda_engine.COPY_ENGINE_MIN_BYTES
    e._registrations, e._raw_stream, e._copier = 0, lambda index: 0, _Copier()
    e._routes, e._plans, e._submissions = {}, OrderedDict(), OrderedDict()
    e._host_buffers, e._magics = {}, itertools.count(1)
    e._check_request = lambda remote, slot: None
    e._check_ranges = lambda pieces, remote: None

    def aiv_work(work, pieces, slot):
        work.plans.append(_Plan())
        work.graphable = True

    e._aiv_work = aiv_work
    return e


def per_call_us(call, repeats: int) -> float:
    for _ in range(min(repeats, 200)):
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e6


def blocks(count: int, size: int) -> tuple[list[MemorySegment], RemoteSlot]:
    return [MemorySegment(0x10_0000 + i * size, size, MemoryKind.DEVICE) for i in range(count)], RemoteSlot(
        0, 0x4000_0000, count * size
    )


def main() -> None:
    e = engine()
    sources, slot = blocks(61, 42 * 1024)
    prepared = e.prepare(sources, slot, notify_slot=0)
    us = per_call_us(lambda: prepared.submit().wait(), 20000)
    print(f"prepared 61 x 42 KiB submit().wait() with a notify slot: {us:.2f} us")
    for count in (256, 1024, 4096):
        sources, slot = blocks(count, 4096)
        us = per_call_us(lambda s=sources, r=slot: e.submit(s, r, notify_slot=0).wait(), 2000)
        print(f"plain submit().wait() of {count} x 4 KiB, repeated: {us:.2f} us ({us / count:.4f} us per segment)")


if __name__ == "__main__":
    main()
