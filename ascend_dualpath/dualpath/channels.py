"""Control channels between the prefill and the decode engine: load plans and replies, never KV bytes.

:class:`QueueChannel` is a pair of in-process queues (fast tests, one process); :class:`DistChannel` sends
messages over ``torch.distributed`` point-to-point (gloo on CPU) between engine processes. Both carry the typed
:data:`~ascend_dualpath.dualpath.messages.EngineMessage` s as msgpack (encoded on send, decoded and checked on
``recv``, so the in-process channel refuses what the process channel would). Every ``recv`` is bounded by its
``timeout_s``.
"""

from __future__ import annotations

import datetime
import queue
from typing import Protocol

import torch

from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.errors import ProtocolError, WaitTimeout


class EngineLost(ProtocolError):
    """The peer engine process is gone (its control channel broke)."""


class Channel(Protocol):
    def send(self, message: m.EngineMessage) -> None: ...

    def recv(self, timeout_s: float, what: str) -> m.EngineMessage: ...


class QueueChannel:
    """One end of an in-process control channel."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue, peer: str) -> None:
        self.inbox, self.outbox, self.peer = inbox, outbox, peer

    @classmethod
    def pair(cls) -> tuple[QueueChannel, QueueChannel]:
        """(PE end, DE end)."""
        a, b = queue.Queue(), queue.Queue()
        return cls(a, b, "decode engine"), cls(b, a, "prefill engine")

    def send(self, message: m.EngineMessage) -> None:
        self.outbox.put(m.encode(message))

    def recv(self, timeout_s: float, what: str) -> m.EngineMessage:
        try:
            payload = self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            raise WaitTimeout(f"no {what} from the {self.peer} within {timeout_s} s") from None
        return m.decode_engine_message(payload)


class DistChannel:
    """Control messages over ``torch.distributed`` point-to-point (msgpack; length then payload)."""

    def __init__(self, peer_rank: int, peer: str) -> None:
        self.peer_rank, self.peer = peer_rank, peer

    def send(self, message: m.EngineMessage) -> None:
        import torch.distributed as dist

        payload = torch.frombuffer(bytearray(m.encode(message)), dtype=torch.uint8)
        try:
            dist.send(torch.tensor([payload.numel()], dtype=torch.int64), self.peer_rank)
            dist.send(payload, self.peer_rank)
        except RuntimeError as error:
            raise EngineLost(
                f"control channel to the {self.peer} (rank {self.peer_rank}) broke while sending "
                f"{type(message).__struct_config__.tag!r}: the engine died or hung ({error})"
            ) from error

    def recv(self, timeout_s: float, what: str) -> m.EngineMessage:
        import torch.distributed as dist

        size = torch.zeros(1, dtype=torch.int64)
        try:
            dist.irecv(size, self.peer_rank).wait(datetime.timedelta(seconds=timeout_s))
            payload = torch.empty(int(size[0]), dtype=torch.uint8)
            dist.irecv(payload, self.peer_rank).wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as error:
            if "timed out" in str(error).lower() or "timeout" in str(error).lower():
                raise WaitTimeout(
                    f"no {what} from the {self.peer} (rank {self.peer_rank}) within {timeout_s} s: {error}"
                ) from error
            raise EngineLost(
                f"control channel to the {self.peer} (rank {self.peer_rank}) broke while waiting for "
                f"{what}: the engine died ({error})"
            ) from error
        return m.decode_engine_message(payload.numpy().tobytes())
