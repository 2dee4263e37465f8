"""Memory regions: keys, bounds-checked lookup, permissions, lifetimes."""

import numpy as np
import pytest

from ascend_dualpath import errors


def test_keys_are_unique_and_lookup_returns_the_registration(C, two_devices):
    d0, d1 = two_devices
    regions = [d.alloc_region(4096, C.MemKind.DEVICE_GM, 7) for d in (d0, d1, d0)]
    keys = [r.lkey for r in regions] + [r.rkey for r in regions]
    assert len(set(keys)) == len(keys)
    fabric = d0.fabric
    info = fabric.lookup_rkey(regions[1].rkey)
    assert (info.addr, info.size, info.device_id, info.kind) == (regions[1].addr, 4096, 1, C.MemKind.DEVICE_GM)
    assert fabric.lookup_rkey(regions[1].lkey) is None, "an lkey must not be accepted as an rkey"


def test_bounds_checked_lookup(C, emu, two_devices):
    d0, _ = two_devices
    r = d0.alloc_region(4096, C.MemKind.HOST_DRAM, int(emu.Access.LOCAL_WRITE | emu.Access.REMOTE_READ))
    fabric = d0.fabric
    ok = fabric.check_remote(r.rkey, r.addr + 4000, 96, 4)
    assert ok == (0, "")
    syndrome, detail = fabric.check_remote(r.rkey, r.addr + 4000, 97, 4)
    assert syndrome == emu.Syndrome.REMOTE_OUT_OF_BOUNDS and f"{r.addr + 4000:#x}" in detail and "+4096" in detail
    syndrome, _ = fabric.check_remote(r.rkey, r.addr - 1, 1, 4)
    assert syndrome == emu.Syndrome.REMOTE_OUT_OF_BOUNDS
    syndrome, detail = fabric.check_remote(r.rkey, r.addr, 8, 2)
    assert syndrome == emu.Syndrome.REMOTE_PERMISSION and "REMOTE_WRITE" in detail
    syndrome, detail = fabric.check_local(r.lkey, d0.pd + 1000, r.addr, 8, False)
    assert syndrome == emu.Syndrome.BAD_LKEY and "protection domain" in detail
    with pytest.raises(errors.BoundsError, match=r"outside region"):
        r.check_range(r.addr + 1, 4096)


def test_close_kills_keys_but_keeps_views_valid(C, emu, two_devices):
    d0, _ = two_devices
    r = d0.alloc_region(4096, C.MemKind.DEVICE_GM, 7)
    view = np.frombuffer(r, dtype=np.uint8)
    view[:] = 7
    rkey, live = r.rkey, d0.fabric.num_live_regions
    r.close()
    assert not r.registered and d0.fabric.num_live_regions == live - 1
    assert d0.fabric.check_remote(rkey, r.addr, 1, 2)[0] == emu.Syndrome.BAD_RKEY
    assert view.sum() == 7 * 4096  # memory stays mapped while a view holds the region


def test_bad_region_arguments(C, two_devices):
    d0, _ = two_devices
    with pytest.raises(errors.ConfigError, match="region size must be > 0"):
        d0.alloc_region(0, C.MemKind.DEVICE_GM, 7)
    with pytest.raises(errors.ConfigError, match="unknown access flags 0x8"):
        d0.alloc_region(64, C.MemKind.DEVICE_GM, 8)


def test_fabric_names_are_exclusive(emu):
    fabric = emu.create_fabric()
    with pytest.raises(errors.ConfigError, match="cannot create fabric"):
        emu.create_fabric(fabric.name)
    with pytest.raises(errors.WaitTimeout, match="waiting for fabric 'nobody-made-this'"):
        emu.attach_fabric("nobody-made-this", timeout_s=0.05)


def test_closing_a_device_releases_everything_it_made(C, emu):
    import os

    with pytest.raises(RuntimeError, match="boom"):
        with emu.emulated_devices(2) as (d0, d1):
            name = d0.fabric.name
            kept = d0.alloc_region(4096, C.MemKind.DEVICE_GM, 7)  # still referenced after the block
            cq = d1.create_cq(8)
            d1.create_qp(cq, None, 8, 4)
            assert any(n.startswith(f"adp.{name}") for n in os.listdir("/dev/shm"))
            raise RuntimeError("boom")
    assert not kept.registered
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"adp.{name}")], "shared memory left behind"
    with pytest.raises(errors.AdpError, match="is closed"):
        d0.alloc_region(64, C.MemKind.DEVICE_GM, 7)
