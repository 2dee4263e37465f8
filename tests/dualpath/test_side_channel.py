"""The side channel lets no one in: every frame proves the deployment token, and anything else (no token, another
token, a replayed, cut, oversized, stale or garbage frame, a peer of an older release) is refused before the
handler sees it, counted, and the channel serves the next good request."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath import side_channel as sc
from ascend_dualpath.dualpath.counters import Counters
from ascend_dualpath.errors import ConfigError, ProtocolError
from ascend_dualpath.kv.layout import BLOCK_ID_BYTES

TOKEN = b"0123456789abcdef-deployment-one"
OTHER = b"0123456789abcdef-deployment-two"
STATUS = m.Status(role="decode", node="de0", device_id=1)


class Served:
    """A side channel on a free loopback port whose handler records every request it is handed."""

    def __init__(self, token: bytes | None = TOKEN, max_bytes: int = sc.DEFAULT_MAX_FRAME_BYTES) -> None:
        self.calls: list[m.Request] = []
        self.counters = Counters()
        self.side = sc.SideChannel(0, self._handle, token=token, max_bytes=max_bytes, counters=self.counters)

    def _handle(self, request: m.Request) -> m.Reply:
        self.calls.append(request)
        return STATUS

    @property
    def address(self) -> str:
        return self.side.address

    def good(self, token: bytes | None = TOKEN) -> m.Reply:
        return sc.query_status(self.address, 5.0, token=token)


@pytest.fixture
def served():
    s = Served()
    yield s
    s.side.close()


@contextlib.contextmanager
def raw_dealer(address: str):
    """A bare DEALER: sends any bytes a test crafts."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


def exchange(sock: zmq.Socket, frame: bytes, timeout_s: float = 5.0) -> bytes | None:
    """Send one frame; the raw reply frame, None when none came within ``timeout_s``."""
    sock.send_multipart([b"", frame])
    if not sock.poll(int(timeout_s * 1000)):
        return None
    return sock.recv_multipart()[-1]


def sealed_request(token: bytes | None, message: m.Message | None = None, sender: sc.Sender | None = None):
    message = m.StatusQuery() if message is None else message
    stamp = (sender or sc.Sender()).stamp()
    return sc.seal(token, sc.REQUEST, stamp, m.encode(message)), stamp


def refused_text(reply: bytes, stamp: sc.Stamp | None = None, token: bytes | None = TOKEN) -> str:
    """The error of a refusal, checked to be an authenticated Error reply (bound to ``stamp`` when given)."""
    got, payload = sc.unseal(token, reply, sc.REPLY, sc.DEFAULT_MAX_FRAME_BYTES)
    if stamp is not None:
        assert got == stamp
    error = m.decode_reply(payload)
    assert isinstance(error, m.Error), error
    return error.error


def assert_refused_then_serving(served: Served, refused: int) -> None:
    assert served.calls == [] and served.counters.side_refused == refused == served.side.refused
    assert served.good() == STATUS and len(served.calls) == 1


def test_a_good_request_is_served_and_its_reply_authenticated(served):
    assert served.good() == STATUS
    assert served.calls == [m.StatusQuery()] and served.counters.side_refused == 0
    client = sc.PeerClient(served.address, 5.0, token=TOKEN)
    try:  # one client, many requests: its counter rises, none is taken for a replay
        for _ in range(3):
            assert client.request(m.StatusQuery()) == STATUS
    finally:
        client.close()
    assert served.counters.side_refused == 0


@pytest.mark.parametrize("token", [None, OTHER], ids=["no-token", "wrong-token"])
def test_a_peer_without_the_token_is_refused(served, token):
    with pytest.raises(ProtocolError, match="deployment-token check"):
        served.good(token=token)
    assert_refused_then_serving(served, 1)


def test_a_replayed_frame_is_refused(served):
    frame, stamp = sealed_request(TOKEN)
    with raw_dealer(served.address) as sock:
        assert isinstance(m.decode_reply(sc.unseal(TOKEN, exchange(sock, frame), sc.REPLY, 1 << 20)[1]), m.Status)
        assert "replayed frame" in refused_text(exchange(sock, frame), stamp)
    assert len(served.calls) == 1 and served.counters.side_refused == 1
    served.calls.clear()
    assert_refused_then_serving(served, 1)


def test_an_earlier_counter_of_a_sender_is_refused(served):
    sender = sc.Sender()
    first, _ = sealed_request(TOKEN, sender=sender)
    second, _ = sealed_request(TOKEN, sender=sender)
    with raw_dealer(served.address) as sock:
        exchange(sock, second)
        assert "replayed frame (counter 1, last admitted 2)" in refused_text(exchange(sock, first))
    served.calls.clear()
    assert_refused_then_serving(served, 1)


def test_a_stale_frame_is_refused(served):
    stamp = sc.Stamp(os.urandom(sc.SENDER_BYTES), 1, int((time.time() - 2 * sc.REPLAY_WINDOW_S) * 1000))
    with raw_dealer(served.address) as sock:
        reply = exchange(sock, sc.seal(TOKEN, sc.REQUEST, stamp, m.encode(m.StatusQuery())))
    assert "beyond the replay window" in refused_text(reply, stamp)
    assert_refused_then_serving(served, 1)


@pytest.mark.parametrize("cut", [1, 40, 80])
def test_a_truncated_frame_is_refused(served, cut):
    frame, _ = sealed_request(TOKEN, m.Plan(pe="tcp://x:1", xfer_id="x", path="de", hit_tokens=0, prompt_tokens=9,
                                            load_start=0, store_ids=[]))  # fmt: skip
    with raw_dealer(served.address) as sock:
        text = refused_text(exchange(sock, frame[:-cut]))
    assert "truncated" in text or "deployment-token check" in text
    assert_refused_then_serving(served, 1)


def test_an_altered_frame_is_refused(served):
    frame, _ = sealed_request(TOKEN, m.Abort(xfer_id="a", reason="r"))
    altered = frame.replace(b"\xa1a\xa6", b"\xa1b\xa6")  # the xfer id's value, the MAC left as it was
    assert altered != frame
    with raw_dealer(served.address) as sock:
        assert "deployment-token check" in refused_text(exchange(sock, altered))
    assert_refused_then_serving(served, 1)


def test_an_oversized_frame_is_refused_on_its_raw_bytes():
    served = Served(max_bytes=4096)
    try:
        big = m.Plan(pe="p", xfer_id="x", path="de", hit_tokens=0, prompt_tokens=1, load_start=0,
                     store_ids=[bytes(16)] * 300)  # fmt: skip
        frame, _ = sealed_request(TOKEN, big)
        assert 4096 < len(frame) <= 2 * 4096
        with raw_dealer(served.address) as sock:
            assert "exceeds the side channel's limit of 4096 bytes" in refused_text(exchange(sock, frame))
        assert_refused_then_serving(served, 1)
        # far over the limit ZMQ itself drops the connection before buffering the frame: no reply, no work
        with raw_dealer(served.address) as sock:
            assert exchange(sock, bytes(3 * 4096), timeout_s=0.5) is None
        assert served.good() == STATUS and len(served.calls) == 2
        # the client refuses to send one
        client = sc.PeerClient(served.address, 5.0, token=TOKEN, max_bytes=4096)
        with pytest.raises(ProtocolError, match="over the side channel's limit of 4096 bytes"):
            client.request(big)
        client.close()
    finally:
        served.side.close()


@pytest.mark.parametrize(
    "frame",
    # "random": not a msgpack map's first byte (0x80-0x8f, 0xde, 0xdf), which is answered as an older release's frame
    [b"", b"\x00", b"hello there", b"ADPs", b"ADPs" + bytes(100), b"\x01" + os.urandom(299)],
    ids=["empty", "zero", "text", "magic-only", "zero-header", "random"],
)
def test_a_garbage_frame_is_refused(served, frame):
    with raw_dealer(served.address) as sock:
        refused_text(exchange(sock, frame))
    assert_refused_then_serving(served, 1)


def test_extra_message_parts_are_refused(served):
    frame, _ = sealed_request(TOKEN)
    with raw_dealer(served.address) as sock:
        sock.send_multipart([b"", frame, b"more"])
        assert sock.poll(5000)
        assert "parts" in refused_text(sock.recv_multipart()[-1])
    assert_refused_then_serving(served, 1)


def test_a_frame_of_another_protocol_version_gets_one_clear_error(served):
    frame, stamp = sealed_request(TOKEN)
    newer = frame[:5] + (m.PROTOCOL_VERSION + 1).to_bytes(2, "big") + frame[7:]
    with raw_dealer(served.address) as sock:
        text = refused_text(exchange(sock, newer), stamp)
    assert f"protocol version {m.PROTOCOL_VERSION + 1} there, {m.PROTOCOL_VERSION} here" in text
    assert_refused_then_serving(served, 1)


def test_a_peer_of_the_unframed_release_is_told_why(served):
    """A protocol-1 peer sends bare msgpack and decodes a bare reply: it gets a bare Error naming the cause."""
    with raw_dealer(served.address) as sock:
        reply = m.decode_reply(exchange(sock, m.encode(m.StatusQuery())))
    assert isinstance(reply, m.Error) and "older ascend_dualpath release" in reply.error
    assert_refused_then_serving(served, 1)


@contextlib.contextmanager
def fake_server(answer):
    """A bare ROUTER answering every frame with ``answer(frame)``: a peer of another build, or a forger."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if sock.poll(50):
                identity, _, frame = sock.recv_multipart()
                sock.send_multipart([identity, b"", answer(frame)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(5)
        sock.close()
        ctx.term()


def _stamp_of(frame: bytes) -> sc.Stamp:
    return sc.unseal(TOKEN, frame, sc.REQUEST, 1 << 20)[0]


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (lambda f: sc.seal(OTHER, sc.REPLY, _stamp_of(f), m.encode(STATUS)), "deployment-token check"),
        (lambda f: sc.seal(TOKEN, sc.REPLY, sc.Sender().stamp(), m.encode(STATUS)), "reply to another request"),
        (lambda f: sc.seal(TOKEN, sc.REQUEST, _stamp_of(f), m.encode(STATUS)), "kind"),
        (lambda f: m.encode(m.Error(error="undecodable request")), "older ascend_dualpath release.*undecodable"),
    ],
    ids=["forged", "another-stamp", "reflected-request", "old-server"],
)
def test_the_client_takes_only_an_authenticated_reply_to_its_own_request(answer, match):
    with fake_server(answer) as address, pytest.raises(ProtocolError, match=match):
        sc.query_status(address, 5.0, token=TOKEN)


def test_the_token_check_is_constant_time(served, monkeypatch):
    calls = []
    real = sc.hmac.compare_digest

    def spy(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(sc.hmac, "compare_digest", spy)
    served.good()
    with pytest.raises(ProtocolError):
        served.good(token=OTHER)
    # the server's check of each request and the client's of the good reply: every MAC compared whole
    assert len(calls) >= 3 and set(calls) == {(sc.MAC_BYTES, sc.MAC_BYTES)}


frames = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda body: sc.MAGIC + body, st.binary(max_size=200)),
    # a valid frame with one byte changed: header, MAC or payload
    st.tuples(st.integers(0, 10_000), st.integers(1, 255)).map(
        lambda t: (lambda f: f[: t[0] % len(f)] + bytes([f[t[0] % len(f)] ^ t[1]]) + f[t[0] % len(f) + 1 :])(
            sealed_request(TOKEN, m.Rows(xfer_id="x", start=0, end=4))[0]
        )
    ),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frame=frames)
def test_random_frames_never_reach_the_handler_nor_stop_the_thread(served, frame):
    with raw_dealer(served.address) as sock:
        reply = exchange(sock, frame)
    assert reply is not None and served.calls == []
    assert served.side._thread.is_alive()


def test_random_frames_leave_the_channel_serving(served):
    with raw_dealer(served.address) as sock:
        for size in (0, 1, 3, 64, 4000):
            exchange(sock, os.urandom(size))
    assert_refused_then_serving(served, 5)


# -- binding and the token -----------------------------------------------------------------------------------------
def test_binding_beyond_loopback_needs_the_token():
    with pytest.raises(ConfigError, match="beyond loopback: the side channel needs the deployment token"):
        sc.SideChannel(0, lambda r: m.Ok(), host="0.0.0.0", advertise="node1")
    with pytest.raises(ConfigError, match="set side_advertise"):
        sc.SideChannel(0, lambda r: m.Ok(), host="0.0.0.0", token=TOKEN)
    side = sc.SideChannel(0, lambda r: m.Ok(), host="0.0.0.0", advertise="node1.example", token=TOKEN)
    try:
        assert side.address.startswith("tcp://node1.example:") and not side.address.endswith(":0")
    finally:
        side.close()


@pytest.mark.parametrize(
    ("host", "advertise", "match"),
    [
        ("localhost", None, "side_host must be an IPv4 address to bind, got 'localhost'"),
        ("::1", None, "side_host must be an IPv4 address"),
        ("127.0.0.1", "0.0.0.0", "side_advertise must be a host name or address peers can reach, got '0.0.0.0'"),
        ("127.0.0.1", "a b", "side_advertise must be"),
        ("127.0.0.1", 7, "side_advertise must be"),
    ],
)
def test_bad_addresses_are_refused_by_name(host, advertise, match):
    with pytest.raises(ConfigError, match=match):
        sc.check_bind(host, advertise, TOKEN)


def test_loopback_needs_no_token_and_advertises_its_host():
    assert sc.check_bind("127.0.0.1", None, None) == "127.0.0.1"
    assert sc.check_bind("10.1.2.3", None, TOKEN) == "10.1.2.3"


def test_the_token_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(sc.TOKEN_ENV, raising=False)
    assert sc.load_token(None) is None
    monkeypatch.setenv(sc.TOKEN_ENV, " " + TOKEN.decode() + "\n")
    assert sc.load_token(None) == TOKEN
    path = tmp_path / "token"
    written = sc.write_token(str(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(written) == 64
    assert sc.load_token(str(path)) == written  # the file wins over the environment
    monkeypatch.setenv(sc.TOKEN_ENV, "short")
    with pytest.raises(ConfigError, match="ADP_SIDE_TOKEN has 5 bytes, at least 16 needed"):
        sc.load_token(None)
    with pytest.raises(ConfigError, match=r"side_token_file='/nonexistent/t' cannot be read"):
        sc.load_token("/nonexistent/t")


def test_the_token_is_never_printed():
    from ascend_dualpath.dualpath.settings import ConnectorSettings

    settings = ConnectorSettings("decode", "/s", "de", 1.0, 7000, "f", 1.0, side_token=TOKEN)
    assert TOKEN.decode() not in repr(settings)


# -- the default limit holds every legitimate message ---------------------------------------------------------------
def test_the_default_limit_holds_a_plan_of_a_long_prompt_and_a_hello():
    blocks = 262_144 // 16  # a 256 k-token prompt of 16-token blocks, all hits
    plan = m.Plan(pe="tcp://192.168.100.200:65535", xfer_id="x" * 64, path="de", hit_tokens=262_144,
                  prompt_tokens=262_144, load_start=262_144, store_ids=[os.urandom(BLOCK_ID_BYTES)] * blocks,
                  notify_base=2**31, magics=[2**63 - 1] * 128, abort_magic=2**63 - 1,
                  ready_magic=2**63 - 1)  # fmt: skip
    hello = m.Hello(pe="tcp://192.168.100.200:65535", device_id=2**31, rank_info=os.urandom(4096),
                    host_mem=(2**63 - 1, 2**40, 2**32 - 1),
                    speaks=m.Speaks.of(m.Compat("mla", 128, 128, "x:bfloat16:[576]" * 8, "mooncake")))  # fmt: skip
    plan_frame, _ = sealed_request(TOKEN, plan)
    hello_frame, _ = sealed_request(TOKEN, hello)
    assert len(plan_frame) < sc.DEFAULT_MAX_FRAME_BYTES // 3 and len(hello_frame) < 8192
    per_block = (len(plan_frame) - len(sealed_request(TOKEN, msgspec.structs.replace(plan, store_ids=[]))[0])) / blocks
    assert round(per_block, 2) == 18  # what the limit's comment in side_channel.py counts on
