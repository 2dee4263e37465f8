"""PE and DE connector workers in separate processes on one GPU over the connector's ``cuda`` engine, without vLLM.

:class:`CudaDeployment` is :class:`~tests.integrations.vllm.worker_harness.Deployment` with each instance in a
process of its own (``spawn``): the driver writes the store and builds the requests as the one-process harness does,
and each instance's calls (``expect_recv``, ``prefill``, ``finish``, ...) run in its process, on a :class:`Half`
(that harness's deployment of the one instance, its FLASH_ATTN caches on the GPU in vLLM's CUDA layout). Every call
is answered within a bound or fails naming the instance and the call; a process that does not stop is killed.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing as mp
import os
import secrets
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from ascend_dualpath.dualpath.dataplane import PE_RANK, SHM_DIR
from ascend_dualpath.dualpath.dataplane_cuda import SHM_PREFIX
from ascend_dualpath.dualpath.settings import UNCAPPED_BYTES_PER_S
from ascend_dualpath.dualpath.transfer_leg import Segment
from ascend_dualpath.kv.store import LocalBlockStore
from ascend_dualpath.transport import cudart
from tests.integrations.vllm.worker_harness import TIMEOUT_S, Deployment, Instance, Model

START_TIMEOUT_S = 120.0  # a fresh process imports torch and initialises CUDA
CALL_TIMEOUT_S = 60.0


class Half(Deployment):
    """The one instance ``name`` of a deployment, in this process, its caches on the current GPU."""

    device = "cuda"

    def __init__(self, root: str, name: str, role: str, index: int, buffers_mb: tuple[int, int]) -> None:
        self.root, self.engine = root, "cuda"
        self.model = Model()  # one rank of the default GQA model: the caches vLLM's CUDA FLASH_ATTN backend keeps
        self.adapter = self.model.adapter
        self.fabric = f"unused{os.getpid()}x{secrets.token_hex(4)}"  # no fabric is made on the cuda engine
        self.hccl_buffer_mb, self.host_buffer_mb = buffers_mb
        self.instances, self._ids, self.layer_waits = {}, itertools.count(), []
        self.instances[name] = self._start(name, role, index, UNCAPPED_BYTES_PER_S)
        self.store = LocalBlockStore(self.root, self.model.full)

    def prefill(self, pe: str, req, **kwargs) -> set[int]:
        return super().prefill(pe, dataclasses.replace(req, rows=req.rows.to(self.device)), **kwargs)

    def caches(self, name: str) -> list[torch.Tensor]:
        """The instance's caches, copied to the host (logical FLASH_ATTN shape)."""
        return [cache.cpu().contiguous() for cache in self.instances[name].caches]

    def links(self, name: str) -> list[dict]:
        """Per link: its class, the kinds its leg used and the bytes it sent."""
        links = self.instances[name].worker.dataplane.links.values()
        return [{"type": type(link).__name__, "kinds": dict(link.leg.kinds_used), "sent": link.leg.bytes_sent} for link in links]  # fmt: skip

    def status(self, name: str) -> dict:
        return self.instances[name].status()


def push_times(half: Half, name: str, blocks: int, layers: int, layer_block: int, reps: int) -> dict:
    """Time one hit layer's push through the DE ``name``'s link to its PE, as the DE pushes it (``blocks`` Full
    Blocks of ``layers`` layers of ``layer_block`` bytes in a host lease; the layer's block of each at a constant
    stride into the start of the PE's window, then the notify), against the same bytes moved by the one copy the
    engine enqueues for it alone (``cudaMemcpy2DAsync``) and by torch between the same memories (the strided host
    blocks, and the same bytes packed in pinned memory: one host-to-device copy). Pushes are timed at the first
    sight of each layer's pattern (``cold``: a new lease's pushes route, check and plan) and after (``warm``), the
    copies after warm-up; medians in µs of ``reps`` runs, with the bytes per push and the kinds the leg used."""
    link = next(iter(half.instances[name].worker.dataplane.links.values()))
    host = half.instances[name].worker.dataplane.host
    full_block, nbytes = layers * layer_block, blocks * layer_block
    lease = host.allocate("timing", blocks * full_block)
    try:
        lease.tensor.copy_(torch.randint(0, 256, (lease.nbytes,), dtype=torch.uint8))
        window_addr, window_size = link.peer_window()
        assert nbytes <= window_size, f"{nbytes} bytes do not fit the PE's window of {window_size}"
        dst = link.peer_memory.window[:nbytes]
        src = lease.tensor.view(blocks, full_block)
        packed = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        copy2d = cudart.Memcpy2D(dst.data_ptr(), layer_block, lease.addr, full_block, layer_block, blocks)
        magics = itertools.count(1 << 40)

        def push(layer: int) -> None:
            segments = [Segment(lease.addr + b * full_block + layer * layer_block, layer_block, b * layer_block) for b in range(blocks)]  # fmt: skip
            ticket = link.leg.submit(layer, segments, PE_RANK, window_addr, 0, next(magics))
            link.leg.wait(ticket, TIMEOUT_S)

        copies = {
            "copy2d": lambda layer: copy2d(torch.cuda.current_stream().cuda_stream),
            "torch": lambda layer: dst.view(blocks, layer_block).copy_(
                src[:, layer * layer_block : (layer + 1) * layer_block], non_blocking=True
            ),  # fmt: skip
            "torch_packed": lambda layer: dst.copy_(packed, non_blocking=True),
        }
        results = {"bytes": nbytes, "blocks": blocks, "layer_block": layer_block}
        results["push_cold"] = _timed(push, range(layers))
        results["push_warm"] = _timed(push, [i % layers for i in range(reps)])
        for label, run in copies.items():
            _timed(run, range(5))
            results[label] = _timed(run, [i % layers for i in range(reps)])
        push(0)
        results["push_exact"] = bool(torch.equal(dst, src[:, :layer_block].reshape(-1).to(dst.device)))
        results["kinds"] = dict(link.leg.kinds_used)
        return results
    finally:
        lease.release()


def _timed(run: Callable[[int], None], layers) -> dict:
    """Median GPU time (CUDA events around the call) and host time (the call until the GPU finished) in µs, one
    run per layer of ``layers``."""
    gpu, wall = [], []
    for layer in layers:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        run(layer)
        end.record()
        end.synchronize()
        wall.append((time.perf_counter() - t0) * 1e6)
        gpu.append(start.elapsed_time(end) * 1e3)
    return {"gpu_us": statistics.median(gpu), "wall_us": statistics.median(wall)}


def _serve(conn, root: str, name: str, role: str, index: int, buffers_mb: tuple[int, int]) -> None:
    """A child's loop: build the instance, then run the driver's calls until it says ``close`` (or stays silent
    past ``CALL_TIMEOUT_S`` twice over: the driver is gone)."""
    torch.cuda.set_device(0)
    try:
        half = Half(root, name, role, index, buffers_mb)
    except BaseException as error:
        conn.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
        return
    conn.send(("ok", half.instances[name].address))
    try:
        while conn.poll(2 * CALL_TIMEOUT_S):
            call, args, kwargs = conn.recv()
            if call == "close":
                break
            try:
                result = call(half, *args, **kwargs) if callable(call) else getattr(half, call)(*args, **kwargs)
                conn.send(("ok", result))
            except BaseException as error:
                conn.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        half.close()
        conn.send(("closed", None))


class CudaDeployment(Deployment):
    """``num_pe`` PEs then ``num_de`` DEs, one process each, on GPU 0 over the ``cuda`` engine, sharing the store
    under ``root``; ``buffers_mb``: each instance's window and host buffer (MiB)."""

    def __init__(self, root, num_pe: int = 1, num_de: int = 1, buffers_mb: tuple[int, int] = (2, 4)) -> None:
        self.root, self.engine = str(root), "cuda"
        self.model = Model()
        self.adapter = self.model.adapter
        self.fabric = f"unused{os.getpid()}x{secrets.token_hex(4)}"
        self.instances, self._ids, self.layer_waits = {}, itertools.count(), []
        self._children: dict[str, tuple[Any, Any]] = {}
        context = mp.get_context("spawn")
        try:
            for i, role in enumerate(["prefill"] * num_pe + ["decode"] * num_de):
                name = f"pe{i}" if role == "prefill" else f"de{i - num_pe}"
                parent, child = context.Pipe()
                args = (child, self.root, name, role, i, buffers_mb)
                process = context.Process(target=_serve, args=args, name=f"adp-{name}", daemon=True)
                process.start()
                self._children[name] = (process, parent)
                address = self._answer(name, "start", START_TIMEOUT_S)
                self.instances[name] = Instance(None, [], address, role)
        except BaseException:
            self.close()
            raise
        self.store = LocalBlockStore(self.root, self.model.full)

    def _answer(self, name: str, what: str, timeout_s: float) -> Any:
        process, conn = self._children[name]
        if not conn.poll(timeout_s):
            raise TimeoutError(f"{name} did not answer {what} within {timeout_s} s (alive: {process.is_alive()})")
        status, value = conn.recv()
        if status != "ok":
            raise AssertionError(f"{name} failed {what}: {value}")
        return value

    def call(self, name: str, call: str | Callable, *args, timeout_s: float = CALL_TIMEOUT_S, **kwargs) -> Any:
        """``call(*args, **kwargs)`` on instance ``name``'s :class:`Half` (a method name, or a module-level function
        taking the half first), in its process; its result, or AssertionError with the child's traceback."""
        self._children[name][1].send((call, args, kwargs))
        return self._answer(name, getattr(call, "__name__", call), timeout_s)

    def expect_recv(self, de, spec) -> None:
        self.call(de, "expect_recv", de, spec)

    def prefill(self, pe, req, **kwargs) -> set[int]:
        return self.call(pe, "prefill", pe, req, **kwargs)

    def finish(self, de, req_ids, timeout_s=TIMEOUT_S):
        return self.call(de, "finish", de, req_ids, timeout_s)

    def drain(self, de, spec, timeout_s=TIMEOUT_S) -> None:
        self.call(de, "drain", de, spec, timeout_s)

    def done(self, pe, req) -> None:
        self.call(pe, "done", pe, req)

    def close(self) -> None:
        for process, conn in self._children.values():
            if process.is_alive():
                conn.send(("close", (), {}))
                if conn.poll(CALL_TIMEOUT_S):
                    conn.recv()
                process.join(CALL_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join(CALL_TIMEOUT_S)
            conn.close()
        self._children.clear()
        self.instances.clear()
        if hasattr(self, "store"):
            self.store.close()


def leftover_shm() -> list[str]:
    """The cuda engine's host-region files in ``/dev/shm`` (none once every instance closed)."""
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(SHM_PREFIX))
