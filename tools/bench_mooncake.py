"""Mooncake TCP between two hosts, beside a plain TCP socket (the ceiling) and torch.distributed gloo: root only.

    sudo PYTHONPATH=. python3 tools/bench_mooncake.py [--iterations 15] [--json bench_mooncake.json]

Two network namespaces joined by a veth pair with private addresses (10.231.N.1/30 and 10.231.N.2/30) are the two
hosts; the receiver runs in one, the sender in the other, and every byte crosses the veth pair. Each method moves
the same bytes: 61 blocks of 42 KiB gathered from a 64-block pool into one destination, and one 64 MiB piece. A
transfer counts as done when the receiver has every byte: Mooncake's write completes once the peer applied it
(then its 8-byte notify lands), the socket and gloo receivers answer one byte (a one-element tensor) after the
last. Medians over ``--iterations`` after ``--warmup`` transfers. The namespaces and the processes go whatever
happens (Ctrl-C included).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from ascend_dualpath.bench.netns import Hosts, unavailable  # noqa: E402

BLOCK, BLOCKS, POOL = 42 * 1024, 61, 64
BIG = 64 << 20
CASES = (("61 x 42 KiB", BLOCKS * BLOCK), ("64 MiB", BIG))
METHODS = ("mooncake tcp", "tcp socket", "gloo")
READY_TIMEOUT_S = 120.0  # the roles import torch and Mooncake before they answer
RUN_TIMEOUT_S = 600.0


def spawn(hosts: Hosts, side: int, *args: str) -> subprocess.Popen:
    """This script in role ``args`` inside namespace ``side`` (0: sender, 1: receiver), in its own group."""
    env = dict(os.environ, PYTHONPATH=ROOT, GLOO_SOCKET_IFNAME=hosts.ifaces[side])
    command = hosts.command(side, [sys.executable, os.path.abspath(__file__), *args])
    return subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True, text=True
    )


def read_line(proc: subprocess.Popen, timeout_s: float, what: str) -> str:
    """One line of ``proc``'s stdout within ``timeout_s``; RuntimeError naming ``what`` otherwise."""
    import select

    if not select.select([proc.stdout], [], [], timeout_s)[0]:
        raise RuntimeError(f"no {what} after {timeout_s} s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the process exited (status {proc.wait(5)}) before its {what}")
    return line


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def orchestrate(args: argparse.Namespace) -> int:
    why = unavailable()
    if why is not None:
        print(f"bench_mooncake: {why} (its two hosts)", file=sys.stderr)
        return 2
    # Ctrl-C and SIGTERM both unwind through the finally blocks below (SIGINT too where a shell started this in the
    # background, with SIGINT ignored)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.default_int_handler)
    procs: list[subprocess.Popen] = []
    try:
        with Hosts() as hosts:
            receiver = spawn(hosts, 1, "--role", "receiver", "--addr", hosts.addrs[1])
            procs.append(receiver)
            ready = read_line(receiver, READY_TIMEOUT_S, "receiver's addresses")
            sender = spawn(
                hosts, 0, "--role", "sender", "--addr", hosts.addrs[0], "--iterations", str(args.iterations),
                "--warmup", str(args.warmup),
            )  # fmt: skip
            procs.append(sender)
            sender.stdin.write(ready)
            sender.stdin.flush()
            rows = json.loads(read_line(sender, RUN_TIMEOUT_S, "results"))
    finally:
        stop(procs)
    report(rows, args)
    return 0


def report(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"{'method':<14} {'case':<12} {'bytes':>10} {'median us':>10} {'GB/s':>6}")
    for row in rows:
        print(f"{row['method']:<14} {row['case']:<12} {row['bytes']:>10} {row['median_us']:>10.0f} {row['gbps']:>6.2f}")
    result = {
        "command": " ".join(["sudo PYTHONPATH=. python3 tools/bench_mooncake.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "iterations": args.iterations,
        "warmup": args.warmup,
        "mooncake": _mooncake_version(),
        "rows": rows,
    }
    with open(args.json, "w") as out:
        json.dump(result, out, indent=1)
    print(f"wrote {args.json}", file=sys.stderr)


def _mooncake_version() -> str:
    import importlib.metadata

    from ascend_dualpath.transport.mooncake import installed_version

    found = installed_version()
    return "none" if found is None else f"{found[0]} {importlib.metadata.version(found[0])}"


# ---- the receiver (namespace 1) ------------------------------------------------------------------------


def receiver(args: argparse.Namespace) -> None:
    """Register a buffer with Mooncake, open the socket and gloo listeners, print where, then serve the socket and
    gloo runs in the sender's order (Mooncake needs nothing from this side)."""
    from ascend_dualpath.transport.mooncake import MooncakeTransferEngine

    buffer = np.zeros(BIG, np.uint8)
    with MooncakeTransferEngine(0, hostname=args.addr) as engine:
        engine.register(buffer)
        listener = socket.create_server((args.addr, 0))
        ports = [listener.getsockname()[1], free_port(args.addr)]
        print(json.dumps({"mooncake": engine.info().encode().hex(), "addr": args.addr, "ports": ports}), flush=True)
        serve_socket(listener, buffer)
        serve_gloo(args.addr, ports[1], buffer)


def free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def serve_socket(listener: socket.socket, buffer: np.ndarray) -> None:
    """Per transfer: an 8-byte length, that many bytes into ``buffer``, then one byte back; length 0 ends."""
    conn, _ = listener.accept()
    view = memoryview(buffer)
    with conn, listener:
        while True:
            header = conn.recv(8, socket.MSG_WAITALL)
            nbytes = int.from_bytes(header, "little")
            if not nbytes:
                return
            got = 0
            while got < nbytes:
                got += conn.recv_into(view[got:nbytes])
            conn.sendall(b"\x01")


def serve_gloo(addr: str, port: int, buffer: np.ndarray) -> None:
    """Per transfer: a (pieces, piece bytes) header, the pieces back to back into ``buffer``, then an ack."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=0, world_size=2)
    target = torch.from_numpy(buffer)
    header, ack = torch.zeros(2, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    while True:
        dist.recv(header, 1)
        pieces, nbytes = (int(v) for v in header)
        if not pieces:
            break
        for i in range(pieces):
            dist.recv(target[i * nbytes : (i + 1) * nbytes], 1)
        dist.send(ack, 1)
    dist.destroy_process_group()


# ---- the sender (namespace 0) --------------------------------------------------------------------------


def median_us(transfer, warmup: int, iterations: int) -> float:
    for _ in range(warmup):
        transfer()
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        transfer()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def sender(args: argparse.Namespace) -> None:
    ready = json.loads(sys.stdin.readline())
    pool = np.random.default_rng(0).integers(0, 256, POOL * BLOCK + BIG, dtype=np.uint8)
    order = np.random.default_rng(1).permutation(POOL)[:BLOCKS]  # scattered blocks, as KV blocks are
    blocks = [pool[b * BLOCK : (b + 1) * BLOCK] for b in order]
    cases = {CASES[0][0]: blocks, CASES[1][0]: [pool[POOL * BLOCK :]]}
    # made one after the other: the receiver serves them in this order
    timers = {
        METHODS[0]: lambda: mooncake_sender(args, ready, pool),
        METHODS[1]: lambda: socket_sender(ready),
        METHODS[2]: lambda: gloo_sender(ready),
    }
    rows = []
    for method, make in timers.items():
        transfer, done = make()
        for case, nbytes in CASES:
            us = median_us(lambda t=transfer, c=cases[case]: t(c), args.warmup, args.iterations)
            rows.append({"method": method, "case": case, "bytes": nbytes, "median_us": us, "gbps": nbytes / us / 1e3})
        done()
    print(json.dumps(rows), flush=True)


def mooncake_sender(args: argparse.Namespace, ready: dict, pool: np.ndarray):
    from ascend_dualpath.transport.mooncake import MooncakePeer, MooncakeTransferEngine

    engine = MooncakeTransferEngine(1, hostname=args.addr)
    peer = MooncakePeer.decode(bytes.fromhex(ready["mooncake"]))
    engine.connect(peer)
    engine.register(pool)
    dst = peer.buffers[0][0]

    def transfer(pieces: list[np.ndarray]) -> None:
        sources = [engine.locate(p.ctypes.data, p.nbytes) for p in pieces]
        engine.transfer(sources, engine.remote_slot(dst, sum(p.nbytes for p in pieces)), notify_slot=0)

    return transfer, engine.close


def socket_sender(ready: dict):
    conn = socket.create_connection((ready["addr"], ready["ports"][0]), timeout=60)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def transfer(pieces: list[np.ndarray]) -> None:
        nbytes = sum(p.nbytes for p in pieces)
        conn.sendall(nbytes.to_bytes(8, "little"))
        for piece in pieces:  # one sendall per block, as a host sends blocks it has not gathered
            conn.sendall(memoryview(piece))
        if conn.recv(1, socket.MSG_WAITALL) != b"\x01":
            raise RuntimeError("the socket receiver did not acknowledge")

    def done() -> None:
        conn.sendall((0).to_bytes(8, "little"))
        conn.close()

    return transfer, done


def gloo_sender(ready: dict):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{ready['addr']}:{ready['ports'][1]}", rank=1, world_size=2)
    ack = torch.zeros(1, dtype=torch.int64)

    def transfer(pieces: list[np.ndarray]) -> None:
        dist.send(torch.tensor([len(pieces), pieces[0].nbytes], dtype=torch.int64), 0)
        for piece in pieces:
            dist.send(torch.from_numpy(piece), 0)
        dist.recv(ack, 0)

    def done() -> None:
        dist.send(torch.zeros(2, dtype=torch.int64), 0)
        dist.destroy_process_group()

    return transfer, done


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("orchestrate", "receiver", "sender"), default="orchestrate")
    parser.add_argument("--addr", default="")
    parser.add_argument("--iterations", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default="bench_mooncake.json")
    args = parser.parse_args()
    for name in ("iterations", "warmup"):
        if not 1 <= getattr(args, name) <= 10000:
            parser.error(f"--{name} {getattr(args, name)} must be in [1, 10000]")
    if args.role == "receiver":
        receiver(args)
    elif args.role == "sender":
        sender(args)
    else:
        try:
            return orchestrate(args)
        except KeyboardInterrupt:
            print("bench_mooncake: interrupted; its namespaces and processes were removed", file=sys.stderr)
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
