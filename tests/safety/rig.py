"""Two emulated ranks with a transfer engine and every byte of both watched, and a runner for cases that may crash.

``Rig`` poisons the windows and notify areas of both ranks and fills each source region with random bytes; tests
say which bytes a transfer may change (``expect``) and ``assert_intact`` finds any other byte that changed: a read
from outside a registration that reached the peer, a stage copy past the window, a write of a refused request.

``run_child`` runs a case in a fresh interpreter, so that a SIGSEGV fails the test instead of killing pytest.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import numpy as np

POISON = 0xA5
WINDOW_MB = 4
MAX_PIECE = 4096
SLOT_BYTES = 1 << 16
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Rig:
    """Rank 0's ``EmulatedTransferEngine`` writing to rank 1 on ``devices`` (two emulated NPUs).

    Parameters
    ----------
    devices : list
        Two devices of one fabric (``emu.emulated_devices(2)``); they close the regions made here.
    window_mb : int
        Size of each HCCL window (``hcclBufferSize``).
    **engine_kwargs
        Overrides of the engine's arguments (small defaults: 2 cores, SQ depth 32, 4 KiB pieces, 5 s waits).
    """

    def __init__(self, devices, window_mb: int = WINDOW_MB, **engine_kwargs):
        from ascend_dualpath import _ext
        from ascend_dualpath.backends import emulator as emu
        from ascend_dualpath.transport.emulator import EmulatedTransferEngine

        self.C = C = _ext.load()
        self.devices = devices
        self.comms = [C.HcclComm(d, r, 2, emu.comm_config(hcclBufferSize=window_mb)) for r, d in enumerate(devices)]
        infos = [c.local_info() for c in self.comms]
        for c in self.comms:
            c.connect(infos)
        self._watched: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for rank, comm in enumerate(self.comms):
            for name in ("windows_in", "windows_out", "notify_region"):
                self.watch(f"rank{rank}.{name}", getattr(comm, name))
        kwargs = {"block_dim": 2, "sq_depth": 32, "max_single_aiv_payload": MAX_PIECE, "timeout_s": 5.0}
        self.engine = EmulatedTransferEngine(self.comms[0], 1, **{**kwargs, **engine_kwargs})

    def watch(self, name: str, region, data: np.ndarray | None = None) -> np.ndarray:
        """Fill ``region`` with ``data`` (default POISON) and check it from now on; returns its uint8 view."""
        view = np.frombuffer(region, np.uint8)
        view[:] = POISON if data is None else data
        self._watched[name] = (view, view.copy())
        return view

    def source(self, name: str, nbytes: int, host: bool = False, device: int = 0, register: bool = True):
        """A watched region of random bytes on ``devices[device]`` (registered with that rank's communicator)."""
        C = self.C
        kind = C.MemKind.HOST_DRAM if host else C.MemKind.DEVICE_GM
        region = self.devices[device].alloc_region(nbytes, kind, 7)
        rng = np.random.default_rng(len(self._watched))
        self.watch(name, region, rng.integers(0, 256, nbytes, dtype=np.uint8))
        if register:
            self.comms[device].register_local(region)
        return region

    def slot(self, offset: int = 0, nbytes: int = SLOT_BYTES, rkey: int | None = None):
        """``nbytes`` of rank 1's ``windows_in`` from ``offset``."""
        from ascend_dualpath.transport import RemoteSlot

        w = self.comms[1].windows_in
        return RemoteSlot(1, w.addr + offset, nbytes, w.rkey if rkey is None else rkey)

    def expect(self, name: str, offset: int, data) -> None:
        """Bytes ``[offset, offset + len(data))`` of watched ``name`` may now hold ``data``."""
        expected = self._watched[name][1]
        expected[offset : offset + len(data)] = np.frombuffer(bytes(data), np.uint8)

    def view(self, name: str) -> np.ndarray:
        return self._watched[name][0]

    def assert_intact(self) -> None:
        """Every watched byte holds what was written or expected: nothing stray landed anywhere."""
        for name, (view, expected) in self._watched.items():
            if not np.array_equal(view, expected):  # memcmp speed: the fuzzers check every region per example
                diff = np.flatnonzero(view != expected)
                raise AssertionError(f"{name}: {diff.size} bytes changed, first at offset {diff[0]}")


def assert_refused(call, error, match: str):
    """``call()`` raises ``error`` whose message matches ``match``; returns the exception."""
    try:
        call()
    except error as exc:
        assert re.search(match, str(exc)), f"{type(exc).__name__} message {str(exc)!r} does not match {match!r}"
        return exc
    raise AssertionError(f"accepted; expected {error.__name__} matching {match!r}")


def run_child(code: str, timeout_s: float = 120.0) -> str:
    """Run ``code`` in a fresh interpreter at the repository root and return its stdout.

    Fails when the child hangs past ``timeout_s``, exits non-zero (a negative code: killed by that signal) or
    leaves fabric or region objects in /dev/shm.
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the child hung for {timeout_s} s\n{err[-4000:]}") from None
    left = glob.glob(f"/dev/shm/adp.fab{proc.pid}x*")
    for path in left:  # a crashed child cannot clean up: remove what it left, then fail
        os.unlink(path)
    assert proc.returncode == 0, f"the child exited with {proc.returncode}\n{out[-2000:]}\n{err[-4000:]}"
    assert not left, f"the child left {len(left)} objects in /dev/shm: {left[:3]}"
    return out
