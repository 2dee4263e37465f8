"""``python -m ascend_dualpath demo``: layer-by-layer KV streaming between two engine processes.

A decode-engine process (DE) holds the cached KV of a request and streams it, one layer block at a
time, into the prefill-engine process (PE) over the emulated RoCE fabric (the DE read path's
transfer leg, seed 000): per layer one HcclBatchPut into the PE's HCCL window and a notify with a
per-call magic; the PE waits for each layer's notify, checks the block bit-exact against what the DE
sent, and reports the virtual time each layer became ready. Runs on the emulator by default.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=61, help="model layers (DeepSeek-V3: 61)")
    parser.add_argument("--tokens", type=int, default=4096, help="cached prefix tokens")
    parser.add_argument("--bytes-per-token", type=int, default=1152, help="KV bytes per token per layer (MLA 576 x bf16)")
    parser.add_argument("--backend", default="emulator", help="only the emulator runs this demo for now")
    parser.add_argument("--timeout", type=float, default=None, help="bound of every wait, seconds")


def _layer_block(layer: int, nbytes: int) -> np.ndarray:
    rng = np.random.default_rng(layer)
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def _engine(rank: int, port: int, fabric_name: str, args: argparse.Namespace, results) -> None:
    import torch.distributed as dist

    from ascend_dualpath import _env, _ext
    from ascend_dualpath.backends import emulator as emu

    C = _ext.load()
    timeout = args.timeout or _env.timeout_s()
    block = args.tokens * args.bytes_per_token
    buffer_mb = max(1, -(-block * args.layers // (1 << 20)))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    fabric = emu.create_fabric(fabric_name) if rank == 0 else emu.attach_fabric(fabric_name, timeout)
    dist.barrier()
    PE, DE = 0, 1
    try:
        with emu.open_device(fabric, device_id=rank) as device:
            comm = emu.init_comm(device, config=emu.comm_config(hcclBufferSize=buffer_mb))
            magics = [None, None]
            dist.all_gather_object(magics, comm.next_magic())
            de_magic = magics[DE]
            if rank == DE:
                staging = np.frombuffer(comm.windows_out, dtype=np.uint8)  # the DE's registered host buffer
                slots = comm.peer_info(PE).windows_in
                start = time.perf_counter()
                for layer in range(args.layers):
                    staging[layer * block:(layer + 1) * block] = _layer_block(layer, block)
                    comm.batch_put(PE, [C.OneSideDesc(comm.windows_out.addr + layer * block, slots.addr + layer * block,
                                                      block, 0)], timeout)
                    comm.notify_record(PE, layer, de_magic, timeout)
                results.put(("de", time.perf_counter() - start, device.nic.virtual_time_ns, device.nic.bytes_moved))
            else:
                hbm = np.frombuffer(comm.windows_in, dtype=np.uint8)
                ready = []
                for layer in range(args.layers):
                    comm.notify_wait(layer, de_magic, timeout)
                    exact = np.array_equal(hbm[layer * block:(layer + 1) * block], _layer_block(layer, block))
                    ready.append((layer, exact))
                    results.put(("layer", layer, exact))
                results.put(("pe", all(e for _, e in ready)))
            dist.barrier()
            comm.close()
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    import multiprocessing as mp

    from ascend_dualpath import get_backend
    from ascend_dualpath.backends import Backend
    from ascend_dualpath.backends.emulator import new_fabric_name

    if get_backend(args.backend) is not Backend.EMULATOR:
        print(f"demo: backend {args.backend!r} is not supported by this demo yet; use --backend emulator")
        return 2
    block = args.tokens * args.bytes_per_token
    print(f"DE -> PE layer-block streaming: {args.layers} layers x {args.tokens} tokens x {args.bytes_per_token} B "
          f"= {block / 2**20:.2f} MiB per layer block, {args.layers * block / 2**20:.1f} MiB in all")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fabric_name = new_fabric_name("demo")
    procs = [ctx.Process(target=_engine, args=(rank, port, fabric_name, args, results)) for rank in range(2)]
    for p in procs:
        p.start()
    from rich.progress import Progress

    summary: dict = {}
    deadline = time.monotonic() + 120 + args.layers
    with Progress(transient=True) as progress:
        task = progress.add_task("layers ready on PE", total=args.layers)
        while len(summary) < 2 and time.monotonic() < deadline:
            try:
                msg = results.get(timeout=1.0)
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                continue
            if msg[0] == "layer":
                progress.advance(task)
                if not msg[2]:
                    progress.console.print(f"[red]layer {msg[1]}: bytes differ")
            else:
                summary[msg[0]] = msg[1:]
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    for name in [n for n in os.listdir("/dev/shm") if n.startswith(f"adp.{fabric_name}")]:
        os.unlink(os.path.join("/dev/shm", name))
    if len(summary) < 2:
        print("demo failed: an engine exited or timed out (exit codes "
              f"{[p.exitcode for p in procs]})")
        return 1
    wall_s, vtime_ns, moved = summary["de"]
    exact = summary["pe"][0]
    print(f"PE: every layer block bit-exact: {exact}")
    print(f"DE: {moved / 2**20:.1f} MiB moved in {wall_s * 1e3:.1f} ms wall; virtual clock (modelled RoCE): "
          f"{vtime_ns / 1e3:.1f} us = {moved / vtime_ns:.2f} GB/s")
    return 0 if exact else 1
