from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dualpath.dualpath.traffic import (
    ClassQos,
    OpensmQos,
    QosPolicy,
    TrafficClass,
    WeightedArbiter,
    comm_config_fields,
    hccl_pg_options,
    validate_service_level,
    validate_traffic_class,
)
from ascend_dualpath.errors import ConfigError, PayloadTooLarge

MODEL, KV = TrafficClass.MODEL, TrafficClass.KV


def test_default_policy_maps_to_hccl_and_torch_npu():
    policy = QosPolicy()
    assert policy.hccl_comm_config(MODEL) == {"hcclRdmaTrafficClass": 132, "hcclRdmaServiceLevel": 4}
    assert policy.pg_options_hccl_config(KV) == {"qos_traffic_class": 96, "qos_service_level": 3}
    assert policy.hccl_env(MODEL) == {"HCCL_RDMA_TC": "132", "HCCL_RDMA_SL": "4"}
    assert policy.model.dscp == 33 and policy.kv.dscp == 24


def test_comm_config_fields_per_class():
    assert comm_config_fields(KV) == {"hcclRdmaTrafficClass": 96, "hcclRdmaServiceLevel": 3}
    assert comm_config_fields(MODEL) == {"hcclRdmaTrafficClass": 132, "hcclRdmaServiceLevel": 4}
    custom = QosPolicy(kv=ClassQos(traffic_class=64, service_level=2, ib_vl=2, weight=3))
    assert comm_config_fields(KV, custom) == {"hcclRdmaTrafficClass": 64, "hcclRdmaServiceLevel": 2}


def test_the_emulated_hccl_config_takes_the_fields(C, emu):
    with emu.emulated_devices(1) as (device,):
        comm = C.HcclComm(device, 0, 1, emu.comm_config(hcclBufferSize=1, **comm_config_fields(KV)))
        try:
            assert (comm.resolved["traffic_class"], comm.resolved["service_level"]) == (96, 3)
        finally:
            comm.close()


class _HcclOptions:
    """torch_npu's ``ProcessGroupHCCL.Options``: ``hccl_config`` reads as a copy, so only a whole assignment sticks."""

    def __init__(self, config=None):
        self._config = dict(config or {})

    @property
    def hccl_config(self):
        return dict(self._config)

    @hccl_config.setter
    def hccl_config(self, value):
        self._config = dict(value)


def test_hccl_pg_options_keep_other_entries_and_set_the_class():
    options = hccl_pg_options(KV, options=_HcclOptions({"hccl_buffer_size": 200, "qos_service_level": 4}))
    assert options.hccl_config == {"hccl_buffer_size": 200, "qos_traffic_class": 96, "qos_service_level": 3}
    assert hccl_pg_options(MODEL, options=_HcclOptions()).hccl_config == {
        "qos_traffic_class": 132,
        "qos_service_level": 4,
    }


def test_hccl_pg_options_make_torch_npu_options(monkeypatch):
    import sys
    import types

    hccl = types.SimpleNamespace(Options=_HcclOptions)
    fake = types.ModuleType("torch_npu")
    fake._C = types.SimpleNamespace(_distributed_c10d=types.SimpleNamespace(ProcessGroupHCCL=hccl))
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    options = hccl_pg_options(KV)
    assert isinstance(options, _HcclOptions)
    assert options.hccl_config == {"qos_traffic_class": 96, "qos_service_level": 3}


def test_emulated_devices_arbitrate_by_the_policy(emu):
    """The emulator's default NIC weights are the policy's (the emulator may not import this module)."""
    assert list(emu.NIC_SL_WEIGHTS) == QosPolicy().nic_sl_weights()
    with emu.emulated_devices(1) as (device,):
        assert list(device.nic.sl_weights) == QosPolicy().nic_sl_weights()
    fabric = emu.create_fabric()
    try:
        with emu.open_device(fabric, sl_weights=(2,) * 8) as device:
            assert list(device.nic.sl_weights) == [2] * 8
        with pytest.raises(ConfigError, match="weight of SL 3 must be in \\[1, 1000\\], got 0"):
            emu.open_device(fabric, sl_weights=(1, 1, 1, 0, 99, 1, 1, 1))
    finally:
        fabric.close()


def test_roce_config():
    roce = QosPolicy().roce_config()
    assert roce["dscp_to_priority"] == {33: 4, 24: 3}
    assert roce["ets_percent"] == {4: 99, 3: 1}
    assert roce["pfc_priorities"] == [3, 4]


def test_opensm_lines_are_the_papers():
    assert OpensmQos().opensm_lines() == [
        "qos_max_vls 4",
        "qos_high_limit 240",
        "qos_vlarb_high 0:192,1:192,2:0,3:192",
        "qos_vlarb_low 0:192,1:192,2:64,3:192",
    ]
    share = OpensmQos().low_vl_min_share(2)
    assert share == pytest.approx(4096 / (240 * 4096 + 4096))
    with pytest.raises(ConfigError, match="starve"):
        OpensmQos().low_vl_min_share(5)


@pytest.mark.parametrize("tc", [-4, 2, 256, 260, True, 4.0])
def test_bad_traffic_class(tc):
    with pytest.raises(ConfigError, match="multiple of 4"):
        validate_traffic_class(tc)


@pytest.mark.parametrize("sl", [-1, 8, True])
def test_bad_service_level(sl):
    with pytest.raises(ConfigError, match=r"\[0, 7\]"):
        validate_service_level(sl)


def test_policy_rejects_inseparable_classes():
    same = ClassQos(traffic_class=132, service_level=4, ib_vl=1, weight=1)
    with pytest.raises(ConfigError, match="differ"):
        QosPolicy(kv=same)
    with pytest.raises(ConfigError, match="weight"):
        ClassQos(traffic_class=96, service_level=3, ib_vl=2, weight=0)


def _drain(arbiter, count):
    return [arbiter.next() for _ in range(count)]


def test_high_class_gets_at_least_98_percent_under_contention():
    arbiter = WeightedArbiter.from_policy(QosPolicy())
    for _ in range(20000):
        arbiter.enqueue(MODEL, 4096)
        arbiter.enqueue(KV, 4096)
    sent = _drain(arbiter, 10000)
    model_bytes = sum(p.nbytes for p in sent if p.traffic is MODEL)
    assert model_bytes / sum(p.nbytes for p in sent) >= 0.98


@settings(max_examples=25, deadline=None)
@given(
    model_sizes=st.lists(st.integers(64, 4096), min_size=50, max_size=50),
    kv_sizes=st.lists(st.integers(1, 4096), min_size=3, max_size=3),
)
def test_low_class_never_starves(model_sizes, kv_sizes):
    """While MODEL stays backlogged, KV is served after at most one round of MODEL credit
    (99 x 4096 B, plus at most one packet of carried deficit): it can be slowed, never starved."""
    arbiter = WeightedArbiter({MODEL: 99, KV: 1})
    for size in model_sizes:
        arbiter.enqueue(MODEL, size)
    for size in kv_sizes:
        arbiter.enqueue(KV, size)
    refill = iter(model_sizes * 10**6)
    model_bytes_since_kv, served_kv = 0, 0
    while served_kv < len(kv_sizes):
        packet = arbiter.next()
        if packet.traffic is KV:
            assert model_bytes_since_kv <= 99 * 4096 + 4096
            model_bytes_since_kv, served_kv = 0, served_kv + 1
        else:
            model_bytes_since_kv += packet.nbytes
            arbiter.enqueue(MODEL, next(refill))  # keep MODEL backlogged: the contention case


def test_kv_served_within_one_round_with_mtu_packets():
    arbiter = WeightedArbiter({MODEL: 99, KV: 1})
    for _ in range(1000):
        arbiter.enqueue(MODEL, 4096)
    arbiter.enqueue(KV, 4096, tag="kv0")
    first_kv = next(i for i, p in enumerate(_drain(arbiter, 200)) if p.traffic is KV)
    assert first_kv == 99


def test_idle_class_gives_full_bandwidth_and_fifo_order():
    arbiter = WeightedArbiter({MODEL: 99, KV: 1})
    for i in range(10):
        arbiter.enqueue(KV, 100 + i, tag=i)
    assert [p.tag for p in _drain(arbiter, 10)] == list(range(10))
    assert arbiter.next() is None
    assert arbiter.sent_bytes[KV] == sum(range(100, 110)) and arbiter.sent_bytes[MODEL] == 0


def test_arbiter_input_checks():
    with pytest.raises(ConfigError, match="weight"):
        WeightedArbiter({MODEL: 0})
    arbiter = WeightedArbiter({MODEL: 1}, max_packet_bytes=4096)
    with pytest.raises(PayloadTooLarge, match="4097"):
        arbiter.enqueue(MODEL, 4097)
    with pytest.raises(ConfigError, match="unknown"):
        arbiter.enqueue(KV, 10)
    assert len(arbiter) == 0 and arbiter.pending_bytes(MODEL) == 0
