"""DualPath's control messages between a prefill (PE) and a decode (DE) instance: typed, versioned, msgpack.

Every message is a msgspec ``Struct`` tagged by its ``op`` field, so a message on the wire is one msgpack map
``{"op": <tag>, ...fields}`` and decoding checks every field's type. The PE asks and the DE answers (how a
serving stack receives requests); the DE asks the PE one thing, :class:`WritesEnded`. Every request gets exactly
one reply: its own reply type, :class:`Ok`, or :class:`Error`.

The first message of a pair is :class:`Hello`. It carries what the sender :class:`Speaks`:
:data:`PROTOCOL_VERSION` and its :class:`Compat` (everything that decides the bytes on the wire: the KV layout's
kind, layer count, block tokens, token-row fields and the transfer engine's kind) with its digest;
:func:`check_peer` refuses a peer whose version or digest differs with one error naming both values and the facts
that differ, before any byte moves (as vLLM's NIXL handshake checks its compatibility hash).

The demo engines (:mod:`~ascend_dualpath.dualpath.nodes`) speak :data:`EngineMessage` over their
:class:`~ascend_dualpath.dualpath.channels.Channel`: the DE's :class:`Setup` (its side channel, where the PE then
says :class:`Hello`), then the waves of turns to prefill and their replies; between the two halves they speak the
side channel's messages like any PE and DE.

KV bytes never travel here: they move over the transfer engine's fabric; these are control messages only.
"""

from __future__ import annotations

import hashlib

import msgspec

from ascend_dualpath.errors import ConfigError, ProtocolError
from ascend_dualpath.kv.layout import KVLayout, KVShard
from ascend_dualpath.transport.mooncake import MooncakePeer

# Bumped whenever a message's fields or meaning change: peers of different versions refuse each other at hello.
# 2: the side channel frames every message (dualpath.side_channel.seal); a peer of 1 sends bare msgpack and is
# answered by a bare Error naming the difference. The demo engines' wave messages (Setup, Prefill of Turns) replaced
# their plan messages.
# 3: the read before the batch: a plan carries no window slots (a Start does, when the PE's step takes the request),
# the DE signals its hit reads done with the plan's ready_magic, and a plan may ask to be deferred, not waited for.
# 4: a link's rank info is tagged by its engine (``MooncakeRank`` carries ``"type": "mooncake"``), since a hello may
# now carry a CudaRank too.
# 5: tensor parallelism: Hello and Welcome carry the sender's tp_size and tp_rank, and the Compat digest is over the
# model's full layout (every head), the same at every tensor-parallel size.
# 6: the two sides' tensor-parallel sizes may differ: a PE rank pairs with each DE rank it is a source of
# (``KVShard.sources``), Status carries the instance's tp_size (the PE learns how the DE is sharded before its hello),
# and where a DE rank has several source PE ranks each pair's transfer id is the request's plus ``@<PE rank>``.
# 7: Status is one rank's share of its instance (it names its tp_rank; only the ranks of rank 0's replicas count
# requests and blocks), merged over the ranks by instance_status.
PROTOCOL_VERSION = 7


class Compat(msgspec.Struct, frozen=True):
    """What must be equal on both ends for the bytes to mean the same: the KV layout (``kind``, ``num_layers``,
    ``block_tokens``, ``row``: each token-row field as ``name:dtype:shape``) and the transfer ``engine`` kind."""

    kind: str
    num_layers: int
    block_tokens: int
    row: str
    engine: str

    @classmethod
    def of(cls, layout: KVLayout, engine: str) -> Compat:
        row = ",".join(f"{f.name}:{str(f.dtype).removeprefix('torch.')}:{list(f.shape)}" for f in layout.fields)
        return cls(layout.kind, layout.num_layers, layout.block_tokens, row, engine)

    @property
    def digest(self) -> str:
        """16 hex digits of SHA-256 over the msgpack of the facts."""
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()[:16]


class Speaks(msgspec.Struct, frozen=True):
    """What one end speaks: the protocol ``version`` and its :class:`Compat` with the ``digest`` of it."""

    version: int
    compat: Compat
    digest: str

    @classmethod
    def of(cls, compat: Compat) -> Speaks:
        return cls(PROTOCOL_VERSION, compat, compat.digest)


class MooncakeRank(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="mooncake"):
    """A Mooncake link's rank info (the ``rank_info`` of :class:`Hello` and :class:`Welcome` where the
    :class:`Compat` engine is ``mooncake-<protocol>``): the link engine's ``engine`` info (its session, the
    buffers it registered, its notify area) and the ``window`` ``(addr, size)`` holding the PE's layer slots."""

    engine: MooncakePeer
    window: tuple[int, int]


class CudaRank(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="cuda"):
    """A CUDA link's rank info (the ``rank_info`` of :class:`Hello` and :class:`Welcome` where the :class:`Compat`
    engine is ``cuda``): what a process on the same host needs to write into this one.

    ``host_id`` is the host's boot id and ``gpu`` the UUID of the GPU holding ``memory``, a ``cudaMalloc``
    allocation exported by its 64-byte CUDA IPC ``handle``; its first ``window[1]`` bytes are the link's window,
    named in this process's addresses from ``window[0]`` (the PE's layer slots), then ``notify_slots`` int64 notify
    words. ``host_shm`` names the ``/dev/shm`` file of the instance's host region (the hello's ``host_mem``)."""

    host_id: str
    gpu: str
    handle: bytes
    window: tuple[int, int]
    notify_slots: int
    host_shm: str


class Message(msgspec.Struct, tag_field="op"):
    """Base of every control message (``op`` on the wire is the subclass's tag)."""


# -- PE -> DE requests -------------------------------------------------------------------------------------------
class Hello(Message, tag="hello"):
    """A PE's first message to a DE: who it is (``pe``: its side channel), its ``device_id`` on the fabric, its
    link's ``rank_info`` (the emulated communicator's serialized rank info, a :class:`MooncakeRank` or a :class:`CudaRank`), its host
    region ``host_mem`` ``(addr, size, rkey)``, what it speaks (over the model's full layout), and which
    tensor-parallel rank ``tp_rank`` of ``tp_size`` it is (the DE checks that the two ranks pair: :func:`check_tp`)."""

    pe: str
    device_id: int
    rank_info: bytes | MooncakeRank | CudaRank
    host_mem: tuple[int, int, int]
    speaks: Speaks
    tp_size: int = 1
    tp_rank: int = 0


class StatusQuery(Message, tag="status"):
    """Asks an instance for its :class:`Status` (the proxy and a PE meeting a DE ask it)."""


class Plan(Message, tag="plan"):
    """What is coming for one transfer ``xfer_id``: ``prompt_tokens`` rows in all, ``hit_tokens`` of them stored
    (``store_ids``: the full blocks), computing from ``load_start``; ``path`` ``pe`` or ``de`` (who reads the
    hits); ``pe_blocks`` of the hit blocks the PE reads itself in a split. When the DE reads hit blocks:
    ``notify_base`` (slot 0 and 1 per layer parity, +2 abort), one notify value per layer (``magics``),
    ``abort_magic``, and ``ready_magic``, which the DE writes into slot ``notify_base`` once its reads are done
    (its pushes wait for :class:`Start`). ``defer``: a full host buffer answers ``Planned(deferred=True)`` at once
    instead of waiting for space (a read ahead of its step tries again later)."""

    pe: str
    xfer_id: str
    path: str
    hit_tokens: int
    prompt_tokens: int
    load_start: int
    store_ids: list[bytes]
    pe_blocks: int = 0
    notify_base: int = -1
    magics: list[int] = []
    abort_magic: int = 0
    ready_magic: int = 0
    defer: bool = False


class Start(Message, tag="start"):
    """The PE's step takes ``xfer_id``: the DE pushes its half's hit layers into these two window ``slots``."""

    xfer_id: str
    slots: list[int]


class Consumed(Message, tag="consumed"):
    """The PE consumed hit layer ``layer`` of ``xfer_id``: its slot may take layer ``layer + 2``."""

    xfer_id: str
    layer: int


class Hits(Message, tag="hits"):
    """A split's PE half (its hit blocks) is in the DE's lease."""

    xfer_id: str


class Rows(Message, tag="rows"):
    """Token rows ``[start, end)`` of ``xfer_id`` are in the DE's lease (``full``: complete layers, the PE path)."""

    xfer_id: str
    start: int
    end: int
    full: bool = False


class Fallback(Message, tag="fallback"):
    """The PE computes ``xfer_id`` whole (``reason``); ``settled``: its writes into the old lease ended."""

    xfer_id: str
    reason: str
    settled: bool = False


class Abort(Message, tag="abort"):
    """The PE gave ``xfer_id`` up (``reason``); ``settled``: none of its writes into the lease is in flight."""

    xfer_id: str
    reason: str
    settled: bool = False


class PushesEnded(Message, tag="pushes_ended"):
    """Asks whether the DE's hit-layer pushes of ``xfer_id`` ended (the PE may then reuse its slots)."""

    xfer_id: str


# -- DE -> PE request --------------------------------------------------------------------------------------------
class WritesEnded(Message, tag="writes_ended"):
    """Asks whether the PE's writes into ``xfer_id``'s lease ended (the DE may then give the lease back)."""

    xfer_id: str


# -- replies -----------------------------------------------------------------------------------------------------
class Ok(Message, tag="ok"):
    """The request was done; nothing to say."""


class Error(Message, tag="error"):
    """The request was refused: ``error`` names why."""

    error: str


class Welcome(Message, tag="welcome"):
    """The DE's answer to :class:`Hello`: its link's ``rank_info`` (as :class:`Hello`'s) and host region
    ``host_mem``, and the DE's tensor-parallel rank ``tp_rank`` of ``tp_size``."""

    rank_info: bytes | MooncakeRank | CudaRank
    host_mem: tuple[int, int, int]
    tp_size: int = 1
    tp_rank: int = 0


class Planned(Message, tag="planned"):
    """The DE's answer to :class:`Plan` and :class:`Fallback`: the lease the rows go to (``lease_addr``);
    ``pushes_ended`` (fallback): the DE's pushes into the PE's slots ended; ``deferred`` (a plan with ``defer``):
    the DE's host buffer is full, nothing was planned (``lease_addr`` 0)."""

    lease_addr: int
    pushes_ended: bool = False
    deferred: bool = False


class Ended(Message, tag="ended"):
    """The answer to :class:`PushesEnded` and :class:`WritesEnded`."""

    ended: bool


class Status(Message, tag="status"):
    """One tensor-parallel rank's share of its instance's live state, what the proxy schedules on and what it must
    see come back to zero; :func:`instance_status` merges the ranks' shares into the instance's.

    The rank's storage-NIC cap ``snic_bytes_per_s`` (None: uncapped; the ranks of an instance share its cap), its read
    queue (``read_queue_bytes``, and ``read_queue_tokens``: those bytes in tokens of the whole model's KV, so that the
    ranks' figures add up), what it has read so far (``snic_read_bytes`` / ``_blocks``: the read-path rule's
    tie-break), the transfers whose storage reads are queued or running now (``reading``: xfer ids, whose tokens the
    read queue counts; the proxy then drops its own estimate of them), the requests it has not finished
    (``unfinished_requests`` / ``_tokens``), and what it holds now: ``host_leases`` and ``quarantined_bytes`` (0 once
    every request ended and late writes are ruled out). Requests and blocks are counted once per instance: by the
    ranks of rank 0's replicas (``KVShard.counts_requests``), each for the requests it leads; every rank moves its
    own heads of every request, so the other ranks count none. The counters (loads per path, fallbacks, takeovers,
    failures, ...) go through vLLM's metrics (``integrations/vllm/stats.py``). ``tp_size`` / ``tp_rank``: the
    instance's tensor-parallel size (a PE asks rank 0 which of its ranks to pair with) and this rank.
    """

    role: str
    node: str
    device_id: int
    snic_bytes_per_s: float | None = None
    read_queue_tokens: int = 0
    read_queue_bytes: int = 0
    snic_read_bytes: int = 0
    snic_read_blocks: int = 0
    unfinished_requests: int = 0
    unfinished_tokens: int = 0
    quarantined_bytes: int = 0
    host_leases: int = 0
    reading: list[str] = []
    tp_size: int = 1
    tp_rank: int = 0


# -- the demo engines: the DE drives, the PE prefills -----------------------------------------------------------
class Setup(Message, tag="setup"):
    """The DE's first message to the PE: the address of its side channel ``de``. The PE says :class:`Hello` there
    (which checks both ends' protocol version and compatibility digest) and answers :class:`Ok`, or :class:`Error`
    naming both ends' values (the PE then stops)."""

    de: str


class Turn(msgspec.Struct, frozen=True):
    """One turn to prefill: its transfer id, the read path (``pe`` / ``de``; ``split`` reads through both storage
    NICs), its prompt ``tokens`` and the store ids of its stored prefix ``hit_block_ids``."""

    xfer_id: str
    path: str
    split: bool
    tokens: list[int]
    hit_block_ids: list[bytes]


class Prefill(Message, tag="prefill"):
    """Prefill ``turns`` together, in one step of the PE; answered by :class:`Prefilled`."""

    turns: list[Turn]


class TurnPrefilled(msgspec.Struct, frozen=True):
    """How one turn's prefill ended on the PE: ``ok`` with its ``first_token``, else the error's ``detail``; the hit
    blocks its storage NIC read (``pe_read_blocks``, a takeover's included), when a load failed the token position
    it computed again from (``recomputed_from``), and the seconds from the wave's arrival to its first token."""

    xfer_id: str
    ok: bool
    first_token: int | None = None
    detail: str | None = None
    pe_read_blocks: int = 0
    recomputed_from: int | None = None
    prefill_s: float = 0.0


class Prefilled(Message, tag="prefilled"):
    """The PE's answer to :class:`Prefill`: one :class:`TurnPrefilled` per turn, in order, and the bytes its storage
    NIC read meanwhile (``pe_read_bytes``)."""

    turns: list[TurnPrefilled]
    pe_read_bytes: int = 0


class Stop(Message, tag="stop"):
    """The PE stops serving."""


EngineMessage = Setup | Ok | Error | Prefill | Prefilled | Stop

Request = Hello | StatusQuery | Plan | Start | Consumed | Hits | Rows | Fallback | Abort | PushesEnded | WritesEnded
Reply = Ok | Error | Welcome | Planned | Ended | Status

_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(Request)
_replies = msgspec.msgpack.Decoder(Reply)
_engine_messages = msgspec.msgpack.Decoder(EngineMessage)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode_request(payload: bytes) -> Request:
    """One request; ProtocolError naming what is wrong (unknown ``op``, a missing or mistyped field)."""
    try:
        return _requests.decode(payload)
    except msgspec.ValidationError as error:
        raise ProtocolError(f"malformed request: {error}") from None
    except msgspec.DecodeError as error:
        raise ProtocolError(f"undecodable request ({len(payload)} bytes): {error}") from None


def decode_reply(payload: bytes) -> Reply:
    """One reply; ProtocolError naming what is wrong."""
    try:
        return _replies.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise ProtocolError(f"malformed reply: {error}") from None


def decode_engine_message(payload: bytes) -> EngineMessage:
    """One demo-engine message; ProtocolError naming what is wrong."""
    try:
        return _engine_messages.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise ProtocolError(f"malformed engine message ({len(payload)} bytes): {error}") from None


def check_peer(mine: Compat, theirs: Speaks, here: str, there: str) -> None:
    """Refuse a peer that speaks another protocol version or moves other bytes: one ProtocolError naming both
    values (``here`` / ``there`` name the two ends) and, for a digest, the facts that differ."""
    if theirs.version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"DualPath protocol version {PROTOCOL_VERSION} at {here}, {theirs.version} at {there}: "
            "both ends need the same ascend_dualpath release"
        )
    if theirs.digest != mine.digest or theirs.compat != mine:
        differ = [
            f"{name} {getattr(mine, name)!r} here, {getattr(theirs.compat, name)!r} there"
            for name in mine.__struct_fields__
            if getattr(mine, name) != getattr(theirs.compat, name)
        ]
        raise ProtocolError(
            f"KV compatibility digest {mine.digest} at {here}, {theirs.digest} at {there}: "
            f"{'; '.join(differ) or 'the digest was computed differently'}"
        )


def pair_id(xfer_id: str, pe: KVShard, de: KVShard) -> str:
    """The transfer id of PE rank ``pe``'s pair with DE rank ``de`` for the request ``xfer_id``: the request's own,
    or, where the DE rank takes rows from several PE ranks (a PE of a larger tensor-parallel size), the request's
    plus ``@<PE rank>``, so that the DE rank keeps each pair's plan, lease and messages apart."""
    return xfer_id if len(de.sources(pe.size)) == 1 else f"{xfer_id}@{pe.rank}"


def check_tp(mine: KVShard, size: int, rank: int, here: str, there: str, *, decode: bool) -> None:
    """Refuse a peer rank (``rank`` of tensor-parallel ``size``) this rank (``decode``: a DE rank, else a PE rank)
    cannot pair with: one ProtocolError naming both ends' ranks and sizes (``here`` / ``there`` name the two ends)
    and why: the model's rows cannot be sharded that way, or the PE rank is not a source of the DE rank's rows
    (:meth:`~ascend_dualpath.kv.layout.KVShard.sources`: each DE row comes from exactly one PE rank)."""
    where = f"tensor-parallel rank {mine.rank} of {mine.size} at {here}, rank {rank} of {size} at {there}"
    try:
        theirs = mine.full.shard(size, rank)
    except ConfigError as error:
        raise ProtocolError(f"{where}: {error}") from None
    pe, de = (theirs, mine) if decode else (mine, theirs)
    sources = [source for source, _ in de.sources(pe.size)]
    if pe.rank not in sources:
        raise ProtocolError(
            f"{where}: DE rank {de.rank} of {de.size} takes its rows from PE ranks {sources} of {pe.size}, not from "
            f"PE rank {pe.rank}"
        )


# Status fields an instance's figure is the sum of its ranks' (the cap apart: None when any rank is uncapped).
_SUMMED = (
    "read_queue_tokens",
    "read_queue_bytes",
    "snic_read_bytes",
    "snic_read_blocks",
    "unfinished_requests",
    "unfinished_tokens",
    "quarantined_bytes",
    "host_leases",
)


def instance_status(ranks: list[Status]) -> Status:
    """The instance's :class:`Status` from each of its tensor-parallel ranks' (``ranks[r]``: rank ``r``'s): the caps
    and the figures of :data:`_SUMMED` summed, the transfers being read joined (in rank order), role, node and
    device id rank 0's. Raises :class:`ProtocolError` unless the replies are ranks ``0 .. tp_size - 1`` of one
    instance of one role, naming the first that is not.

    Examples
    --------
    >>> a = Status("decode", "n.tp0", 0, 1e9, read_queue_bytes=4, unfinished_requests=1, reading=["x"], tp_size=2)
    >>> b = Status("decode", "n.tp1", 1, 1e9, read_queue_bytes=4, reading=["x", "y"], tp_size=2, tp_rank=1)
    >>> merged = instance_status([a, b])
    >>> merged.snic_bytes_per_s, merged.read_queue_bytes, merged.unfinished_requests, merged.reading
    (2000000000.0, 8, 1, ['x', 'y'])
    """
    if not ranks:
        raise ProtocolError("an instance's status needs its rank 0's reply, got none")
    first = ranks[0]
    for index, status in enumerate(ranks):
        if (status.role, status.tp_size, status.tp_rank) != (first.role, len(ranks), index):
            raise ProtocolError(
                f"status reply {index} of {len(ranks)} is from {status.role} rank {status.tp_rank} of "
                f"tensor-parallel size {status.tp_size} ({status.node}), not {first.role} rank {index} of {len(ranks)}"
            )
    caps = [status.snic_bytes_per_s for status in ranks]
    summed = {name: sum(getattr(status, name) for status in ranks) for name in _SUMMED}
    return msgspec.structs.replace(
        first,
        snic_bytes_per_s=None if None in caps else sum(caps),
        reading=list(dict.fromkeys(xfer_id for status in ranks for xfer_id in status.reading)),
        **summed,
    )
