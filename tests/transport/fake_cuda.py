"""A CUDA transfer engine whose GPU parts are stand-ins, for its bookkeeping on machines without a GPU.

:func:`fake_engine` builds :class:`~ascend_dualpath.transport.cuda_engine.CudaTransferEngine` without its constructor
(which needs a GPU): range checks pass, an ``aiv`` plan is a :class:`FakePlan` and the copier publishes each value in
the plan's (or the graph's) host word at once, unless ``publish=False``. Used by the CPU tests of the engine and by
``tools/bench_engine_host.py`` (the engine's own Python per request).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

import numpy as np

from ascend_dualpath.transport import cuda_engine
from ascend_dualpath.transport.kinds import AIV_DATAPLANE_BIT, ChannelCapabilities, MemoryKind
from ascend_dualpath.transport.segments import MemorySegment, RemoteSlot


class FakeWord:
    """A host word in ordinary memory, with the real one's ``reached``."""

    def __init__(self):
        self._view = np.zeros(1, np.int64)

    def reached(self, value: int) -> bool:
        return self._view[0] >= value


class FakePlan:
    def __init__(self):
        self.host_word = FakeWord()
        self.runs: list[int] = []


class FakeGraph:
    """A captured plan: replay ``k`` publishes ``first + k``."""

    def __init__(self, copier: FakeCopier, plan: FakePlan, first: int):
        self.copier, self.plan, self.next_value, self.host_word = copier, plan, first, FakeWord()
        self.flag_values: list[int] = []  # what each replay published in the flag

    def replay(self, stream: int, flag_value: int | None = None) -> int:
        self.flag_values.append(self.next_value if flag_value is None else flag_value)
        if self.copier.publish:
            self.host_word._view[0] = self.next_value
        self.next_value += 1
        return self.next_value - 1


class FakeCopier:
    def __init__(self, publish: bool):
        self.publish = publish
        self.captures = 0

    def run(self, plan: FakePlan, value: int, word_value: int | None = None) -> None:
        plan.runs.append(value)
        if self.publish:
            plan.host_word._view[0] = value if word_value is None else word_value

    def capture(self, plan: FakePlan, first: int) -> FakeGraph:
        self.captures += 1
        return FakeGraph(self, plan, first)


class FakeTail:
    """The tail stream's ordering calls, counted."""

    def __init__(self):
        self.joins = 0

    def join(self, stream: int) -> None:
        self.joins += 1


class _Device:
    index = 0


class _TorchC:
    @staticmethod
    def _cuda_getDevice() -> int:
        return 0


class _Torch:
    _C = _TorchC()


def fake_engine(publish: bool = True, graphs: bool = True, timeout_s: float = 10.0) -> cuda_engine.CudaTransferEngine:
    """The engine's state as its constructor leaves it for one GPU, with the GPU parts replaced."""
    e = cuda_engine.CudaTransferEngine.__new__(cuda_engine.CudaTransferEngine)
    e.timeout_s, e.graphs, e._graph_magic = timeout_s, graphs, cuda_engine.GRAPH_FIRST_MAGIC
    e.torch, e.device, e.peer_device, e.notify = _Torch(), _Device(), _Device(), None
    e.caps = ChannelCapabilities(AIV_DATAPLANE_BIT, "local", cuda_engine.DEFAULT_MAX_SINGLE_PIECE)
    e.copy_engine_min_bytes = cuda_engine.COPY_ENGINE_MIN_BYTES
    e.strided_min_piece_bytes, e.max_pitch = cuda_engine.STRIDED_MIN_PIECE_BYTES, (1 << 31) - 1
    e._registrations, e._raw_stream, e._copier = 0, lambda index: 0, FakeCopier(publish)
    e._routes, e._plans, e._submissions = {}, OrderedDict(), OrderedDict()
    e._host_buffers, e._magics = {}, itertools.count(1)
    e.zero_copy, e._zero_copy_buffers, e.zero_copy_config = True, {}, None
    e._tail, e._tail_notify = FakeTail(), {}
    e._check_request = lambda remote, slot: None
    e._check_ranges = lambda pieces, remote: None

    def aiv_work(work, pieces, slot):
        work.plans.append(FakePlan())
        work.graphable = True

    e._aiv_work = aiv_work
    return e


def blocks(count: int, size: int, base: int = 0x10_0000) -> tuple[list[MemorySegment], RemoteSlot]:
    """``count`` device segments of ``size`` bytes end to end from ``base``, and a slot that holds them."""
    sources = [MemorySegment(base + i * size, size, MemoryKind.DEVICE) for i in range(count)]
    return sources, RemoteSlot(0, 0x4000_0000, count * size)
