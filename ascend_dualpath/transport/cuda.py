"""CUDA analogues of the transfer kinds, so the AIV-direct question gets real-silicon numbers.

- ``device`` (analogue of ``aiv``): one Triton kernel launch copies every segment into peer or local
  memory, reading a tile table (src, dst, elements) from device memory, and the last program to finish
  publishes a ready flag with release semantics (system scope, so a peer GPU or the host may poll it).
  DualPath sends the same layer pattern every request, so the work is split: :meth:`DeviceCopier.plan`
  builds and uploads the tile table once per pattern, :meth:`DeviceCopier.run` is one kernel launch per
  request with no other host work, and :meth:`DeviceCopier.capture` records that launch in a CUDA graph
  whose replays publish successive flag values.
- ``host`` (analogue of the host path): one ``cudaMemcpyAsync`` per segment (``copy_(non_blocking=True)``);
  ``host-batch``: one ``cudaMemcpyBatchAsync`` for all segments where the runtime has it
  (:mod:`ascend_dualpath.transport.cudart`).
- ``foreach``: ``torch._foreach_copy_`` over all segments (torch's own batched copy), as a baseline.
- ``staged`` (analogue of ``staging``): pinned host buffer -> device staging slot -> destination in chunks,
  double-buffered so that the H2D copy of one chunk overlaps the device-initiated scatter of the previous one
  (:class:`StagedCopy`).

Import needs neither CUDA nor Triton; they are loaded when used.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from ascend_dualpath import errors as E

TILE_BYTES = 4 * 1024  # bytes one program copies per loop iteration (4 KiB tiles measured best at every size)


@dataclass(frozen=True)
class KernelConfig:
    """Grid and kernel shape of a plan: bytes per tile, grid bound per SM, warps per program, streaming hints."""

    tile_bytes: int
    programs_per_sm: int
    num_warps: int
    streaming: bool


# Chosen from the tuning runs on H200 (docs/benchmarks.md): small requests want many programs of 4 warps
# (latency), large ones 16 programs of 2 warps per SM with streaming cache hints (bandwidth: 1 GPU, 64 MiB and
# 302 MB 3-5 % faster than 8 x 4 warps; peer to peer every shape sits at the link).
SMALL_CONFIG = KernelConfig(TILE_BYTES, 8, 4, False)
LARGE_CONFIG = KernelConfig(TILE_BYTES, 16, 2, True)


def choose_config(total_bytes: int, sm_count: int) -> KernelConfig:
    """LARGE_CONFIG from ``2 * sm_count * 16 KiB`` bytes (4.3 MB on an H200), SMALL_CONFIG below."""
    return LARGE_CONFIG if total_bytes >= large_threshold(sm_count) else SMALL_CONFIG


def large_threshold(sm_count: int) -> int:
    """Bytes from which a request counts as large: two waves of 16 KiB per program at 8 programs per SM."""
    return 2 * sm_count * 16 * 1024


@dataclass(frozen=True)
class BulkConfig:
    """Shape of a bulk-copy plan (:func:`cuda_kernels.bulk_copy_tiles`): bytes of one program's shared-memory stage
    (= bytes per tile), grid bound per SM, pieces a tile is split into (stores of early pieces overlap later loads)."""

    stage_bytes: int
    programs_per_sm: int
    chunks: int


BULK_ALIGN = 16  # cp.async.bulk needs 16-byte aligned addresses and sizes
BULK_MAX_STAGE = 32 * 1024  # a program's static shared memory is limited to 48 KiB; stages are powers of two
# 32 KiB stages fit 6 programs in an H200 SM's 228 KiB of shared memory
BULK_CONFIG = BulkConfig(BULK_MAX_STAGE, 6, 2)
# whether plan() picks bulk copies by itself for large, 16-byte aligned requests on compute capability >= 9.0
BULK_DEFAULT = False


# kernel switches (cuda_kernels.copy_tiles); plan() takes each as an argument, None meaning these defaults
# (streaming: from choose_config; arrival scope: DeviceCopier.arrivals_need_sys, unless ARRIVE_SYS is set)
PREFETCH = False
ARRIVE_SYS: bool | None = None
BENCH_KINDS = ("device", "graph", "device-new", "host", "host-batch", "foreach", "staged", "floor")
# not in a default sweep: the device kind launched through Triton's runner or its JIT (host cost of each tier)
EXTRA_KINDS = ("device-runner", "device-jit")
KERNEL_OPTIONS = {"stream": ("streaming", True), "nostream": ("streaming", False), "prefetch": ("prefetch", True),
                  "noprefetch": ("prefetch", False), "sys": ("arrive_sys", True), "gpu": ("arrive_sys", False),
                  "bulk": ("bulk", True), "nobulk": ("bulk", False), "split1": ("chunks", 1),
                  "split2": ("chunks", 2), "split4": ("chunks", 4)}
FLAG_MAX = (1 << 63) - 1


def _segment_arrays(src_addrs: Sequence[int], dst_addrs: Sequence[int], nbytes: Sequence[int]):
    """``(src, dst, size)`` as int64 arrays of one shape; ConfigError unless equal non-empty 1-D lists,
    EmptyTransfer for a segment of no bytes."""
    src = np.asarray(src_addrs, np.int64)
    dst = np.asarray(dst_addrs, np.int64)
    size = np.asarray(nbytes, np.int64)
    if not (src.shape == dst.shape == size.shape) or src.ndim != 1 or src.size == 0:
        raise E.ConfigError(
            f"need equal non-empty 1-D address and size lists, got {src.shape}, {dst.shape}, {size.shape}"
        )
    if (size < 1).any():
        raise E.EmptyTransfer(f"segment {int(np.flatnonzero(size < 1)[0])} has no bytes")
    return src, dst, size


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
    src, dst, size = _segment_arrays(src_addrs, dst_addrs, nbytes)
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


def bulk_tile_table(src_addrs: Sequence[int], dst_addrs: Sequence[int], nbytes: Sequence[int], stage_bytes: int):
    """Rows (src address, dst address, bytes) for :func:`cuda_kernels.bulk_copy_tiles`: an int64 array (rows, 3).

    Every address must be 16-byte aligned (AlignmentError otherwise); lengths need not be. A segment's largest
    multiple of 16 bytes is cut into tiles of at most ``stage_bytes`` (each a multiple of 16: bulk copies), its
    remaining 1-15 bytes become one tail row (byte copies), placed after every bulk tile.
    """
    src, dst, size = _segment_arrays(src_addrs, dst_addrs, nbytes)
    misaligned = (src % BULK_ALIGN != 0) | (dst % BULK_ALIGN != 0)
    if misaligned.any():
        i = int(np.flatnonzero(misaligned)[0])
        raise E.AlignmentError(
            f"segment {i} (src {src[i]:#x}, dst {dst[i]:#x}) is not {BULK_ALIGN}-byte aligned: bulk copies need it"
        )
    body = size - size % BULK_ALIGN
    has_body = body > 0
    parts = []
    if has_body.any():
        parts.append(tile_table(src[has_body], dst[has_body], body[has_body], 1, stage_bytes))
    tail = size % BULK_ALIGN != 0
    if tail.any():
        parts.append(np.stack([src[tail] + body[tail], dst[tail] + body[tail], size[tail] % BULK_ALIGN], axis=1))
    return np.concatenate(parts).astype(np.int64)


def choose_bulk(src_addrs, dst_addrs, total_bytes: int, sm_count: int, capability: tuple[int, int]) -> bool:
    """The default kernel choice: bulk copies when ``BULK_DEFAULT``, the GPU has them (compute capability >= 9.0),
    the request is large (:func:`large_threshold`) and every address is 16-byte aligned; else the load/store kernel
    (which also serves 4-, 8-byte and unaligned segments)."""
    if not (BULK_DEFAULT and capability >= (9, 0) and total_bytes >= large_threshold(sm_count)):
        return False
    combined = np.bitwise_or.reduce(np.concatenate([np.asarray(a, np.int64) for a in (src_addrs, dst_addrs)]))
    return int(combined) % BULK_ALIGN == 0


def element_bytes(src_addrs, dst_addrs, nbytes) -> int:
    """Widest of 16/8/4/1 bytes dividing every address and length."""
    combined = np.bitwise_or.reduce(np.concatenate([np.asarray(a, np.int64) for a in (src_addrs, dst_addrs, nbytes)]))
    for width in (16, 8, 4):
        if combined % width == 0:
            return width
    return 1


def grid_size(tiles: int, max_programs: int) -> int:
    """Programs for ``tiles`` tiles: at most ``max_programs``, as few as give every program the same number of
    tiles (4096 tiles over at most 1056 programs: 1024 programs of 4, not 1056 of which 928 take a fourth)."""
    rounds = -(-tiles // max_programs)
    return -(-tiles // rounds)


def _kernels():
    """The kernels module; imported here so that importing this module needs no Triton."""
    from ascend_dualpath.transport import cuda_kernels

    return cuda_kernels


@dataclass(eq=False)
class CopyPlan:
    """A segment pattern ready to launch: its tile table lives in device memory.

    One plan must not run on two streams at once (its arrival counter is shared by its launches).

    Attributes
    ----------
    table : torch.Tensor
        (tiles, 3) int64 on the copier's GPU: src address, dst address, elements of ``elem_bytes``.
    tiles, segments, nbytes : int
        Tiles in the table, segments planned, bytes copied per run.
    elem_bytes, tile_bytes, programs, num_warps : int
        Element width (16/8/4/1), bytes per tile, programs in the grid, warps per program.
    state : torch.Tensor
        int64[2] on the GPU: programs arrived in the running launch, last published graph epoch.
    constexprs : dict
        The kernel's compile-time switches for this plan (``FROM_EPOCH`` excluded).
    site : LaunchSite
        The launch site of :meth:`DeviceCopier.run` (fixed grid; bound to the binary after the first run).
    args, fast_args : tuple
        The run's arguments before the flag value: with tensors (first launch, through Triton) and with plain
        addresses (later launches, straight to the binary's launcher).
    bulk, chunks : bool, int
        Whether the plan uses bulk copies (then the table's third column is bytes, ``elem_bytes`` is 1 and
        ``tile_bytes`` the shared-memory stage) and the pieces per tile (0 without bulk copies).
    """

    table: object
    tiles: int
    segments: int
    nbytes: int
    elem_bytes: int
    tile_bytes: int
    programs: int
    state: object
    constexprs: dict
    num_warps: int
    site: object
    args: tuple
    fast_args: tuple
    bulk: bool = False
    chunks: int = 0


def enable_peer_access(device_a, device_b) -> None:
    """Let each of two GPUs address the other's memory (Triton's launcher refuses a peer pointer before this).

    torch enables peer access on the first copy between two devices, so one word is copied each way.
    """
    import torch

    a, b = torch.device(device_a), torch.device(device_b)
    torch.ones(1, device=a).copy_(torch.ones(1, device=b))
    torch.ones(1, device=b).copy_(torch.ones(1, device=a))


class DeviceCopier:
    """Device-initiated multi-segment copy from one GPU: one launch per request, plus a ready flag.

    Parameters
    ----------
    device : torch.device
        The GPU that runs the kernel (the sources' GPU); it must be the current device when launching.
    flag : torch.Tensor
        int64 tensor whose first element receives the request's flag value once every byte landed;
        may live on a peer GPU (peer access to it is enabled here; destinations on any other GPU need
        :func:`enable_peer_access` first).
    programs_per_sm : int or None
        Upper bound of programs in the grid per SM for every plan; None: :func:`choose_config` per plan.
    """

    def __init__(self, device, flag, programs_per_sm: int | None = None):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        if self.device.index is None:  # "cuda": the current GPU, so that plans can tell local memory by ordinal
            self.device = torch.device("cuda", torch.cuda.current_device())
        if flag.dtype != torch.int64 or flag.device.type != "cuda":
            raise E.ConfigError(f"the ready flag must be an int64 CUDA tensor, got {flag.dtype} on {flag.device}")
        if programs_per_sm is not None and programs_per_sm < 1:
            raise E.ConfigError(f"programs_per_sm must be >= 1, got {programs_per_sm}")
        self.flag = flag
        self.programs_per_sm = programs_per_sm
        if flag.device != self.device:
            enable_peer_access(self.device, flag.device)
        properties = torch.cuda.get_device_properties(self.device)
        self.sm_count = properties.multi_processor_count
        self.capability = (properties.major, properties.minor)
        self.bulk_capable = self.capability >= (9, 0)

    def plan(
        self,
        src_addrs,
        dst_addrs,
        nbytes,
        tile_bytes: int | None = None,
        programs_per_sm: int | None = None,
        num_warps: int | None = None,
        streaming: bool | None = None,
        prefetch: bool | None = None,
        arrive_sys: bool | None = None,
        launch_mode: str | None = None,
        bulk: bool | None = None,
        chunks: int | None = None,
        flag=None,
    ) -> CopyPlan:
        """Build the tile table for one segment pattern and enqueue its upload (host work, once per pattern).

        The upload goes on the current stream: run the plan on that stream, or synchronize first.

        Parameters
        ----------
        src_addrs, dst_addrs : sequence of int
            Device addresses of each segment's source (on this GPU) and destination (here or on a peer).
        nbytes : sequence of int
            Length of each segment in bytes (>= 1).
        tile_bytes, programs_per_sm, num_warps, streaming : int, int, int, bool, or None
            Bytes per tile (a power of two >= 64), grid bound per SM, warps per program (1, 2, 4, 8 or 16),
            streaming cache hints; None: the copier's ``programs_per_sm``, else :func:`choose_config` of the
            request size.
        prefetch, arrive_sys : bool or None
            Kernel switches (see :mod:`ascend_dualpath.transport.cuda_kernels`); None: the module default
            ``PREFETCH``, and for the arrival scope ``ARRIVE_SYS`` if set, else :meth:`arrivals_need_sys`.
        launch_mode : str or None
            How :meth:`run` launches after the first time (:class:`ascend_dualpath._triton_launch.LaunchSite`).
        bulk : bool or None
            Copy with Hopper's bulk copies (:func:`cuda_kernels.bulk_copy_tiles`; needs compute capability 9.0 and
            16-byte aligned addresses). None: :func:`use_bulk` decides (large, aligned requests when
            ``BULK_DEFAULT``). With bulk copies ``tile_bytes`` is the shared-memory stage (a power of two from 256
            to 32 KiB; default ``BULK_CONFIG``), ``chunks`` the pieces a tile is split into (1, 2 or 4), and
            ``streaming`` / ``prefetch`` do not apply.
        flag : torch.Tensor or None
            This plan's ready flag (an int64 CUDA tensor; its first element is written), e.g. a notify slot on the
            destination GPU; None: the copier's flag.
        """
        flag = self.flag if flag is None else self._checked_flag(flag)
        sizes = np.asarray(nbytes, np.int64)
        if bulk is None:
            bulk = self.use_bulk(src_addrs, dst_addrs, int(sizes.sum()))
        if bulk:
            return self._plan_bulk(src_addrs, dst_addrs, sizes, tile_bytes, programs_per_sm, num_warps, streaming,
                                   prefetch, arrive_sys, launch_mode, chunks, flag)
        if chunks is not None:
            raise E.ConfigError(f"chunks={chunks} applies to bulk copies only")
        return self._plan_tiles(src_addrs, dst_addrs, sizes, tile_bytes, programs_per_sm, num_warps, streaming,
                                prefetch, arrive_sys, launch_mode, flag)

    def _checked_flag(self, flag):
        """``flag`` if it can be a ready flag (int64, CUDA, at least one element), with peer access to its GPU."""
        if flag.dtype != self.torch.int64 or flag.device.type != "cuda" or flag.numel() < 1:
            raise E.ConfigError(f"a ready flag must be a non-empty int64 CUDA tensor, got {flag.dtype} "
                                f"{tuple(flag.shape)} on {flag.device}")
        if flag.device != self.device:
            enable_peer_access(self.device, flag.device)
        return flag

    def arrivals_need_sys(self, dst_addrs, nbytes) -> bool:
        """Whether the programs' arrivals must be system-scope atomics: unless every destination byte is this GPU's
        own device memory (one driver query per allocation, :func:`cudart.memory_devices`).

        The last program publishes the flag with a system-scope release, and releases are cumulative, so for local
        destinations GPU-scope arrivals already order every program's stores before the flag for any observer (a
        peer or the host reads this GPU's memory through its L2). Stores to a peer or to host memory travel over
        NVLink or PCIe; for them each program's own release is system-scope. Saves ~0.5 µs per launch (run 3).
        """
        from ascend_dualpath.transport.cudart import memory_devices

        return memory_devices(dst_addrs, nbytes) != {self.device.index}

    def _arrive_sys(self, dst_addrs, sizes, arrive_sys: bool | None) -> bool:
        if arrive_sys is not None:
            return arrive_sys
        return ARRIVE_SYS if ARRIVE_SYS is not None else self.arrivals_need_sys(dst_addrs, sizes)

    def use_bulk(self, src_addrs, dst_addrs, total_bytes: int) -> bool:
        """:func:`choose_bulk` for this GPU."""
        return choose_bulk(src_addrs, dst_addrs, total_bytes, self.sm_count, self.capability)

    def _launch_site(self, kernel, programs: int, constexprs: dict, num_warps: int, launch_mode: str | None):
        from ascend_dualpath._triton_launch import LaunchSite

        return LaunchSite(kernel, programs, {**constexprs, "FROM_EPOCH": False, "num_warps": num_warps}, launch_mode)

    def _finish_plan(self, table, sizes, width, tile_bytes, programs, constexprs, num_warps, launch_mode, kernel,
                     chunks, flag) -> CopyPlan:
        torch = self.torch
        # pinned source, asynchronous upload: torch's host allocator keeps the block until the copy is done
        device_table = torch.from_numpy(table).pin_memory().to(self.device, non_blocking=True)
        state = torch.zeros(2, dtype=torch.int64, device=self.device)
        return CopyPlan(
            table=device_table,
            tiles=int(table.shape[0]),
            segments=int(sizes.size),
            nbytes=int(sizes.sum()),
            elem_bytes=width,
            tile_bytes=tile_bytes,
            programs=programs,
            state=state,
            constexprs=constexprs,
            num_warps=num_warps,
            site=self._launch_site(kernel, programs, constexprs, num_warps, launch_mode),
            args=(device_table, int(table.shape[0]), state, flag),
            fast_args=(device_table.data_ptr(), int(table.shape[0]), state.data_ptr(), flag.data_ptr()),
            bulk=chunks is not None,
            chunks=chunks or 0,
        )

    def _plan_bulk(self, src_addrs, dst_addrs, sizes, stage_bytes, programs_per_sm, num_warps, streaming, prefetch,
                   arrive_sys, launch_mode, chunks, flag) -> CopyPlan:
        if not self.bulk_capable:
            raise E.BackendUnavailable(
                f"bulk copies need compute capability 9.0 or newer; {self.device} has {self.capability}"
            )
        if streaming is not None or prefetch is not None:
            raise E.ConfigError("streaming and prefetch apply to the load/store kernel, not to bulk copies")
        stage_bytes = BULK_CONFIG.stage_bytes if stage_bytes is None else stage_bytes
        chunks = BULK_CONFIG.chunks if chunks is None else chunks
        if programs_per_sm is None:
            programs_per_sm = BULK_CONFIG.programs_per_sm if self.programs_per_sm is None else self.programs_per_sm
        num_warps = 1 if num_warps is None else num_warps  # one thread issues; the others only wait
        if stage_bytes < 256 or stage_bytes > BULK_MAX_STAGE or stage_bytes & (stage_bytes - 1):
            raise E.ConfigError(f"bulk stage of {stage_bytes} bytes is not a power of two in [256, {BULK_MAX_STAGE}]")
        if chunks not in (1, 2, 4):
            raise E.ConfigError(f"chunks {chunks} is not one of 1, 2, 4")
        if num_warps not in (1, 2, 4, 8, 16):
            raise E.ConfigError(f"num_warps {num_warps} is not one of 1, 2, 4, 8, 16")
        if programs_per_sm < 1:
            raise E.ConfigError(f"programs_per_sm must be >= 1, got {programs_per_sm}")
        table = bulk_tile_table(src_addrs, dst_addrs, sizes, stage_bytes)
        programs = grid_size(table.shape[0], programs_per_sm * self.sm_count)
        constexprs = {
            "STAGE_PTX": _kernels().bulk_tile_ptx(stage_bytes, chunks),
            "SINGLE": programs == 1,
            "ARRIVE_SYS": self._arrive_sys(dst_addrs, sizes, arrive_sys),
        }
        return self._finish_plan(table, sizes, 1, stage_bytes, programs, constexprs, num_warps, launch_mode,
                                 _kernels().bulk_copy_tiles, chunks, flag)

    def _plan_tiles(self, src_addrs, dst_addrs, sizes, tile_bytes, programs_per_sm, num_warps, streaming, prefetch,
                    arrive_sys, launch_mode, flag) -> CopyPlan:
        width = element_bytes(src_addrs, dst_addrs, sizes)
        total = int(sizes.sum())
        chosen = choose_config(total, self.sm_count)
        tile_bytes = chosen.tile_bytes if tile_bytes is None else tile_bytes
        if programs_per_sm is None:
            programs_per_sm = chosen.programs_per_sm if self.programs_per_sm is None else self.programs_per_sm
        num_warps = chosen.num_warps if num_warps is None else num_warps
        streaming = chosen.streaming if streaming is None else streaming
        if tile_bytes < 64 or tile_bytes & (tile_bytes - 1):
            raise E.ConfigError(f"tile_bytes {tile_bytes} is not a power of two >= 64")
        if num_warps not in (1, 2, 4, 8, 16):
            raise E.ConfigError(f"num_warps {num_warps} is not one of 1, 2, 4, 8, 16")
        max_programs = programs_per_sm * self.sm_count
        if max_programs < 1:
            raise E.ConfigError(f"programs_per_sm must be >= 1, got {programs_per_sm}")
        table = tile_table(src_addrs, dst_addrs, sizes, width, tile_bytes)
        programs = grid_size(table.shape[0], max_programs)
        constexprs = {
            "TILE": tile_bytes if width == 1 else tile_bytes // 4,
            "ELEM_BYTES": width,
            "SINGLE": programs == 1,
            "ARRIVE_SYS": self._arrive_sys(dst_addrs, sizes, arrive_sys),
            "STREAMING": streaming,
            "PREFETCH": PREFETCH if prefetch is None else prefetch,
        }
        return self._finish_plan(table, sizes, width, tile_bytes, programs, constexprs, num_warps, launch_mode,
                                 _kernels().copy_tiles, None, flag)

    def run(self, plan: CopyPlan, flag_value: int) -> None:
        """Enqueue ``plan`` on the current stream; the flag becomes ``flag_value`` after every byte landed.

        ``flag_value`` must be in [1, 2**63 - 1] (0 is the flag's idle value). After the plan's first run
        this is one call of the compiled binary's launcher with the plan's cached arguments.
        """
        if not 0 < flag_value <= FLAG_MAX:
            raise E.ConfigError(f"flag_value {flag_value} is outside [1, {FLAG_MAX}]")
        site = plan.site
        site(*(plan.fast_args if site.bound else plan.args), flag_value)

    def copy(self, src_addrs, dst_addrs, nbytes, flag_value: int) -> CopyPlan:
        """Plan and run a pattern seen once (table built and uploaded on every call); returns the plan."""
        if not 0 < flag_value <= FLAG_MAX:
            raise E.ConfigError(f"flag_value {flag_value} is outside [1, {FLAG_MAX}]")
        plan = self.plan(src_addrs, dst_addrs, nbytes)
        self.run(plan, flag_value)
        return plan

    def capture(self, plan: CopyPlan, first_flag_value: int) -> GraphedCopy:
        """Record one launch of ``plan`` in a CUDA graph; replay ``k`` (from 0) publishes ``first_flag_value + k``."""
        from ascend_dualpath._triton_launch import LaunchSite

        if not 0 < first_flag_value <= FLAG_MAX:
            raise E.ConfigError(f"first_flag_value {first_flag_value} is outside [1, {FLAG_MAX}]")
        torch = self.torch
        site = LaunchSite(
            plan.site.kernel,
            plan.programs,
            {**plan.constexprs, "FROM_EPOCH": True, "num_warps": plan.num_warps},
            plan.site.mode,
        )
        with torch.cuda.device(self.device):
            # compile outside the capture (the flag value is unspecialised and unused with FROM_EPOCH)
            fast = site.prepare(*plan.args, 1 << 40)
            plan.state[1].fill_(first_flag_value - 1)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                site(*(plan.fast_args if fast else plan.args), 1 << 40)
        return GraphedCopy(graph, plan, first_flag_value, fast_launch=fast)

class GraphedCopy:
    """A captured launch of one plan: :meth:`replay` is the whole host work of a request."""

    def __init__(self, graph, plan: CopyPlan, first_flag_value: int, fast_launch: bool):
        self.graph = graph
        self.plan = plan
        self.next_value = first_flag_value
        self.fast_launch = fast_launch  # captured through Triton's compiled launcher (else through the JIT)

    def replay(self) -> int:
        """Enqueue the copy on the current stream; returns the flag value it publishes."""
        self.graph.replay()
        self.next_value += 1
        return self.next_value - 1


STAGED_CHUNK_BYTES = 4 << 20  # bytes per staged chunk: 16 chunks for 64 MiB; a 61 x 42 KiB request is one chunk


def staged_pieces(offsets, dst_addrs, nbytes, chunk_bytes: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per chunk of the host buffer (``[k * chunk_bytes, (k + 1) * chunk_bytes)``, up to the last segment's end), the
    pieces of segments inside it: (offset in the chunk, destination address, bytes), int64 arrays.

    A segment crossing a chunk boundary is split there; chunks holding no segment byte get empty arrays.
    """
    off = np.asarray(offsets, np.int64)
    dst = np.asarray(dst_addrs, np.int64)
    size = np.asarray(nbytes, np.int64)
    chunks = -(-int((off + size).max()) // chunk_bytes)
    pieces = []
    for k in range(chunks):
        lo, hi = k * chunk_bytes, (k + 1) * chunk_bytes
        start = np.maximum(off, lo)
        end = np.minimum(off + size, hi)
        inside = end > start
        pieces.append((start[inside] - lo, dst[inside] + (start[inside] - off[inside]), (end - start)[inside]))
    return pieces


def staged_chunk_lengths(end: int, chunk_bytes: int) -> list[int]:
    """Bytes of each chunk's host-to-device copy when the furthest segment ends at byte ``end`` of the host buffer:
    whole chunks, the last one cut at ``end`` (nothing past the last segment is copied or staged)."""
    return [min(chunk_bytes, end - start) for start in range(0, end, chunk_bytes)]


class StagedCopy:
    """The ``staged`` kind, pipelined: pinned host buffer -> device staging slot -> destination, chunk by chunk.

    The host buffer is cut into chunks of ``chunk_bytes``; chunk ``k`` goes host -> slot ``k % 2`` with one
    ``cudaMemcpyAsync`` on a side stream, then the device-initiated kernel scatters its segment pieces from the slot
    to their destinations on the caller's stream. Two slots, so the host-to-device copy of chunk ``k + 1`` overlaps the
    scatter of chunk ``k``; a slot is refilled only after the scatter that read it finished (events). Staging holds at
    most two chunks instead of the whole request. Only the last chunk's launch publishes the request's flag value
    (the earlier launches publish to a private counter): launches on one stream run in order, so when the flag
    appears every earlier chunk's kernel has completed.

    Parameters
    ----------
    copier : DeviceCopier
        The GPU that stages and scatters, and the request's ready flag.
    host : torch.Tensor
        Pinned uint8 CPU tensor, 1-D: the source buffer.
    offsets, dst_addrs, nbytes : sequence of int
        Each segment's offset in ``host``, destination address (on the copier's GPU or a peer) and length (>= 1).
    chunk_bytes : int
        Bytes per chunk, a multiple of 16 from 4 KiB (default ``STAGED_CHUNK_BYTES``).
    """

    def __init__(self, copier: DeviceCopier, host, offsets, dst_addrs, nbytes, chunk_bytes: int = STAGED_CHUNK_BYTES):
        torch = copier.torch
        if host.device.type != "cpu" or host.dtype != torch.uint8 or host.dim() != 1 or not host.is_pinned():
            raise E.ConfigError(f"the staged source must be a pinned 1-D uint8 CPU tensor, got {host.dtype} "
                                f"{tuple(host.shape)} on {host.device} (pinned: {host.is_pinned()})")
        if chunk_bytes < 4096 or chunk_bytes % 16:
            raise E.ConfigError(f"chunk_bytes {chunk_bytes} is not a multiple of 16 from 4096")
        off = np.asarray(offsets, np.int64)
        size = np.asarray(nbytes, np.int64)
        if off.shape != size.shape or off.ndim != 1 or off.size == 0:
            raise E.ConfigError(f"need equal non-empty 1-D offset and size lists, got {off.shape}, {size.shape}")
        if (size < 1).any():
            raise E.EmptyTransfer(f"segment {int(np.flatnonzero(size < 1)[0])} has no bytes")
        outside = (off < 0) | (off + size > host.numel())
        if outside.any():
            i = int(np.flatnonzero(outside)[0])
            raise E.ConfigError(
                f"segment {i} (offset {off[i]}, {size[i]} bytes) lies outside the host buffer of {host.numel()} bytes"
            )
        self.copier, self.host, self.torch = copier, host, torch
        pieces = staged_pieces(off, dst_addrs, size, chunk_bytes)
        self.chunk_bytes = chunk_bytes
        self.lengths = staged_chunk_lengths(int((off + size).max()), chunk_bytes)
        slot_bytes = self.lengths[0]  # the first chunk is the longest
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=copier.device)
                      for _ in range(min(2, len(pieces)))]
        self.staging_bytes = sum(s.numel() for s in self.slots)
        self.scratch = DeviceCopier(copier.device, torch.zeros(1, dtype=torch.int64, device=copier.device))
        self.scratch_value = 0
        self.plans = []
        for k, (chunk_off, dst, length) in enumerate(pieces):
            base = self.slots[k % 2].data_ptr()
            last = k == len(pieces) - 1
            # a chunk without segment bytes (a gap in the host buffer) is neither copied nor scattered; the last chunk
            # holds the end of the furthest segment, so the flag's plan always exists
            plan = None if length.size == 0 else (copier if last else self.scratch).plan(base + chunk_off, dst, length)
            self.plans.append(plan)
        self.copy_stream = torch.cuda.Stream(copier.device)
        self.landed = [torch.cuda.Event() for _ in self.slots]
        self.read = [torch.cuda.Event() for _ in self.slots]

    @property
    def chunks(self) -> int:
        return len(self.plans)

    def run(self, flag_value: int) -> None:
        """Enqueue the request on the current stream (host copies on the side stream); the flag becomes
        ``flag_value`` after every byte landed."""
        if not 0 < flag_value <= FLAG_MAX:
            raise E.ConfigError(f"flag_value {flag_value} is outside [1, {FLAG_MAX}]")
        torch = self.torch
        main = torch.cuda.current_stream(self.copier.device)
        copy_stream = self.copy_stream
        copy_stream.wait_stream(main)  # the host buffer and the slots are ready as of the caller's stream
        for k, plan in enumerate(self.plans):
            if plan is None:
                continue
            slot = k % 2
            with torch.cuda.stream(copy_stream):
                if k >= 2:
                    copy_stream.wait_event(self.read[slot])  # the scatter of chunk k - 2 has read this slot
                start = k * self.chunk_bytes
                self.slots[slot][: self.lengths[k]].copy_(self.host[start : start + self.lengths[k]], non_blocking=True)
                self.landed[slot].record(copy_stream)
            main.wait_event(self.landed[slot])
            if k == len(self.plans) - 1:
                self.copier.run(plan, flag_value)
            else:
                self.scratch_value = self.scratch_value % FLAG_MAX + 1
                self.scratch.run(plan, self.scratch_value)
            self.read[slot].record(main)


def plan_facts(plan: CopyPlan) -> dict:
    """What a benchmark row records about a plan."""
    return {
        "tiles": plan.tiles,
        "tile_bytes": plan.tile_bytes,
        "elem_bytes": plan.elem_bytes,
        "programs": plan.programs,
        "num_warps": plan.num_warps,
        "streaming": plan.constexprs.get("STREAMING", False),
        "prefetch": plan.constexprs.get("PREFETCH", False),
        "bulk": plan.bulk,
        "chunks": plan.chunks,
        "arrive_sys": plan.constexprs["ARRIVE_SYS"],
        "launch_mode": plan.site.mode,
        "fast_launch": plan.site.bound,
    }


def host_copy(dsts, srcs) -> None:
    """One cudaMemcpyAsync per segment."""
    for d, s in zip(dsts, srcs, strict=True):
        d.copy_(s, non_blocking=True)


# ---- benchmark -------------------------------------------------------------------------------------


def _sleep_cycles_per_us(torch) -> float:
    """GPU clock cycles per microsecond of ``torch.cuda._sleep``, measured with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    end.synchronize()
    return 2_000_000 / (start.elapsed_time(end) * 1e3)


def parse_kind(kind: str) -> tuple[str, dict]:
    """A bench kind, for ``device`` / ``graph`` with an optional kernel configuration
    ``device:TILE_KIB:PROGRAMS_PER_SM:WARPS[:OPTIONS]``: ``-`` keeps a field's default, OPTIONS is a ``+``-joined
    list of ``stream``/``nostream``, ``prefetch``/``noprefetch``, ``sys``/``gpu`` (arrival scope), ``bulk``/``nobulk``
    (bulk copies; TILE_KIB is then the shared-memory stage) and ``split1``/``split2``/``split4`` (pieces per tile);
    ``staged:CHUNK_KIB`` sets the staged kind's chunk (a chunk as large as the request: one H2D copy, one scatter)."""
    base, *params = kind.split(":")
    known = BENCH_KINDS + EXTRA_KINDS
    if base == "staged" and len(params) == 1 and params[0].isdigit() and int(params[0]) > 0:
        return base, {"chunk_bytes": int(params[0]) * 1024}
    if base not in known or (params and (base not in ("device", "graph") or len(params) not in (3, 4))):
        raise E.ConfigError(
            f"unknown cuda kind {kind!r}; known: {', '.join(known)}, "
            "device/graph:TILE_KIB:PER_SM:WARPS[:OPTIONS] or staged:CHUNK_KIB"
        )
    config: dict = {}
    for name, field, scale in zip(params[:3], ("tile_bytes", "programs_per_sm", "num_warps"), (1024, 1, 1), strict=False):
        if name != "-":
            config[field] = int(name) * scale
    for option in params[3].split("+") if len(params) == 4 else ():
        if option not in KERNEL_OPTIONS:
            raise E.ConfigError(f"unknown kernel option {option!r} in {kind!r}; known: {', '.join(KERNEL_OPTIONS)}")
        field, value = KERNEL_OPTIONS[option]
        config[field] = value
    if base in EXTRA_KINDS:
        base, config = "device", {"launch_mode": base.split("-")[1]}
    return base, config


def _submitter(kind, torch, copier, case, srcs, dsts, src, dst, flag_base):
    """(submit, facts): ``submit(value)`` enqueues one request of ``kind`` and returns the value to expect in
    the flag (None for kinds without one); ``facts()`` describes the kind's cached plan for the row. Plans and
    graphs are built here, outside the timing."""
    s_addrs = [t.data_ptr() for t in srcs]
    d_addrs = [t.data_ptr() for t in dsts]
    sizes = [case.size] * case.count
    kind, config = parse_kind(kind)
    if kind == "device":
        plan = copier.plan(s_addrs, d_addrs, sizes, **config)

        def submit(value):
            copier.run(plan, value)
            return value

        return submit, lambda: plan_facts(plan)
    if kind == "graph":
        plan = copier.plan(s_addrs, d_addrs, sizes, **config)
        graphed = copier.capture(plan, flag_base)
        return lambda value: graphed.replay(), lambda: {**plan_facts(plan), "fast_launch": graphed.fast_launch}
    if kind == "device-new":

        def submit(value):
            copier.copy(s_addrs, d_addrs, sizes, value)
            return value

        return submit, dict
    if kind == "host":
        return lambda value: host_copy(dsts, srcs), dict
    if kind == "host-batch":
        from ascend_dualpath.transport.cudart import MemcpyBatch

        batch = MemcpyBatch(d_addrs, s_addrs, sizes)
        stream_index = src.device.index

        def submit(value):
            batch(torch._C._cuda_getCurrentRawStream(stream_index))

        return submit, lambda: {"batched": batch.batched, "cuda_runtime": batch.rt.version}
    if kind == "foreach":

        def submit(value):
            torch._foreach_copy_(dsts, srcs, non_blocking=True)  # returns the list: not a flag value

        return submit, dict
    if kind == "floor":
        from ascend_dualpath._triton_launch import LaunchSite

        site = LaunchSite(_kernels().empty, 1, {"num_warps": 1})
        site.prepare(copier.flag)
        flag_ptr = copier.flag.data_ptr()

        def submit(value):
            site(flag_ptr)

        return submit, lambda: {"fast_launch": site.bound, "note": "empty Triton kernel: moves nothing"}
    # staged: the only kind left after parse_kind
    staged = StagedCopy(copier, src.cpu().pin_memory(), [i * case.size for i in range(case.count)], d_addrs, sizes,
                        **config)

    def submit(value):
        staged.run(value)
        return value

    return submit, lambda: {**plan_facts(staged.plans[-1]), "chunks": staged.chunks,
                            "chunk_bytes": staged.chunk_bytes, "staging_bytes": staged.staging_bytes}


def _measure(torch, kind, case, copier, flag, buffers, graph_base, magic, repeats, sync, cycles_per_us):
    """One benchmark row: ``repeats`` timed requests of ``kind`` after two warm-ups; returns (row, last magic)."""
    from ascend_dualpath.bench.transfer import Row, percentile

    srcs, dsts, src, dst = buffers
    submit, facts = _submitter(kind, torch, copier, case, srcs, dsts, src, dst, graph_base)
    dst.zero_()
    for _ in range(2):  # the first compiles kernels and maps peers; the second's submit time sizes the hold
        sync()
        magic += 1
        t0 = time.perf_counter()
        expected = submit(magic)
        warm_submit_us = (time.perf_counter() - t0) * 1e6
    sync()
    hold_cycles = int(min(200_000, 1.5 * warm_submit_us + 50) * cycles_per_us)
    submit_s, cpu_s, latency_ms, gpu_ms = [], [], [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        magic += 1
        start.record()
        t0, c0 = time.perf_counter(), time.process_time()
        expected = submit(magic)
        t1, c1 = time.perf_counter(), time.process_time()
        end.record()
        sync()
        submit_s.append(t1 - t0)
        cpu_s.append(c1 - c0)
        latency_ms.append(start.elapsed_time(end))
        magic += 1
        torch.cuda._sleep(hold_cycles)  # the stream is busy while the request is enqueued
        start.record()
        expected = submit(magic)
        end.record()
        sync()
        gpu_ms.append(start.elapsed_time(end))
    if kind != "floor" and not torch.equal(dst, src.to(dst.device)):
        raise AssertionError(f"{kind} {case.name}: destination differs from the source")
    if expected is not None and int(flag.item()) != expected:
        raise AssertionError(f"{kind} {case.name}: ready flag {int(flag.item())} != {expected}")
    row_facts = facts()
    submit_us = percentile(submit_s, 50) * 1e6
    p50 = percentile(latency_ms, 50) * 1e3
    gpu_p50 = percentile(gpu_ms, 50) * 1e3
    row = Row(
        kind,
        case.name,
        case.count,
        case.size,
        submit_us / case.count,
        submit_us,
        p50,
        percentile(latency_ms, 99) * 1e3,
        case.nbytes / (gpu_p50 * 1e3),
        percentile(cpu_s, 50) * 1e6,
        row_facts.get("staging_bytes", 0),
        submit_us / p50 if p50 else 0.0,
        "measured",
        {
            "hold_us": hold_cycles / cycles_per_us,
            "warm_submit_us": warm_submit_us,
            **row_facts,
        },
        gpu_p50,
        percentile(gpu_ms, 99) * 1e3,
    )
    return row, magic


def run_bench(cases, kinds: list[str], repeats: int, progress, peer: bool | None = None):
    """Measure every kind on the current GPU(s); destination on cuda:1 when there are two GPUs.

    Per request, three clocks: host submit time (``perf_counter`` around the enqueue), end-to-end latency
    (CUDA events from an idle GPU, so it includes the submission) and GPU time (CUDA events with the
    stream held by a ``torch.cuda._sleep`` that outlasts the submission, so it is the copy alone).
    """
    import torch

    for kind in kinds:
        parse_kind(kind)  # a typo fails here, not after minutes of GPU time
    if not torch.cuda.is_available():
        raise E.BackendUnavailable("the cuda transfer benchmark needs a CUDA GPU")
    src_dev = torch.device("cuda:0")
    torch.cuda.set_device(src_dev)
    peer = torch.cuda.device_count() > 1 if peer is None else peer
    dst_dev = torch.device("cuda:1" if peer else "cuda:0")
    if peer:
        enable_peer_access(src_dev, dst_dev)
    devices = {src_dev, dst_dev}

    def sync():
        for d in devices:
            torch.cuda.synchronize(d)

    stream = torch.cuda.Stream(src_dev)  # not the legacy default stream, which cudaMemcpyBatchAsync refuses
    with torch.cuda.stream(stream):
        rows, meta = _run_cases(torch, cases, kinds, repeats, progress, peer, src_dev, dst_dev, sync)
    return rows, meta


def _run_cases(torch, cases, kinds, repeats, progress, peer, src_dev, dst_dev, sync):
    cycles_per_us = _sleep_cycles_per_us(torch)
    flag = torch.zeros(1, dtype=torch.int64, device=dst_dev)
    copier = DeviceCopier(src_dev, flag)
    rows, failures = [], []
    magic = 0
    for case_index, case in enumerate(cases):
        src = torch.randint(0, 256, (case.nbytes,), dtype=torch.uint8, device=src_dev)
        dst = torch.empty(case.nbytes, dtype=torch.uint8, device=dst_dev)
        srcs = [src[i * case.size : (i + 1) * case.size] for i in range(case.count)]
        dsts = [dst[i * case.size : (i + 1) * case.size] for i in range(case.count)]
        for kind in kinds:
            graph_base = (1 << 40) + (case_index << 20)  # graph replays count up from here
            try:
                buffers = (srcs, dsts, src, dst)
                row, magic = _measure(
                    torch, kind, case, copier, flag, buffers, graph_base, magic, repeats, sync, cycles_per_us
                )
            except Exception as exc:  # noqa: BLE001 - one broken kind must not lose the rest of a GPU session
                failures.append(f"{kind} {case.name}: {type(exc).__name__}: {exc}")
                print(f"  FAILED {failures[-1]}", flush=True)
                continue
            row.extra["peer"] = peer
            rows.append(row)
            progress(row)
        del src, dst, srcs, dsts
        torch.cuda.empty_cache()
    meta = {
        "backend": "cuda",
        "clock": "measured (host submit: perf_counter; latency: CUDA events from an idle GPU; "
        "GPU time: CUDA events behind a sleep that outlasts the submission)",
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "peer": peer,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _triton_version(),
        "sm_count": copier.sm_count,
        "configs": {"small": asdict(SMALL_CONFIG), "large": asdict(LARGE_CONFIG)},
        "repeats": repeats,
        "sleep_cycles_per_us": cycles_per_us,
        "kernel_defaults": {"prefetch": PREFETCH, "arrive_sys": "by destination" if ARRIVE_SYS is None else ARRIVE_SYS,
                            "bulk_default": BULK_DEFAULT, "bulk": asdict(BULK_CONFIG)},
        "launch_mode": _default_launch_mode(),
        "cudaMemcpyBatchAsync": _batch_note() if any(k.startswith("host-batch") for k in kinds) else "not run",
        "failures": failures,
    }
    return rows, meta


def _default_launch_mode() -> str:
    from ascend_dualpath._triton_launch import default_mode

    return default_mode()


def _batch_note() -> str:
    from ascend_dualpath.transport.cudart import batch_available

    ok, why = batch_available()
    return why if ok else f"absent ({why}): host-batch rows are one cudaMemcpyAsync per segment"


def _triton_version() -> str:
    import triton

    return triton.__version__
