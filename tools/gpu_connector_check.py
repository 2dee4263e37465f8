"""The connector's ``cuda`` engine on a GPU, in one go: its checks, then the per-layer push timed against torch.

1. runs the GPU tests of the engine's connector path (``pytest -m cuda tests/integrations/vllm/test_cuda_pairs.py``:
   a PE and a DE in two processes on one GPU, every read path bit-exact in vLLM's CUDA FLASH_ATTN layout);
2. starts a PE and a DE (two processes, :class:`~tests.integrations.vllm.cuda_harness.CudaDeployment`), lets them
   meet with one DE-path request, then times in the DE one hit layer's push into the PE's window through the
   connector's leg (the layer's block of each hit Full Block at a constant stride, then the notify), against a torch
   copy of the same bytes between the same memories (the strided host blocks, and the same bytes packed in pinned
   memory: one host-to-device copy), CUDA events and host clock, medians after warm-up;
3. prints a table and writes ``gpu_connector_check.json`` under ``$OUT`` (default: the current directory).

Run from the repository root on a machine with a CUDA GPU and Triton: ``OUT=/tmp/out python3 tools/gpu_connector_check.py``.
The layer shape is a Llama-3-8B-like layer of 16-token blocks (8 KV heads of 128, float16: 64 KiB per block and
layer, 32 layers per Full Block).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYERS, LAYER_BLOCK = 32, 64 << 10  # 16 tokens x 8 KV heads x 128 x (K, V) x float16
HIT_BLOCKS = (4, 16, 61, 128)
REPS = 64
BUFFERS_MB = (64, 320)  # the PE's window (two slots of the largest push fit), each host buffer


def run_tests() -> dict:
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
            "tests/integrations/vllm/test_cuda_pairs.py"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=540)
    tail = done.stdout.strip().splitlines()[-1:] or [done.stderr.strip()[-300:]]
    print(done.stdout[-3000:])
    return {"command": " ".join(argv[1:]), "returncode": done.returncode, "summary": tail[0]}


def time_pushes() -> list[dict]:
    import torch

    from tests.integrations.vllm.cuda_harness import CudaDeployment, push_times
    from tests.integrations.vllm.worker_harness import run_request

    rows = []
    with tempfile.TemporaryDirectory(prefix="adp-gpu-check-") as root:
        d = CudaDeployment(root, buffers_mb=BUFFERS_MB)
        try:
            run_request(d, "pe0", "de0", 29, 6, "de", False, 0)  # the hello: the link exists on both sides
            for blocks in HIT_BLOCKS:
                rows.append(d.call("de0", push_times, "de0", blocks, LAYERS, LAYER_BLOCK, REPS, timeout_s=300))
                print({k: v for k, v in rows[-1].items() if k != "kinds"}, rows[-1]["kinds"], flush=True)
        finally:
            d.close()
    rows and rows[0].update(device=torch.cuda.get_device_name(0), torch_version=torch.__version__)
    return rows


def table(rows: list[dict]) -> str:
    """One line per push size: the push's host time (cold, warm), then the GPU time of the same bytes moved alone."""
    cols = ["hit blocks", "MiB per layer", "push cold µs", "push warm µs", "its 2-D copy µs", "torch strided µs",
            "torch packed µs", "exact"]  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r["blocks"], f"{r['bytes'] / 2**20:.2f}", f"{r['push_cold']['wall_us']:.0f}",
                 f"{r['push_warm']['wall_us']:.0f}", f"{r['copy2d']['gpu_us']:.0f}", f"{r['torch']['gpu_us']:.0f}",
                 f"{r['torch_packed']['gpu_us']:.0f}", r["push_exact"]]  # fmt: skip
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> int:
    out = os.environ.get("OUT", ".")
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    report["tests"] = run_tests()
    report["pushes"] = time_pushes()
    print(table(report["pushes"]))
    with open(os.path.join(out, "gpu_connector_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0 if report["tests"]["returncode"] == 0 and all(r["push_exact"] for r in report["pushes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
