"""What the DualPath connector halves, the peer instance and the proxy say to each other.

- ``kv_transfer_params["dualpath"]`` (proxy -> each instance, per request): :class:`XferParams`.
- The side channel: a ZMQ ROUTER in each instance's worker on ``127.0.0.1:side_port`` carrying the typed
  messages of :mod:`ascend_dualpath.dualpath.messages`; every request gets exactly one reply. The PE worker is
  the client of the DE worker (``status``, ``hello``, then per request ``plan``, ``consumed``, ``hits``, ``rows``,
  ``fallback``, ``abort``, ``pushes_ended``), the DE asks the PE ``writes_ended``, the proxy asks every instance
  for ``status``. Any PE may work with any DE: a PE sends ``hello`` (its side-channel address, device id,
  protocol version and compatibility digest) to each DE the first time a request names it, and every later
  message of a request carries its ``xfer_id``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import zmq

from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.scheduler import ReadPath
from ascend_dualpath.errors import ConfigError, ProtocolError, WaitTimeout

PARAMS_KEY = "dualpath"
ROLES = ("prefill", "decode")
POLL_MS = 50  # the serving thread's poll period: bounds how late it sees a stop request


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


class SideChannel:
    """A ROUTER socket served by one thread: ``handler(request) -> reply`` for every request.

    The handler runs on the serving thread; a malformed request or an exception becomes an :class:`Error` reply
    naming it, so a bad message never kills the channel. ``port`` 0 binds a free port (``address`` names it).
    """

    def __init__(
        self, port: int, handler: Callable[[m.Request], m.Reply], *, host: str = "127.0.0.1", name: str = "adp"
    ) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            if port == 0:  # any free port (tests, the demo): no race between choosing it and binding it
                port = self._socket.bind_to_random_port(f"tcp://{host}")
            else:
                self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as error:
            self._socket.close()
            self._context.term()
            raise ConfigError(f"side channel: cannot bind tcp://{host}:{port}: {error}") from error
        self.address = f"tcp://{host}:{port}"
        self._handler = handler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"{name}-side", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(POLL_MS):
                continue
            identity, _, payload = self._socket.recv_multipart()
            try:
                reply = self._handler(m.decode_request(payload))
            except Exception as error:  # reported to the caller, the channel lives on
                reply = m.Error(error=f"{type(error).__name__}: {error}")
            self._socket.send_multipart([identity, b"", m.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * POLL_MS / 1000 + 1)
        self._socket.close()
        self._context.term()


class PeerClient:
    """A DEALER to one side channel: :meth:`request` sends one message and waits (bounded) for its reply.

    Not thread-safe: one client per thread that talks to the peer.
    """

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)

    def request(self, message: m.Message, timeout_s: float | None = None) -> m.Reply:
        """Send ``message`` and return the reply; WaitTimeout naming the op and the peer, ProtocolError on an
        :class:`Error` reply or a malformed one."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        op = type(message).__struct_config__.tag
        self._socket.send_multipart([b"", m.encode(message)])
        if not self._socket.poll(int(timeout * 1000)):
            # the socket now holds a request whose reply may come late: replace it so replies stay paired
            self._reset()
            raise WaitTimeout(f"no reply to {op!r} from {self.address} within {timeout} s")
        _, payload = self._socket.recv_multipart()
        reply = m.decode_reply(payload)
        if isinstance(reply, m.Error):
            raise ProtocolError(f"{self.address} refused {op!r}: {reply.error}")
        return reply

    def _reset(self) -> None:
        self._socket.close()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(self.address)

    def close(self) -> None:
        self._socket.close()
        self._context.term()


def expect(reply: m.Reply, kind: type) -> Any:
    """``reply`` if it is a ``kind``; ProtocolError naming both otherwise (a peer of another build)."""
    if not isinstance(reply, kind):
        raise ProtocolError(f"expected a {kind.__name__} reply, got {type(reply).__name__}")
    return reply


def request_once(address: str, message: m.Message, timeout_s: float) -> m.Reply:
    """One round trip of ``message`` to the side channel at ``address`` on a client of its own (bounded)."""
    client = PeerClient(address, timeout_s)
    try:
        return client.request(message)
    finally:
        client.close()


def query_status(address: str, timeout_s: float) -> m.Status:
    """One ``status`` round trip to the side channel at ``address``."""
    return expect(request_once(address, m.StatusQuery(), timeout_s), m.Status)
