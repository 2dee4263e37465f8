"""Emulated HCCL communicator: config resolution, windows, one-sided API, BatchWrite, notify flags."""

import numpy as np
import pytest

from ascend_dualpath import errors

NOT_SET = 0xFFFFFFFF
HCCL_ENV = ("HCCL_BUFFSIZE", "HCCL_RDMA_TC", "HCCL_RDMA_SL", "HCCL_OP_EXPANSION_MODE")
FP32, INT8 = 4, 0


@pytest.fixture(autouse=True)
def clean_hccl_env(monkeypatch):
    for name in HCCL_ENV:
        monkeypatch.delenv(name, raising=False)


def resolve(C, emu, product="A2", **fields):
    return C.resolve_comm_config(emu.comm_config(**fields), emu.product_profile(product))


def test_config_starts_not_set(C, emu):
    config = emu.comm_config()
    assert config.hcclBufferSize == config.hcclRdmaTrafficClass == config.hcclRdmaServiceLevel == NOT_SET
    assert C.CONFIG_NOT_SET == NOT_SET


def test_defaults_env_and_config_precedence(C, emu, monkeypatch):
    r = resolve(C, emu)
    assert (r["buffer_bytes"], r["traffic_class"], r["service_level"]) == (200 << 20, 132, 4)
    assert set(r["origin"].values()) == {"default"}
    monkeypatch.setenv("HCCL_BUFFSIZE", "64")
    monkeypatch.setenv("HCCL_RDMA_TC", "160")
    monkeypatch.setenv("HCCL_RDMA_SL", "3")
    r = resolve(C, emu)
    assert (r["buffer_bytes"], r["traffic_class"], r["service_level"]) == (64 << 20, 160, 3)
    assert r["origin"]["hcclRdmaTrafficClass"] == "env HCCL_RDMA_TC"
    # an explicit config field beats the environment
    r = resolve(C, emu, hcclBufferSize=8, hcclRdmaTrafficClass=224, hcclRdmaServiceLevel=7)
    assert (r["buffer_bytes"], r["traffic_class"], r["service_level"]) == (8 << 20, 224, 7)
    assert r["origin"]["hcclBufferSize"] == "config"


def test_expansion_mode_per_product(C, emu, monkeypatch):
    assert resolve(C, emu, "A2")["expansion_mode"] == 1  # A2 defaults to HOST
    assert resolve(C, emu, "A3")["expansion_mode"] == 2  # A3 defaults to AI_CPU
    monkeypatch.setenv("HCCL_OP_EXPANSION_MODE", "AIV")
    assert resolve(C, emu, "A2")["expansion_mode"] == 3
    monkeypatch.setenv("HCCL_OP_EXPANSION_MODE", "HOST")  # not an A3 value: falls back to A3's default
    assert resolve(C, emu, "A3")["expansion_mode"] == 2
    assert resolve(C, emu, "A3", hcclOpExpansionMode=3)["expansion_mode"] == 3


@pytest.mark.parametrize(
    "fields, env, message",
    [
        (
            {"hcclRdmaTrafficClass": 130},
            {},
            "traffic class must be a multiple of 4 in \\[0, 255\\], got 130 \\(config\\)",
        ),
        ({}, {"HCCL_RDMA_TC": "256"}, "got 256 \\(env HCCL_RDMA_TC\\)"),
        ({"hcclRdmaServiceLevel": 8}, {}, "service level must be in \\[0, 7\\], got 8"),
        ({}, {"HCCL_BUFFSIZE": "0"}, "must be >= 1 MB, got 0"),
        ({}, {"HCCL_BUFFSIZE": "lots"}, "HCCL_BUFFSIZE='lots' is not a non-negative integer"),
        (
            {"hcclOpExpansionMode": 4},
            {},
            "hcclOpExpansionMode must be 0 \\(default\\), 1 \\(host\\), 2 \\(aicpu\\) or 3 \\(aiv\\), got 4",
        ),
    ],
)
def test_out_of_range_config_is_rejected(C, emu, monkeypatch, fields, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(errors.ConfigError, match=message):
        resolve(C, emu, **fields)


@pytest.fixture
def pair(C, emu):
    """Two single-process ranks on two devices, connected to each other, 4 MB windows."""
    with emu.emulated_devices(2) as devices:
        comms = [C.HcclComm(d, rank, 2, emu.comm_config(hcclBufferSize=4)) for rank, d in enumerate(devices)]
        infos = [C.RankInfo.deserialize(c.local_info().serialize()) for c in comms]
        for c in comms:
            c.connect(infos)
        yield comms
        for c in comms:
            c.close()


def u8(region):
    return np.frombuffer(region, dtype=np.uint8)


def test_windows_and_capability(pair, emu):
    c0, c1 = pair
    assert c0.windows_in.size == c0.windows_out.size == 4 << 20
    assert c0.resolved["origin"]["hcclBufferSize"] == "config"
    assert c0.capability_bitmap & 0x04 and c0.aiv_dataplane
    assert c0.aiv_qp(1).dest_qpn == c1.local_info().aiv_qpns[0]
    assert c0.aiv_qp(1).sl == 4


def test_batch_put_and_get_move_exact_bytes(C, pair):
    c0, c1 = pair
    out0, in1 = u8(c0.windows_out), u8(c1.windows_in)
    out0[:8192] = np.random.default_rng(1).integers(0, 256, 8192, dtype=np.uint8)
    in1[:] = 0xA5
    vtime = c0.batch_put(
        1,
        [
            C.OneSideDesc(c0.windows_out.addr, c1.windows_in.addr + 64, 1024, FP32),
            C.OneSideDesc(c0.windows_out.addr + 4096, c1.windows_in.addr + 8192, 100, INT8),
        ],
        10.0,
    )
    assert vtime > 0
    expected = np.full(in1.shape, 0xA5, np.uint8)
    expected[64 : 64 + 4096] = out0[:4096]
    expected[8192:8292] = out0[4096:4196]
    assert np.array_equal(in1, expected)
    in0 = u8(c0.windows_in)
    c0.batch_get(1, [C.OneSideDesc(c0.windows_in.addr, c1.windows_in.addr + 64, 4096, INT8)], 10.0)
    assert np.array_equal(in0[:4096], out0[:4096])


@pytest.mark.parametrize(
    "bad, error, message",
    [
        ("local unregistered", errors.NotRegistered, "local address .* is not in the communicator's windows"),
        ("remote past window", errors.BoundsError, "remote range .* runs past its registered memory"),
        ("remote unknown", errors.NotRegistered, "remote address .* is in no memory rank 1 registered"),
        ("zero count", errors.ConfigError, "count must be > 0"),
        ("bad dtype", errors.ConfigError, "unknown HcclDataType 99"),
    ],
)
def test_bad_descriptor_moves_nothing(C, emu, pair, bad, error, message):
    c0, c1 = pair
    in1 = u8(c1.windows_in)
    in1[:] = 0xA5
    stray = c0.device.alloc_region(4096, C.MemKind.DEVICE_GM, 7)  # registered on the fabric, not with the comm
    good = C.OneSideDesc(c0.windows_out.addr, c1.windows_in.addr, 16, INT8)
    bad_desc = {
        "local unregistered": C.OneSideDesc(stray.addr, c1.windows_in.addr, 16, INT8),
        "remote past window": C.OneSideDesc(c0.windows_out.addr, c1.windows_in.addr + (4 << 20) - 8, 16, INT8),
        "remote unknown": C.OneSideDesc(c0.windows_out.addr, 0x10, 16, INT8),
        "zero count": C.OneSideDesc(c0.windows_out.addr, c1.windows_in.addr, 0, INT8),
        "bad dtype": C.OneSideDesc(c0.windows_out.addr, c1.windows_in.addr, 16, 99),
    }[bad]
    with pytest.raises(error, match=message):
        c0.batch_put(1, [good, bad_desc], 10.0)
    assert (in1 == 0xA5).all(), "a rejected batch must move nothing, not even its valid descriptors"
    c0.register_local(stray)  # HcclRegisterMem makes the same memory usable
    c0.batch_put(1, [C.OneSideDesc(stray.addr, c1.windows_in.addr, 16, INT8)], 10.0)


def items_array(items):
    dtype = np.dtype([("local", "<u8"), ("remote", "<u8"), ("count", "<u8"), ("dtype", "<u4"), ("rank", "<u4")])
    assert dtype.itemsize == 32
    return np.array(items, dtype=dtype).view(np.uint8)


def test_batch_write_from_core_zero(C, emu, pair):
    c0, c1 = pair
    out0, in1 = u8(c0.windows_out), u8(c1.windows_in)
    out0[:4096] = np.arange(4096, dtype=np.uint16).astype(np.uint8)
    in1[:] = 0
    # the items live in device memory (the workspace), as the kernels write them
    work = u8(c0.windows_out)
    base = 1 << 20
    items = items_array(
        [(c0.windows_out.addr + 1024 * i, c1.windows_in.addr + 2048 * i, 256, FP32, 1) for i in range(4)]
    )
    work[base : base + items.size] = items
    issues = c0.batch_write_issues
    handle = c0.batch_write(c0.windows_out.addr + base, 4, 0)
    vtime = c0.batch_write_wait(handle, 10.0)
    for i in range(4):
        assert np.array_equal(in1[2048 * i : 2048 * i + 1024], out0[1024 * i : 1024 * i + 1024])
    assert c0.batch_write_issues == issues + 1
    cost = c0.device.nic.cost
    assert vtime >= cost.aicpu_issue_ns + 4 * cost.aicpu_wqe_ns  # the fixed per-issue cost is paid


def test_batch_write_rules(C, pair):
    c0, c1 = pair
    base = 1 << 20
    with pytest.raises(errors.ProtocolError, match="vector core 3; only core 0 may write the hcclMsgArea"):
        c0.batch_write(c0.windows_out.addr + base, 1, 3)
    stray = c0.device.alloc_region(4096, C.MemKind.DEVICE_GM, 7)
    with pytest.raises(errors.NotRegistered, match="BatchWrite item array"):
        c0.batch_write(stray.addr, 1, 0)
    in1 = u8(c1.windows_in)
    in1[:] = 0xA5
    work = u8(c0.windows_out)
    items = items_array(
        [(c0.windows_out.addr, c1.windows_in.addr, 8, INT8, 1), (c0.windows_out.addr, c1.windows_in.addr, 8, INT8, 7)]
    )  # rank 7 does not exist
    work[base : base + items.size] = items
    handle = c0.batch_write(c0.windows_out.addr + base, 2, 0)
    with pytest.raises(errors.ConfigError, match="peer rank 7 is outside world size 2"):
        c0.batch_write_wait(handle, 10.0)
    assert (in1 == 0xA5).all(), "the server rejects the whole issue"
    with pytest.raises(errors.InvalidKey, match="unknown or already waited"):
        c0.batch_write_wait(handle, 1.0)


def test_notify_magic_never_takes_a_stale_flag(pair):
    c0, c1 = pair
    first, second = c0.next_magic(), c0.next_magic()
    assert first != second and first and second
    c0.notify_record(1, 5, first, 10.0)
    c1.notify_wait(5, first, 1.0)
    with pytest.raises(errors.WaitTimeout, match=r"notify slot 5 of rank 1 to hold magic .*stale flag"):
        c1.notify_wait(5, second, 0.05)
    c0.notify_record(1, 5, second, 10.0)
    c1.notify_wait(5, second, 1.0)
    with pytest.raises(errors.WaitTimeout, match="never written"):
        c1.notify_wait(6, second, 0.01)
    with pytest.raises(errors.BoundsError, match="notify slot 1024 is outside"):
        c0.notify_record(1, 1024, first, 1.0)


def test_capability_bit_can_be_cleared(C, emu):
    with emu.emulated_devices(1, capability_bitmap=0) as (d,):
        comm = emu.init_comm(d, config=emu.comm_config(hcclBufferSize=1))
        assert not comm.aiv_dataplane and comm.world_size == 1
        comm.close()
