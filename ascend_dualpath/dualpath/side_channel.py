"""What the DualPath connector halves, the peer instance and the proxy say to each other.

- ``kv_transfer_params["dualpath"]`` (proxy -> each instance, per request): :class:`XferParams`.
- The side channel: a ZMQ ROUTER in each instance's worker on ``side_host:side_port`` (127.0.0.1 by default)
  carrying the typed messages of :mod:`ascend_dualpath.dualpath.messages`; every request gets exactly one reply.
  The PE worker is the client of the DE worker (``status``, ``hello``, then per request ``plan``, ``consumed``,
  ``hits``, ``rows``, ``fallback``, ``abort``, ``pushes_ended``), the DE asks the PE ``writes_ended``, the proxy
  asks every instance for ``status``. Any PE may work with any DE: a PE sends ``hello`` (its side-channel address,
  device id, protocol version and compatibility digest) to each DE the first time a request names it, and every
  later message of a request carries its ``xfer_id``.
- Every message travels in a frame (:func:`seal`): ``"ADPs"``, its kind (request ``Q`` / reply ``R``), the
  protocol version, a stamp (a random 16-byte sender id per client socket, a counter increasing per sender, the
  sender's wall clock in ms), an HMAC-SHA256 of all that and the msgpack payload under the deployment token, then
  the payload. The server checks the raw bytes before decoding anything (:class:`_Gate`): size, version, the HMAC
  (constant time), the stamp within :data:`REPLAY_WINDOW_S` of its clock and the counter above the sender's last.
  A reply echoes its request's stamp under the same HMAC, so it is bound to that request. The token comes from
  ``ADP_SIDE_TOKEN`` or a file (:func:`load_token`) and is required once the channel binds beyond loopback
  (:func:`check_bind`); without one (loopback) the HMAC's key is empty: integrity, no authentication.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import ipaddress
import itertools
import logging
import os
import re
import secrets
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from ascend_dualpath import _env
from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.scheduler import ReadPath
from ascend_dualpath.errors import ConfigError, ProtocolError, WaitTimeout

log = logging.getLogger(__name__)

PARAMS_KEY = "dualpath"
ROLES = ("prefill", "decode")
POLL_MS = 50  # the serving thread's poll period: bounds how late it sees a stop request

TOKEN_ENV = "ADP_SIDE_TOKEN"
MIN_TOKEN_BYTES = 16  # 128 bits: a token shorter than that could be guessed
# The largest frame a side channel takes. A Plan's store ids are its bulk: 18 msgpack bytes per block, so 1 MiB
# holds a plan of about 58 000 blocks (930 k tokens at 16-token blocks); tests/dualpath/test_side_channel.py
# measures it and a Hello.
DEFAULT_MAX_FRAME_BYTES = 1 << 20
MIN_FRAME_BYTES, MAX_FRAME_BYTES = 4096, 1 << 30
REPLAY_WINDOW_S = 300.0  # a frame's stamp may differ this much from the receiver's clock (hosts run NTP)
MAGIC = b"ADPs"
REQUEST, REPLY = ord("Q"), ord("R")
SENDER_BYTES = 16
MAC_BYTES = 32
_HEADER = struct.Struct(">4sBH16sQQ")  # magic, kind, protocol version, sender, counter, time_ms
_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})")


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` (an IPv4 address) listens on this machine's loopback only."""
    return ipaddress.ip_address(host).is_loopback


def check_bind(
    host: str, advertise: str | None, token: bytes | None, name: Callable[[str], str] = lambda key: key
) -> str:
    """The address peers reach a side channel bound to ``host`` at: ``advertise``, or ``host`` itself.

    ConfigError (``name(key)`` names each setting) for a ``host`` that is not an IPv4 address, ``0.0.0.0``
    without ``advertise``, an ``advertise`` that is not a host name or address (or is ``0.0.0.0``), and a
    ``host`` beyond loopback without a ``token``.
    """
    try:
        ipaddress.IPv4Address(host)
    except (ipaddress.AddressValueError, ValueError):
        raise ConfigError(f"{name('side_host')} must be an IPv4 address to bind, got {host!r}") from None
    if advertise is not None and (
        not isinstance(advertise, str) or not _HOSTNAME.fullmatch(advertise) or advertise == "0.0.0.0"
    ):
        raise ConfigError(f"{name('side_advertise')} must be a host name or address peers can reach, got {advertise!r}")
    if host == "0.0.0.0" and advertise is None:
        raise ConfigError(
            f"{name('side_host')} is '0.0.0.0' (every interface): set {name('side_advertise')} to the address "
            "peers reach this instance at"
        )
    if not is_loopback(host) and token is None:
        raise ConfigError(
            f"{name('side_host')} is {host!r}, beyond loopback: the side channel needs the deployment token "
            f"({TOKEN_ENV} or {name('side_token_file')})"
        )
    return advertise or host


def load_token(token_file: str | None, setting: str = "side_token_file") -> bytes | None:
    """The deployment token: the contents of ``token_file`` when given (``setting`` names it in errors), else
    ``ADP_SIDE_TOKEN``; None when neither is set. Surrounding whitespace (a file's newline) is not part of it;
    ConfigError for an unreadable file or a token under :data:`MIN_TOKEN_BYTES` bytes."""
    if token_file:
        try:
            with open(token_file, "rb") as f:
                token, source = f.read(1 << 16).strip(), f"{setting}={token_file!r}"
        except OSError as error:
            raise ConfigError(f"{setting}={token_file!r} cannot be read: {error.strerror}") from None
    else:
        token, source = (_env.side_token() or "").strip().encode(), TOKEN_ENV
        if not token:
            return None
    if len(token) < MIN_TOKEN_BYTES:
        raise ConfigError(
            f"the side-channel token of {source} has {len(token)} bytes, at least {MIN_TOKEN_BYTES} needed"
        )
    return token


def write_token(path: str, token: bytes | None = None) -> bytes:
    """``token``, or a fresh random one (32 bytes as 64 hex digits), written to a new file ``path`` of mode 0600."""
    token = token or secrets.token_hex(32).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(token + b"\n")
    return token


@dataclasses.dataclass(frozen=True)
class XferParams:
    """One request's DualPath assignment, as the proxy writes it into ``kv_transfer_params``.

    ``role`` is what this instance does for the request (``prefill``: the PE; ``decode``: the DE), ``path``
    the read path the proxy chose, ``peer`` the other instance's side channel, ``xfer_id`` the id both
    instances know the request by (vLLM's request ids differ between instances). ``split`` (optional, default
    False) reads the request's hit blocks through both storage NICs: the PE sizes the halves at plan time
    (``path`` is then ignored).
    """

    xfer_id: str
    role: str
    path: ReadPath
    peer: str
    split: bool = False

    @classmethod
    def from_request(cls, kv_transfer_params: dict | None) -> XferParams | None:
        """The request's assignment, None for a request the proxy did not assign (served standalone)."""
        if not kv_transfer_params or PARAMS_KEY not in kv_transfer_params:
            return None
        raw = kv_transfer_params[PARAMS_KEY]
        if not isinstance(raw, dict):
            raise ConfigError(f"kv_transfer_params[{PARAMS_KEY!r}] must be a mapping, got {type(raw).__name__}")
        missing = [k for k in ("xfer_id", "role", "path", "peer") if k not in raw]
        if missing:
            raise ConfigError(f"kv_transfer_params[{PARAMS_KEY!r}] lacks {missing}")
        if raw["role"] not in ROLES:
            raise ConfigError(f"kv_transfer_params[{PARAMS_KEY!r}]['role'] must be one of {ROLES}, got {raw['role']!r}")
        try:
            path = ReadPath(raw["path"])
        except ValueError:
            raise ConfigError(
                f"kv_transfer_params[{PARAMS_KEY!r}]['path'] must be 'pe' or 'de', got {raw['path']!r}"
            ) from None
        split = raw.get("split", False)
        if not isinstance(split, bool):
            raise ConfigError(f"kv_transfer_params[{PARAMS_KEY!r}]['split'] must be a bool, got {split!r}")
        return cls(str(raw["xfer_id"]), raw["role"], path, str(raw["peer"]), split)

    def as_params(self) -> dict:
        fields = {"xfer_id": self.xfer_id, "role": self.role, "path": self.path.value, "peer": self.peer}
        if self.split:
            fields["split"] = True
        return {PARAMS_KEY: fields}


class Refused(ProtocolError):
    """A side-channel frame refused before it was parsed into work; ``stamp`` the frame's own (echoed in the
    reply) when its header could be read, ``unframed``: it came from a peer of an older release (protocol 1 sent
    bare msgpack), which is answered in its own format so that it shows this error."""

    def __init__(self, reason: str, stamp: Stamp | None = None, unframed: bool = False) -> None:
        super().__init__(reason)
        self.stamp, self.unframed = stamp, unframed


@dataclasses.dataclass(frozen=True)
class Stamp:
    """Who sent a request frame and when: a random ``sender`` id (one per client socket), its ``counter``
    (increasing per sender) and the sender's wall clock ``time_ms``. A reply echoes its request's stamp."""

    sender: bytes
    counter: int
    time_ms: int


class Sender:
    """The stamps of one client socket: a fresh random id and an increasing counter (one thread uses it)."""

    def __init__(self) -> None:
        self.id = secrets.token_bytes(SENDER_BYTES)
        self._counter = itertools.count(1)

    def stamp(self) -> Stamp:
        return Stamp(self.id, next(self._counter), int(time.time() * 1000))


def _mac(token: bytes | None, header: bytes, payload: bytes) -> bytes:
    # without a token (loopback only) the empty key still makes a truncated or corrupted frame fail the check
    mac = hmac.new(token or b"", header, hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def seal(token: bytes | None, kind: int, stamp: Stamp, payload: bytes) -> bytes:
    """One frame: header (magic, ``kind``, :data:`~ascend_dualpath.dualpath.messages.PROTOCOL_VERSION`, the
    stamp), HMAC-SHA256 under ``token`` over header and payload, then the payload (a msgpack message)."""
    header = _HEADER.pack(MAGIC, kind, m.PROTOCOL_VERSION, stamp.sender, stamp.counter, stamp.time_ms)
    return header + _mac(token, header, payload) + payload


def unseal(token: bytes | None, frame: bytes, kind: int, max_bytes: int) -> tuple[Stamp, bytes]:
    """``(stamp, payload)`` of a frame of ``kind``; :class:`Refused` naming why for one that is oversized, not a
    frame, of another protocol version or kind, or fails the token check (compared in constant time)."""
    if len(frame) > max_bytes:
        raise Refused(f"frame of {len(frame)} bytes exceeds the side channel's limit of {max_bytes} bytes")
    if not frame.startswith(MAGIC):
        unframed = frame[:1] != b"" and (0x80 <= frame[0] <= 0x8F or frame[0] in (0xDE, 0xDF))  # a msgpack map
        raise Refused(
            f"not a side-channel frame of protocol {m.PROTOCOL_VERSION} ({len(frame)} bytes"
            f"{', a bare msgpack message: a peer of an older ascend_dualpath release' if unframed else ''})",
            unframed=unframed,
        )
    if len(frame) < _HEADER.size + MAC_BYTES:
        raise Refused(
            f"truncated side-channel frame ({len(frame)} bytes, the header alone is {_HEADER.size + MAC_BYTES})"
        )
    _, got_kind, version, sender, counter, time_ms = _HEADER.unpack_from(frame)
    stamp = Stamp(sender, counter, time_ms)
    if version != m.PROTOCOL_VERSION:
        raise Refused(
            f"DualPath protocol version {version} there, {m.PROTOCOL_VERSION} here: both ends need the same "
            "ascend_dualpath release",
            stamp,
        )
    header, mac, payload = (
        frame[: _HEADER.size],
        frame[_HEADER.size : _HEADER.size + MAC_BYTES],
        frame[_HEADER.size + MAC_BYTES :],
    )
    if not hmac.compare_digest(mac, _mac(token, header, payload)):
        raise Refused(
            f"frame fails the deployment-token check (the sender has no {TOKEN_ENV} / side_token_file, another "
            "one, or the frame was cut or altered)",
            stamp,
        )
    if got_kind != kind:
        raise Refused(f"frame of kind {got_kind!r} where {kind!r} was expected", stamp)
    return stamp, payload


class _Gate:
    """Admits the request frames of one side channel: :func:`unseal`, then refuses a frame outside the replay
    window (its clock more than ``window_s`` from ours) or whose counter is not above the last one admitted from
    its sender. Senders last heard from before the window are forgotten: a replay of theirs is out of it."""

    def __init__(self, token: bytes | None, max_bytes: int, window_s: float = REPLAY_WINDOW_S) -> None:
        self.token, self.max_bytes, self.window_ms = token, max_bytes, int(window_s * 1000)
        self._last: dict[bytes, tuple[int, int]] = {}  # sender -> (counter, its time_ms)
        self._swept_ms = 0

    def admit(self, frame: bytes) -> tuple[Stamp, m.Request]:
        stamp, payload = unseal(self.token, frame, REQUEST, self.max_bytes)
        now = int(time.time() * 1000)
        if abs(now - stamp.time_ms) > self.window_ms:
            raise Refused(
                f"frame stamped {(now - stamp.time_ms) / 1000:.1f} s from this host's clock, beyond the replay "
                f"window of {self.window_ms / 1000:.0f} s (a replay, or clocks out of sync)",
                stamp,
            )
        last = self._last.get(stamp.sender)
        if last is not None and stamp.counter <= last[0]:
            raise Refused(f"replayed frame (counter {stamp.counter}, last admitted {last[0]})", stamp)
        try:
            message = m.decode_request(payload)
        except ProtocolError as error:
            raise Refused(str(error), stamp) from None
        self._last[stamp.sender] = (stamp.counter, stamp.time_ms)
        if now - self._swept_ms > self.window_ms // 4:
            self._swept_ms = now
            self._last = {s: v for s, v in self._last.items() if now - v[1] <= self.window_ms}
        return stamp, message


class SideChannel:
    """A ROUTER socket served by one thread: ``handler(request) -> reply`` for every admitted request.

    Every frame is checked on its raw bytes before it is decoded (:class:`_Gate`: size, framing version, the
    deployment ``token``'s HMAC, replay); a refused one is answered by an :class:`~ascend_dualpath.dualpath.messages.Error`
    without calling the handler and counted in ``counters.side_refused``. The handler runs on the serving thread;
    an exception becomes an Error reply naming it, so nothing a peer sends kills the channel. ``host`` is the
    address bound, ``advertise`` the one peers reach it at (:func:`check_bind`); a token is required beyond loopback.
    """

    def __init__(
        self,
        port: int,
        handler: Callable[[m.Request], m.Reply],
        *,
        host: str = "127.0.0.1",
        advertise: str | None = None,
        token: bytes | None = None,
        max_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        counters: Any = None,
        name: str = "adp",
    ) -> None:
        advertised = check_bind(host, advertise, token)
        if not (isinstance(max_bytes, int) and MIN_FRAME_BYTES <= max_bytes <= MAX_FRAME_BYTES):
            raise ConfigError(
                f"side channel: max_bytes must be in [{MIN_FRAME_BYTES}, {MAX_FRAME_BYTES}], got {max_bytes!r}"
            )
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # ZMQ drops the connection of a peer whose frame exceeds twice the limit before buffering it; frames up
        # to twice the limit reach the gate, which answers and counts them
        self._socket.setsockopt(zmq.MAXMSGSIZE, 2 * max_bytes)
        try:
            self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as error:
            self._socket.close()
            self._context.term()
            raise ConfigError(f"side channel: cannot bind tcp://{host}:{port}: {error}") from error
        port = int(self._socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])  # port 0: the one taken
        self.address = f"tcp://{advertised}:{port}"
        self._handler = handler
        self._token = token
        self._gate = _Gate(token, max_bytes)
        self._counters = counters
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"{name}-side", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(POLL_MS):
                continue
            parts = self._socket.recv_multipart(copy=False)
            try:
                reply = self._answer(parts)
            except Exception as error:  # the channel lives on, whatever a peer sent
                log.exception("side channel %s: unexpected error answering a frame: %s", self.address, error)
                continue
            with contextlib.suppress(zmq.ZMQError):  # a peer gone since: ROUTER drops its reply
                self._socket.send_multipart([parts[0], b"", reply])

    def _answer(self, parts: list[zmq.Frame]) -> bytes:
        """The reply frame to one received message (``[identity, b"", frame]`` from a DEALER)."""
        try:
            if len(parts) != 3 or len(parts[1].bytes) != 0:
                raise Refused(f"a message of {len(parts)} parts where [identity, empty, frame] was expected")
            stamp, request = self._gate.admit(parts[2].bytes)
        except Refused as refusal:
            return self._refuse(refusal, parts[-1])
        try:
            reply = self._handler(request)
        except Exception as error:  # reported to the caller, the channel lives on
            reply = m.Error(error=f"{type(error).__name__}: {error}")
        return seal(self._token, REPLY, stamp, m.encode(reply))

    def _refuse(self, refusal: Refused, frame: zmq.Frame) -> bytes:
        self.refused += 1
        if self._counters is not None:
            self._counters.side_refused += 1
        if self.refused & (self.refused - 1) == 0:  # the 1st, 2nd, 4th, 8th, ...: a flood cannot flood the log
            log.warning("side channel %s refused a frame from %s (%d refused so far): %s",
                        self.address, _peer_address(frame), self.refused, refusal)  # fmt: skip
        error = m.Error(error=f"side channel {self.address} refused the frame: {refusal}")
        if refusal.unframed:
            return m.encode(error)  # what a peer of protocol 1 decodes, so it shows why
        return seal(self._token, REPLY, refusal.stamp or Stamp(bytes(SENDER_BYTES), 0, 0), m.encode(error))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * POLL_MS / 1000 + 1)
        self._socket.close()
        self._context.term()


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError, TypeError):
        return "an unknown address"


def open_reply(token: bytes | None, frame: bytes, sent: Stamp, address: str, op: str, max_bytes: int) -> m.Reply:
    """The reply to the request stamped ``sent``; ProtocolError naming ``address`` and ``op`` for an Error reply,
    one that fails the token check (with the Error it carries, unverified, when it is one), another request's
    reply, or one from a peer of an older release."""
    try:
        stamp, payload = unseal(token, frame, REPLY, max_bytes)
    except Refused as refusal:
        said = _unverified_error(frame)
        raise ProtocolError(
            f"{address} answered {op!r} with a frame refused here: {refusal}" + (f"; it said: {said}" if said else "")
        ) from None
    if stamp != sent:
        raise ProtocolError(f"{address} answered {op!r} with the reply to another request")
    reply = m.decode_reply(payload)
    if isinstance(reply, m.Error):
        raise ProtocolError(f"{address} refused {op!r}: {reply.error}")
    return reply


def _unverified_error(frame: bytes) -> str | None:
    """The text of an Error a frame carries, framed or bare, without trusting it (only ever shown in an error)."""
    for payload in (frame[_HEADER.size + MAC_BYTES :], frame):
        try:
            reply = m.decode_reply(payload)
        except ProtocolError:
            continue
        if isinstance(reply, m.Error):
            return reply.error
    return None


class PeerClient:
    """A DEALER to one side channel: :meth:`request` sends one message and waits (bounded) for its reply.

    Every request is sealed with the deployment ``token`` (:func:`seal`) and its reply checked the same way;
    ``max_bytes`` bounds both. Not thread-safe: one client per thread that talks to the peer.
    """

    def __init__(
        self, address: str, timeout_s: float, *, token: bytes | None = None, max_bytes: int = DEFAULT_MAX_FRAME_BYTES
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._token, self._max_bytes = token, max_bytes
        self._context = zmq.Context()
        self._socket = self._connect()

    def _connect(self) -> zmq.Socket:
        self._sender = Sender()  # a fresh socket, a fresh sender: a late frame of the old one cannot collide
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self._max_bytes)
        sock.connect(self.address)
        return sock

    def request(self, message: m.Message, timeout_s: float | None = None) -> m.Reply:
        """Send ``message`` and return the reply; WaitTimeout naming the op and the peer, ProtocolError on an
        :class:`Error` reply, a malformed or unauthenticated one, or a request over ``max_bytes``."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        op = type(message).__struct_config__.tag
        stamp = self._sender.stamp()
        frame = seal(self._token, REQUEST, stamp, m.encode(message))
        if len(frame) > self._max_bytes:
            raise ProtocolError(
                f"{op!r} to {self.address} is {len(frame)} bytes, over the side channel's limit of "
                f"{self._max_bytes} bytes (side_max_bytes, on both ends)"
            )
        self._socket.send_multipart([b"", frame])
        if not self._socket.poll(int(timeout * 1000)):
            # the socket now holds a request whose reply may come late: replace it so replies stay paired
            self._socket.close()
            self._socket = self._connect()
            raise WaitTimeout(f"no reply to {op!r} from {self.address} within {timeout} s")
        return open_reply(self._token, self._socket.recv_multipart()[-1], stamp, self.address, op, self._max_bytes)

    def close(self) -> None:
        self._socket.close()
        self._context.term()


def expect(reply: m.Reply, kind: type) -> Any:
    """``reply`` if it is a ``kind``; ProtocolError naming both otherwise (a peer of another build)."""
    if not isinstance(reply, kind):
        raise ProtocolError(f"expected a {kind.__name__} reply, got {type(reply).__name__}")
    return reply


def request_once(address: str, message: m.Message, timeout_s: float, **framing: Any) -> m.Reply:
    """One round trip of ``message`` to the side channel at ``address`` on a client of its own (bounded);
    ``framing``: :class:`PeerClient`'s ``token`` and ``max_bytes``."""
    client = PeerClient(address, timeout_s, **framing)
    try:
        return client.request(message)
    finally:
        client.close()


def query_status(address: str, timeout_s: float, **framing: Any) -> m.Status:
    """One ``status`` round trip to the side channel at ``address``."""
    return expect(request_once(address, m.StatusQuery(), timeout_s, **framing), m.Status)
