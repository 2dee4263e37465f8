"""Shared fixtures: emulated devices on a private fabric, regions with poisoned guard zones."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# Tests are about behaviour, not speed: no per-example deadline (the first example loads _C).
settings.register_profile("adp", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("adp")

POISON = 0xA5


@pytest.fixture(scope="session")
def C():
    """The compiled runtime ``ascend_dualpath._C``."""
    from ascend_dualpath import _ext

    return _ext.load()


@pytest.fixture(scope="session")
def emu():
    from ascend_dualpath.backends import emulator

    return emulator


@pytest.fixture
def two_devices(emu):
    """Two emulated NPUs (device 0 and 1) on one private fabric."""
    with emu.emulated_devices(2) as devices:
        yield devices


class Poisoned:
    """A registered region filled with POISON: tests write a window of it and check the rest is untouched."""

    def __init__(self, device, size, kind, access):
        self.region = device.alloc_region(size, kind, int(access))
        self.view = np.frombuffer(self.region, dtype=np.uint8)
        self.view[:] = POISON
        self.expected = self.view.copy()

    @property
    def addr(self) -> int:
        return self.region.addr

    def expect(self, offset: int, data: np.ndarray) -> None:
        self.expected[offset : offset + len(data)] = data

    def assert_intact(self) -> None:
        """Bytes equal what the test expected: writes landed exactly and nothing else changed."""
        diff = np.flatnonzero(self.view != self.expected)
        assert diff.size == 0, f"{diff.size} bytes differ, first at offset {diff[0]}"


@pytest.fixture
def poisoned(C):
    made: list[Poisoned] = []

    def make(device, size=1 << 16, kind=None, access=7) -> Poisoned:
        p = Poisoned(device, size, kind if kind is not None else C.MemKind.DEVICE_GM, access)
        made.append(p)
        return p

    yield make
    for p in made:
        p.region.close()


def poll_all(cq, n: int, timeout_s: float = 10.0) -> list:
    """Exactly ``n`` completions from ``cq``, waiting at most ``timeout_s`` for each."""
    out = []
    while len(out) < n:
        out += cq.poll(n - len(out), timeout_s)
    return out


def cuda_torch():
    """torch, for a test that needs a CUDA GPU and Triton; skips the test where either is missing."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch
