"""One GPU run for the transfer engine: versions, the CUDA tests, the engine against torch, a profile.

    python3 tools/gpu_bench_engine.py            # results under $OUT (default ./gpu_bench_engine_out)

Steps, each bounded and each failure recorded without stopping the others (the whole run stays under
``TOTAL_S``):

1. versions of python, torch, CUDA, Triton, pytest, hypothesis and the GPU (``versions.json``);
2. ``pytest -m cuda tests/dualpath tests/transport`` in a subprocess (``pytest.txt``);
3. on one GPU (source and destination there), through the engine API (``prepare`` once, then ``submit`` /
   ``wait``) beside torch's baselines in this process: 61 x 42 KiB layer blocks, 256 / 1024 / 4096 x 4 KiB (with
   the cost of a plain ``submit`` per segment), 256 x 1 MiB, one piece of 1 to 64 MiB (the copy-engine gate
   against the kernel and ``copy_``), CUDA-graph replay of a prepared request; every row bit-exact
   (``bench.json``, a table on stdout);
4. what a stream operation right after a 64 MiB copy-engine copy adds to the stream's GPU time (an event, a stream
   write, a kernel, a second copy, the engine's tail stream), the reason the copy-engine kinds end on a tail stream
   (``tail.json``, a table on stdout);
5. a cProfile of prepared 61 x 42 KiB requests (``profile.txt``);
6. the issue's targets, met or not (``summary.json``).
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OUT = os.environ.get("OUT") or os.path.join(ROOT, "gpu_bench_engine_out")
TOTAL_S = 450.0  # the lead's window is 8 minutes
PYTEST_S = 200.0
START = time.monotonic()
KIB, MIB = 1024, 1 << 20


def left_s() -> float:
    return TOTAL_S - (time.monotonic() - START)


def write(name: str, data) -> None:
    with open(os.path.join(OUT, name), "w") as f:
        if isinstance(data, str):
            f.write(data)
        else:
            json.dump(data, f, indent=1, default=str)


def versions() -> dict:
    found = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    for name in ("torch", "triton", "numpy", "pytest", "hypothesis"):
        try:
            found[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - a missing package is a finding, not a failure
            found[name] = f"absent ({type(exc).__name__}: {exc})"
    try:
        import torch

        found["torch_cuda"] = torch.version.cuda
        found["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            found["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as exc:  # noqa: BLE001
        found["cuda_available"] = f"no ({exc})"
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        found["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        found["nvidia_smi"] = f"not run ({exc})"
    return found


def run_tests() -> dict:
    limit = min(PYTEST_S, left_s() - 200)
    if limit < 30:
        return {"skipped": "no time left"}
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "cuda",
        "-rs",
        "tests/dualpath",
        "tests/transport",
    ]
    env = dict(os.environ, PYTHONPATH=ROOT)
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit, check=False)
        output, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output, rc = f"{_text(exc.stdout)}{_text(exc.stderr)}\nTIMED OUT after {limit:.0f} s", "timeout"
    write("pytest.txt", " ".join(command) + "\n\n" + output)
    tail = [line for line in output.splitlines() if line.strip()][-1:] or [""]
    print(f"pytest rc={rc}: {tail[0]}", flush=True)
    return {"command": " ".join(command), "rc": rc, "last_line": tail[0]}


def _text(captured) -> str:
    """A timed-out subprocess's partial output (bytes even with ``text=True``, or None) as text."""
    if captured is None:
        return ""
    return captured.decode(errors="replace") if isinstance(captured, bytes) else captured


# ---- the benchmark ---------------------------------------------------------------------------------------------

CASES = [  # (name, count, size, rows)
    (
        "61x42K layer blocks",
        61,
        42 * KIB,
        ("engine", "engine submit", "engine graph", "bare kernel", "foreach", "copy"),
    ),
    ("256x4K", 256, 4 * KIB, ("engine", "engine submit", "foreach")),
    ("1024x4K", 1024, 4 * KIB, ("engine", "engine submit", "foreach")),
    ("4096x4K", 4096, 4 * KIB, ("engine", "engine submit", "foreach", "copy")),
    ("256x1M", 256, MIB, ("engine", "foreach", "copy")),
    ("1x64M", 1, 64 * MIB, ("engine", "engine no notify", "engine aiv", "copy")),
    ("1x16M", 1, 16 * MIB, ("engine", "engine aiv", "copy")),
    ("1x8M", 1, 8 * MIB, ("engine", "engine aiv", "copy")),
    ("1x4M", 1, 4 * MIB, ("engine", "engine aiv", "copy")),
    ("1x1M", 1, MIB, ("engine", "engine aiv", "copy")),
]


def submitter(torch, bench, engine, copier, label, case, buffers):
    """The row's Submitter: the engine with its gates, forced to aiv, a plain submit, a graph replay, the bare
    kernel, or a torch baseline."""
    if label in ("foreach", "copy"):
        return bench.baseline_submitter(torch, label, buffers)
    if label == "bare kernel":
        return bench.primitive_submitter(torch, "device", case, copier, buffers)
    segments = [engine.segment(buffers.src, i * case.size, case.size) for i in range(case.count)]
    slot = engine.slot(buffers.dst)
    kind = "aiv" if label in ("engine aiv", "engine graph") else None
    prepared = engine.prepare(segments, slot, notify_slot=None if label == "engine no notify" else 0, kind=kind)
    name = f"{label} {case.name}"
    if label == "engine graph":
        return bench.graph_submitter(torch, engine, prepared, name, buffers.src)
    if label == "engine submit":  # routed again on every call (its cache): the cost per segment of submit()
        return bench.engine_submitter(
            engine, prepared, name, buffers.src, lambda: engine.submit(segments, slot, notify_slot=0)
        )
    return bench.engine_submitter(engine, prepared, name, buffers.src)


def run_bench() -> tuple[list[dict], list[str]]:
    import torch

    from ascend_dualpath.bench import cuda_transfer as bench
    from ascend_dualpath.bench.transfer import Case
    from ascend_dualpath.transport.cuda import DeviceCopier
    from ascend_dualpath.transport.cuda_engine import CudaTransferEngine

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    rows, failures = [], []
    stream = torch.cuda.Stream(dev)  # not the legacy default stream (the aicpu kind's batch call refuses it)
    with torch.cuda.stream(stream):
        cycles = bench.sleep_cycles_per_us(torch)
        engine = CudaTransferEngine(dev, dev, torch.zeros(4, dtype=torch.int64, device=dev), timeout_s=30)
        copier = DeviceCopier(dev, torch.zeros(1, dtype=torch.int64, device=dev))
        for name, count, size, labels in CASES:
            case = Case(name, count, size)
            buffers = bench.make_buffers(torch, case, dev, dev)
            torch.cuda.synchronize()
            for label in labels:
                if left_s() < 40:
                    failures.append(f"{label} {name}: skipped, the run's time is up")
                    continue
                repeats = 10 if (label == "copy" and count >= 1024) else 50
                try:
                    row = bench.measure(
                        torch,
                        label,
                        case,
                        submitter(torch, bench, engine, copier, label, case, buffers),
                        buffers,
                        repeats,
                        cycles,
                        warmup=10,
                    )
                except Exception as exc:  # noqa: BLE001 - one failing case must not stop the others
                    failures.append(f"{label} {name}: {type(exc).__name__}: {exc}")
                    print(f"  FAILED {failures[-1]}\n{traceback.format_exc(limit=4)}", flush=True)
                    continue
                rows.append(asdict(row))
                print(line(rows[-1]), flush=True)
            del buffers
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return rows, failures


def line(r: dict) -> str:
    extra = r["extra"]
    return (
        f"{r['case']:<21} {r['kind']:<14} submit {r['submit_us']:8.2f} us ({r['submit_us_per_segment']:.3f}/seg)"
        f"  wall {extra['wall_us_p50']:8.1f}  latency {r['latency_us_p50']:8.1f}  gpu {r['gpu_us_p50']:8.1f} us"
        f"  {extra.get('decided_by', '')}"
    )


def copy_tail() -> list[dict]:
    """GPU time (CUDA events, the stream held while the work is enqueued, median of 100 interleaved rounds) of one
    64 MiB ``cudaMemcpyAsync`` followed by each kind of stream operation, against ``copy_`` alone."""
    import statistics

    import torch

    from ascend_dualpath.bench import cuda_transfer as bench
    from ascend_dualpath.transport import cudart
    from ascend_dualpath.transport.cuda import HostWord

    dev = torch.device("cuda:0")
    stream = torch.cuda.Stream(dev)
    with torch.cuda.stream(stream):
        hold = int(bench.sleep_cycles_per_us(torch) * 100)
        src = torch.randint(0, 256, (64 * MIB,), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        word, flag = HostWord(torch), torch.zeros(1, dtype=torch.int64, device=dev)
        tail = cudart.TailStream(torch, dev)
        host_write, both = cudart.StreamWrites([word.addr]), cudart.StreamWrites([flag.data_ptr(), word.addr])
        event, values = torch.cuda.Event(), itertools.count(1)
        memcpy = cudart.runtime().lib.cudaMemcpyAsync

        def copy(s, n=64 * MIB, at=0):
            memcpy(dst.data_ptr() + at, src.data_ptr() + at, n, cudart.MEMCPY_DEFAULT, s)

        variants = {
            "copy_ alone": lambda s: dst.copy_(src),
            "cudaMemcpyAsync alone": copy,
            "+ event record": lambda s: (copy(s), event.record()),
            "+ stream write to a host word": lambda s: (copy(s), host_write(s, next(values))),
            "+ stream writes to a flag and a host word": lambda s: (copy(s), both(s, next(values))),
            "+ a kernel (one add_)": lambda s: (copy(s), flag.add_(1)),
            "as two copies of 32 MiB": lambda s: (copy(s, 32 * MIB), copy(s, 32 * MIB, 32 * MIB)),
            "+ the same writes on the engine's tail stream": lambda s: (copy(s), both(tail.follow(s), next(values))),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for round_ in range(110):
            for name, enqueue in variants.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(hold)
                start.record()
                enqueue(stream.cuda_stream)
                end.record()
                end.synchronize()
                if round_ >= 10:  # warm-up
                    times[name].append(start.elapsed_time(end) * 1e3)
        torch.cuda.synchronize()
        if not torch.equal(dst, src):
            raise AssertionError("the copies' destination differs from the source")
    base = statistics.median(times["copy_ alone"])
    rows = []
    for name, values_us in times.items():
        gpu = statistics.median(values_us)
        rows.append({"variant": name, "gpu_us_p50": gpu, "copy_over_this": base / gpu})
        print(f"  {name:<48} {gpu:8.2f} us  copy_ / this {base / gpu:6.3f}", flush=True)
    return rows


def profile() -> str:
    import cProfile
    import io
    import pstats

    import torch

    from ascend_dualpath.transport.cuda_engine import CudaTransferEngine

    dev = torch.device("cuda:0")
    engine = CudaTransferEngine(dev, dev, torch.zeros(1, dtype=torch.int64, device=dev))
    src = torch.randint(0, 256, (61 * 42 * KIB,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    prepared = engine.prepare([engine.segment(src, i * 42 * KIB, 42 * KIB) for i in range(61)], engine.slot(dst), 0)
    for _ in range(20):
        prepared.transfer()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(500):
        prepared.transfer()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return "500 x prepared 61x42K submit().wait(), by own time\n" + text.getvalue()


# ---- targets ---------------------------------------------------------------------------------------------------


def targets(rows: list[dict]) -> list[dict]:
    by = {(r["case"], r["kind"]): r for r in rows}

    def get(case, kind, field):
        r = by.get((case, kind))
        if r is None:
            return None
        return r["extra"]["wall_us_p50"] if field == "wall" else r[field]

    def ratio(a, b):
        return None if a is None or b is None or a == 0 else b / a

    lb = "61x42K layer blocks"
    checks = [
        ("61x42K engine wall p50 <= 20 us", get(lb, "engine", "wall"), lambda v: v <= 20),
        (
            "61x42K foreach / engine (wall) >= 2",
            ratio(get(lb, "engine", "wall"), get(lb, "foreach", "wall")),
            lambda v: v >= 2,
        ),
        (
            "61x42K foreach / engine (CUDA-event latency) >= 2",
            ratio(get(lb, "engine", "latency_us_p50"), get(lb, "foreach", "latency_us_p50")),
            lambda v: v >= 2,
        ),
        (
            "1x64M copy_ / engine (GPU time) >= 0.97",
            ratio(get("1x64M", "engine", "gpu_us_p50"), get("1x64M", "copy", "gpu_us_p50")),
            lambda v: v >= 0.97,
        ),
        (
            "1x64M copy_ / engine without notify (GPU time) (info)",
            ratio(get("1x64M", "engine no notify", "gpu_us_p50"), get("1x64M", "copy", "gpu_us_p50")),
            lambda v: True,
        ),
        (
            "256x1M foreach / engine (wall) >= 1.8",
            ratio(get("256x1M", "engine", "wall"), get("256x1M", "foreach", "wall")),
            lambda v: v >= 1.8,
        ),
        (
            "256x1M foreach / engine (GPU time) >= 1.8",
            ratio(get("256x1M", "engine", "gpu_us_p50"), get("256x1M", "foreach", "gpu_us_p50")),
            lambda v: v >= 1.8,
        ),
    ]
    for case in ("256x4K", "1024x4K", "4096x4K"):
        checks.append(
            (
                f"{case} plain submit <= 0.1 us/segment",
                get(case, "engine submit", "submit_us_per_segment"),
                lambda v: v <= 0.1,
            )
        )
        checks.append(
            (f"{case} prepared submit us/segment (info)", get(case, "engine", "submit_us_per_segment"), lambda v: True)
        )
    checks.append(
        ("every measured row bit-exact", all(r["extra"].get("bit_exact") for r in rows) and bool(rows), lambda v: v)
    )
    return [
        {"target": name, "value": value, "met": None if value is None else bool(test(value))}
        for name, value, test in checks
    ]


def main() -> int:
    os.makedirs(OUT, exist_ok=True)
    summary: dict = {"out": OUT}
    found = versions()
    write("versions.json", found)
    print(json.dumps(found, indent=1), flush=True)
    summary["tests"] = safe("tests", run_tests, summary)
    if found.get("cuda_available") is not True or str(found.get("triton", "")).startswith("absent"):
        summary["bench"] = "skipped: needs torch with CUDA and Triton"
        write("summary.json", summary)
        print(summary["bench"])
        return 1
    result = safe("bench", run_bench, summary)
    rows, failures = result if isinstance(result, tuple) else ([], [str(result)])
    write("bench.json", {"versions": found, "rows": rows, "failures": failures})
    if left_s() > 30:
        print("\n64 MiB copy-engine copy, then:")
        write("tail.json", safe("tail", copy_tail, summary))
    if left_s() > 30:
        text = safe("profile", profile, summary)
        write("profile.txt", str(text))
        print("\n".join(str(text).splitlines()[:40]))
    summary["failures"] = failures
    summary["targets"] = targets(rows)
    summary["elapsed_s"] = round(time.monotonic() - START, 1)
    write("summary.json", summary)
    print("\ntarget".ljust(60), "value", "met")
    for t in summary["targets"]:
        value = t["value"] if not isinstance(t["value"], float) else round(t["value"], 3)
        print(f"  {t['target']:<58} {value!s:<10} {t['met']}")
    for failure in failures:
        print("FAILED", failure)
    print(f"elapsed {summary['elapsed_s']} s; results in {OUT}")
    return 0 if not failures else 1


def safe(step: str, call, summary: dict):
    """``call()``, or the error it raised (recorded under ``summary['errors']``): one step never stops the run."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001
        summary.setdefault("errors", {})[step] = traceback.format_exc()
        print(f"step {step} failed: {type(exc).__name__}: {exc}", flush=True)
        return f"{type(exc).__name__}: {exc}"


if __name__ == "__main__":
    raise SystemExit(main())
