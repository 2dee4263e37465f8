"""DualPath's typed control messages: every message survives the wire, a malformed one is refused naming what is
wrong, and peers of another protocol version or KV layout refuse each other at hello with both values named."""

from __future__ import annotations

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ascend_dualpath.dualpath import messages as m
from ascend_dualpath.dualpath.channels import QueueChannel
from ascend_dualpath.dualpath.scheduler import ReadPath
from ascend_dualpath.errors import ProtocolError
from ascend_dualpath.kv.layout import KVLayout

LAYOUT = KVLayout.gqa(2, 2, 16, torch.bfloat16, block_tokens=16)
COMPAT = m.Compat.of(LAYOUT, "emulator")
ints = st.integers(0, 2**62)
ids = st.text(min_size=1, max_size=24)


def _hello(**overrides) -> m.Hello:
    fields = dict(pe="tcp://127.0.0.1:1", device_id=0, rank_info=b"\x01\x02", host_mem=(4096, 65536, 7),
                  speaks=m.Speaks.of(COMPAT))  # fmt: skip
    return m.Hello(**{**fields, **overrides})


REQUESTS = st.one_of(
    st.builds(_hello, device_id=st.integers(0, 63), rank_info=st.binary(max_size=64)),
    st.just(m.StatusQuery()),
    st.builds(
        m.Plan,
        pe=ids,
        xfer_id=ids,
        path=st.sampled_from(["pe", "de"]),
        hit_tokens=ints,
        prompt_tokens=ints,
        load_start=ints,
        store_ids=st.lists(st.binary(min_size=16, max_size=16), max_size=8),
        pe_blocks=ints,
        notify_base=ints,
        magics=st.lists(ints, max_size=4),
        abort_magic=ints,
        ready_magic=ints,
        defer=st.booleans(),
    ),  # fmt: skip
    st.builds(m.Start, xfer_id=ids, slots=st.lists(ints, max_size=2)),
    st.builds(m.Consumed, xfer_id=ids, layer=st.integers(0, 200)),
    st.builds(m.Hits, xfer_id=ids),
    st.builds(m.Rows, xfer_id=ids, start=ints, end=ints, full=st.booleans()),
    st.builds(m.Fallback, xfer_id=ids, reason=st.text(max_size=40), settled=st.booleans()),
    st.builds(m.Abort, xfer_id=ids, reason=st.text(max_size=40), settled=st.booleans()),
    st.builds(m.PushesEnded, xfer_id=ids),
    st.builds(m.WritesEnded, xfer_id=ids),
)
REPLIES = st.one_of(
    st.just(m.Ok()),
    st.builds(m.Error, error=st.text(max_size=40)),
    st.builds(m.Welcome, rank_info=st.binary(max_size=64), host_mem=st.tuples(ints, ints, ints)),
    st.builds(m.Planned, lease_addr=ints, pushes_ended=st.booleans(), deferred=st.booleans()),
    st.builds(m.Ended, ended=st.booleans()),
    st.builds(
        m.Status,
        role=st.sampled_from(["prefill", "decode"]),
        node=ids,
        device_id=st.integers(0, 63),
        snic_bytes_per_s=st.none() | st.floats(1, 1e12),
        unfinished_tokens=ints,
        host_leases=ints,
        reading=st.lists(ids, max_size=4),
    ),  # fmt: skip
)


@given(REQUESTS)
def test_every_request_survives_the_wire(message):
    assert m.decode_request(m.encode(message)) == message


@given(REPLIES)
def test_every_reply_survives_the_wire(reply):
    assert m.decode_reply(m.encode(reply)) == reply


def test_the_wire_form_is_a_map_with_its_op():
    assert msgspec.msgpack.decode(m.encode(m.Consumed(xfer_id="x", layer=3))) == {"op": "consumed", "xfer_id": "x",
                                                                                 "layer": 3}  # fmt: skip
    assert msgspec.msgpack.decode(m.encode(m.StatusQuery())) == {"op": "status"}


def test_a_status_from_a_peer_without_reading_decodes_with_none():
    """An older peer's status has no ``reading``: it decodes, naming no transfer."""
    wire = msgspec.msgpack.decode(m.encode(m.Status(role="decode", node="n", device_id=0, reading=["x"])))
    del wire["reading"]
    assert m.decode_reply(msgspec.msgpack.encode(wire)).reading == []


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"op": "launch", "xfer_id": "x"}, "malformed request.*launch"),
        ({"op": "consumed", "xfer_id": "x"}, "malformed request.*layer"),
        ({"op": "consumed", "xfer_id": "x", "layer": "3"}, r"malformed request.*int.*layer"),
        ({"xfer_id": "x"}, "malformed request.*op"),
    ],
)
def test_a_malformed_request_is_refused_naming_what_is_wrong(raw, match):
    with pytest.raises(ProtocolError, match=match):
        m.decode_request(msgspec.msgpack.encode(raw))
    with pytest.raises(ProtocolError, match="undecodable request"):
        m.decode_request(b"\xc1")


def test_a_peer_of_another_protocol_version_is_refused_naming_both():
    with pytest.raises(ProtocolError, match=rf"version {m.PROTOCOL_VERSION} at DE a, {m.PROTOCOL_VERSION + 1} at PE b"):
        m.check_peer(COMPAT, m.Speaks(m.PROTOCOL_VERSION + 1, COMPAT, COMPAT.digest), "DE a", "PE b")


@pytest.mark.parametrize(
    ("theirs", "fact"),
    [
        (m.Compat.of(KVLayout.gqa(4, 2, 16, torch.bfloat16, block_tokens=16), "emulator"), "num_layers 2 here, 4"),
        (m.Compat.of(KVLayout.gqa(2, 2, 16, torch.float16, block_tokens=16), "emulator"), "bfloat16.*float16"),
        (m.Compat.of(KVLayout.gqa(2, 2, 16, torch.bfloat16, block_tokens=32), "emulator"), "block_tokens 16 here, 32"),
        (
            m.Compat.of(KVLayout.gqa(2, 4, 16, torch.bfloat16, block_tokens=16), "emulator"),
            r"\[2, 2, 16\].*\[2, 4, 16\]",
        ),
        (m.Compat.of(LAYOUT, "cuda"), "engine 'emulator' here, 'cuda' there"),
    ],
)
def test_a_peer_moving_other_bytes_is_refused_naming_both_digests_and_the_fact(theirs, fact):
    assert theirs.digest != COMPAT.digest
    with pytest.raises(ProtocolError, match=rf"digest {COMPAT.digest} at DE a, {theirs.digest} at PE b: .*{fact}"):
        m.check_peer(COMPAT, m.Speaks.of(theirs), "DE a", "PE b")
    m.check_peer(COMPAT, m.Speaks.of(COMPAT), "DE a", "PE b")  # the same facts pass


def test_a_digest_that_does_not_match_its_facts_is_refused():
    with pytest.raises(ProtocolError, match="computed differently"):
        m.check_peer(COMPAT, m.Speaks(m.PROTOCOL_VERSION, COMPAT, "0" * 16), "DE a", "PE b")


TURNS = st.builds(
    m.Turn,
    xfer_id=ids,
    path=st.sampled_from([p.value for p in ReadPath]),
    split=st.booleans(),
    tokens=st.lists(st.integers(0, 50_000), max_size=8),
    hit_block_ids=st.lists(st.binary(min_size=16, max_size=16), max_size=4),
)
PREFILLED = st.builds(
    m.TurnPrefilled,
    xfer_id=ids,
    ok=st.booleans(),
    first_token=st.none() | st.integers(0, 50_000),
    detail=st.none() | st.text(max_size=40),
    pe_read_blocks=st.integers(0, 1000),
    recomputed_from=st.none() | st.integers(0, 10_000),
    prefill_s=st.floats(0, 1e4),
)
ENGINE_MESSAGES = st.one_of(
    st.builds(m.Setup, de=ids),
    st.just(m.Ok()),
    st.builds(m.Error, error=st.text(max_size=40)),
    st.builds(m.Prefill, turns=st.lists(TURNS, max_size=3)),
    st.builds(m.Prefilled, turns=st.lists(PREFILLED, max_size=3), pe_read_bytes=ints),
    st.just(m.Stop()),
)


@given(ENGINE_MESSAGES)
def test_every_demo_engine_message_survives_both_channels(message):
    """The in-process channel carries the wire form too: what arrives is what a process channel would decode."""
    pe_end, de_end = QueueChannel.pair()
    de_end.send(message)
    assert pe_end.recv(1.0, "a message") == message
    assert m.decode_engine_message(m.encode(message)) == message


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        ({"op": "prefill"}, "malformed engine message.*turns"),
        ({"op": "prefill", "turns": [{"xfer_id": "a"}]}, "malformed engine message.*path"),
        ({"op": "setup", "de": 5}, "malformed engine message.*de"),
        ({"op": "hello"}, "malformed engine message.*hello"),  # a vLLM side-channel op is no demo engine's
    ],
)
def test_a_malformed_demo_engine_message_is_refused_on_receipt(raw, match):
    pe_end, _ = QueueChannel.pair()
    pe_end.inbox.put(msgspec.msgpack.encode(raw))
    with pytest.raises(ProtocolError, match=match):
        pe_end.recv(1.0, "a message")


STATUS_FIGURES = st.fixed_dictionaries({name: st.integers(0, 2**40) for name in m._SUMMED})


@given(
    st.lists(
        st.tuples(STATUS_FIGURES, st.one_of(st.none(), st.floats(1.0, 1e12)), st.lists(ids, max_size=3)),
        min_size=1,
        max_size=8,
    )
)
def test_an_instances_status_sums_its_ranks_shares(ranks):
    size = len(ranks)
    replies = [
        m.Status("decode", f"de0.tp{rank}", 7 + rank, cap, tp_size=size, tp_rank=rank, reading=reading, **figures)
        for rank, (figures, cap, reading) in enumerate(ranks)
    ]
    merged = m.instance_status(replies)
    for name in m._SUMMED:
        assert getattr(merged, name) == sum(figures[name] for figures, _, _ in ranks), name
    caps = [cap for _, cap, _ in ranks]
    assert merged.snic_bytes_per_s == (None if None in caps else pytest.approx(sum(caps)))
    assert merged.reading == list(dict.fromkeys(x for _, _, reading in ranks for x in reading))
    assert (merged.role, merged.node, merged.device_id, merged.tp_size, merged.tp_rank) == (
        "decode",
        "de0.tp0",
        7,
        size,
        0,
    )


@pytest.mark.parametrize(
    ("replies", "why"),
    [
        ([], "needs its rank 0's reply, got none"),
        (
            [m.Status("decode", "a", 0, tp_size=2)],
            "status reply 0 of 1 is from decode rank 0 of tensor-parallel size 2",
        ),
        (
            [m.Status("decode", "a", 0, tp_size=2), m.Status("decode", "b", 1, tp_size=2)],
            r"status reply 1 of 2 is from decode rank 0 of tensor-parallel size 2 \(b\), not decode rank 1 of 2",
        ),
        (
            [m.Status("decode", "a", 0, tp_size=2), m.Status("prefill", "b", 1, tp_size=2, tp_rank=1)],
            "is from prefill rank 1",
        ),
    ],
    ids=["none", "a rank missing", "a rank twice", "another role"],
)
def test_replies_that_are_not_one_instances_ranks_are_refused_naming_the_first(replies, why):
    with pytest.raises(ProtocolError, match=why):
        m.instance_status(replies)
