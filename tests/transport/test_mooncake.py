"""The Mooncake engine between two processes on loopback (TCP, P2P handshake): exact bytes, the notify after the
data, every range refused before a byte moves, and bounded failures (killed peer, unreachable peer, bad protocol).

The receiver is ``mooncake_peer.py`` in its own process (SIGKILLed with this one); this process sends."""

from __future__ import annotations

import hashlib
import os
import pathlib
import select
import signal
import socket
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dualpath import errors as E
from ascend_dualpath._process import die_with_parent
from ascend_dualpath.transport import MemoryKind, MemorySegment, RemoteSlot, create_engine
from ascend_dualpath.transport.mooncake import MooncakePeer, MooncakeTransferEngine, PeerUnreachable
from tests.transport import mooncake_peer as wire

pytest.importorskip(
    "mooncake.engine",
    reason="the Mooncake Transfer Engine is optional: pip install 'ascend_dualpath[mooncake]' (docs/mooncake.md)",
)

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BLOCK = 42 * 1024
BLOCKS = 61
BIG = 64 << 20
DEST_BYTES = BIG + (1 << 20)  # the 64 MiB piece lands 1 MiB in, so both edges are checked against poison
BOUND_S = 5.0  # every wait of these tests
SLOT = 7


class Peer:
    """The receiving process; every read of its replies is bounded by ``BOUND_S``."""

    def __init__(self, nbytes: int, log: pathlib.Path):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.log = log
        with open(log, "wb") as stderr:  # Mooncake logs to stderr; kept for a failure's message
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "mooncake_peer.py"), str(nbytes)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=env,
                preexec_fn=die_with_parent,
            )
        hello = self._read(wire.Hello, 60.0)  # the first start imports torch and Mooncake
        self.info = MooncakePeer.decode(hello.peer)
        self.addr = hello.buffer_addr
        self.nbytes = hello.buffer_nbytes

    def _read_exact(self, n: int, deadline: float) -> bytes:
        data = b""
        fd = self.proc.stdout.fileno()
        while len(data) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise E.WaitTimeout(
                    f"the Mooncake peer did not answer in time; its log: {self.log.read_text()[-2000:]}"
                )
            chunk = os.read(fd, n - len(data))
            if not chunk:
                raise E.ProtocolError(f"the Mooncake peer exited; its log: {self.log.read_text()[-2000:]}")
            data += chunk
        return data

    def _read(self, kind, timeout_s: float = BOUND_S):
        deadline = time.monotonic() + timeout_s
        (size,) = wire.HEADER.unpack(self._read_exact(wire.HEADER.size, deadline))
        return msgspec.msgpack.decode(self._read_exact(size, deadline), type=kind)

    def send(self, request) -> None:
        wire.send(self.proc.stdin, request)

    def reply(self, timeout_s: float = BOUND_S) -> wire.Reply:
        reply = self._read(wire.Reply, timeout_s)
        assert not reply.error, reply.error
        return reply

    def ask(self, request) -> wire.Reply:
        self.send(request)
        return self.reply()

    def digest(self, offset: int = 0, nbytes: int | None = None) -> str:
        return self.ask(wire.Digest(offset, self.nbytes - offset if nbytes is None else nbytes)).digest

    def assert_poisoned(self) -> None:
        """Nothing landed: the whole buffer still holds the poison."""
        assert self.digest() == poisoned(self.nbytes)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(BOUND_S)
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()


def poisoned(nbytes: int) -> str:
    return wire.digest(np.full(nbytes, wire.POISON, np.uint8))


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    p = Peer(DEST_BYTES, tmp_path_factory.mktemp("mooncake") / "peer.log")
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def small_peer(tmp_path):
    """A peer of its own (the tests that kill it)."""
    p = Peer(1 << 20, tmp_path / "peer.log")
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def sender(peer):
    engine = MooncakeTransferEngine(1, timeout_s=BOUND_S)
    engine.connect(peer.info)
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="module")
def source(sender):
    """A registered source pool of 64 blocks and the 64 MiB piece, random bytes."""
    data = np.random.default_rng(0).integers(0, 256, 64 * BLOCK + BIG, dtype=np.uint8)
    sender.register(data)
    return data


def test_create_engine_names_the_mooncake_engine():
    with create_engine("mooncake", 1, timeout_s=1.0) as engine:
        assert isinstance(engine, MooncakeTransferEngine) and engine.timeout_s == 1.0
        assert engine.session.startswith("127.0.0.1:") and engine.notify_value(0) == 0


@settings(max_examples=4)
@given(
    blocks=st.permutations(range(64)).map(lambda p: p[:BLOCKS]),
    dst_offset=st.integers(0, 255).map(lambda k: k * 4093),  # 4093: unaligned destinations too
    notify_value=st.integers(1, (1 << 63) - 1),
)
def test_61_blocks_of_42_kib_arrive_exact_with_the_callers_notify(
    peer, sender, source, blocks, dst_offset, notify_value
):
    peer.ask(wire.Poison())
    sources = [sender.locate(source.ctypes.data + b * BLOCK, BLOCK) for b in blocks]
    expected = np.concatenate([source[b * BLOCK : (b + 1) * BLOCK] for b in blocks])
    remote = sender.remote_slot(peer.addr + dst_offset, expected.nbytes)
    peer.send(wire.Poll(SLOT, notify_value, dst_offset, expected.nbytes, BOUND_S))  # polls while the bytes move
    result = sender.transfer(sources, remote, notify_slot=SLOT, notify_value=notify_value)
    assert (result.nbytes, result.num_pieces, result.notify_magic) == (expected.nbytes, BLOCKS, notify_value)
    assert peer.reply().digest == wire.digest(expected)  # all there when the notify was seen
    whole = np.full(DEST_BYTES, wire.POISON, np.uint8)
    whole[dst_offset : dst_offset + expected.nbytes] = expected
    assert peer.digest() == wire.digest(whole)  # and nothing else changed


def test_one_64_mib_piece_arrives_before_its_notify(peer, sender, source):
    piece = source[64 * BLOCK :]
    dst = 1 << 20
    for _ in range(2):  # the first with the engine's own magic, the second with the caller's
        peer.ask(wire.Poison())
        prepared = sender.prepare(
            [sender.locate(piece.ctypes.data, BIG)], sender.remote_slot(peer.addr + dst, BIG), SLOT
        )
        ticket = prepared.submit()
        result = ticket.wait()
        assert peer.ask(wire.Poll(SLOT, result.notify_magic, dst, BIG, BOUND_S)).digest == wire.digest(piece)
        value = result.notify_magic + 12345
        peer.ask(wire.Poison())
        peer.send(wire.Poll(SLOT, value, dst, BIG, BOUND_S))  # polling before a byte moved
        assert prepared.transfer(notify_value=value).notify_magic == value
        assert peer.reply().digest == wire.digest(piece)
    assert peer.digest(0, dst) == poisoned(dst)
    assert peer.digest(dst + BIG) == poisoned(DEST_BYTES - dst - BIG)


def test_record_writes_the_callers_value_now(peer, sender):
    sender.record(SLOT + 1, 0x5EED)
    assert peer.ask(wire.Poll(SLOT + 1, 0x5EED, 0, 1, BOUND_S)).digest
    with pytest.raises(E.BoundsError, match="notify slot 1024"):
        sender.record(1024, 1)
    with pytest.raises(E.BoundsError, match="notify_value 0"):
        sender.record(SLOT, 0)


def test_an_unregistered_local_range_is_refused_before_any_byte_moves(peer, sender, source):
    peer.ask(wire.Poison())
    stray = np.ones(BLOCK, np.uint8)  # never registered: Mooncake itself would send it
    remote = sender.remote_slot(peer.addr, 2 * BLOCK)
    good = sender.locate(source.ctypes.data, BLOCK)
    with pytest.raises(E.NotRegistered, match=f"piece 1 \\[{stray.ctypes.data:#x}, \\+{BLOCK}\\)"):
        sender.transfer([good, MemorySegment(stray.ctypes.data, BLOCK, MemoryKind.HOST)], remote, notify_slot=SLOT)
    with pytest.raises(E.NotRegistered, match=f"{stray.ctypes.data:#x}"):
        sender.locate(stray.ctypes.data, BLOCK)
    end = source.ctypes.data + source.nbytes - 16  # straddles the end of the registration
    with pytest.raises(E.NotRegistered, match=f"piece 0 \\[{end:#x}, \\+32\\)"):
        sender.transfer([MemorySegment(end, 32, MemoryKind.HOST)], remote)
    peer.assert_poisoned()


def test_a_bad_remote_address_is_refused_before_any_byte_moves(peer, sender, source):
    peer.ask(wire.Poison())
    good = [sender.locate(source.ctypes.data, BLOCK)]
    past = peer.addr + DEST_BYTES - BLOCK // 2  # runs past the end of the peer's buffer
    for addr in (past, peer.addr - 4096, 0x1000):
        with pytest.raises(E.BoundsError, match=f"remote slot \\[{addr:#x}, \\+{BLOCK}\\) on {peer.info.session}"):
            sender.transfer(good, RemoteSlot(1, addr, BLOCK), notify_slot=SLOT)
        with pytest.raises(E.BoundsError, match=f"{addr:#x}"):
            sender.remote_slot(addr, BLOCK)
    with pytest.raises(E.BoundsError, match="notify slot 5000"):
        sender.transfer(good, RemoteSlot(1, peer.addr, BLOCK), notify_slot=5000)
    peer.assert_poisoned()


def test_unregister_then_submit_is_refused(peer, sender):
    peer.ask(wire.Poison())
    data = np.full(BLOCK, 7, np.uint8)
    region = sender.register(data)
    prepared = sender.prepare([sender.locate(data.ctypes.data, BLOCK)], sender.remote_slot(peer.addr, BLOCK))
    sender.unregister(region)
    with pytest.raises(E.NotRegistered, match=f"piece 0 \\[{data.ctypes.data:#x}, \\+{BLOCK}\\)"):
        prepared.submit()
    with pytest.raises(E.NotRegistered):
        sender.unregister(region)
    peer.assert_poisoned()


def test_a_killed_peer_gives_an_error_within_the_bound(small_peer):
    with MooncakeTransferEngine(1, timeout_s=BOUND_S) as engine:
        engine.connect(small_peer.info)
        data = np.full(1 << 20, 3, np.uint8)
        engine.register(data)
        sources, remote = [engine.locate(data.ctypes.data, data.nbytes)], engine.remote_slot(small_peer.addr, 1 << 20)
        engine.transfer(sources, remote, notify_slot=0)  # alive: it works
        small_peer.stop()
        for attempt in (lambda: engine.transfer(sources, remote, notify_slot=0), lambda: engine.record(0, 9)):
            start = time.monotonic()
            with pytest.raises(E.DeviceError, match=small_peer.info.session):
                attempt()
            assert time.monotonic() - start < BOUND_S


def test_a_peer_killed_mid_transfer_ends_the_wait_within_the_bound(tmp_path):
    peer = Peer(BIG, tmp_path / "peer.log")
    try:
        with MooncakeTransferEngine(1, timeout_s=BOUND_S) as engine:
            engine.connect(peer.info)
            data = np.zeros(BIG, np.uint8)
            engine.register(data)
            ticket = engine.submit(
                [engine.locate(data.ctypes.data, BIG)], engine.remote_slot(peer.addr, BIG), notify_slot=0
            )
            peer.proc.kill()
            start = time.monotonic()
            try:
                ticket.wait()  # it may have finished before the kill; it must not hang past the bound
            except E.DeviceError as error:
                assert peer.info.session in str(error)
            assert time.monotonic() - start < BOUND_S
    finally:
        peer.stop()


def test_a_stalled_peer_times_out_and_its_memory_stays_registered_until_mooncake_is_done(tmp_path):
    """A stopped peer: the bounded wait raises WaitTimeout naming the ticket; the piece Mooncake still runs keeps
    its source registered; once the peer resumes and the piece ends, unregister goes through."""
    peer = Peer(BIG, tmp_path / "peer.log")
    try:
        with MooncakeTransferEngine(1, timeout_s=BOUND_S) as engine:
            engine.connect(peer.info)
            data = np.full(BIG, 9, np.uint8)
            region = engine.register(data)
            peer.proc.send_signal(signal.SIGSTOP)  # after connect's handshake: the write itself stalls
            ticket = engine.submit([engine.locate(data.ctypes.data, BIG)], engine.remote_slot(peer.addr, BIG))
            start = time.monotonic()
            with pytest.raises(
                E.WaitTimeout, match=f"waiting for the 1 pieces \\({BIG} bytes\\) of ticket {ticket.id}"
            ):
                ticket.wait(0.5)
            assert time.monotonic() - start < 0.5 + 1.0
            with pytest.raises(E.ProtocolError, match=rf"\[{ticket.id}\] still read"):  # still in flight
                engine.unregister(region)
            peer.proc.send_signal(signal.SIGCONT)
            ticket.wait(BOUND_S)  # Mooncake finishes the piece once the peer reads again: the later wait ends it
            engine.unregister(region)
            assert peer.digest(0, BIG) == wire.digest(data)
    finally:
        peer.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_peer_is_one_clear_error():
    with MooncakeTransferEngine(1, timeout_s=BOUND_S) as engine:
        data = np.zeros(4096, np.uint8)
        engine.register(data)
        ghost = MooncakePeer(f"127.0.0.1:{_free_port()}", "tcp", ((1 << 20, 4096),), 1 << 21, 8)
        with pytest.raises(PeerUnreachable, match=f"{ghost.session} \\(tcp\\) does not answer: .*ERR_SOCKET"):
            engine.connect(ghost)
        engine.connect(ghost, probe=False)  # not probed: the first write says it
        with pytest.raises(E.DeviceError, match=ghost.session):
            engine.transfer([engine.locate(data.ctypes.data, 4096)], engine.remote_slot(1 << 20, 4096))


def test_bad_protocols_and_bad_peer_info_are_refused():
    with pytest.raises(E.ConfigError, match="protocol 'udp' is not one of tcp, rdma, ascend"):
        MooncakeTransferEngine(1, protocol="udp")
    with pytest.raises(E.BackendUnavailable, match="ascend"):
        MooncakeTransferEngine(1, protocol="ascend")  # the CPU wheel has no NPU transport
    with pytest.raises(E.ProtocolError, match="malformed Mooncake peer info"):
        MooncakePeer.decode(b"\x93garbage")
    with MooncakeTransferEngine(1) as engine:
        info = engine.info()
        assert MooncakePeer.decode(info.encode()) == info
        with pytest.raises(E.ConfigError, match="speaks 'rdma'"):
            engine.connect(MooncakePeer(info.session, "rdma", (), info.notify_addr, 8))
        with pytest.raises(E.ConfigError, match="is not that engine's"):  # its own session, another's notify area
            engine.connect(MooncakePeer(info.session, "tcp", (), info.notify_addr + 8, 8))
        with pytest.raises(E.ConfigError, match="not host:port"):
            engine.connect(MooncakePeer("127.0.0.1", "tcp", (), info.notify_addr, 8))
        with pytest.raises(E.ProtocolError, match="connect"):
            engine.remote_slot(1 << 20, 8)


def test_rdma_without_a_nic_is_refused(monkeypatch):
    if pathlib.Path("/sys/class/infiniband").is_dir() and any(pathlib.Path("/sys/class/infiniband").iterdir()):
        pytest.skip("this machine has RDMA NICs")
    with pytest.raises(E.BackendUnavailable, match="no RDMA NIC"):
        MooncakeTransferEngine(1, protocol="rdma")
    monkeypatch.setenv("MC_TCP_PROTO", "1")
    with pytest.raises(E.ConfigError, match="MC_TCP_PROTO=1"):
        MooncakeTransferEngine(1)


def test_a_closed_engine_refuses_use(peer):
    engine = MooncakeTransferEngine(1, timeout_s=BOUND_S)
    engine.connect(peer.info)
    data = np.zeros(4096, np.uint8)
    region = engine.register(data)
    segment = engine.locate(data.ctypes.data, 4096)
    engine.close()
    engine.close()  # idempotent
    for use in (
        lambda: engine.transfer([segment], RemoteSlot(1, peer.addr, 4096)),
        lambda: engine.register(np.zeros(8, np.uint8)),
        lambda: engine.unregister(region),
        lambda: engine.record(0, 1),
        engine.info,
    ):
        with pytest.raises(E.QueueError, match="closed"):
            use()


def test_registrations_are_checked():
    with MooncakeTransferEngine(1) as engine:
        data = np.zeros(8192, np.uint8)
        engine.register(data)
        with pytest.raises(E.ConfigError, match="overlaps the registered region"):
            engine.register(data.ctypes.data + 4096, 8192)
        with pytest.raises(E.ConfigError, match="needs nbytes"):
            engine.register(data.ctypes.data)
        with pytest.raises(E.ArgumentTypeError, match="register takes"):
            engine.register("buffer")
        with pytest.raises(E.ConfigError, match="C-contiguous"):
            engine.register(np.zeros((4, 4), np.uint8)[:, 0])


def test_digest_helper_sees_one_byte():
    """The checks above compare digests: one changed byte changes it."""
    a = np.zeros(1 << 16, np.uint8)
    b = a.copy()
    b[12345] = 1
    assert (
        wire.digest(a) != wire.digest(b) and wire.digest(a) == hashlib.blake2b(a.tobytes(), digest_size=16).hexdigest()
    )
