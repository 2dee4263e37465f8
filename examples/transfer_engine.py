"""The transfer engine on the CPU emulator: one batch write of a layer's KV blocks, then its notify.

Two emulated NPUs on a private fabric, one HCCL communicator each. Rank 0 registers a source region holding 61
layer blocks of 42 KiB (DualPath's shape: one layer of a request's KV); rank 1 registers the destination region.
One ``submit`` moves all 61 blocks (the engine's gates pick the kind: ``aiv``, the vector cores posting RoCE
work requests themselves, for device memory) and writes a fresh magic into rank 1's notify slot once every
byte has landed. Rank 1 waits for that notify, then the example checks the destination bit for bit.

Run::

    python3 examples/transfer_engine.py

Prints the kind chosen and bytes over time (wall clock and the emulator's virtual clock); exits 1 if the bytes
differ or the notify does not arrive.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from ascend_dualpath import _ext, create_engine
from ascend_dualpath.backends import emulator as emu
from ascend_dualpath.transport import MemorySegment, RemoteSlot

BLOCKS, BLOCK_BYTES = 61, 42 * 1024  # one layer of a request: 61 blocks of 64 tokens x 672 bytes
NOTIFY_SLOT = 3
RW = 7  # access: LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ


def main() -> int:
    C = _ext.load()
    nbytes = BLOCKS * BLOCK_BYTES
    with emu.emulated_devices(2) as devices:
        comms = [C.HcclComm(device, rank, 2, emu.comm_config(hcclBufferSize=4)) for rank, device in enumerate(devices)]
        infos = [comm.local_info() for comm in comms]
        for comm in comms:
            comm.connect(infos)  # what HCCL exchanges at init: windows, notify area, queue pairs
        src = devices[0].alloc_region(nbytes, C.MemKind.DEVICE_GM, RW)
        dst = devices[1].alloc_region(nbytes, C.MemKind.DEVICE_GM, RW)
        comms[0].register_local(src)
        comms[1].register_local(dst)
        expected = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        np.frombuffer(src, np.uint8)[:] = expected
        np.frombuffer(dst, np.uint8)[:] = 0xA5  # poison: a byte that did not arrive shows
        engine = create_engine("emulator", comms[0], peer=1, timeout_s=10.0)
        try:
            blocks = [MemorySegment.of_region(src, i * BLOCK_BYTES, BLOCK_BYTES) for i in range(BLOCKS)]
            start = time.perf_counter()
            ticket = engine.submit(blocks, RemoteSlot(1, dst.addr, nbytes, dst.rkey), notify_slot=NOTIFY_SLOT)
            result = ticket.wait(timeout_s=10.0)
            comms[1].notify_wait(NOTIFY_SLOT, result.notify_magic, 10.0)  # the receiver's side: WaitTimeout if absent
            wall_s = time.perf_counter() - start
            arrived = np.frombuffer(dst, np.uint8).copy()
        finally:
            engine.close()
            for comm in comms:
                comm.close()
            src.close()
            dst.close()
    virtual_us = (result.complete_vtime_ns - result.start_vtime_ns) / 1e3
    print(f"kind {result.kind.value} ({result.selection.decided_by}: {result.selection.reason})")
    print(
        f"moved {nbytes} bytes in {BLOCKS} blocks, {result.num_pieces} work requests, notify magic "
        f"{result.notify_magic:#x} seen by rank 1"
    )
    print(
        f"wall clock {wall_s * 1e3:.2f} ms ({nbytes / wall_s / 1e9:.2f} GB/s on this CPU); "
        f"virtual clock {virtual_us:.1f} us ({nbytes / virtual_us / 1e3:.2f} GB/s on the modelled NPU)"
    )
    differ = np.flatnonzero(arrived != expected)
    if differ.size:
        print(f"FAILED: {differ.size} destination bytes differ, first at {differ[0]}", file=sys.stderr)
        return 1
    print(f"bit-exact: all {nbytes} bytes arrived")
    return 0


if __name__ == "__main__":
    sys.exit(main())
