"""The emulated NIC arbitrates service levels by weight: model traffic keeps ~99% of the wire under
contention and KV traffic still progresses (the QoS that DualPath relies on, paper §5)."""

import numpy as np
import pytest

from ascend_dualpath import errors
from ascend_dualpath.dualpath.traffic import QosPolicy
from tests.conftest import poll_all

POLICY = QosPolicy()
MODEL_SL, KV_SL = POLICY.model.service_level, POLICY.kv.service_level
CHUNK = 64 << 10
COUNT = 200


def backlog_two_classes(C, emu, weights):
    """Both QPs full before the NIC looks; returns (model completions, kv completions)."""
    with emu.emulated_devices(2) as (d0, d1):
        d0.nic.sl_weights = weights
        src = d0.alloc_region(CHUNK * COUNT, C.MemKind.DEVICE_GM, 4)
        dst = d1.alloc_region(2 * CHUNK * COUNT, C.MemKind.DEVICE_GM, 7)
        np.frombuffer(src, dtype=np.uint8)[:] = np.arange(CHUNK * COUNT, dtype=np.uint64).astype(np.uint8)
        cqs = {sl: d0.create_cq(512) for sl in (MODEL_SL, KV_SL)}
        qps = {sl: d0.create_qp(cqs[sl], None, 256, sl) for sl in (MODEL_SL, KV_SL)}
        d0.nic.set_paused(True)
        for k, sl in enumerate((KV_SL, MODEL_SL)):  # KV rings first: arbitration, not arrival, must decide
            qps[sl].post(
                [
                    C.WorkRequest(
                        3, src.addr + i * CHUNK, src.lkey, CHUNK, dst.addr + (k * COUNT + i) * CHUNK, dst.rkey
                    )
                    for i in range(COUNT)
                ],
                0.0,
                10.0,
            )
        d0.nic.set_paused(False)
        done = {sl: poll_all(cqs[sl], COUNT) for sl in (MODEL_SL, KV_SL)}
        assert all(c.status == 0 for cs in done.values() for c in cs)
        landed = np.frombuffer(dst, dtype=np.uint8)
        expected = np.frombuffer(src, dtype=np.uint8)
        assert np.array_equal(landed[: CHUNK * COUNT], expected) and np.array_equal(landed[CHUNK * COUNT :], expected)
        return done[MODEL_SL], done[KV_SL]


def test_high_class_gets_its_share_and_low_class_never_starves(C, emu):
    model, kv = backlog_two_classes(C, emu, POLICY.nic_sl_weights())  # 99:1
    model_done_at = max(c.vtime_ns for c in model)
    kv_before = sum(c.byte_cnt for c in kv if c.vtime_ns <= model_done_at)
    share = CHUNK * COUNT / (CHUNK * COUNT + kv_before)
    assert share >= 0.98, f"model class got {share:.3%} of the wire while both were backlogged"
    assert kv_before > 0, "the KV class starved while the model class was backlogged"
    assert [c.wqe_index for c in kv] == sorted(c.wqe_index for c in kv)


def test_equal_weights_share_the_wire(C, emu):
    model, kv = backlog_two_classes(C, emu, [1] * 8)
    model_done_at = max(c.vtime_ns for c in model)
    kv_before = sum(c.byte_cnt for c in kv if c.vtime_ns <= model_done_at)
    assert 0.45 <= kv_before / (CHUNK * COUNT) <= 1.0


def test_weights_are_validated(emu):
    with emu.emulated_devices(1) as (d,):
        with pytest.raises(errors.ConfigError, match="weight of SL 2 must be in \\[1, 1000\\], got 0"):
            d.nic.sl_weights = [1, 1, 0, 1, 1, 1, 1, 1]
        with pytest.raises(errors.ConfigError, match="one weight per service level \\(8\\), got 3"):
            d.nic.sl_weights = [1, 2, 3]
