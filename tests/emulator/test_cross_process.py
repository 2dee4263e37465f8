"""Two processes, two emulated devices, one fabric: writes cross the process boundary only through WQEs."""

import multiprocessing as mp
import os
import socket

import numpy as np
import pytest

pytestmark = pytest.mark.slow
WORLD = 2
TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pattern(rank: int, n: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.uint32) * 2654435761 + rank) >> 7).astype(np.uint8)


def worker(rank: int, fabric_name: str, port: int, results) -> None:
    try:
        import torch.distributed as dist

        from ascend_dualpath import _ext
        from ascend_dualpath.backends import emulator as emu

        C = _ext.load()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        fabric = emu.create_fabric(fabric_name) if rank == 0 else emu.attach_fabric(fabric_name, TIMEOUT_S)
        dist.barrier()
        with emu.open_device(fabric, device_id=rank) as device:
            comm = emu.init_comm(device, config=emu.comm_config(hcclBufferSize=2))
            win_in = np.frombuffer(comm.windows_in, dtype=np.uint8)
            win_out = np.frombuffer(comm.windows_out, dtype=np.uint8)
            win_in[:] = 0xA5
            win_out[:65536] = pattern(rank, 65536)
            peer = 1 - rank
            # 1) host one-sided put into the peer's windowsIn, then a notify with this call's magic
            magic = comm.next_magic()
            dist.barrier()
            comm.batch_put(
                peer,
                [C.OneSideDesc(comm.windows_out.addr, comm.peer_info(peer).windows_in.addr + 128, 65536, 0)],
                TIMEOUT_S,
            )
            comm.notify_record(peer, rank, magic, TIMEOUT_S)
            magics = [None] * WORLD
            dist.all_gather_object(magics, magic)
            comm.notify_wait(peer, magics[peer], TIMEOUT_S)
            expected = np.full(win_in.shape, 0xA5, np.uint8)
            expected[128 : 128 + 65536] = pattern(peer, 65536)
            landed = bool(np.array_equal(win_in, expected))
            # 2) a raw WQE on this rank's AIV QP towards the peer, with the peer's rkey
            dist.barrier()
            qp = comm.aiv_qp(peer)
            info = comm.peer_info(peer)
            qp.post(
                [
                    C.WorkRequest(
                        C.OPCODE_WRITE,
                        comm.windows_out.addr,
                        comm.windows_out.lkey,
                        4096,
                        info.windows_in.addr + (1 << 20),
                        info.windows_in.rkey,
                    )
                ],
                1000.0,
                TIMEOUT_S,
            )
            qp.drain(TIMEOUT_S)
            dist.barrier()
            raw_ok = bool(np.array_equal(win_in[1 << 20 : (1 << 20) + 4096], pattern(peer, 4096)))
            dist.barrier()
            comm.close()
        results.put((rank, landed, raw_ok, None))
        dist.destroy_process_group()
    except Exception as exc:  # report instead of hanging the parent
        results.put((rank, False, False, f"{type(exc).__name__}: {exc}"))


def test_write_into_another_process_through_wqes(emu):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    name = emu.new_fabric_name("xp")
    port = free_port()
    procs = [ctx.Process(target=worker, args=(rank, name, port, results)) for rank in range(WORLD)]
    for p in procs:
        p.start()
    try:
        got = sorted(results.get(timeout=TIMEOUT_S * 2) for _ in range(WORLD))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    for rank, landed, raw_ok, error in got:
        assert error is None, f"rank {rank}: {error}"
        assert landed, f"rank {rank}: batch_put bytes differ or stray bytes written"
        assert raw_ok, f"rank {rank}: raw WQE write did not land"
    assert not any(n.startswith(f"adp.{name}") for n in os.listdir("/dev/shm")), "shared memory leaked"


def _register_and_die(fabric_name: str, out) -> None:
    from ascend_dualpath import _ext
    from ascend_dualpath.backends import emulator as emu

    fabric = emu.attach_fabric(fabric_name, TIMEOUT_S)
    device = emu.open_device(fabric, device_id=1)
    region = device.alloc_region(4096, _ext.load().MemKind.HOST_DRAM, 7)
    out.send((region.rkey, region.addr, region.shm_name))  # a pipe sends synchronously, before the exit below
    os._exit(0)  # killed without closing anything, as a crashed engine would be


def test_regions_of_a_dead_process_are_reaped(C, emu):
    fabric = emu.create_fabric()
    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_register_and_die, args=(fabric.name, sender))
    child.start()
    assert receiver.poll(TIMEOUT_S), "the child never registered its region"
    rkey, addr, shm_name = receiver.recv()
    child.join(TIMEOUT_S)
    assert fabric.check_remote(rkey, addr, 8, 2)[0] == 0, "still registered: nobody has noticed the death yet"
    assert fabric.reap_dead_owners() >= 1
    assert fabric.check_remote(rkey, addr, 8, 2)[0] == emu.Syndrome.BAD_RKEY
    assert not os.path.exists("/dev/shm" + shm_name), "the dead process's memory was not unlinked"
    assert fabric.reap_dead_owners() == 0
