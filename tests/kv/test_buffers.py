from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_dualpath.errors import AdmissionDeferred, BoundsError, CapacityError, ConfigError, InvalidKey
from ascend_dualpath.kv.buffers import HostBuffer, Registration, de_buffer, pe_buffer
from ascend_dualpath.kv.layout import KVLayout

ALIGN = 64


class RegisteredRegion(bytearray):
    """Stand-in for the emulator's registered shared-memory region: buffer protocol plus addr/size/lkey."""

    def __init__(self, size: int, addr: int, lkey: int) -> None:
        super().__init__(size)
        self.addr, self.size, self.lkey = addr, size, lkey


def assert_idle(buffer: HostBuffer) -> None:
    buffer.check_invariants()
    stats = buffer.stats()
    assert (stats.used_bytes, stats.live_leases, stats.live_requests, stats.waiting_allocations) == (0, 0, 0, 0)
    assert stats.largest_free_extent == buffer.capacity_bytes


class Boom(Exception):
    pass


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 120))
def test_accounting_returns_to_zero_after_random_sequences(seed, steps):
    rng = random.Random(seed)
    buffer = HostBuffer(ALIGN * 40, alignment=ALIGN, role=rng.choice(["pe_buffer", "de_buffer"]))
    live = []  # (lease, fill byte): each lease is filled with its own byte so overlaps would show

    def check_contents():
        for lease, fill in live:
            assert torch.all(lease.tensor == fill), f"lease {lease.lease_id} was overwritten"

    for step in range(steps):
        action = rng.random()
        if action < 0.45:
            size = rng.randint(1, ALIGN * 12)
            try:
                lease = buffer.allocate(f"r{rng.randint(0, 5)}", size, timeout_s=0)
            except AdmissionDeferred:
                assert buffer.stats().largest_free_extent < -(-size // ALIGN) * ALIGN
            else:
                assert lease.nbytes == size and lease.addr % ALIGN == 0
                fill = step % 251
                lease.tensor.fill_(fill)
                live.append((lease, fill))
        elif action < 0.75 and live:
            lease, _ = live.pop(rng.randrange(len(live)))
            lease.release()
        elif action < 0.85:
            request = f"r{rng.randint(0, 5)}"
            expected = {lease.lease_id for lease, _ in live if lease.request_id == request}
            assert {lease.lease_id for lease in buffer.leases_of(request)} == expected
            assert buffer.release_request(request) == len(expected)
            live = [(lease, fill) for lease, fill in live if lease.request_id != request]
        else:  # a request scope that fails half-way must release everything it took
            with pytest.raises(Boom), buffer.request(f"scoped{step}") as scope:
                for _ in range(rng.randint(0, 3)):
                    try:
                        scope.allocate(rng.randint(1, ALIGN * 4), timeout_s=0)
                    except AdmissionDeferred:
                        pass
                raise Boom
            assert buffer.leases_of(f"scoped{step}") == []
        buffer.check_invariants()
        check_contents()
        assert buffer.stats().used_bytes == sum(-(-lease.nbytes // ALIGN) * ALIGN for lease, _ in live)
    for lease, _ in live:
        lease.release()
    assert_idle(buffer)


def test_admission_deferred_after_the_deadline_and_nothing_taken():
    buffer = de_buffer(4 * ALIGN, alignment=ALIGN)
    held = buffer.allocate("a", 3 * ALIGN)
    before = buffer.stats()
    with pytest.raises(AdmissionDeferred, match=r"request 'b' waited 0.05 s for 128 bytes.*64 of 256 bytes free"):
        buffer.allocate("b", 2 * ALIGN, timeout_s=0.05)
    assert buffer.stats() == before and buffer.leases_of("b") == []
    held.release()
    assert_idle(buffer)


def test_waiting_allocation_is_admitted_when_space_is_released():
    buffer = pe_buffer(4 * ALIGN, alignment=ALIGN)
    held = buffer.allocate("a", 4 * ALIGN)
    admitted = []
    waiter = threading.Thread(target=lambda: admitted.append(buffer.allocate("b", 2 * ALIGN, timeout_s=30)))
    waiter.start()
    while buffer.stats().waiting_allocations == 0 and waiter.is_alive():
        waiter.join(0.01)
    held.release()
    waiter.join(30)
    assert not waiter.is_alive() and admitted[0].request_id == "b"
    admitted[0].release()
    assert_idle(buffer)


def test_admission_is_fifo_so_large_requests_are_not_starved():
    buffer = de_buffer(4 * ALIGN, alignment=ALIGN)
    held = buffer.allocate("a", 3 * ALIGN)
    big = []
    waiter = threading.Thread(target=lambda: big.append(buffer.allocate("big", 4 * ALIGN, timeout_s=30)))
    waiter.start()
    while buffer.stats().waiting_allocations == 0 and waiter.is_alive():
        waiter.join(0.01)
    # one aligned unit is free, but "big" is first in line: the small request must not overtake it
    with pytest.raises(AdmissionDeferred, match="1 allocation\\(s\\) ahead"):
        buffer.allocate("small", 1, timeout_s=0)
    held.release()
    waiter.join(30)
    big[0].release()
    assert_idle(buffer)


def test_request_larger_than_capacity_fails_at_once():
    buffer = de_buffer(4 * ALIGN, alignment=ALIGN)
    with pytest.raises(CapacityError, match=r"needs 257 bytes \(320 aligned\), capacity is 256"):
        buffer.allocate("r", 4 * ALIGN + 1)
    with pytest.raises(BoundsError, match="needs >= 1"):
        buffer.allocate("r", 0)
    assert_idle(buffer)


def test_double_release_and_foreign_release_are_rejected():
    buffer = de_buffer(4 * ALIGN, alignment=ALIGN)
    other = de_buffer(4 * ALIGN, alignment=ALIGN)
    with buffer.allocate("r", 10) as lease:
        with pytest.raises(InvalidKey, match="belongs to another buffer"):
            other.release(lease)
    with pytest.raises(InvalidKey, match=f"lease {lease.lease_id} of request 'r' .* already released"):
        lease.release()
    assert_idle(buffer)
    assert_idle(other)


def test_slices_are_bounds_checked_and_carry_their_offset():
    backing = RegisteredRegion(10 * ALIGN + 56, addr=0x7F00_0000_0008, lkey=0x1234)  # base 8 bytes past alignment
    buffer = HostBuffer(backing=backing, alignment=ALIGN)
    assert buffer.registration == Registration(0x7F00_0000_0008, 10 * ALIGN + 56, 0x1234)
    assert buffer.capacity_bytes == 10 * ALIGN  # 56 bytes skipped so leases are aligned in the region's addresses
    first = buffer.allocate("r", 3 * ALIGN)
    lease = buffer.allocate("r", 2 * ALIGN)
    assert lease.addr % ALIGN == 0 and lease.addr == backing.addr + lease.offset and lease.lkey == 0x1234
    part = lease.slice(16, 32)
    assert part.offset == lease.offset + 16 and part.addr == lease.addr + 16 and part.nbytes == 32
    part.tensor.copy_(torch.arange(32, dtype=torch.uint8))
    assert bytes(backing[part.offset : part.offset + 32]) == bytes(range(32))  # writes land in the backing
    assert bytes(backing[: lease.offset + 16]).count(0) == lease.offset + 16
    for offset, nbytes in [(0, 2 * ALIGN + 1), (2 * ALIGN, 1), (-1, 4), (4, -1)]:
        with pytest.raises(BoundsError, match="outside a region of 128 bytes"):
            lease.slice(offset, nbytes)
    assert lease.slice(2 * ALIGN, 0).nbytes == 0
    first.release()
    lease.release()
    assert_idle(buffer)


def test_default_and_numpy_backings_and_block_views():
    layout = KVLayout.gqa(2, 2, 32, torch.float16, block_tokens=8)  # 4096-byte Full Blocks
    buffer = de_buffer(3 * layout.full_block_bytes)
    assert isinstance(buffer.backing, torch.Tensor) and buffer.registration.lkey is None
    with buffer.allocate("r", 2 * layout.full_block_bytes) as lease:
        assert lease.addr % 4096 == 0
        blocks = lease.full_blocks(layout)
        assert blocks.shape == (2, 2, 8, layout.token_bytes)
        assert blocks.data_ptr() == buffer.bytes.data_ptr() + lease.offset
        with pytest.raises(BoundsError, match="3 Full Blocks need"):
            lease.full_blocks(layout, 3)
    array = np.zeros(8192, dtype=np.uint8)
    numpy_buffer = pe_buffer(backing=array, alignment=ALIGN)
    with numpy_buffer.allocate("r", 5) as lease:
        lease.tensor.fill_(9)
        assert array[lease.offset : lease.offset + 5].tolist() == [9] * 5
    assert_idle(numpy_buffer)


def test_configuration_errors_name_the_value():
    with pytest.raises(ConfigError, match="role must be one of"):
        HostBuffer(64, role="kv_buffer")
    with pytest.raises(ConfigError, match="alignment must be a power of two, got 48"):
        HostBuffer(64, alignment=48)
    with pytest.raises(ConfigError, match="capacity_bytes must be >= 1"):
        HostBuffer(0)
    with pytest.raises(ConfigError, match=r"capacity_bytes=100 must be in \[1, 64\]"):
        HostBuffer(100, backing=bytearray(64), alignment=1)
    with pytest.raises(ValueError, match="read-only"):
        HostBuffer(backing=bytes(64))
