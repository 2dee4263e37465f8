"""One GPU run for the transfer engine: versions, the CUDA tests, the engine against torch and the link, a profile.

    python3 tools/gpu_bench_engine.py            # results under $OUT (default ./gpu_bench_engine_out)
    python3 tools/gpu_bench_engine.py --skip-tests --only h2d   # the host-to-device rows alone, no pytest

Steps, each bounded and each failure recorded without stopping the others (the whole run stays under
``TOTAL_S``):

1. versions of python, torch, CUDA, Triton, pytest, hypothesis and the GPU (``versions.json``);
2. ``pytest -m cuda tests/transport tests/dualpath`` in a subprocess (``pytest.txt``);
3. host to device from a registered pinned buffer (61 x 42 KiB, 64 x 1 MiB, 4096 x 4 KiB end to end; 61 x 42 KiB
   and 4096 x 4 KiB strided, ``/s``: DualPath's layer ``l`` of hit Full Block ``b`` at ``b * 61 * 42 KiB + l * 42
   KiB``) through the engine API on torch's default stream, timed as a user times it (``torch.cuda.synchronize()``,
   then ``submit().wait()``, wall clock): the gates' choice, ``staging`` forced, the zero-copy kernel forced
   (``engine aiv``, and in another shape), the copy engine forced (``engine host``: one 2-D copy where the pieces
   allow), one ``cudaMemcpyBatchAsync``, ``_foreach_copy_`` and one ``copy_`` per segment, against the pinned limit
   (one 256 MiB ``copy_`` from pinned memory) measured in the same run;
4. device to device on one GPU, the same way: 61 x 42 KiB layer blocks and 4096 x 4 KiB against ``_foreach_copy_``,
   one 64 MiB piece against ``copy_`` (GPU time: CUDA events behind a sleep that outlasts the submission);
5. a cProfile of prepared 61 x 42 KiB requests (``profile.txt``);
6. the targets, met or not (``summary.json``); every row bit-exact (``bench.json``, a table on stdout).
"""

from __future__ import annotations

import argparse
import dataclasses
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
TOTAL_S = 480.0  # a device command may run 10 minutes; this leaves room for the start
PYTEST_S = 240.0
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
        "tests/transport",
        "tests/dualpath",
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))))
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

# the zero-copy kernel in another shape (TILE_KIB:PER_SM:WARPS[:stream]); earlier runs tried five, within 3 %
ZERO_COPY_SHAPES = ("16:8:4",)
H2D_ROWS = ("engine", "engine aiv", "engine host", "engine staging") + tuple(f"engine zc {s}" for s in ZERO_COPY_SHAPES)
H2D_ROWS += ("graph", "host-batch", "foreach", "copy")
STRIDED_ROWS = ("engine", "engine aiv", "engine host", "host-batch")
# (name, pieces, piece bytes, source stride or None for end to end, rows)
H2D_CASES = [
    ("61x42K", 61, 42 * KIB, None, H2D_ROWS),
    ("61x42K/s", 61, 42 * KIB, 61 * 42 * KIB, STRIDED_ROWS),
    ("64x1M", 64, MIB, None, H2D_ROWS),
    ("4096x4K", 4096, 4 * KIB, None, H2D_ROWS),
    ("4096x4K/s", 4096, 4 * KIB, 8 * KIB, STRIDED_ROWS),
]
D2D_CASES = [
    (
        "61x42K",
        61,
        42 * KIB,
        ("engine", "engine side stream", "engine plain", "engine host", "foreach", "copy")
        + ("graph", "graph:8:8:4", "graph:16:4:4", "graph:2:16:4", "graph:4:4:8", "graph:4:16:2"),
    ),
    ("4096x4K", 4096, 4 * KIB, ("engine", "foreach")),
    ("1x64M", 1, 64 * MIB, ("engine", "copy")),
]
LIMIT_BYTES = 256 * MIB


def host_buffers(torch, bench, case, dev, stride=None):
    """A random registered-to-be pinned host buffer holding ``case``'s segments ``stride`` bytes apart (None: end to
    end), and a device destination. ``host`` is that buffer, ``hosts`` and ``srcs`` its segments, ``src`` the
    segments gathered (what the destination must equal)."""
    stride = stride or case.size
    host = torch.randint(0, 256, (case.count * stride,), dtype=torch.uint8, device=dev).cpu().pin_memory()
    dst = torch.empty(case.nbytes, dtype=torch.uint8, device=dev)
    hosts = [host[i * stride : i * stride + case.size] for i in range(case.count)]
    src = host if stride == case.size else torch.cat(hosts).pin_memory()
    dsts = [dst[i * case.size : (i + 1) * case.size] for i in range(case.count)]
    return bench.Buffers(src, host, dst, hosts, hosts, dsts)


def engine_for(torch, label, case, dev):
    """The engine a row measures: default gates, or the zero-copy kernel in the row's shape."""
    from ascend_dualpath.bench.cuda_transfer import parse_kind
    from ascend_dualpath.transport.cuda import choose_config
    from ascend_dualpath.transport.cuda_engine import CudaTransferEngine

    engine = CudaTransferEngine(dev, dev, torch.zeros(4, dtype=torch.int64, device=dev), timeout_s=30)
    if label.startswith("engine zc "):
        fields = parse_kind("device:" + label.split()[-1], primitives=True)[1]["config"]
        sm = torch.cuda.get_device_properties(dev).multi_processor_count
        engine.zero_copy_config = dataclasses.replace(choose_config(case.nbytes, sm), **fields)
    return engine


def submitter(torch, bench, engine, copier, label, case, buffers):
    """The row's Submitter: the engine (prepared, or ``engine plain``: ``engine.submit`` each time), one
    ``cudaMemcpyBatchAsync`` (``host-batch``), a bare CUDA-graph replay of the copy kernel in a given shape
    (``graph[:TILE_KIB:PER_SM:WARPS]``) or a torch baseline, all on the current stream."""
    if label in ("foreach", "copy", "host-batch") or label.startswith("graph"):
        if buffers.src.is_cuda:
            return _baseline(torch, bench, label, case, copier, buffers)
        # from host memory: the helpers take the stream's GPU from the source, so hand them the destination's, then
        # check against the real source
        made = _baseline(torch, bench, label, case, copier, dataclasses.replace(buffers, src=buffers.dst))
        return dataclasses.replace(made, source=buffers.src)
    base, views = (buffers.src, buffers.srcs) if buffers.src.is_cuda else (buffers.host, buffers.hosts)
    if not buffers.src.is_cuda:
        engine.register(base)
    segments = [engine.segment(base, v.data_ptr() - base.data_ptr(), case.size) for v in views]
    slot = engine.slot(buffers.dst)
    kind = "aiv" if label.startswith("engine zc") else None
    kind = {"engine staging": "staging", "engine aiv": "aiv", "engine host": "host"}.get(label, kind)
    prepared = engine.prepare(segments, slot, notify_slot=0, kind=kind)
    name = f"{label} {case.name}"
    if label == "engine plain":
        return bench.engine_submitter(
            engine, prepared, name, buffers.src, lambda: engine.submit(segments, slot, notify_slot=0)
        )
    made = bench.engine_submitter(engine, prepared, name, buffers.src)
    made.prepared = prepared  # for the launch probe
    return made


def launch_probe(torch, prepared) -> dict:
    """Host time of the prepared request's bare ``cudaGraphLaunch`` (after a synchronise, median of 50) against the
    whole ``submit()``: where the engine's submission time goes."""
    import statistics

    graph = prepared.state["work"].graph
    if graph is None:
        return {}
    stream = torch.cuda.current_stream(prepared.engine.device).cuda_stream
    launch, submit = [], []
    for _ in range(50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay(stream)
        launch.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ticket = prepared.submit()
        submit.append(time.perf_counter() - t0)
        ticket.wait()
    return {"graph_replay_us": statistics.median(launch) * 1e6, "submit_us_probe": statistics.median(submit) * 1e6}


def _baseline(torch, bench, label, case, copier, buffers):
    if label == "host-batch" or label.startswith("graph"):
        return bench.primitive_submitter(torch, label, case, copier, buffers)
    return bench.baseline_submitter(torch, label, buffers)


def measure_row(torch, bench, case, label, buffers, direction, cycles, copier, rows, failures):
    """One row, bit-exact, on the default stream (``host-batch`` and ``side stream`` rows on a side stream: the
    batch call refuses the legacy default stream)."""
    import contextlib

    if left_s() < 40:
        failures.append(f"{direction} {label} {case.name}: skipped, the run's time is up")
        return
    dev = buffers.dst.device
    side = label == "host-batch" or label.endswith("side stream")
    context = torch.cuda.stream(torch.cuda.Stream(dev)) if side else contextlib.nullcontext()
    slow = label in ("copy", "foreach") and case.count >= 1024 or case.nbytes >= 64 * MIB
    try:
        with context:
            engine = engine_for(torch, label, case, dev) if label.startswith("engine") else None
            made = submitter(torch, bench, engine, copier, label, case, buffers)
            row = bench.measure(torch, label, case, made, buffers, 10 if slow else 100, cycles, warmup=5)
            probe = launch_probe(torch, made.prepared) if hasattr(made, "prepared") else {}
    except Exception as exc:  # noqa: BLE001 - one failing case must not stop the others
        failures.append(f"{direction} {label} {case.name}: {type(exc).__name__}: {exc}")
        print(f"  FAILED {failures[-1]}\n{traceback.format_exc(limit=4)}", flush=True)
        return
    out = asdict(row)
    out["direction"] = direction
    out["extra"]["wall_gbps"] = case.nbytes / (out["extra"]["wall_us_p50"] * 1e3)
    out["extra"].update(probe)
    rows.append(out)
    print(line(out), flush=True)


def pinned_limit(torch, bench, cycles, dev) -> dict:
    """The pinned host-to-device limit: one 256 MiB ``copy_`` from pinned memory (GB/s of GPU time and of wall)."""
    from ascend_dualpath.bench.transfer import Case

    case = Case("1x256M", 1, LIMIT_BYTES)
    buffers = host_buffers(torch, bench, case, dev)
    row = bench.measure(
        torch, "copy", case, submitter(torch, bench, None, None, "copy", case, buffers), buffers, 10, cycles
    )
    limit = {
        "gpu_us_p50": row.gpu_us_p50,
        "wall_us_p50": row.extra["wall_us_p50"],
        "gbps": LIMIT_BYTES / (row.gpu_us_p50 * 1e3),
        "wall_gbps": LIMIT_BYTES / (row.extra["wall_us_p50"] * 1e3),
    }
    print(f"pinned H2D limit: {limit['gbps']:.1f} GB/s (GPU time), {limit['wall_gbps']:.1f} GB/s (wall)", flush=True)
    return limit


def run_bench(only: str = "") -> tuple[list[dict], list[str], dict]:
    import torch

    from ascend_dualpath.bench import cuda_transfer as bench
    from ascend_dualpath.bench.transfer import Case
    from ascend_dualpath.transport.cuda import DeviceCopier

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    rows, failures = [], []
    cycles = bench.sleep_cycles_per_us(torch)
    copier = DeviceCopier(dev, torch.zeros(1, dtype=torch.int64, device=dev))
    limit = pinned_limit(torch, bench, cycles, dev)
    for name, count, size, stride, labels in H2D_CASES:
        if only not in f"h2d {name}":
            continue
        case = Case(name, count, size)
        buffers = host_buffers(torch, bench, case, dev, stride)
        for label in labels:
            measure_row(torch, bench, case, label, buffers, "h2d", cycles, copier, rows, failures)
        del buffers
    for name, count, size, labels in D2D_CASES:
        if only not in f"d2d {name}":
            continue
        case = Case(name, count, size)
        buffers = bench.make_buffers(torch, case, dev, dev)
        for label in labels:
            measure_row(torch, bench, case, label, buffers, "d2d", cycles, copier, rows, failures)
        del buffers
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return rows, failures, limit


def line(r: dict) -> str:
    extra = r["extra"]
    return (
        f"{r['direction']} {r['case']:<8} {r['kind']:<26} wall {extra['wall_us_p50']:9.1f} us"
        f" ({extra['wall_gbps']:6.1f} GB/s)  latency {r['latency_us_p50']:9.1f}  gpu {r['gpu_us_p50']:9.1f} us"
        f" ({r['bandwidth_gbps']:7.1f} GB/s)  submit {r['submit_us']:7.2f} us  {extra.get('kind_chosen', '')}"
        f" {extra.get('decided_by', '')}"
        + (
            f"  [replay {extra['graph_replay_us']:.1f} / submit {extra['submit_us_probe']:.1f} us]"
            if extra.get("graph_replay_us")
            else ""
        )
    )


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


def targets(rows: list[dict], limit: dict | None) -> list[dict]:
    by = {(r["direction"], r["case"], r["kind"]): r for r in rows}

    def get(direction, case, kind, field):
        r = by.get((direction, case, kind))
        if r is None:
            return None
        return r["extra"][field] if field in r["extra"] else r[field]

    def ratio(a, b):
        return None if a is None or b is None or a == 0 else b / a

    checks = []
    for case, *_ in H2D_CASES:
        if case.endswith("/s") and not case.startswith("61x"):
            continue  # small strided rows: a measurement for the gate's threshold, no target
        gbps = get("h2d", case, "engine", "wall_gbps")
        share = None if gbps is None or not limit else gbps / limit["gbps"]
        checks.append((f"h2d {case} engine wall / pinned limit >= 0.85", share, lambda v: v >= 0.85))
    checks += [
        ("d2d 61x42K engine wall p50 <= 20 us", get("d2d", "61x42K", "engine", "wall_us_p50"), lambda v: v <= 20),
        (
            "d2d 61x42K foreach / engine (wall) >= 2",
            ratio(get("d2d", "61x42K", "engine", "wall_us_p50"), get("d2d", "61x42K", "foreach", "wall_us_p50")),
            lambda v: v >= 2,
        ),
        (
            "d2d 1x64M copy_ / engine (GPU time) >= 0.97",
            ratio(get("d2d", "1x64M", "engine", "gpu_us_p50"), get("d2d", "1x64M", "copy", "gpu_us_p50")),
            lambda v: v >= 0.97,
        ),
        ("every measured row bit-exact", all(r["extra"].get("bit_exact") for r in rows) and bool(rows), lambda v: v),
    ]
    return [
        {"target": name, "value": value, "met": None if value is None else bool(test(value))}
        for name, value, test in checks
    ]


def main() -> int:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=OUT, help="results folder (default $OUT or ./gpu_bench_engine_out)")
    parser.add_argument("--skip-tests", action="store_true", help="no pytest step")
    parser.add_argument("--only", default="", help="measure only the cases whose 'h2d NAME' / 'd2d NAME' holds this")
    args = parser.parse_args()
    OUT = args.out
    os.makedirs(OUT, exist_ok=True)
    summary: dict = {"out": OUT}
    found = versions()
    write("versions.json", found)
    print(json.dumps(found, indent=1), flush=True)
    summary["tests"] = {"skipped": "--skip-tests"} if args.skip_tests else safe("tests", run_tests, summary)
    if found.get("cuda_available") is not True or str(found.get("triton", "")).startswith("absent"):
        summary["bench"] = "skipped: needs torch with CUDA and Triton"
        write("summary.json", summary)
        print(summary["bench"])
        return 1
    result = safe("bench", lambda: run_bench(args.only), summary)
    rows, failures, limit = result if isinstance(result, tuple) else ([], [str(result)], None)
    write("bench.json", {"versions": found, "pinned_limit": limit, "rows": rows, "failures": failures})
    if left_s() > 30:
        text = safe("profile", profile, summary)
        write("profile.txt", str(text))
        print("\n".join(str(text).splitlines()[:30]))
    summary["failures"] = failures
    summary["pinned_limit"] = limit
    summary["targets"] = targets(rows, limit)
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
