"""Property-based fuzzing of WQE streams: valid writes land exactly, invalid ones end in an error CQE,
the rest of the stream is flushed, and no byte outside the valid writes ever changes."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import poll_all

SIZE = 1 << 14
DEPTH = 64
KINDS = ["valid", "valid", "valid", "bad_rkey", "remote_oob", "local_oob", "bad_lkey", "zero_len", "no_permission",
         "bad_opcode"]
EXPECTED = {  # kind -> (status, syndrome)
    "bad_rkey": (0x13, 4), "remote_oob": (0x13, 5), "local_oob": (0x04, 2), "bad_lkey": (0x04, 1),
    "zero_len": (0x01, 7), "no_permission": (0x13, 6), "bad_opcode": (0x02, 9), "wrong_sl": (0x02, 8),
}


@pytest.fixture(scope="module")
def rig():
    from ascend_dualpath import _ext
    from ascend_dualpath.backends import emulator as emu

    C = _ext.load()
    with emu.emulated_devices(2) as (d0, d1):
        src = d0.alloc_region(SIZE, C.MemKind.DEVICE_GM, 4)
        dst = d1.alloc_region(SIZE, C.MemKind.DEVICE_GM, 7)
        read_only = d1.alloc_region(SIZE, C.MemKind.DEVICE_GM, 4)
        cq = d0.create_cq(256)
        qp = d0.create_qp(cq, None, DEPTH, 4)
        yield C, src, dst, read_only, cq, qp


op = st.tuples(st.sampled_from(KINDS), st.integers(0, SIZE - 1), st.integers(0, SIZE - 1), st.integers(1, 2048))


@settings(max_examples=60)
@given(ops=st.lists(op, min_size=1, max_size=DEPTH // 2 - 1), wrong_sl=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_random_wqe_streams(rig, ops, wrong_sl, seed):
    C, src, dst, read_only, cq, qp = rig
    rng = np.random.default_rng(seed)
    views = {name: np.frombuffer(r, dtype=np.uint8) for name, r in (("src", src), ("dst", dst), ("ro", read_only))}
    for v in views.values():
        v[:] = rng.integers(0, 256, SIZE, dtype=np.uint8)
    model = {name: v.copy() for name, v in views.items()}

    requests, expected, failed = [], [], False
    for i, (kind, s_off, d_off, length) in enumerate(ops):
        length = min(length, SIZE - s_off, SIZE - d_off)  # valid ops stay in bounds
        la, ra, lkey, rkey, opcode = src.addr + s_off, dst.addr + d_off, src.lkey, dst.rkey, 3
        if kind == "bad_rkey":
            rkey ^= 0x3
        elif kind == "remote_oob":
            ra = dst.addr + SIZE - length + 1 + (d_off % 64)
        elif kind == "local_oob":
            la = src.addr + SIZE - length + 1
        elif kind == "bad_lkey":
            lkey = 0x7FFFF00
        elif kind == "zero_len":
            length = 0
        elif kind == "no_permission":
            ra, rkey = read_only.addr + d_off, read_only.rkey
        elif kind == "bad_opcode":
            opcode = 6
        requests.append(C.WorkRequest(opcode, la, lkey, length, ra, rkey))
        if failed:
            expected.append((0x05, 16))  # flushed: the QP is in ERROR
        elif wrong_sl and i == 0:
            expected.append(EXPECTED["wrong_sl"])
            failed = True
        elif kind == "valid":
            model["dst"][d_off:d_off + length] = model["src"][s_off:s_off + length]
            expected.append((0, 0))
        else:
            expected.append(EXPECTED[kind])
            failed = True

    qp.post(requests, 0.0, 10.0, sl=5 if wrong_sl else -1)
    completions = poll_all(cq, len(requests))
    assert [(c.status, c.syndrome) for c in completions] == expected
    assert [c.wqe_index for c in completions] == list(range(completions[0].wqe_index, completions[0].wqe_index + len(ops)))
    for name, v in views.items():
        assert np.array_equal(v, model[name]), f"{name}: stray or missing bytes"
    qp.reset(10.0)
    assert cq.poll(1, 0.0) == []
