"""CUDA analogues: the tile table, the copy kernels (compiled for sm_90, and run by Triton's CPU interpreter),
and the planned / graphed device-initiated copy with its ready flag (GPU only)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ascend_dualpath import errors
from ascend_dualpath.transport import cuda
from ascend_dualpath.transport.cuda import (
    LARGE_CONFIG,
    SMALL_CONFIG,
    TILE_BYTES,
    KernelConfig,
    choose_config,
    element_bytes,
    grid_size,
    tile_table,
)
from tests.conftest import cuda_torch


@given(k=st.integers(1, 20), extra=st.sampled_from([0, 16]), tile_kib=st.sampled_from([1, 4, 64]))
def test_tiles_are_exact_at_k_tiles_and_one_more_element(k, extra, tile_kib):
    tile = tile_kib * 1024
    n = k * tile + extra
    table = tile_table([0x1000], [0x900000], [n], 16, tile)
    assert table.shape == (k + (extra > 0), 3)
    assert (table[:, 2] * 16).sum() == n
    assert (table[:, 1] - table[:, 0] == 0x900000 - 0x1000).all()
    assert (np.diff(table[:, 0]) == tile).all()


@given(sizes=st.lists(st.integers(1, 300000), min_size=1, max_size=30))
def test_tiles_cover_every_byte_once(sizes):
    src = np.cumsum([0] + sizes[:-1]) + 7
    dst = src * 3
    table = tile_table(src, dst, sizes, 1, 4096)
    covered = np.zeros(sum(sizes) + 7, np.int64)
    for s, _, n in table:
        covered[s : s + n] += 1
    assert (covered[7:] == 1).all() and (covered[:7] == 0).all()


def test_element_width_and_alignment_errors():
    assert element_bytes([0x100], [0x200], [4096]) == 16
    assert element_bytes([0x104], [0x200], [4096]) == 4
    assert element_bytes([0x101], [0x200], [4096]) == 1
    with pytest.raises(errors.AlignmentError, match="segment 1 .* not 16-byte aligned"):
        tile_table([0, 8], [0, 0], [16, 16], 16)
    with pytest.raises(errors.EmptyTransfer, match="segment 0 has no bytes"):
        tile_table([0], [0], [0], 1)


def test_large_requests_get_the_bandwidth_configuration_from_4_3_mb_on_an_h200():
    sms = 132
    threshold = 2 * sms * 16 * 1024
    assert choose_config(61 * 42 * 1024, sms) == SMALL_CONFIG
    assert choose_config(threshold - 1, sms) == SMALL_CONFIG
    assert choose_config(threshold, sms) == LARGE_CONFIG == choose_config(64 << 20, sms)
    assert LARGE_CONFIG.streaming and not SMALL_CONFIG.streaming


@given(
    sizes=st.lists(st.integers(1, 50000), min_size=1, max_size=12),
    gaps=st.lists(st.integers(0, 9000), min_size=12, max_size=12),
    chunk_kib=st.sampled_from([4, 8, 64]),
)
def test_staging_chunks_split_segments_at_chunk_edges_and_cover_every_byte_once(sizes, gaps, chunk_kib):
    chunk = chunk_kib * 1024
    offsets = np.cumsum([g + n for g, n in zip(gaps, [0] + sizes[:-1], strict=False)])
    dst = 0x7000000 + 3 * offsets
    pieces = cuda.staging_pieces(offsets, dst, sizes, chunk)
    assert len(pieces) == -(-int(offsets[-1] + sizes[-1]) // chunk) and pieces[-1][0].size > 0
    landed = {}
    for k, (chunk_off, d, n) in enumerate(pieces):
        assert ((chunk_off >= 0) & (chunk_off + n <= chunk) & (n > 0)).all()
        for o, a, m in zip(chunk_off, d, n, strict=True):
            for i in range(m):
                assert a + i not in landed
                landed[a + i] = k * chunk + o + i  # the host byte that lands at destination a + i
    expected = {int(d0 + i): int(o + i) for o, d0, n in zip(offsets, dst, sizes, strict=True) for i in range(n)}
    assert landed == expected
    lengths = cuda.staging_chunk_lengths(int(offsets[-1] + sizes[-1]), chunk)
    assert len(lengths) == len(pieces) and sum(lengths) == offsets[-1] + sizes[-1] and max(lengths) <= chunk
    assert cuda.staging_chunk_lengths(3 * chunk, chunk) == [chunk] * 3
    assert cuda.staging_chunk_lengths(5, chunk) == [5]  # a request shorter than a chunk stages only itself


@given(tiles=st.integers(1, 100000), max_programs=st.integers(1, 4096))
def test_grid_gives_every_program_the_same_number_of_rounds(tiles, max_programs):
    programs = grid_size(tiles, max_programs)
    rounds = -(-tiles // max_programs)
    assert 1 <= programs <= min(tiles, max_programs)
    assert -(-tiles // programs) == rounds  # no more rounds than the widest grid needs
    assert grid_size(4096, 1056) == 1024


def test_launch_site_checks_its_mode_and_stays_on_the_jit_under_the_interpreter(monkeypatch):
    from ascend_dualpath import _env
    from ascend_dualpath._triton_launch import LaunchSite, default_mode

    with pytest.raises(errors.ConfigError, match="launch mode 'fast' is not one of direct, runner, jit"):
        LaunchSite(object(), 1, {}, "fast")
    monkeypatch.delenv("ADP_DIRECT_LAUNCH", raising=False)
    monkeypatch.delenv("ADP_MOE_DIRECT_LAUNCH", raising=False)
    assert default_mode() == "direct" and _env.moe_direct_launch()
    monkeypatch.setenv("ADP_DIRECT_LAUNCH", "0")
    assert default_mode() == "jit" and not _env.moe_direct_launch()
    monkeypatch.setenv("ADP_MOE_DIRECT_LAUNCH", "1")  # the narrower switch wins
    assert _env.moe_direct_launch() and not _env.direct_launch()
    monkeypatch.setenv("ADP_DIRECT_LAUNCH", "yes")
    with pytest.raises(ValueError, match="ADP_DIRECT_LAUNCH must be 0 or 1, got 'yes'"):
        default_mode()

    launched = []

    class FakeKernel:  # what the interpreter's kernel[grid] returns: no compiled binary
        arg_names = ["x"]

        def __getitem__(self, grid):
            return lambda *args, **constants: launched.append((grid, args, constants))

    monkeypatch.setenv("ADP_DIRECT_LAUNCH", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    site = LaunchSite(FakeKernel(), 3, {"N": 2})
    site(5)
    site(6)
    assert not site.bound and launched == [((3,), (5,), {"N": 2}), ((3,), (6,), {"N": 2})]


def test_memcpy_batch_attributes_layout_and_clean_absence():
    import ctypes

    from ascend_dualpath.transport import cudart

    assert ctypes.sizeof(cudart.MemcpyAttributes) == 24  # enum + two {type, id} locations + unsigned flags
    assert cudart.MemcpyAttributes.flags.offset == 20
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        ok, why = cudart.batch_available()
        assert not ok and "needs a CUDA GPU" in why
        with pytest.raises(errors.BackendUnavailable, match="needs a CUDA GPU"):
            cudart.MemcpyBatch([0x1000], [0x2000], [16])


def test_ready_flag_must_be_an_int64_cuda_tensor():
    torch = pytest.importorskip("torch")
    from ascend_dualpath.transport.cuda import DeviceCopier

    with pytest.raises(errors.ConfigError, match="int64 CUDA tensor, got torch.int32 on cpu"):
        DeviceCopier("cuda:0", torch.zeros(1, dtype=torch.int32))


class _FakeDriver:
    """``cuPointerGetAttributes`` over a fixed list of allocations (start, size, memory type, device ordinal)."""

    def __init__(self, allocations):
        self.allocations = allocations
        self.queries = []

    def cuPointerGetAttributes(self, count, kinds, data, addr):
        import ctypes

        self.queries.append(addr)
        for start, size, mem_type, ordinal in self.allocations:
            if start <= addr < start + size:
                values = {
                    2: (ctypes.c_uint, mem_type),
                    9: (ctypes.c_int, ordinal),
                    11: (ctypes.c_uint64, start),
                    12: (ctypes.c_uint64, size),
                }
                for i in range(count):
                    kind, value = values[kinds[i]]
                    ctypes.cast(data[i], ctypes.POINTER(kind))[0] = value
                return 0
        return 1  # CUDA_ERROR_INVALID_VALUE: not a pointer the driver knows


def test_memory_devices_classify_each_range_with_one_query_per_allocation(monkeypatch):
    """Without a GPU: ranges in device memory report their GPU, host memory and unknown addresses report
    NOT_DEVICE_MEMORY, a range whose last byte lies in another allocation reports both, and addresses inside an
    allocation already found are not queried again."""
    from ascend_dualpath.transport import cudart

    device_0 = (0x10_0000, 0x10_0000, 2, 0)
    device_1 = (0x20_0000, 0x1000, 2, 1)
    pinned_host = (0x30_0000, 0x1000, 1, 0)
    fake = _FakeDriver([device_0, device_1, pinned_host])
    monkeypatch.setattr(cudart, "_driver", lambda: fake)
    local = [0x10_0000 + i * 4096 for i in range(61)]
    assert cudart.memory_devices(local, [4096] * 61) == {0}
    assert fake.queries == [0x10_0000]
    assert cudart.memory_devices(local + [0x20_0000], [4096] * 62) == {0, 1}
    assert cudart.memory_devices([0x30_0000], [16]) == {cudart.NOT_DEVICE_MEMORY}
    assert cudart.memory_devices([0x90_0000], [16]) == {cudart.NOT_DEVICE_MEMORY}
    # 16 bytes from 8 before an allocation's end: into the next allocation, or into memory no one allocated
    assert cudart.memory_devices([0x20_0000 - 8], [16]) == {0, 1}
    assert cudart.memory_devices([0x20_1000 - 8], [16]) == {1, cudart.NOT_DEVICE_MEMORY}


def test_stream_write_parameters_have_the_drivers_layout():
    """``CUstreamBatchMemOpParams`` (cuda.h): a 48-byte union whose write is operation, address, value, flags and
    alias at offsets 0, 8, 16, 24, 32; a wrong layout would write elsewhere in device memory."""
    import ctypes

    from ascend_dualpath.transport.cudart import _BatchMemOp, _WriteValue64

    assert ctypes.sizeof(_BatchMemOp) == 48
    offsets = [getattr(_WriteValue64, name).offset for name in ("operation", "address", "value64", "flags", "alias")]
    assert offsets == [0, 8, 16, 24, 32]


_PTX_SIGNATURE = {
    "table": "*i64",
    "n_tiles": "i32",
    "state": "*i64",
    "flag": "*i64",
    "flag_value": "i64",
    "host_flag": "i64",
    "word_value": "i64",
    **{name: "constexpr" for name in ("TILE", "ELEM_BYTES", "FROM_EPOCH", "SINGLE", "ARRIVE_SYS", "STREAMING")},
}


def _ptx(tile_bytes, **switches):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from ascend_dualpath.transport.cuda_kernels import copy_tiles

    constexprs = {
        "TILE": tile_bytes // 4,
        "ELEM_BYTES": 16,
        "FROM_EPOCH": False,
        "SINGLE": False,
        "ARRIVE_SYS": True,
        "STREAMING": False,
        **switches,
    }
    source = triton.compiler.ASTSource(fn=copy_tiles, signature=_PTX_SIGNATURE, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]


def test_a_host_word_dropped_before_its_last_write_landed_keeps_its_memory_until_it_has():
    import gc
    import weakref

    torch = pytest.importorskip("torch")
    cuda.release_parked()
    before = len(cuda._PARKED)
    word = cuda.HostWord.__new__(cuda.HostWord)  # its memory as the constructor leaves it, without pinning
    word.tensor = torch.zeros(1, dtype=torch.int64)
    word._view, word.enqueued = word.tensor.numpy(), 7
    memory = weakref.ref(word.tensor)
    del word
    gc.collect()
    assert memory() is not None and cuda.release_parked() == before + 1  # the write of 7 may still come
    cuda._PARKED[-1][0][0] = 6
    assert cuda.release_parked() == before + 1
    cuda._PARKED[-1][0][0] = 7  # it landed
    assert cuda.release_parked() == before
    gc.collect()
    assert memory() is None
    landed = cuda.HostWord.__new__(cuda.HostWord)
    landed.tensor = torch.full((1,), 3, dtype=torch.int64)
    landed._view, landed.enqueued = landed.tensor.numpy(), 3
    del landed
    assert len(cuda._PARKED) == before  # nothing pending: freed at once


@pytest.mark.parametrize("tile_bytes", [TILE_BYTES, 4 * TILE_BYTES])
@pytest.mark.parametrize("from_epoch", [False, True])
def test_copy_kernel_compiles_to_vectorized_ptx_with_a_system_scope_release_flag(monkeypatch, tile_bytes, from_epoch):
    """Without a GPU: Triton compiles the kernel for sm_90; copies are 16-byte vectors (tile / 2 KiB of them
    per thread at 4 warps), nothing spills, and the flag, then the host word, is a system-scope release after the
    arrival count."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # silences Triton 3.9's notice; the kernel has no floats
    ptx = _ptx(tile_bytes, FROM_EPOCH=from_epoch)
    vectors_per_thread = tile_bytes // (4 * 32 * 16)
    assert ptx.count("ld.global.v4") == vectors_per_thread and ptx.count("st.global.v4") == vectors_per_thread
    assert ".local" not in ptx
    arrival = ptx.index("atom.global.sys.acq_rel.add")
    flag = ptx.index("atom.global.sys.release.exch.b64")
    assert ptx.index("bar.sync") < arrival < flag < ptx.index("atom.global.sys.release.exch.b64", flag + 1)
    assert ("atom.global.gpu.relaxed.add" in ptx) == from_epoch


def test_kernel_switches_change_exactly_their_instructions(monkeypatch):
    """GPU-scope arrival, a single program (no arrival count, still a barrier before the release), streaming
    cache hints."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    gpu = _ptx(TILE_BYTES, ARRIVE_SYS=False)
    assert "atom.global.gpu.acq_rel.add" in gpu and "atom.global.sys.acq_rel" not in gpu
    assert "atom.global.sys.release.exch.b64" in gpu
    single = _ptx(TILE_BYTES, SINGLE=True)
    assert "acq_rel" not in single and single.index("bar.sync") < single.index("atom.global.sys.release.exch.b64")
    streaming = _ptx(4 * TILE_BYTES, STREAMING=True)
    assert streaming.count("ld.global.cg.v4") == 8 and streaming.count("st.global.cs.v4") == 8
    plain = _ptx(4 * TILE_BYTES)
    assert ".cg" not in plain and ".cs" not in plain


_INTERPRETED = textwrap.dedent(
    """
    import numpy as np, torch
    from ascend_dualpath.transport import cuda, cuda_kernels as K

    rng = np.random.default_rng(5)
    for trial in range(8):
        unit = (16, 4, 1, 8)[trial % 4]
        sizes = [int(unit * rng.integers(1, 700)) for _ in range(int(rng.integers(1, 6)))]
        gaps = [int(unit * rng.integers(0, 4)) for _ in sizes]
        src_offs = np.cumsum([0] + [s + g for s, g in zip(sizes, gaps)])[:-1] + unit
        dst_offs = np.cumsum([0] + sizes[:-1]) + 2 * unit
        src = torch.randint(0, 256, (int(src_offs[-1]) + sizes[-1] + 64,), dtype=torch.uint8)
        dst = torch.full((int(dst_offs[-1]) + sizes[-1] + 64,), 0xA5, dtype=torch.uint8)
        width = cuda.element_bytes(src.data_ptr() + src_offs, dst.data_ptr() + dst_offs, sizes)
        tile = 1024
        table = torch.from_numpy(cuda.tile_table(src.data_ptr() + src_offs, dst.data_ptr() + dst_offs, sizes,
                                                 width, tile))
        state = torch.tensor([0, 40, 0], dtype=torch.int64)  # arrivals, epoch, the caller's value cell
        flag = torch.zeros(1, dtype=torch.int64)
        word = torch.zeros(1, dtype=torch.int64)  # the host word; the last launch passes none (address 0)
        programs = int(rng.integers(1, len(table) + 2))
        switches = dict(ELEM_BYTES=width, TILE=tile if width == 1 else tile // 4, SINGLE=programs == 1,
                        ARRIVE_SYS=bool(trial % 2), STREAMING=trial % 3 == 0)
        # (from_epoch, the cell's value, the flag and the host word expected): an eager launch publishes its two
        # arguments, a replay the next epoch in both, or the cell's caller value in the flag
        launches = ((False, 0, 77, 5), (True, 0, 41, 41), (True, 9000 + trial, 9000 + trial, 42), (False, 0, 80, 8))
        for launch, (from_epoch, cell, want_flag, want_word) in enumerate(launches):
            dst[:] = 0xA5
            state[2] = cell
            K.copy_tiles[(programs,)](table, len(table), state, flag, 77 + launch,
                                      word.data_ptr() if launch < 3 else 0, 5 + launch, FROM_EPOCH=from_epoch,
                                      **switches)
            expected = torch.full_like(dst, 0xA5)
            for s, d, n in zip(src_offs, dst_offs, sizes):
                expected[d : d + n] = src[s : s + n]
            assert torch.equal(dst, expected), (trial, launch)
            assert int(flag) == want_flag, (trial, launch, int(flag))
            assert int(word) == (want_word if launch < 3 else 42), (trial, launch, int(word))
            assert int(state[0]) == 0 and int(state[1]) == 40 + min(launch, 2), (trial, launch)
    print("interpreted ok")
    """
)


def test_copy_kernel_under_the_triton_interpreter_is_exact_and_publishes_the_flag():
    """On the CPU (TRITON_INTERPRET=1): the kernel copies scattered segments exactly at every element width and
    switch combination (single program, arrival scope, streaming hints), leaves poisoned gaps alone,
    publishes the explicit values, the next epoch or the caller's value in the plan's cell, and resets the arrival counter."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.getcwd())
    result = subprocess.run([sys.executable, "-c", _INTERPRETED], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "interpreted ok" in result.stdout


# ---- on a GPU ----------------------------------------------------------------------------------------


def _settled(torch, *tensors):
    """Wait for the GPUs holding ``tensors``: a copy kernel on one GPU's stream is not ordered after their fills."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.synchronize(device)


def _poison(torch, dst):
    """Fill ``dst`` with 0xA5 and wait for it on ``dst``'s own GPU: the copy kernels run on the source GPU's stream,
    which is not ordered after work on another GPU's stream."""
    dst.fill_(0xA5)
    torch.cuda.synchronize(dst.device)


def _segments(torch, count, size, src_dev, dst_dev):
    src = torch.randint(0, 256, (count * size + 64,), dtype=torch.uint8, device=src_dev)
    dst = torch.full((count * size + 64,), 0xA5, dtype=torch.uint8, device=dst_dev)
    _settled(torch, src, dst)
    s_addrs = [src.data_ptr() + i * size for i in range(count)]
    d_addrs = [dst.data_ptr() + 32 + i * size for i in range(count)]
    return src, dst, s_addrs, d_addrs


_KEEP = []  # the source behind the last _four_page_copier's addresses


def _four_page_copier(torch):
    """A copier on cuda:0 with its flag there, the poisoned destination, and the addresses of four 4 KiB source and
    destination pages."""
    from ascend_dualpath.transport.cuda import DeviceCopier

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    src, dst, s_addrs, d_addrs = _segments(torch, 4, 4096, dev, dev)
    _KEEP[:] = [src]
    return DeviceCopier(dev, torch.zeros(1, dtype=torch.int64, device=dev)), dst, s_addrs, d_addrs


def _assert_landed(torch, src, dst, count, size):
    n = count * size
    assert torch.equal(dst[32 : 32 + n], src[:n].to(dst.device))
    assert (dst[:32] == 0xA5).all() and (dst[32 + n :] == 0xA5).all()


@pytest.mark.cuda
@pytest.mark.parametrize("count,size", [(1, 1), (61, 42 * 1024), (300, 4096 + 16), (7, 3 * 65536 + 1), (2, 9 << 20)])
def test_device_initiated_copy_is_exact_and_flags_ready(count, size):
    torch = cuda_torch()
    from ascend_dualpath.transport.cuda import DeviceCopier

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    src, dst, s_addrs, d_addrs = _segments(torch, count, size, dev, dev)
    flag = torch.zeros(1, dtype=torch.int64, device=dev)
    copier = DeviceCopier(dev, flag)
    plan = copier.copy(s_addrs, d_addrs, [size] * count, 77)
    torch.cuda.synchronize()
    assert int(flag.item()) == 77
    _assert_landed(torch, src, dst, count, size)
    for value in (78, 1 << 40):  # the cached plan again, through the compiled launcher
        _poison(torch, dst)
        copier.run(plan, value)
        torch.cuda.synchronize()
        assert int(flag.item()) == value
        _assert_landed(torch, src, dst, count, size)


@pytest.mark.cuda
def test_arrival_scope_follows_the_destinations_and_a_local_copy_with_gpu_scope_is_exact_for_a_peer_flag():
    """Arrivals are GPU-scope only when every destination is the launching GPU's memory (a peer's or pinned host
    memory needs system scope); such a plan is exact, with the flag on a peer polled from there."""
    torch = cuda_torch()
    from ascend_dualpath.transport.cuda import DeviceCopier, enable_peer_access

    src_dev = torch.device("cuda:0")
    torch.cuda.set_device(src_dev)
    count, size = 300, 4096 + 16
    src, dst, s_addrs, d_addrs = _segments(torch, count, size, src_dev, src_dev)
    flag_dev = torch.device("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    flag = torch.zeros(1, dtype=torch.int64, device=flag_dev)
    copier = DeviceCopier("cuda", flag)  # no index: the current GPU
    assert copier.device == src_dev
    assert not copier.arrivals_need_sys(d_addrs, [size] * count)
    host = torch.empty(size, dtype=torch.uint8).pin_memory()
    assert copier.arrivals_need_sys(d_addrs + [host.data_ptr()], [size] * (count + 1))
    if flag_dev != src_dev:
        enable_peer_access(src_dev, flag_dev)
        peer = torch.empty(size, dtype=torch.uint8, device=flag_dev)
        assert copier.arrivals_need_sys([peer.data_ptr()], [size])
    plan = copier.plan(s_addrs, d_addrs, [size] * count, KernelConfig(TILE_BYTES, 1, 4, False))
    assert plan.constexprs["ARRIVE_SYS"] is False and plan.programs > 1
    for value in (21, 22):
        _poison(torch, dst)
        copier.run(plan, value)
        deadline = time.monotonic() + 10
        while int(flag.item()) != value:  # polled on the flag's GPU, as a consumer there would
            assert time.monotonic() < deadline, f"flag still {int(flag.item())}, waiting for {value}"
        _assert_landed(torch, src, dst, count, size)


@pytest.mark.cuda
def test_graph_replays_copy_again_and_publish_successive_values_to_a_peer_flag():
    torch = cuda_torch()
    from ascend_dualpath.transport.cuda import DeviceCopier

    src_dev = torch.device("cuda:0")
    dst_dev = torch.device("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    torch.cuda.set_device(src_dev)
    count, size = 61, 42 * 1024
    src, dst, s_addrs, d_addrs = _segments(torch, count, size, src_dev, dst_dev)
    flag = torch.zeros(1, dtype=torch.int64, device=dst_dev)
    copier = DeviceCopier(src_dev, flag)
    graphed = copier.capture(copier.plan(s_addrs, d_addrs, [size] * count), 1000)
    torch.cuda.synchronize()
    assert int(flag.item()) == 0 and (dst == 0xA5).all()  # capturing runs nothing
    for expected in (1000, 1001, 1002):
        _poison(torch, dst)
        src.random_(0, 256)
        torch.cuda.synchronize()
        assert graphed.replay() == expected
        torch.cuda.synchronize(src_dev)
        torch.cuda.synchronize(dst_dev)
        assert int(flag.item()) == expected
        _assert_landed(torch, src, dst, count, size)


@pytest.mark.cuda
def test_bad_flag_value_is_refused_before_anything_moves():
    torch = cuda_torch()
    from ascend_dualpath.transport.cuda import FLAG_MAX

    copier, dst, s_addrs, d_addrs = _four_page_copier(torch)
    plan = copier.plan(s_addrs, d_addrs, [4096] * 4)
    for bad in (0, -3, FLAG_MAX + 1):
        with pytest.raises(errors.ConfigError, match=f"flag_value {bad} is outside"):
            copier.run(plan, bad)
        with pytest.raises(errors.ConfigError, match=f"word_value {bad} is outside"):
            copier.run(plan, 5, bad)
    with pytest.raises(errors.ConfigError, match="tile_bytes 3000 is not a power of two"):
        copier.plan(s_addrs, d_addrs, [4096] * 4, KernelConfig(3000, 8, 4, False))
    with pytest.raises(errors.ConfigError, match="num_warps 3 is not one of"):
        copier.plan(s_addrs, d_addrs, [4096] * 4, KernelConfig(TILE_BYTES, 8, 3, False))
    with pytest.raises(errors.ConfigError, match="programs_per_sm must be >= 1, got 0"):
        copier.plan(s_addrs, d_addrs, [4096] * 4, KernelConfig(TILE_BYTES, 0, 4, False))
    torch.cuda.synchronize()
    assert (dst == 0xA5).all() and int(copier.flag.item()) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["direct", "runner", "jit"])
def test_every_launch_mode_copies_exactly_and_binds_as_documented(mode):
    torch = cuda_torch()
    from ascend_dualpath._triton_launch import LaunchSite
    from ascend_dualpath.transport.cuda import DeviceCopier

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    count, size = 61, 42 * 1024
    src, dst, s_addrs, d_addrs = _segments(torch, count, size, dev, dev)
    flag = torch.zeros(1, dtype=torch.int64, device=dev)
    copier = DeviceCopier(dev, flag)
    plan = copier.plan(s_addrs, d_addrs, [size] * count)
    plan.site = LaunchSite(plan.site.kernel, plan.programs, plan.site.constants, mode)
    for value in (5, 6, 7):
        _poison(torch, dst)
        src.random_(0, 256)
        copier.run(plan, value)
        torch.cuda.synchronize()
        assert int(flag.item()) == value
        _assert_landed(torch, src, dst, count, size)
    assert plan.site.bound == (mode != "jit")


@pytest.mark.cuda
@pytest.mark.parametrize("streaming", [True, False])
def test_kernel_configurations_copy_exactly_to_a_peer(streaming):
    torch = cuda_torch()
    from ascend_dualpath.transport.cuda import DeviceCopier, enable_peer_access

    src_dev = torch.device("cuda:0")
    dst_dev = torch.device("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    torch.cuda.set_device(src_dev)
    if dst_dev != src_dev:
        enable_peer_access(src_dev, dst_dev)
    count, size = 300, 4096 + 16
    src, dst, s_addrs, d_addrs = _segments(torch, count, size, src_dev, dst_dev)
    flag = torch.zeros(1, dtype=torch.int64, device=dst_dev)
    copier = DeviceCopier(src_dev, flag)
    plan = copier.plan(s_addrs, d_addrs, [size] * count, KernelConfig(TILE_BYTES, 1, 2, streaming))
    for value in (11, 12):
        _poison(torch, dst)
        copier.run(plan, value)
        torch.cuda.synchronize(src_dev)
        torch.cuda.synchronize(dst_dev)
        assert int(flag.item()) == value
        _assert_landed(torch, src, dst, count, size)


@pytest.mark.cuda
@pytest.mark.parametrize("count,size", [(1, 1), (61, 42 * 1024), (300, 4096 + 3)])
def test_memcpy_batch_delivers_exact_bytes_or_falls_back(count, size):
    """cudaMemcpyBatchAsync (or, where the runtime lacks it, one cudaMemcpyAsync per copy) moves exactly the
    bytes asked for, here and to a peer, and leaves the poisoned margins alone."""
    torch = cuda_torch()
    from ascend_dualpath.transport import cudart
    from ascend_dualpath.transport.cuda import enable_peer_access

    src_dev = torch.device("cuda:0")
    torch.cuda.set_device(src_dev)
    peers = ["cuda:0"] + (["cuda:1"] if torch.cuda.device_count() > 1 else [])
    for dst_name in peers:
        dst_dev = torch.device(dst_name)
        if dst_dev != src_dev:
            enable_peer_access(src_dev, dst_dev)
        src, dst, s_addrs, d_addrs = _segments(torch, count, size, src_dev, dst_dev)
        batch = cudart.MemcpyBatch(d_addrs, s_addrs, [size] * count)
        ok, why = cudart.batch_available()
        assert batch.batched == ok, why
        stream = torch.cuda.Stream(src_dev)
        stream.wait_stream(torch.cuda.current_stream(src_dev))
        torch.cuda.synchronize(dst_dev)
        batch(stream.cuda_stream)
        stream.synchronize()
        _assert_landed(torch, src, dst, count, size)
        if batch.batched:
            with pytest.raises(errors.ConfigError, match="legacy default stream"):
                batch(0)


@pytest.mark.cuda
def test_memcpy_batch_absent_runtime_refuses_without_fallback(monkeypatch):
    torch = cuda_torch()
    from ascend_dualpath.transport import cudart

    rt = cudart.runtime()
    monkeypatch.setattr(cudart, "runtime", lambda: cudart.Runtime(rt.path, 12040, rt.lib, None, True))
    with pytest.raises(errors.BackendUnavailable, match="has no cudaMemcpyBatchAsync"):
        cudart.MemcpyBatch([0x1000], [0x2000], [16], fallback=False)
    src = torch.arange(64, dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(64, dtype=torch.uint8, device="cuda:0")
    fallback = cudart.MemcpyBatch([dst.data_ptr()], [src.data_ptr()], [64])
    assert not fallback.batched
    fallback(torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(dst, src)


ALIGN = 16  # segment offsets of _scattered


def _scattered(torch, sizes, src_dev, dst_dev):
    """Segments at 16-byte aligned offsets with poisoned gaps between them (sources random, destinations 0xA5)."""
    src_offs, dst_offs, s_end, d_end = [], [], 16, 48
    for n in sizes:
        src_offs.append(s_end)
        dst_offs.append(d_end)
        padded = -(-n // ALIGN) * ALIGN
        s_end, d_end = s_end + padded + 16, d_end + padded + 32
    src = torch.randint(0, 256, (s_end + 64,), dtype=torch.uint8, device=src_dev)
    dst = torch.full((d_end + 64,), 0xA5, dtype=torch.uint8, device=dst_dev)
    _settled(torch, src, dst)
    return src, dst, src_offs, dst_offs


def _expected(torch, src, dst, src_offs, dst_offs, sizes):
    expected = torch.full_like(dst, 0xA5)
    for s, d, n in zip(src_offs, dst_offs, sizes, strict=True):
        expected[d : d + n] = src[s : s + n].to(dst.device)
    return expected


@pytest.mark.cuda
@pytest.mark.parametrize("chunk_bytes", [4096, 64 * 1024, cuda.STAGING_CHUNK_BYTES])
def test_staging_copy_in_chunks_is_exact_here_and_to_a_peer(chunk_bytes):
    """Pinned host -> double-buffered staging slots -> destinations: segments crossing chunk edges, odd lengths and
    gaps land exactly, poisoned gaps stay, the flag holds the request's value; a second request with new host data
    (the slots reused) is exact too."""
    torch = cuda_torch()
    from ascend_dualpath.transport.cuda import DeviceCopier, StagingCopy, enable_peer_access

    src_dev = torch.device("cuda:0")
    torch.cuda.set_device(src_dev)
    sizes = [42 * 1024] * 7 + [5, 100003, 1 << 20, 3]
    for dst_name in ["cuda:0"] + (["cuda:1"] if torch.cuda.device_count() > 1 else []):
        dst_dev = torch.device(dst_name)
        if dst_dev != src_dev:
            enable_peer_access(src_dev, dst_dev)
        src, dst, src_offs, dst_offs = _scattered(torch, sizes, "cpu", dst_dev)
        host = src.pin_memory()
        flag = torch.zeros(1, dtype=torch.int64, device=dst_dev)
        staging = StagingCopy(
            DeviceCopier(src_dev, flag), host, src_offs, [dst.data_ptr() + o for o in dst_offs], sizes, chunk_bytes
        )
        assert staging.staging_bytes <= 2 * chunk_bytes
        for value in (31, 32):
            host.random_(0, 256)
            _poison(torch, dst)
            staging.run(value)
            torch.cuda.synchronize(src_dev)
            torch.cuda.synchronize(dst_dev)
            assert int(flag.item()) == value, dst_name
            assert torch.equal(dst, _expected(torch, host, dst, src_offs, dst_offs, sizes)), (dst_name, value)


@pytest.mark.cuda
def test_staging_copy_refuses_bad_sources_before_anything_moves():
    torch = cuda_torch()
    from ascend_dualpath.transport.cuda import DeviceCopier, StagingCopy

    dev = torch.device("cuda:0")
    flag = torch.zeros(1, dtype=torch.int64, device=dev)
    copier = DeviceCopier(dev, flag)
    dst = torch.full((8192,), 0xA5, dtype=torch.uint8, device=dev)
    with pytest.raises(
        errors.ConfigError, match="pinned 1-D uint8 CPU tensor, got torch.uint8 .4096,. on cpu \\(pinned: False\\)"
    ):
        StagingCopy(copier, torch.zeros(4096, dtype=torch.uint8), [0], [dst.data_ptr()], [4096])
    host = torch.zeros(4096, dtype=torch.uint8).pin_memory()
    with pytest.raises(errors.ConfigError, match="segment 1 .offset 4000, 100 bytes. lies outside the host buffer"):
        StagingCopy(copier, host, [0, 4000], [dst.data_ptr(), dst.data_ptr() + 4096], [16, 100])
    with pytest.raises(errors.ConfigError, match="chunk_bytes 1000 is not a multiple of 16 from 4096"):
        StagingCopy(copier, host, [0], [dst.data_ptr()], [16], chunk_bytes=1000)
    torch.cuda.synchronize()
    assert (dst == 0xA5).all() and int(copier.flag.item()) == 0


@pytest.mark.cuda
def test_a_late_write_of_a_dropped_request_lands_in_its_own_parked_word_not_in_the_next_pinned_tensor():
    """A ticket dropped without a wait, its pattern evicted: the GPU still writes the host word after the host let go
    of it. The pinned memory must not go back to torch's allocator (which would hand it to the next pinned tensor)
    before that write landed."""
    import gc

    torch = cuda_torch()
    from ascend_dualpath.transport.cuda_engine import CudaTransferEngine

    dev = torch.device("cuda:0")
    engine = CudaTransferEngine(dev, dev, torch.zeros(2, dtype=torch.int64, device=dev), timeout_s=30)
    src = torch.randint(0, 256, (16 << 20,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for kind, nbytes, slot in (("aiv", 1 << 20, 0), ("host", 16 << 20, None)):
        request = ([engine.segment(src, 0, nbytes)], engine.slot(dst, 0, nbytes), slot, kind)
        engine.submit(*request).wait()  # compiled and warm: the next submission is quick
        for cache in (engine._plans, engine._submissions):
            cache.clear()
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s: the request's writes come long after the drop below
        engine.submit(*request)
        for cache in (engine._plans, engine._submissions):
            cache.clear()
        gc.collect()
        assert cuda.release_parked() >= 1, kind
        others = [torch.full((1,), -5, dtype=torch.int64).pin_memory() for _ in range(64)]
        torch.cuda.synchronize()
        assert all(int(t[0]) == -5 for t in others), f"{kind}: a late write landed in another pinned tensor"
        assert cuda.release_parked() == 0 and torch.equal(dst[:nbytes], src[:nbytes])
