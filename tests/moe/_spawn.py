"""Run a function on N gloo ranks in spawned processes, with a hard bound on the whole run."""

from __future__ import annotations

import contextlib
import os
import queue
import tempfile
import traceback

import torch.multiprocessing as mp

RUN_TIMEOUT_S = 120.0


def _entry(rank: int, world: int, store_path: str, fn, args, results, backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world,
            **({"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}),
        )
        results.put((rank, fn(rank, world, *args)))
    except BaseException:  # report everything, including assertion failures outside the checks
        results.put((rank, {"__fatal__": traceback.format_exc()}))
    finally:
        results.close()
        results.join_thread()
        # Skip interpreter teardown: a peer stuck in a timed-out collective must not block our exit.
        os._exit(0)


def run_ranks(world: int, fn, *args, timeout_s: float = RUN_TIMEOUT_S, backend: str = "gloo") -> list[dict]:
    """Return ``fn(rank, world, *args)`` of every rank (each a dict of check name -> "ok" or a traceback)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = tempfile.NamedTemporaryFile(prefix="adp_moe_store_", delete=False)
    store.close()
    os.unlink(store.name)
    procs = [ctx.Process(target=_entry, args=(r, world, store.name, fn, args, results, backend)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, dict] = {}
    try:
        for _ in range(world):
            rank, value = results.get(timeout=timeout_s)
            out[rank] = value
    except queue.Empty:
        out = {r: out.get(r, {"__fatal__": f"rank {r} gave no result within {timeout_s} s"}) for r in range(world)}
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        # the ranks skip destroy_process_group (os._exit), which would delete the rendezvous file
        with contextlib.suppress(FileNotFoundError):
            os.unlink(store.name)
    return [out[r] for r in range(world)]
