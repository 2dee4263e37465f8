"""The CUDA copy primitives under the CUDA transfer engine (:mod:`~ascend_dualpath.transport.cuda_engine`).

- :class:`DeviceCopier` (the ``aiv`` analogue): one Triton kernel launch copies every segment into peer or local
  memory, reading a tile table (src, dst, elements) from device memory, and the last program to finish
  publishes a ready flag with release semantics (system scope, so a peer GPU or the host may poll it).
  DualPath sends the same layer pattern every request, so the work is split: :meth:`DeviceCopier.plan`
  builds and uploads the tile table once per pattern, :meth:`DeviceCopier.run` is one kernel launch per
  request with no other host work, and :meth:`DeviceCopier.capture` records that launch in a CUDA graph
  whose replays publish successive flag values. The same program then writes the value into a pinned
  :class:`HostWord` of the plan (asked for at :meth:`DeviceCopier.plan`) or of the graph, so the host sees
  completion in its own memory.
- :class:`StagingCopy` (the ``staging`` analogue): pinned host buffer -> device staging slot -> destination in
  chunks, double-buffered so that the H2D copy of one chunk overlaps the device-initiated scatter of the previous
  one.

The benchmark of these primitives is :mod:`ascend_dualpath.bench.cuda_transfer` (``--primitives``).
Import needs neither CUDA nor Triton; they are loaded when used.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ascend_dualpath import errors as E

TILE_BYTES = 4 * 1024  # bytes one program copies per loop iteration (4 KiB tiles measured best at every size)


@dataclass(frozen=True)
class KernelConfig:
    """Grid and kernel shape of a plan.

    Attributes
    ----------
    tile_bytes : int
        Bytes one program copies per loop iteration (a power of two >= 64; default :data:`TILE_BYTES`).
    programs_per_sm : int
        Upper bound of programs in the grid per SM.
    num_warps : int
        Warps per program (1, 2, 4, 8 or 16).
    streaming : bool
        Streaming cache hints (loads bypass L1, stores evict first): for bytes touched once, in large requests.
    """

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


FLAG_MAX = (1 << 63) - 1


# Pinned memory of dropped host words whose last write has not landed: (view, value, tensor). torch's pinned
# allocator knows nothing of the GPU's writes and would hand the memory to the next pinned tensor at once.
_PARKED: deque = deque()


class HostWord:
    """One pinned int64 in host memory that the GPU writes after a request's last byte (a system-scope release),
    so that the host learns completion by reading its own memory: no event record, no driver query.

    The values a word receives only grow (a plan's launches, a graph's replays, one engine counter), so
    ``reached(v)`` holds once the request that publishes ``v`` or any later one completed. Whoever enqueues a write
    sets ``enqueued`` to its value: a word dropped before that value landed keeps its memory until it has
    (:func:`release_parked`), so a late write never lands in another tensor."""

    def __init__(self, torch):
        from ascend_dualpath.transport.cudart import host_device_pointer

        release_parked()
        self.enqueued = 0
        self.tensor = torch.zeros(1, dtype=torch.int64).pin_memory()
        self.addr = host_device_pointer(self.tensor.data_ptr())  # where the GPU writes it
        self._view = self.tensor.numpy()

    def reached(self, value: int) -> bool:
        return self._view[0] >= value

    def __del__(self):
        view = getattr(self, "_view", None)  # absent when the constructor failed
        if view is not None and view[0] < self.enqueued:
            _PARKED.append((view, self.enqueued, self.tensor))


def release_parked() -> int:
    """Let go of the parked memory of dropped host words whose last write has landed; returns how many stay."""
    for _ in range(len(_PARKED)):
        parked = _PARKED.popleft()
        if parked[0][0] < parked[1]:
            _PARKED.append(parked)
    return len(_PARKED)


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
        int64[3] on the GPU: programs arrived in the running launch, last published graph epoch, and the value cell
        (the caller's notify value of the next graph replay, 0 for none; written in stream order before it).
    host_word : HostWord or None
        Where the plan's launches (not its graph replays) publish their flag value for the host (None: nowhere).
    constexprs : dict
        The kernel's compile-time switches for this plan (``FROM_EPOCH`` excluded).
    site : LaunchSite
        The launch site of :meth:`DeviceCopier.run` (fixed grid; bound to the binary after the first run).
    args, fast_args : tuple
        The run's arguments before the flag value and the host word: with tensors (first launch, through Triton)
        and with plain addresses (later launches, straight to the binary's launcher).
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
    host_word: HostWord | None = None


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
        self.sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count

    def plan(
        self, src_addrs, dst_addrs, nbytes, config: KernelConfig | None = None, flag=None, host_word: bool = False
    ) -> CopyPlan:
        """Build the tile table for one segment pattern and enqueue its upload (host work, once per pattern).

        The upload goes on the current stream: run the plan on that stream, or synchronize first.

        Parameters
        ----------
        src_addrs, dst_addrs : sequence of int
            Device addresses of each segment's source (on this GPU) and destination (here or on a peer).
        nbytes : sequence of int
            Length of each segment in bytes (>= 1).
        config : KernelConfig or None
            Grid and kernel shape; None: :func:`choose_config` of the request size (its ``programs_per_sm``
            replaced by the copier's when set).
        flag : torch.Tensor or None
            This plan's ready flag (an int64 CUDA tensor; its first element is written), e.g. a notify slot on the
            destination GPU; None: the copier's flag.
        host_word : bool
            Give the plan a :class:`HostWord` that its launches publish into after the flag (for a caller that learns
            completion from it; the staging chunks and the benchmark's primitives do not).
        """
        flag = self.flag if flag is None else self._checked_flag(flag)
        sizes = np.asarray(nbytes, np.int64)
        if config is None:
            config = choose_config(int(sizes.sum()), self.sm_count)
            if self.programs_per_sm is not None:
                config = KernelConfig(config.tile_bytes, self.programs_per_sm, config.num_warps, config.streaming)
        plan = self._plan_tiles(src_addrs, dst_addrs, sizes, config, flag)
        if host_word:
            plan.host_word = HostWord(self.torch)
        return plan

    def _checked_flag(self, flag):
        """``flag`` if it can be a ready flag (int64, CUDA, at least one element), with peer access to its GPU."""
        if flag.dtype != self.torch.int64 or flag.device.type != "cuda" or flag.numel() < 1:
            raise E.ConfigError(
                f"a ready flag must be a non-empty int64 CUDA tensor, got {flag.dtype} "
                f"{tuple(flag.shape)} on {flag.device}"
            )
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

    def _plan_tiles(self, src_addrs, dst_addrs, sizes, config: KernelConfig, flag) -> CopyPlan:
        from ascend_dualpath._triton_launch import LaunchSite

        torch = self.torch
        tile_bytes, num_warps = config.tile_bytes, config.num_warps
        if tile_bytes < 64 or tile_bytes & (tile_bytes - 1):
            raise E.ConfigError(f"tile_bytes {tile_bytes} is not a power of two >= 64")
        if num_warps not in (1, 2, 4, 8, 16):
            raise E.ConfigError(f"num_warps {num_warps} is not one of 1, 2, 4, 8, 16")
        if config.programs_per_sm < 1:
            raise E.ConfigError(f"programs_per_sm must be >= 1, got {config.programs_per_sm}")
        width = element_bytes(src_addrs, dst_addrs, sizes)
        table = tile_table(src_addrs, dst_addrs, sizes, width, tile_bytes)
        programs = grid_size(table.shape[0], config.programs_per_sm * self.sm_count)
        constexprs = {
            "TILE": tile_bytes if width == 1 else tile_bytes // 4,
            "ELEM_BYTES": width,
            "SINGLE": programs == 1,
            "ARRIVE_SYS": self.arrivals_need_sys(dst_addrs, sizes),
            "STREAMING": config.streaming,
        }
        # pinned source, asynchronous upload: torch's host allocator keeps the block until the copy is done
        device_table = torch.from_numpy(table).pin_memory().to(self.device, non_blocking=True)
        state = torch.zeros(3, dtype=torch.int64, device=self.device)
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
            site=LaunchSite(
                _kernels().copy_tiles, programs, {**constexprs, "FROM_EPOCH": False, "num_warps": num_warps}
            ),
            args=(device_table, int(table.shape[0]), state, flag),
            fast_args=(device_table.data_ptr(), int(table.shape[0]), state.data_ptr(), flag.data_ptr()),
        )

    def run(self, plan: CopyPlan, flag_value: int, word_value: int | None = None) -> None:
        """Enqueue ``plan`` on the current stream; the flag becomes ``flag_value``, then ``plan.host_word`` (if any)
        ``word_value`` (default ``flag_value``), after every byte landed.

        Both must be in [1, 2**63 - 1] (0 is the flag's idle value), ``word_value`` above the plan's earlier ones (its
        host word only grows; the flag may take any value, e.g. a caller's notify value). After the plan's first run
        this is one call of the compiled binary's launcher with the plan's cached arguments.
        """
        word_value = flag_value if word_value is None else word_value
        for name, value in (("flag_value", flag_value), ("word_value", word_value)):
            if not 0 < value <= FLAG_MAX:
                raise E.ConfigError(f"{name} {value} is outside [1, {FLAG_MAX}]")
        site = plan.site
        word = plan.host_word
        if word is None:
            site(*(plan.fast_args if site.bound else plan.args), flag_value, 0, word_value)
        else:
            word.enqueued = word_value
            site(*(plan.fast_args if site.bound else plan.args), flag_value, word.addr, word_value)

    def copy(self, src_addrs, dst_addrs, nbytes, flag_value: int) -> CopyPlan:
        """Plan and run a pattern seen once (table built and uploaded on every call); returns the plan."""
        if not 0 < flag_value <= FLAG_MAX:
            raise E.ConfigError(f"flag_value {flag_value} is outside [1, {FLAG_MAX}]")
        plan = self.plan(src_addrs, dst_addrs, nbytes)
        self.run(plan, flag_value)
        return plan

    def capture(self, plan: CopyPlan, first_flag_value: int) -> GraphedCopy:
        """Record one launch of ``plan`` in a CUDA graph; replay ``k`` (from 0) publishes ``first_flag_value + k`` in
        the graph's own host word, and in the flag unless the replay carries a caller's value
        (:meth:`GraphedCopy.replay`). A new capture of a plan retires its earlier graphs (they share the plan's epoch
        counter and value cell)."""
        from ascend_dualpath._triton_launch import LaunchSite

        if not 0 < first_flag_value <= FLAG_MAX:
            raise E.ConfigError(f"first_flag_value {first_flag_value} is outside [1, {FLAG_MAX}]")
        torch = self.torch
        site = LaunchSite(
            plan.site.kernel,
            plan.programs,
            {**plan.constexprs, "FROM_EPOCH": True, "num_warps": plan.num_warps},
        )
        word = HostWord(torch)
        with torch.cuda.device(self.device):
            # compile outside the capture (the flag value is unspecialised and unused with FROM_EPOCH)
            fast = site.prepare(*plan.args, 1 << 40, word.addr, 1 << 40)
            plan.state[1].fill_(first_flag_value - 1)
            plan.state[2].fill_(0)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                site(*(plan.fast_args if fast else plan.args), 1 << 40, word.addr, 1 << 40)
        return GraphedCopy(graph, plan, first_flag_value, word, fast_launch=fast)


class GraphedCopy:
    """A captured launch of one plan: :meth:`replay` is the whole host work of a request; ``host_word`` receives
    each replay's epoch after its last byte. The graph bakes in no notify value: a replay that carries one writes it
    into the plan's value cell first (one stream write, in stream order, so an earlier replay still in flight keeps
    its own), and the next replay without one clears the cell."""

    def __init__(self, graph, plan: CopyPlan, first_flag_value: int, host_word: HostWord, fast_launch: bool):
        self.graph = graph
        self.plan = plan
        self.next_value = first_flag_value
        self.host_word = host_word
        self.fast_launch = fast_launch  # captured through Triton's compiled launcher (else through the JIT)
        self._exec = _graph_exec(graph)
        self._launch = None  # the runtime's cudaGraphLaunch, bound at the first replay on a raw stream
        self._cell = None  # cudart.StreamWrites of the plan's value cell, made at the first caller's value
        self._cell_value = 0  # what the cell holds as of the last replay enqueued

    def replay(self, stream: int | None = None, flag_value: int | None = None) -> int:
        """Enqueue the copy on ``stream`` (a raw handle; None: the current stream); returns the epoch it publishes in
        the host word, which is also the flag's value unless ``flag_value`` (in [1, 2**63 - 1]) is given. With a
        stream, the instantiated graph is launched through the runtime (``cudaGraphLaunch``, ~1 µs of host time
        against ~4 µs for ``torch.cuda.CUDAGraph.replay``)."""
        cell = 0 if flag_value is None else flag_value
        if cell != self._cell_value:
            self._write_cell(stream, cell)
        if stream is None or self._exec is None:
            self.graph.replay()
        else:
            if self._launch is None:
                from ascend_dualpath.transport.cudart import graph_launcher

                self._launch = graph_launcher(self._exec)
            self._launch(stream)
        self.host_word.enqueued = value = self.next_value
        self.next_value += 1
        return value

    def _write_cell(self, stream: int | None, value: int) -> None:
        """Enqueue the write of ``value`` into the plan's value cell on ``stream`` (None: the current stream)."""
        if not 0 <= value <= FLAG_MAX:
            raise E.ConfigError(f"flag_value {value} is outside [1, {FLAG_MAX}]")
        if self._cell is None:
            from ascend_dualpath.transport.cudart import StreamWrites

            state = self.plan.state
            self._cell = StreamWrites([state.data_ptr() + 2 * state.element_size()])
        if stream is None:
            import torch

            stream = torch.cuda.current_stream(self.plan.state.device).cuda_stream
        self._cell(stream, value)
        self._cell_value = value


def _graph_exec(graph) -> int | None:
    """The ``cudaGraphExec_t`` of a captured torch graph, None where this torch does not expose it."""
    raw = getattr(graph, "raw_cuda_graph_exec", None)
    if raw is None:
        return None
    try:
        return int(raw())
    except RuntimeError:  # a torch that keeps the graph un-instantiated until the first replay
        return None


STAGING_CHUNK_BYTES = 4 << 20  # bytes per staging chunk: 16 chunks for 64 MiB; a 61 x 42 KiB request is one chunk


def staging_pieces(offsets, dst_addrs, nbytes, chunk_bytes: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
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


def staging_chunk_lengths(end: int, chunk_bytes: int) -> list[int]:
    """Bytes of each chunk's host-to-device copy when the furthest segment ends at byte ``end`` of the host buffer:
    whole chunks, the last one cut at ``end`` (nothing past the last segment is copied or staged)."""
    return [min(chunk_bytes, end - start) for start in range(0, end, chunk_bytes)]


def _check_staging_request(torch, host, offsets, nbytes, chunk_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The segments' offsets and lengths (int64 ``[segments]`` each) of a :class:`StagingCopy` request, after checking
    the host buffer (pinned 1-D uint8 CPU), ``chunk_bytes`` and that every segment is non-empty and inside ``host``.
    """
    if host.device.type != "cpu" or host.dtype != torch.uint8 or host.dim() != 1 or not host.is_pinned():
        raise E.ConfigError(
            f"the staging source must be a pinned 1-D uint8 CPU tensor, got {host.dtype} "
            f"{tuple(host.shape)} on {host.device} (pinned: {host.is_pinned()})"
        )
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
    return off, size


class StagingCopy:
    """The ``staging`` kind, pipelined: pinned host buffer -> device staging slot -> destination, chunk by chunk.

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
        Bytes per chunk, a multiple of 16 from 4 KiB (default ``STAGING_CHUNK_BYTES``).
    """

    def __init__(self, copier: DeviceCopier, host, offsets, dst_addrs, nbytes, chunk_bytes: int = STAGING_CHUNK_BYTES):
        torch = copier.torch
        off, size = _check_staging_request(torch, host, offsets, nbytes, chunk_bytes)
        self.copier, self.host, self.torch = copier, host, torch
        pieces = staging_pieces(off, dst_addrs, size, chunk_bytes)
        self.chunk_bytes = chunk_bytes
        self.lengths = staging_chunk_lengths(int((off + size).max()), chunk_bytes)
        slot_bytes = self.lengths[0]  # the first chunk is the longest
        self.slots = [
            torch.empty(slot_bytes, dtype=torch.uint8, device=copier.device) for _ in range(min(2, len(pieces)))
        ]
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
