"""CUDA analogues of the transfer kinds, so the AIV-direct question gets real-silicon numbers.

- ``device`` (analogue of ``aiv``): one Triton kernel launch copies every segment into peer or local
  memory, reading a tile table (src, dst, bytes) from device memory, and the last program to finish
  publishes a ready flag with release semantics (system scope, so a peer GPU may poll it).
- ``host`` (analogue of the host path): one ``cudaMemcpyAsync`` per segment (``copy_(non_blocking=True)``).
- ``foreach``: ``torch._foreach_copy_`` over all segments (torch's own batched copy), as a baseline.
- ``staged`` (analogue of ``staging``): pinned host buffer -> device staging buffer (one H2D copy),
  then the device-initiated kernel scatters into the destination.

Import needs neither CUDA nor Triton; they are loaded when used. Status: not yet run on a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from ascend_dualpath import errors as E

TILE_BYTES = 64 * 1024  # bytes one program copies per loop iteration
BENCH_KINDS = ("device", "host", "foreach", "staged")
_FLAG_DTYPE_BYTES = 8


def tile_table(
    src_addrs: Sequence[int],
    dst_addrs: Sequence[int],
    nbytes: Sequence[int],
    elem_bytes: int,
    tile_bytes: int = TILE_BYTES,
) -> np.ndarray:
    """Tiles of at most ``tile_bytes`` covering every segment: an int64 array of shape (tiles, 3)
    holding (src address, dst address, elements of ``elem_bytes``).

    A segment of ``k * tile_bytes`` bytes gives ``k`` tiles, one more byte ``k + 1``. Every address and
    length must be a multiple of ``elem_bytes`` (AlignmentError otherwise).
    """
    src = np.asarray(src_addrs, np.int64)
    dst = np.asarray(dst_addrs, np.int64)
    size = np.asarray(nbytes, np.int64)
    if not (src.shape == dst.shape == size.shape) or src.ndim != 1 or src.size == 0:
        raise E.ConfigError(
            f"need equal non-empty 1-D address and size lists, got {src.shape}, {dst.shape}, {size.shape}"
        )
    if (size < 1).any():
        raise E.EmptyTransfer(f"segment {int(np.flatnonzero(size < 1)[0])} has no bytes")
    if tile_bytes % elem_bytes:
        raise E.ConfigError(f"tile_bytes {tile_bytes} is not a multiple of the element size {elem_bytes}")
    misaligned = (src % elem_bytes != 0) | (dst % elem_bytes != 0) | (size % elem_bytes != 0)
    if misaligned.any():
        i = int(np.flatnonzero(misaligned)[0])
        raise E.AlignmentError(
            f"segment {i} (src {src[i]:#x}, dst {dst[i]:#x}, {size[i]} bytes) is not {elem_bytes}-byte aligned"
        )
    tiles = -(-size // tile_bytes)
    seg = np.repeat(np.arange(size.size), tiles)
    first = np.cumsum(tiles) - tiles
    offset = (np.arange(seg.size) - first[seg]) * tile_bytes
    table = np.empty((seg.size, 3), np.int64)
    table[:, 0] = src[seg] + offset
    table[:, 1] = dst[seg] + offset
    table[:, 2] = np.minimum(tile_bytes, size[seg] - offset) // elem_bytes
    return table


def element_bytes(src_addrs, dst_addrs, nbytes) -> int:
    """Widest of 16/8/4/1 bytes dividing every address and length."""
    combined = np.bitwise_or.reduce(np.concatenate([np.asarray(a, np.int64) for a in (src_addrs, dst_addrs, nbytes)]))
    for width in (16, 8, 4):
        if combined % width == 0:
            return width
    return 1


_kernel = None


def _copy_kernel():
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def copy_tiles(table, n_tiles, counter, flag, flag_value, TILE: tl.constexpr, WORDS: tl.constexpr):
            # elements are int32 words; WORDS words per element (4 -> 16-byte vectors)
            pid = tl.program_id(0)
            nprog = tl.num_programs(0)
            offs = tl.arange(0, TILE)
            for t in range(pid, n_tiles, nprog):
                src = tl.load(table + t * 3).to(tl.pointer_type(tl.int32))
                dst = tl.load(table + t * 3 + 1).to(tl.pointer_type(tl.int32))
                n = tl.load(table + t * 3 + 2) * WORDS
                src = tl.multiple_of(src, 4 * WORDS)
                dst = tl.multiple_of(dst, 4 * WORDS)
                mask = offs < n
                tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
            # the last program to finish publishes the flag after everybody's stores
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="sys")
            if done == nprog - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="sys")
                tl.atomic_xchg(flag, flag_value, sem="release", scope="sys")

        @triton.jit
        def copy_tiles_bytes(table, n_tiles, counter, flag, flag_value, TILE: tl.constexpr):
            pid = tl.program_id(0)
            nprog = tl.num_programs(0)
            offs = tl.arange(0, TILE)
            for t in range(pid, n_tiles, nprog):
                src = tl.load(table + t * 3).to(tl.pointer_type(tl.int8))
                dst = tl.load(table + t * 3 + 1).to(tl.pointer_type(tl.int8))
                n = tl.load(table + t * 3 + 2)
                mask = offs < n
                tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="sys")
            if done == nprog - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="sys")
                tl.atomic_xchg(flag, flag_value, sem="release", scope="sys")

        _kernel = (copy_tiles, copy_tiles_bytes)
    return _kernel


class DeviceCopier:
    """Device-initiated multi-segment copy on one GPU: one launch per request, plus a ready flag.

    Parameters
    ----------
    device : torch.device
        The GPU that runs the kernel (the sources' GPU).
    flag : torch.Tensor
        int64 scalar tensor that receives ``flag_value`` when every byte landed; may live on a peer GPU.
    programs : int or None
        Programs in the grid (default: 4 per SM).
    """

    def __init__(self, device, flag, programs: int | None = None):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.flag = flag
        props = torch.cuda.get_device_properties(self.device)
        self.programs = programs or 4 * props.multi_processor_count
        self.counter = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._table = torch.empty((0, 3), dtype=torch.int64, device=self.device)
        self._pinned = torch.empty((0, 3), dtype=torch.int64, pin_memory=True)
        self._table_copied = None  # event: the pinned table may be rewritten once the last upload finished

    def copy(self, src_addrs, dst_addrs, nbytes, flag_value: int) -> int:
        """Enqueue the copy on the current stream; returns the number of tiles."""
        width = element_bytes(src_addrs, dst_addrs, nbytes)
        elem = 1 if width == 1 else width
        table = tile_table(src_addrs, dst_addrs, nbytes, elem)
        n = table.shape[0]
        if self._pinned.shape[0] < n:  # grow geometrically: no allocation on the steady path
            self._pinned = self.torch.empty((2 * n, 3), dtype=self.torch.int64, pin_memory=True)
            self._table = self.torch.empty((2 * n, 3), dtype=self.torch.int64, device=self.device)
        if self._table_copied is not None:
            self._table_copied.synchronize()
        self._pinned[:n].numpy()[:] = table
        self._table[:n].copy_(self._pinned[:n], non_blocking=True)
        self._table_copied = self.torch.cuda.Event()
        self._table_copied.record()
        words, bytes_kernel = _copy_kernel()
        grid = (min(self.programs, n),)
        if width == 1:
            bytes_kernel[grid](self._table, n, self.counter, self.flag, flag_value, TILE=TILE_BYTES)
        else:
            words[grid](self._table, n, self.counter, self.flag, flag_value, TILE=TILE_BYTES // 4, WORDS=width // 4)
        return n


def host_copy(dsts, srcs) -> None:
    """One cudaMemcpyAsync per segment."""
    for d, s in zip(dsts, srcs, strict=True):
        d.copy_(s, non_blocking=True)


# ---- benchmark -------------------------------------------------------------------------------------


def run_bench(cases, kinds: list[str], repeats: int, progress, peer: bool | None = None):
    """Measure every kind on the current GPU(s); destination on cuda:1 when there are two GPUs."""
    import torch

    from ascend_dualpath.bench.transfer import Row, percentile

    if not torch.cuda.is_available():
        raise E.BackendUnavailable("the cuda transfer benchmark needs a CUDA GPU")
    src_dev = torch.device("cuda:0")
    peer = torch.cuda.device_count() > 1 if peer is None else peer
    dst_dev = torch.device("cuda:1" if peer else "cuda:0")
    if peer:
        torch.ones(1, device=src_dev).copy_(torch.ones(1, device=dst_dev))  # enables peer access both ways
        torch.ones(1, device=dst_dev).copy_(torch.ones(1, device=src_dev))
    flag = torch.zeros(1, dtype=torch.int64, device=dst_dev)
    copier = DeviceCopier(src_dev, flag)
    rows = []
    magic = 0
    for case in cases:
        src = torch.randint(0, 256, (case.nbytes,), dtype=torch.uint8, device=src_dev)
        dst = torch.empty(case.nbytes, dtype=torch.uint8, device=dst_dev)
        srcs = [src[i * case.size : (i + 1) * case.size] for i in range(case.count)]
        dsts = [dst[i * case.size : (i + 1) * case.size] for i in range(case.count)]
        s_addrs = [t.data_ptr() for t in srcs]
        d_addrs = [t.data_ptr() for t in dsts]
        sizes = [case.size] * case.count
        pinned = staging = None
        for kind in kinds:
            if kind == "staged":
                pinned = pinned if pinned is not None else src.cpu().pin_memory()
                staging = staging if staging is not None else torch.empty_like(src)
            dst.zero_()
            submit_s, cpu_s, gpu_ms = [], [], []
            for rep in range(repeats + 1):  # the first run warms up (Triton compile, peer mappings)
                torch.cuda.synchronize(src_dev)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                t0, c0 = time.perf_counter(), time.process_time()
                magic += 1
                if kind == "device":
                    copier.copy(s_addrs, d_addrs, sizes, magic)
                elif kind == "host":
                    host_copy(dsts, srcs)
                elif kind == "foreach":
                    torch._foreach_copy_(dsts, srcs, non_blocking=True)
                elif kind == "staged":
                    staging.copy_(pinned, non_blocking=True)
                    copier.copy([staging.data_ptr() + i * case.size for i in range(case.count)], d_addrs, sizes, magic)
                else:
                    raise E.ConfigError(f"unknown cuda kind {kind!r}; known: {', '.join(BENCH_KINDS)}")
                t1, c1 = time.perf_counter(), time.process_time()
                end.record()
                torch.cuda.synchronize(src_dev)
                torch.cuda.synchronize(dst_dev)
                if rep:
                    submit_s.append(t1 - t0)
                    cpu_s.append(c1 - c0)
                    gpu_ms.append(start.elapsed_time(end))
            if not torch.equal(dst.cpu(), src.cpu()):
                raise AssertionError(f"{kind} {case.name}: destination differs from the source")
            if kind in ("device", "staged") and int(flag.item()) != magic:
                raise AssertionError(f"{kind} {case.name}: ready flag {int(flag.item())} != {magic}")
            submit_us = percentile(submit_s, 50) * 1e6
            p50 = percentile(gpu_ms, 50) * 1e3
            rows.append(
                Row(
                    kind,
                    case.name,
                    case.count,
                    case.size,
                    submit_us / case.count,
                    submit_us,
                    p50,
                    percentile(gpu_ms, 99) * 1e3,
                    case.nbytes / (p50 * 1e3),
                    percentile(cpu_s, 50) * 1e6,
                    case.nbytes if kind == "staged" else 0,
                    submit_us / p50 if p50 else 0.0,
                    "measured",
                    {"peer": peer},
                )
            )
            progress(rows[-1])
        del src, dst, pinned, staging
        torch.cuda.empty_cache()
    meta = {
        "backend": "cuda",
        "clock": "measured (CUDA events; host submit by perf_counter)",
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "peer": peer,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "repeats": repeats,
    }
    return rows, meta
