"""CUDA rows of ``bench transfer``: the CUDA transfer engine per kind, beside torch's baselines in the same run.

Kinds (the vocabulary of every backend; the CUDA meanings of :mod:`ascend_dualpath.transport.cuda_engine`)::

    aiv        the device copy kernel               (device sources)
    aicpu      batched runtime copies               (device sources)
    staging    pinned host staging, then the kernel (registered pinned host sources)
    host       one cudaMemcpyAsync per piece        (device sources)
    foreach    baseline: torch._foreach_copy_ over the segments
    copy       baseline: one torch copy_ per segment

An engine kind is routed once (``engine.prepare`` with the kind forced), then every request is
``prepared.submit()`` and ``ticket.wait()``: the path DualPath takes.

``--primitives`` measures the raw copy primitives under the engine instead, with their tuning variants::

    device[:TILE_KIB:PER_SM:WARPS[:stream|nostream]]   DeviceCopier.run of a cached plan
    graph[:...]                                        the same launch replayed from a CUDA graph
    host-batch                                         one cudaMemcpyBatchAsync
    staging[:CHUNK_KIB]                                StagingCopy
    floor                                              an empty Triton kernel (the launch floor)

Four clocks per request: host submit time (``perf_counter`` around the enqueue), wall time (submit until the
request is known complete: ``ticket.wait`` for engine kinds, a stream synchronize otherwise), latency (CUDA events
from an idle GPU, so it includes the submission) and GPU time (CUDA events with the stream held by a
``torch.cuda._sleep`` that outlasts the submission, so it is the copy alone). Every row is checked bit-exact.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from ascend_dualpath import errors as E
from ascend_dualpath.bench.transfer import Row, percentile

ENGINE_KINDS = ("aiv", "aicpu", "staging", "host")
BASELINES = ("foreach", "copy")
DEFAULT_KINDS = ENGINE_KINDS + BASELINES
PRIMITIVES = ("device", "graph", "host-batch", "staging", "floor")
STREAMING = {"stream": True, "nostream": False}
GRAPH_BASE = 1 << 40  # graph replays of a primitive count up from here (eager requests stay far below)


def parse_kind(kind: str, primitives: bool) -> tuple[str, dict]:
    """``(base, options)`` of a bench kind; ConfigError naming the kind and the known ones.

    Options: for ``device`` / ``graph`` the :class:`~ascend_dualpath.transport.cuda.KernelConfig` fields given as
    ``TILE_KIB:PER_SM:WARPS[:stream|nostream]`` (``-`` keeps the field's default), for ``staging`` ``chunk_bytes``.
    """
    base, *params = kind.split(":")
    known = PRIMITIVES if primitives else DEFAULT_KINDS
    if base not in known:
        where = "--primitives kinds" if primitives else "kinds (raw primitives need --primitives)"
        raise E.ConfigError(f"unknown cuda kind {kind!r}; {where}: {', '.join(known)}")
    if not params:
        return base, {}
    if base == "staging" and len(params) == 1 and params[0].isdigit() and int(params[0]) > 0:
        return base, {"chunk_bytes": int(params[0]) * 1024}
    if (
        base not in ("device", "graph")
        or len(params) not in (3, 4)
        or (len(params) == 4 and params[3] not in STREAMING)
    ):
        raise E.ConfigError(
            f"bad cuda kind {kind!r}: device/graph:TILE_KIB:PER_SM:WARPS[:stream|nostream] or staging:CHUNK_KIB"
        )
    return base, {"config": _kernel_config_fields(params)}


def _kernel_config_fields(params: list[str]) -> dict:
    """KernelConfig fields of ``TILE_KIB:PER_SM:WARPS[:stream|nostream]`` (already checked; ``-`` keeps a default)."""
    fields: dict = {}
    for value, name, scale in zip(
        params[:3], ("tile_bytes", "programs_per_sm", "num_warps"), (1024, 1, 1), strict=False
    ):
        if value != "-":
            fields[name] = int(value) * scale
    if len(params) == 4:
        fields["streaming"] = STREAMING[params[3]]
    return fields


@dataclasses.dataclass
class Buffers:
    """One case's memory: device source and its pinned host copy (both ``uint8 [count * size]``), the destination,
    and per-segment views of each."""

    src: object
    host: object
    dst: object
    srcs: list
    hosts: list
    dsts: list


@dataclasses.dataclass
class Submitter:
    """How one kind enqueues a request: ``submit()`` returns a handle, ``finish(handle)`` waits until it completed
    (bounded; timed, so it checks nothing), ``check()`` verifies the last request's ready flag or notify (after the
    timing), ``facts()`` describes the row; ``source`` is the tensor the destination must equal afterwards (None:
    the kind moves nothing)."""

    submit: Callable[[], Any]
    finish: Callable[[Any], Any]
    facts: Callable[[], dict]
    source: Any
    check: Callable[[], None] = lambda: None


class _Last:
    """The last value a request published, kept by ``finish`` for the untimed ``check``."""

    value: Any = None


def engine_submitter(engine, prepared, name: str, source, submit=None) -> Submitter:
    """A prepared request of ``engine`` (``submit``: default ``prepared.submit``), its notify slot 0 checked (a
    request without a notify slot: its result carries no magic)."""
    last = _Last()

    def finish(ticket):
        last.value = ticket.wait()

    def check():
        if prepared.notify_slot is None:
            if last.value is None or last.value.notify_magic is not None:
                raise AssertionError(f"{name}: a request without a notify slot published {last.value}")
            return
        if last.value is None or engine.notify_value(0) != last.value.notify_magic:
            raise AssertionError(
                f"{name}: notify slot holds {engine.notify_value(0)}, the last request published "
                f"{last.value and last.value.notify_magic}"
            )

    def facts():
        selection = prepared.selection
        return {
            "decided_by": selection.decided_by,
            "kind_chosen": selection.kind.value,
            "pieces": len(prepared.pieces),
            "staging_bytes": prepared.state["work"].staging_bytes,
        }

    return Submitter(submit or prepared.submit, finish, facts, source, check)


def graph_submitter(torch, engine, prepared, name: str, source) -> Submitter:
    """CUDA-graph replays of a prepared ``aiv`` request (:meth:`CudaTransferEngine.capture`)."""
    graphed = engine.capture(prepared)
    stream = torch.cuda.current_stream(engine.device)
    last = _Last()

    def finish(value):
        stream.synchronize()
        last.value = value

    def check():
        if engine.notify_value(0) != last.value:
            raise AssertionError(
                f"{name}: notify slot holds {engine.notify_value(0)}, the last replay published {last.value}"
            )

    return Submitter(graphed.replay, finish, lambda: {"graph": True}, source, check)


def _engine_kind(torch, engine, kind: str, case, buffers: Buffers) -> Submitter:
    source = buffers.host if kind == "staging" else buffers.src
    segments = [engine.segment(source, i * case.size, case.size) for i in range(case.count)]
    prepared = engine.prepare(segments, engine.slot(buffers.dst), notify_slot=0, kind=kind)
    return engine_submitter(engine, prepared, f"{kind} {case.name}", source)


def baseline_submitter(torch, kind: str, buffers: Buffers) -> Submitter:
    """torch's ``_foreach_copy_`` (``foreach``) or one ``copy_`` per segment (``copy``) on the current stream."""
    stream = torch.cuda.current_stream(buffers.src.device)

    def finish(_):
        stream.synchronize()

    if kind == "foreach":
        return Submitter(
            lambda: torch._foreach_copy_(buffers.dsts, buffers.srcs, non_blocking=True), finish, dict, buffers.src
        )

    def copy_each():
        for d, s in zip(buffers.dsts, buffers.srcs, strict=True):
            d.copy_(s, non_blocking=True)

    return Submitter(copy_each, finish, dict, buffers.src)


def primitive_submitter(torch, kind: str, case, copier, buffers: Buffers) -> Submitter:
    """A raw copy primitive of ``--primitives`` (:func:`parse_kind`) on ``copier``'s GPU, its ready flag checked."""
    from ascend_dualpath.transport import cuda

    base, options = parse_kind(kind, primitives=True)
    s_addrs = [t.data_ptr() for t in buffers.srcs]
    d_addrs = [t.data_ptr() for t in buffers.dsts]
    sizes = [case.size] * case.count
    stream = torch.cuda.current_stream(buffers.src.device)
    flag = copier.flag
    values = iter(range(1, 1 << 62))
    last = _Last()

    def finish(value):
        stream.synchronize()
        last.value = value

    def check():
        if last.value is not None and int(flag.item()) != last.value:
            raise AssertionError(f"{kind} {case.name}: ready flag {int(flag.item())} != {last.value}")

    def submitter(submit, facts, source=buffers.src):
        return Submitter(submit, finish, facts, source, check)

    if base in ("device", "graph"):
        chosen = cuda.choose_config(case.nbytes, copier.sm_count)
        plan = copier.plan(s_addrs, d_addrs, sizes, dataclasses.replace(chosen, **options.get("config", {})))
        facts = {
            "tiles": plan.tiles,
            "programs": plan.programs,
            "num_warps": plan.num_warps,
            "tile_bytes": plan.tile_bytes,
            "streaming": plan.constexprs["STREAMING"],
        }
        if base == "graph":
            return submitter(copier.capture(plan, GRAPH_BASE).replay, lambda: facts)

        def run():
            value = next(values)
            copier.run(plan, value)
            return value

        return submitter(run, lambda: facts)
    if base == "host-batch":
        from ascend_dualpath.transport.cudart import MemcpyBatch

        batch = MemcpyBatch(d_addrs, s_addrs, sizes)
        index = buffers.src.device.index
        return submitter(lambda: batch(torch._C._cuda_getCurrentRawStream(index)), lambda: {"batched": batch.batched})
    if base == "floor":
        from ascend_dualpath._triton_launch import LaunchSite

        site = LaunchSite(cuda._kernels().empty, 1, {"num_warps": 1})
        site.prepare(flag)
        flag_ptr = flag.data_ptr()
        return submitter(lambda: site(flag_ptr), lambda: {"note": "empty Triton kernel: moves nothing"}, None)
    staging = cuda.StagingCopy(
        copier, buffers.host, [i * case.size for i in range(case.count)], d_addrs, sizes, **options
    )

    def run_staging():
        value = next(values)
        staging.run(value)
        return value

    return submitter(
        run_staging, lambda: {"chunks": staging.chunks, "staging_bytes": staging.staging_bytes}, buffers.host
    )


def measure(
    torch, kind, case, submitter: Submitter, buffers: Buffers, repeats: int, cycles_per_us: float, warmup: int = 2
) -> Row:
    """``repeats`` timed requests after ``warmup`` (>= 1) untimed ones (the first compiles and maps; the last sizes
    the hold); then the destination is compared with the source and the last request's flag is checked."""
    buffers.dst.zero_()
    sync = torch.cuda.synchronize
    for _ in range(warmup):
        sync()
        t0 = time.perf_counter()
        handle = submitter.submit()
        warm_submit_us = (time.perf_counter() - t0) * 1e6
        submitter.finish(handle)
    hold_cycles = int(min(200_000, 1.5 * warm_submit_us + 50) * cycles_per_us)
    submit_s, wall_s, cpu_s, latency_ms, gpu_ms = [], [], [], [], []
    for _ in range(repeats):
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        handle = submitter.submit()
        t1, c1 = time.perf_counter(), time.process_time()
        submitter.finish(handle)
        wall_s.append(time.perf_counter() - t0)
        submit_s.append(t1 - t0)
        cpu_s.append(c1 - c0)
        for hold, into in ((0, latency_ms), (hold_cycles, gpu_ms)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if hold:
                torch.cuda._sleep(hold)  # the stream is busy while the request is enqueued
            start.record()
            handle = submitter.submit()
            end.record()
            submitter.finish(handle)
            sync()
            into.append(start.elapsed_time(end))
    if submitter.source is not None and not torch.equal(buffers.dst, submitter.source.to(buffers.dst.device)):
        raise AssertionError(f"{kind} {case.name}: destination differs from the source")
    submitter.check()
    facts = submitter.facts()
    submit_us = percentile(submit_s, 50) * 1e6
    p50 = percentile(latency_ms, 50) * 1e3
    gpu_p50 = percentile(gpu_ms, 50) * 1e3
    return Row(
        kind=kind,
        case=case.name,
        count=case.count,
        size=case.size,
        submit_us_per_segment=submit_us / case.count,
        submit_us=submit_us,
        latency_us_p50=p50,
        latency_us_p99=percentile(latency_ms, 99) * 1e3,
        bandwidth_gbps=case.nbytes / (gpu_p50 * 1e3),
        host_cpu_us=percentile(cpu_s, 50) * 1e6,
        staging_peak_bytes=facts.get("staging_bytes", 0),
        submit_share=submit_us / p50 if p50 else 0.0,
        clock="measured",
        extra={
            "wall_us_p50": percentile(wall_s, 50) * 1e6,
            "hold_us": hold_cycles / cycles_per_us,
            "warm_submit_us": warm_submit_us,
            "bit_exact": True,
            **facts,
        },
        gpu_us_p50=gpu_p50,
        gpu_us_p99=percentile(gpu_ms, 99) * 1e3,
    )


def sleep_cycles_per_us(torch) -> float:
    """GPU clock cycles per microsecond of ``torch.cuda._sleep``, measured with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    end.synchronize()
    return 2_000_000 / (start.elapsed_time(end) * 1e3)


def run_bench(cases, kinds: list[str], repeats: int, progress, primitives: bool = False, peer: bool | None = None):
    """Measure every kind on every case; destination on cuda:1 when there are two GPUs (unless ``peer`` says).

    Returns ``(rows, meta)``; a kind that fails on a case is recorded in ``meta["failures"]`` and the run goes on.
    """
    import torch

    for kind in kinds:
        parse_kind(kind, primitives)  # a typo fails here, not after minutes of GPU time
    if not torch.cuda.is_available():
        raise E.BackendUnavailable("the cuda transfer benchmark needs a CUDA GPU")
    src_dev = torch.device("cuda:0")
    torch.cuda.set_device(src_dev)
    peer = torch.cuda.device_count() > 1 if peer is None else peer
    dst_dev = torch.device("cuda:1" if peer else "cuda:0")
    stream = torch.cuda.Stream(src_dev)  # not the legacy default stream, which cudaMemcpyBatchAsync refuses
    with torch.cuda.stream(stream):
        return _run_cases(torch, cases, kinds, repeats, progress, primitives, src_dev, dst_dev)


def _make(torch, kind, case, primitives, engine, copier, buffers) -> Submitter:
    if primitives:
        return primitive_submitter(torch, kind, case, copier, buffers)
    if kind in BASELINES:
        return baseline_submitter(torch, kind, buffers)
    return _engine_kind(torch, engine, kind, case, buffers)


def make_buffers(torch, case, src_dev, dst_dev) -> Buffers:
    """Random source (device and pinned host copy) and an empty destination of ``case``, cut into segments."""
    src = torch.randint(0, 256, (case.nbytes,), dtype=torch.uint8, device=src_dev)
    host = src.cpu().pin_memory()
    dst = torch.empty(case.nbytes, dtype=torch.uint8, device=dst_dev)

    def pieces(t):
        return [t[i * case.size : (i + 1) * case.size] for i in range(case.count)]

    return Buffers(src, host, dst, pieces(src), pieces(host), pieces(dst))


def _run_cases(torch, cases, kinds, repeats, progress, primitives, src_dev, dst_dev):
    from ascend_dualpath.transport import cuda
    from ascend_dualpath.transport.cuda_engine import CudaTransferEngine

    cycles_per_us = sleep_cycles_per_us(torch)
    engine = CudaTransferEngine(src_dev, dst_dev, torch.zeros(1, dtype=torch.int64, device=dst_dev))
    copier = cuda.DeviceCopier(src_dev, torch.zeros(1, dtype=torch.int64, device=dst_dev))
    rows, failures = [], []
    for case in cases:
        buffers = make_buffers(torch, case, src_dev, dst_dev)
        engine.register(buffers.host)
        torch.cuda.synchronize()
        for kind in kinds:
            try:
                submitter = _make(torch, kind, case, primitives, engine, copier, buffers)
                row = measure(torch, kind, case, submitter, buffers, repeats, cycles_per_us)
            except Exception as exc:  # noqa: BLE001 - one broken kind must not lose the rest of a GPU session
                failures.append(f"{kind} {case.name}: {type(exc).__name__}: {exc}")
                print(f"  FAILED {failures[-1]}", flush=True)
                continue
            row.extra["peer"] = src_dev != dst_dev
            rows.append(row)
            progress(row)
        torch.cuda.synchronize()
        engine.unregister(buffers.host)
        del buffers
        torch.cuda.empty_cache()
    return rows, _meta(torch, cuda, copier, repeats, cycles_per_us, src_dev != dst_dev, primitives, failures)


def _meta(torch, cuda, copier, repeats, cycles_per_us, peer, primitives, failures) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    return {
        "backend": "cuda",
        "mode": "primitives" if primitives else "engine",
        "clock": "measured (host submit: perf_counter; wall: submit until known complete; latency: CUDA events "
        "from an idle GPU; GPU time: CUDA events behind a sleep that outlasts the submission)",
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "peer": peer,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "sm_count": copier.sm_count,
        "configs": {"small": asdict(cuda.SMALL_CONFIG), "large": asdict(cuda.LARGE_CONFIG)},
        "repeats": repeats,
        "sleep_cycles_per_us": cycles_per_us,
        "failures": failures,
    }
