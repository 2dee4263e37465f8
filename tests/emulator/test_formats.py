"""Wire formats against the documented byte layout, written out here independently of the encoders."""

import struct

from hypothesis import given
from hypothesis import strategies as st

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


def reference_wqe(opcode, owner, signaled, length, rkey, remote_addr, lkey, local_addr, imm=0):
    # the hns RoCE v2 WQE (rdma-core's public hns provider): byte4 = opcode | (~owner << 7 & 0x80) | 1 << 8 (signaled);
    # msg_len; immt; byte16 = 1 << 24 (num_sge); byte20 = 0; rkey; u64 remote_va; SGE {len, lkey, u64 va}
    byte4 = opcode | ((~owner << 7) & 0x80) | (0x100 if signaled else 0)
    return struct.pack("<IIIIIIQIIQ", byte4, length, imm, 1 << 24, 0, rkey, remote_addr, length, lkey, local_addr)


@given(
    opcode=st.sampled_from([3, 4, 5]),
    owner=st.integers(0, 1),
    signaled=st.booleans(),
    length=u32,
    rkey=u32,
    remote=u64,
    lkey=u32,
    local=u64,
    imm=u32,
)
def test_wqe_matches_documented_layout(emu, opcode, owner, signaled, length, rkey, remote, lkey, local, imm):
    wqe = emu.encode_rdma_wqe(opcode, owner, signaled, length, rkey, remote, lkey, local, imm)
    assert wqe == reference_wqe(opcode, owner, signaled, length, rkey, remote, lkey, local, imm)
    fields = emu.decode_rdma_wqe(wqe)
    assert (fields["opcode"], fields["owner"], fields["signaled"], fields["length"]) == (
        opcode,
        owner,
        signaled,
        length,
    )
    assert (fields["rkey"], fields["remote_addr"], fields["lkey"], fields["local_addr"]) == (rkey, remote, lkey, local)
    assert fields["num_sge"] == 1 and fields["sge_length"] == length and fields["imm"] == imm
    assert fields["owner_bit"] == 1 - owner  # bit 7 holds the inverse


def test_owner_bit_follows_ring_passes(emu):
    depth, shift = 8, 3
    bits = [
        emu.decode_rdma_wqe(emu.encode_rdma_wqe(3, (head >> shift) & 1, True, 1, 0, 0, 0, 0))["owner_bit"]
        for head in range(3 * depth)
    ]
    assert bits == [1] * depth + [0] * depth + [1] * depth


@given(qpn=st.integers(0, 2**24 - 1), pi=u32, sl=st.integers(0, 7))
def test_doorbell_layout(emu, qpn, pi, sl):
    value = emu.encode_sq_doorbell(qpn, pi, sl)
    assert value == qpn | (0 << 24) | ((pi % 65536) << 32) | (sl << 48)
    assert emu.decode_sq_doorbell(value) == {"qpn": qpn, "cmd": 0, "pi": pi % 65536, "sl": sl}


def test_encoders_reject_values_that_do_not_fit(emu):
    import pytest

    from ascend_dualpath.errors import ConfigError

    with pytest.raises(ConfigError, match="sl 8 exceeds its field's maximum 7"):
        emu.encode_sq_doorbell(1, 0, 8)
    with pytest.raises(ConfigError, match="qpn 16777216 exceeds"):
        emu.encode_sq_doorbell(1 << 24, 0, 0)
    with pytest.raises(ConfigError, match="owner 2 exceeds"):
        emu.encode_rdma_wqe(3, 2, True, 1, 0, 0, 0, 0)
    with pytest.raises(ConfigError, match="a WQE is 48 bytes, got 47"):
        emu.decode_rdma_wqe(b"\0" * 47)
