"""The receiving side of tests/transport/test_mooncake.py, in its own process: a Mooncake engine with one
poisoned buffer, answering typed requests (msgspec, length-prefixed on stdin/stdout).

Run as ``python3 mooncake_peer.py NBYTES``: it first writes a :class:`Hello` carrying its engine's
:class:`~ascend_dualpath.transport.mooncake.MooncakePeer`, then serves requests until :class:`Exit` or EOF.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from typing import BinaryIO

import msgspec
import numpy as np

POISON = 0xA5
HEADER = struct.Struct("<I")


class Hello(msgspec.Struct):
    peer: bytes  # MooncakePeer.encode() of the receiver's engine
    buffer_addr: int
    buffer_nbytes: int


class Poll(msgspec.Struct, tag=True):
    """Wait (bounded) until notify ``slot`` holds ``magic``, then digest ``[offset, +nbytes)`` of the buffer at once."""

    slot: int
    magic: int
    offset: int
    nbytes: int
    timeout_s: float


class Digest(msgspec.Struct, tag=True):
    offset: int
    nbytes: int


class Poison(msgspec.Struct, tag=True):
    """Fill the whole buffer with POISON again and clear every notify slot."""


class Exit(msgspec.Struct, tag=True):
    pass


Request = Poll | Digest | Poison | Exit


class Reply(msgspec.Struct):
    digest: str = ""
    error: str = ""


def digest(data) -> str:
    return hashlib.blake2b(memoryview(data).cast("B"), digest_size=16).hexdigest()


def send(stream: BinaryIO, message: msgspec.Struct) -> None:
    body = msgspec.msgpack.encode(message)
    stream.write(HEADER.pack(len(body)) + body)
    stream.flush()


def receive(stream: BinaryIO, kind):
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    return msgspec.msgpack.decode(stream.read(HEADER.unpack(header)[0]), type=kind)


def serve(engine, buffer: np.ndarray, request) -> Reply:
    from ascend_dualpath.dualpath.transfer_leg import wait_notify

    if isinstance(request, Poison):
        buffer[:] = POISON
        for slot in range(engine.notify_slots):
            engine.reset_notify(slot)
        return Reply()
    window = buffer[request.offset : request.offset + request.nbytes]
    if isinstance(request, Poll):
        wait_notify(engine, request.slot, request.magic, f"notify slot {request.slot}", timeout_s=request.timeout_s)
        # copied from the last byte backwards at once: bytes that land in order (one stream) after the notify
        # leave the copy's tail unwritten
        window = window[::-1].copy()[::-1]
    return Reply(digest=digest(np.ascontiguousarray(window)))


def main() -> None:
    from ascend_dualpath.transport.mooncake import MooncakeTransferEngine

    buffer = np.full(int(sys.argv[1]), POISON, np.uint8)
    with MooncakeTransferEngine(0, timeout_s=10.0) as engine:
        engine.register(buffer)
        out = sys.stdout.buffer
        send(out, Hello(engine.info().encode(), buffer.ctypes.data, buffer.nbytes))
        while (request := receive(sys.stdin.buffer, Request)) is not None and not isinstance(request, Exit):
            try:
                reply = serve(engine, buffer, request)
            except Exception as error:  # reported to the test, which fails naming it
                reply = Reply(error=f"{type(error).__name__}: {error}")
            send(out, reply)


if __name__ == "__main__":
    main()
