"""The transfer leg under test, over each transfer engine: the emulator's (CI) and the CUDA engine (``-m cuda``:
PE and DE on one GPU, a valid peer), so the same leg tests run on both. The CUDA variant skips cleanly without a
GPU or Triton."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.conftest import cuda_torch

LANDING_BYTES = 1 << 20
NOTIFY_SLOTS = 1024  # the leg's abort slot is 1023


@dataclasses.dataclass
class LegBench:
    """A leg writing from rank 0 into rank 1, with what a test needs around it.

    ``source`` / ``landing`` are uint8 views (numpy) of the source memory and of rank 1's landing area, ``notify``
    answers ``notify_value(slot)`` on rank 1, ``refused`` is a request (segments as ``(addr, nbytes)``, destination
    address) that the backend must refuse before anything moves."""

    leg: Any
    source_addr: int
    source: Callable[[], np.ndarray]
    write_source: Callable[[np.ndarray], None]
    landing_addr: int
    landing: Callable[[], np.ndarray]
    poison_landing: Callable[[], None]
    notify: Any
    next_magic: Callable[[], int]
    refused: tuple[list[tuple[int, int]], int]


@contextlib.contextmanager
def _connected_pair(emu, C):
    """Two emulated ranks of one communicator (1 MiB windows), connected; closed after."""
    with emu.emulated_devices(2) as devices:
        comms = [C.HcclComm(d, rank, 2, emu.comm_config(hcclBufferSize=1)) for rank, d in enumerate(devices)]
        infos = [c.local_info() for c in comms]
        for c in comms:
            c.connect(infos)
        try:
            yield comms
        finally:
            for c in comms:
                c.close()


@pytest.fixture
def comms(emu, C):
    """Rank 0 and rank 1 of :func:`_connected_pair`."""
    with _connected_pair(emu, C) as pair:
        yield pair


def _emulator_bench(emu, C, leg_cls):
    with _connected_pair(emu, C) as comms:
        src, dst = comms
        out = np.frombuffer(src.windows_out, dtype=np.uint8)
        landing = np.frombuffer(dst.windows_in, dtype=np.uint8)

        def write(data):
            out[: data.size] = data

        def poison():
            landing[:] = 0xA5

        size = dst.windows_in.size
        refused = ([(src.windows_out.addr, 64), (src.windows_out.addr, 128)], dst.windows_in.addr + size - 100)
        leg = leg_cls(src, timeout_s=5.0)
        yield LegBench(
            leg,
            src.windows_out.addr,
            lambda: out,
            write,
            dst.windows_in.addr,
            lambda: landing,
            poison,
            dst,
            src.next_magic,
            refused,
        )
        leg.close()


def _cuda_bench():
    torch = cuda_torch()
    import itertools

    from ascend_dualpath.dualpath.transfer_leg import TransportTransferLeg
    from ascend_dualpath.transport.cuda_engine import CudaTransferEngine

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    src = torch.zeros(LANDING_BYTES, dtype=torch.uint8, device=dev)
    dst = torch.full((LANDING_BYTES,), 0xA5, dtype=torch.uint8, device=dev)
    notify = torch.zeros(NOTIFY_SLOTS, dtype=torch.int64, device=dev)
    engine = CudaTransferEngine(dev, dev, notify, timeout_s=5.0)
    unregistered = torch.zeros(4096, dtype=torch.uint8).pin_memory()  # host memory never given to the engine
    magics = itertools.count(1)

    def write(data):
        src[: data.size].copy_(torch.from_numpy(data))
        torch.cuda.synchronize()

    def poison():
        dst.fill_(0xA5)
        torch.cuda.synchronize()

    def landing():
        torch.cuda.synchronize()
        return dst.cpu().numpy()

    def source():
        torch.cuda.synchronize()
        return src.cpu().numpy()

    leg = TransportTransferLeg(engines=[engine, engine], timeout_s=5.0)  # rank 0 and rank 1: the same GPU
    refused = ([(unregistered.data_ptr(), 64), (src.data_ptr(), 128)], dst.data_ptr())
    yield LegBench(
        leg, src.data_ptr(), source, write, dst.data_ptr(), landing, poison, engine, lambda: next(magics), refused
    )
    leg.close()
    torch.cuda.synchronize()


LEG_BACKENDS = [
    "transport-emulator",
    pytest.param("transport-cuda", marks=pytest.mark.cuda),
]


@pytest.fixture(params=LEG_BACKENDS)
def leg_bench(request):
    """A :class:`LegBench` per leg and transfer engine."""
    if request.param == "transport-cuda":
        yield from _cuda_bench()
        return
    from ascend_dualpath import _ext
    from ascend_dualpath.backends import emulator as emu
    from ascend_dualpath.dualpath.transfer_leg import TransportTransferLeg

    yield from _emulator_bench(emu, _ext.load(), TransportTransferLeg)
