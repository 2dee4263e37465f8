"""Three-way layer-block transfer microbenchmark: AIV-direct vs AICPU/host vs HCCL-buffer staging.

``python -m ascend_dualpath.bench.transfer [--backend emulator|cuda] [--kinds aiv,aicpu,staging,host]`` runs
the transfer engine of the backend for every kind over a sweep of segment sizes and counts (with DualPath-shaped
cases: one layer block per layer for 61 layers) and reports, per kind and case: submit time per segment, completion latency p50/p99, effective bandwidth,
host CPU time, staging peak bytes, and the share of submit time in the request's critical path with
the seed's stop condition (submit share under 5% => keep the host path). Output: a table, JSON, a plot.

On the emulator every time is the virtual clock of the cost model (printed with the results); host
CPU time there is the emulator's own and says nothing about hardware. On CUDA times are measured, and torch's
baselines (``foreach``, per-segment ``copy``) run in the same process; ``--primitives`` measures the raw copy
primitives under the CUDA engine and their tuning variants instead (:mod:`ascend_dualpath.bench.cuda_transfer`).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field

from ascend_dualpath import _args, _json
from ascend_dualpath.errors import ConfigError

KIB, MIB = 1024, 1024 * 1024
BASELINE_KINDS = ("foreach", "copy")  # torch's own copies on CUDA: compared against, never a transfer kind
STOP_SHARE = 0.05  # the seed's stop condition: submit under 5% of the critical path => keep the host path
MLA_BLOCK_BYTES = 64 * 576 * 2  # 64 tokens of DeepSeek-V3 MLA KV (512 latent + 64 rope, bf16) per layer


@dataclass(frozen=True)
class Case:
    name: str
    count: int
    size: int

    @property
    def nbytes(self) -> int:
        return self.count * self.size


def standard_cases() -> list[Case]:
    cases = [Case(f"{n}x4K", n, 4 * KIB) for n in (1, 16, 64, 256, 1024, 4096)]
    cases += [
        Case(f"1x{s // KIB}K" if s < MIB else f"1x{s // MIB}M", 1, s) for s in (64 * KIB, MIB, 16 * MIB, 64 * MIB)
    ]
    cases += [Case("256x64K", 256, 64 * KIB), Case("64x1M", 64, MIB)]
    cases += [
        Case("61x42K layer blocks", 61, 42 * KIB),
        Case("61x72K MLA 64-token blocks", 61, MLA_BLOCK_BYTES),
        Case("4096x72K MLA blocks", 4096, MLA_BLOCK_BYTES),
    ]
    return cases


@dataclass
class Row:
    kind: str
    case: str
    count: int
    size: int
    submit_us_per_segment: float
    submit_us: float
    latency_us_p50: float
    latency_us_p99: float
    bandwidth_gbps: float
    host_cpu_us: float
    staging_peak_bytes: int
    submit_share: float
    clock: str
    extra: dict = field(default_factory=dict)
    gpu_us_p50: float | None = None  # CUDA only: the copy alone on the GPU (stream held during submission)
    gpu_us_p99: float | None = None


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


# ---- emulator ------------------------------------------------------------------------------------

EMULATOR_KINDS = ("aiv", "aicpu", "staging", "host", "host/seg")


def run_emulator(
    cases: list[Case], kinds: list[str], repeats: int, block_dim: int, max_aiv_payload: int, progress
) -> tuple[list[Row], dict]:
    from ascend_dualpath import _ext
    from ascend_dualpath.backends import emulator as emu
    from ascend_dualpath.dualpath.transfer_leg import KV_COMM_FIELDS
    from ascend_dualpath.transport import MemoryKind, TransferKind
    from ascend_dualpath.transport.emulator import EmulatedTransferEngine

    C = _ext.load()
    window_mb = max(8, -(-max(c.nbytes for c in cases) // MIB) + 1)
    rows: list[Row] = []
    cost_params: dict = {}
    for kind in kinds:
        with emu.emulated_devices(2) as devices:
            config = emu.comm_config(hcclBufferSize=window_mb, **KV_COMM_FIELDS)  # the KV path's traffic class
            comms = [C.HcclComm(d, r, 2, config) for r, d in enumerate(devices)]
            infos = [c.local_info() for c in comms]
            for c in comms:
                c.connect(infos)
            cost = devices[0].nic.cost
            cost_params = {k: getattr(cost, k) for k in dir(cost) if k.endswith("_ns") or k.endswith("_per_ns")}
            engine = EmulatedTransferEngine(
                comms[0],
                1,
                block_dim=block_dim,
                sq_depth=1024,
                doorbell_batch=32,
                max_single_aiv_payload=max_aiv_payload,
                max_pieces=8192,
                host_call_per_piece=kind == "host/seg",
            )
            transfer_kind = TransferKind("host" if kind == "host/seg" else kind)
            memory = MemoryKind.HOST if transfer_kind is TransferKind.STAGING else MemoryKind.DEVICE
            mem_kind = C.MemKind.HOST_DRAM if memory is MemoryKind.HOST else C.MemKind.DEVICE_GM
            window = comms[1].windows_in
            for case in cases:
                rows.append(
                    _emulated_case(engine, devices[0], comms[0], window, mem_kind, kind, transfer_kind, case, repeats)
                )
                progress(rows[-1])
            engine.close()
            for c in comms:
                c.close()
    return rows, cost_params


def _emulated_case(engine, device, comm, window, mem_kind, kind: str, transfer_kind, case: Case, repeats: int) -> Row:
    """One row: ``case`` moved ``repeats`` times by ``engine`` from a fresh region of ``device`` (memory
    ``mem_kind``, registered with ``comm``) into rank 1's ``window``, checked byte-exact after the last run."""
    import numpy as np

    from ascend_dualpath.transport import MemorySegment, RemoteSlot

    region = device.alloc_region(case.nbytes, mem_kind, 7)
    view = np.frombuffer(region, np.uint8)
    view[:] = np.random.default_rng(case.count).integers(0, 256, case.nbytes, dtype=np.uint8)
    comm.register_local(region)
    sources = [MemorySegment.of_region(region, i * case.size, case.size) for i in range(case.count)]
    slot = RemoteSlot(1, window.addr, case.nbytes, window.rkey)
    engine.staging.peak_bytes = 0
    latencies, cpu, submit = [], [], 0.0
    for _ in range(repeats):
        cpu0 = time.process_time()
        result = engine.transfer(sources, slot, kind=transfer_kind)
        cpu.append((time.process_time() - cpu0) * 1e6)
        latencies.append(result.latency_vtime_ns / 1e3)
        submit = result.submit_vtime_ns / 1e3
    if not np.array_equal(np.frombuffer(window, np.uint8)[: case.nbytes], view):
        raise AssertionError(f"{kind} {case.name}: destination differs from the source")
    region.close()
    p50 = percentile(latencies, 50)
    return Row(
        kind=kind,
        case=case.name,
        count=case.count,
        size=case.size,
        submit_us_per_segment=submit / case.count,
        submit_us=submit,
        latency_us_p50=p50,
        latency_us_p99=percentile(latencies, 99),
        bandwidth_gbps=case.nbytes / (p50 * 1e3),
        host_cpu_us=percentile(cpu, 50),
        staging_peak_bytes=engine.staging.peak_bytes,
        submit_share=submit / p50 if p50 else 0.0,
        clock="virtual",
        extra={"pieces": result.num_pieces},
    )


# ---- verdict ---------------------------------------------------------------------------------------


def verdicts(rows: list[Row]) -> list[dict]:
    """Per case: the host path's submit share, the best device-side kind, and the stop-condition verdict."""
    out = []
    by_case: dict[str, dict[str, Row]] = {}
    for r in rows:
        by_case.setdefault(r.case, {})[r.kind] = r
    for case, kinds in by_case.items():
        host_kinds = [k for k in kinds if k.startswith("host")]
        device_kinds = [k for k in kinds if not k.startswith("host") and k not in ("aicpu", *BASELINE_KINDS)]
        if not host_kinds or not device_kinds:
            continue
        host = min((kinds[k] for k in host_kinds), key=lambda r: r.latency_us_p50)
        best = min((kinds[k] for k in device_kinds), key=lambda r: r.latency_us_p50)
        share = host.submit_share
        gain = 1 - best.latency_us_p50 / host.latency_us_p50
        if share < STOP_SHARE:
            verdict = "keep host path (submit < 5% of the critical path)"
        elif gain > 0:
            verdict = f"{best.kind} pays off: {gain:.0%} lower latency than {host.kind}"
        else:
            verdict = f"keep host path ({best.kind} is {-gain:.0%} slower than {host.kind})"
        entry = {
            "case": case,
            "host_submit_share": share,
            "best_device_kind": best.kind,
            "best_host_kind": host.kind,
            "latency_gain": gain,
            "verdict": verdict,
        }
        if "host/seg" in kinds:  # DualPath's layerwise path: one host submission per layer block
            per_seg = kinds["host/seg"]
            entry["per_segment_host_share"] = per_seg.submit_share
            entry["speedup_vs_per_segment_host"] = per_seg.latency_us_p50 / best.latency_us_p50
        out.append(entry)
    return out


# ---- output ----------------------------------------------------------------------------------------


def format_table(rows: list[Row]) -> str:
    """One line per row; with GPU times (CUDA) the submit and GPU columns come first, GB/s is from GPU time."""
    gpu = any(r.gpu_us_p50 is not None for r in rows)
    head = (
        f"{'kind':<14} {'case':<27} {'submit/seg us':>13} "
        + (f"{'submit us':>10} {'gpu p50 us':>10} {'gpu p99 us':>10} " if gpu else "")
        + f"{'p50 us':>10} {'p99 us':>10} {'GB/s':>8} {'cpu us':>9} {'stage peak':>11} {'submit share':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.kind:<14} {r.case:<27} {r.submit_us_per_segment:>13.3f} "
            + (f"{r.submit_us:>10.1f} {r.gpu_us_p50 or 0:>10.1f} {r.gpu_us_p99 or 0:>10.1f} " if gpu else "")
            + f"{r.latency_us_p50:>10.1f} {r.latency_us_p99:>10.1f} {r.bandwidth_gbps:>8.2f} {r.host_cpu_us:>9.0f} "
            f"{r.staging_peak_bytes:>11} {r.submit_share:>12.1%}"
        )
    return "\n".join(lines)


def progress_line(r: Row) -> str:
    line = f"  {r.kind:<14} {r.case:<27} p50 {r.latency_us_p50:10.1f} us"
    if r.gpu_us_p50 is not None:
        line += f"  submit {r.submit_us:9.1f} us ({r.submit_us_per_segment:.3f}/seg)  gpu {r.gpu_us_p50:9.1f} us"
        line += f"  {r.bandwidth_gbps:8.1f} GB/s"
    return line


def _time_us(r: Row) -> float:
    return r.gpu_us_p50 if r.gpu_us_p50 is not None else r.latency_us_p50


def _plot_kind(ax_count, ax_size, rows: list[Row], kind: str) -> None:
    """``kind``'s two curves: time over the 4 KiB segment-count sweep, bandwidth over the one-segment size sweep."""
    sweep = sorted((r for r in rows if r.size == 4 * KIB), key=lambda r: r.count)
    ax_count.plot([r.count for r in sweep], [_time_us(r) for r in sweep], marker="o", label=kind)
    sizes = sorted((r for r in rows if r.count == 1), key=lambda r: r.size)
    ax_size.plot([r.size for r in sizes], [r.bandwidth_gbps for r in sizes], marker="o", label=kind)


def plot(rows: list[Row], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_count, ax_size) = plt.subplots(1, 2, figsize=(12, 4.5))
    for kind in dict.fromkeys(r.kind for r in rows):
        _plot_kind(ax_count, ax_size, [r for r in rows if r.kind == kind], kind)
    gpu = any(r.gpu_us_p50 is not None for r in rows)
    ylabel = "GPU time p50 (us)" if gpu else "completion latency p50 (us)"
    ax_count.set(xscale="log", yscale="log", xlabel="segments of 4 KiB", ylabel=ylabel)
    ax_size.set(xscale="log", xlabel="one segment of N bytes", ylabel="effective bandwidth (GB/s)")
    for ax in (ax_count, ax_size):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- command ---------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("emulator", "cuda"), default="emulator")
    parser.add_argument(
        "--kinds",
        default=None,
        help="comma-separated kinds (default: aiv,aicpu,staging,host and the backend's baselines)",
    )
    parser.add_argument(
        "--primitives",
        action="store_true",
        help="cuda: measure the raw copy primitives and their tuning variants instead of the engine",
    )
    parser.add_argument(
        "--repeats", type=_args.positive_int(10**4), default=5, help="runs per case (p50/p99 over them)"
    )
    parser.add_argument("--quick", action="store_true", help="a few small cases only (smoke test)")
    parser.add_argument("--cases", default=None, help="comma-separated case names to keep (default: all)")
    parser.add_argument(
        "--block-dim", type=_args.positive_int(1024), default=8, help="emulated vector cores (emulator)"
    )
    parser.add_argument(
        "--max-aiv-payload", type=_args.positive_int(1 << 30), default=1 * MIB, help="max single AIV payload in bytes"
    )
    parser.add_argument("--json", default=None, help="write results to this JSON file")
    parser.add_argument("--plot", default=None, help="write a figure to this PNG file")


def run(args: argparse.Namespace) -> int:
    cases = _selected_cases(args)
    rows, meta = _run_backend(args, cases)
    meta["date_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    table = format_table(rows)
    decided = verdicts(rows)
    print()
    print("\n".join(f"{k} = {v}" for k, v in meta.items() if k != "cost_model"))
    for k, v in meta.get("cost_model", {}).items():
        print(f"cost.{k} = {v}")
    print()
    print(table)
    print()
    for v in decided:
        print(_verdict_line(v))
    if args.json:
        with open(args.json, "w") as f:
            f.write(_json.dumps({"meta": meta, "rows": [asdict(r) for r in rows], "verdicts": decided}, indent=1))
    if args.plot:
        clock = "measured" if meta["backend"] == "cuda" else meta["clock"]
        plot(rows, args.plot, f"layer-block transfers, {meta['backend']} ({clock} clock)")
    for failure in meta.get("failures", []):
        print(f"FAILED {failure}")
    return 1 if meta.get("failures") else 0


def _selected_cases(args: argparse.Namespace) -> list[Case]:
    """The standard cases (or ``--quick``'s few), narrowed to ``--cases``; ConfigError naming unknown ones."""
    cases = standard_cases()
    if args.quick:
        cases = [Case("16x4K", 16, 4 * KIB), Case("1x1M", 1, MIB), Case("61x42K layer blocks", 61, 42 * KIB)]
    if args.cases:
        wanted = args.cases.split(",")
        unknown = [w for w in wanted if w not in {c.name for c in cases}]
        if unknown:
            raise ConfigError(f"unknown case(s) {unknown}; known: {[c.name for c in cases]}")
        cases = [c for c in cases if c.name in wanted]
    return cases


def _run_backend(args: argparse.Namespace, cases: list[Case]) -> tuple[list[Row], dict]:
    """(rows, meta) of ``args.backend`` over ``cases``, printing a progress line per row."""
    if args.backend == "emulator":
        if args.primitives:
            raise ConfigError("--primitives measures the CUDA copy primitives: it needs --backend cuda")
        kinds = args.kinds.split(",") if args.kinds else list(EMULATOR_KINDS)
        rows, params = run_emulator(
            cases,
            kinds,
            args.repeats,
            args.block_dim,
            args.max_aiv_payload,
            progress=lambda r: print(progress_line(r), flush=True),
        )
        meta = {
            "backend": "emulator",
            "clock": "virtual",
            "cost_model": params,
            "block_dim": args.block_dim,
            "max_single_aiv_payload": args.max_aiv_payload,
            "repeats": args.repeats,
        }
        return rows, meta
    from ascend_dualpath.bench import cuda_transfer

    default = cuda_transfer.PRIMITIVES if args.primitives else cuda_transfer.DEFAULT_KINDS
    kinds = args.kinds.split(",") if args.kinds else list(default)
    return cuda_transfer.run_bench(
        cases,
        kinds,
        args.repeats,
        progress=lambda r: print(progress_line(r), flush=True),
        primitives=args.primitives,
    )


def _verdict_line(v: dict) -> str:
    """One case's verdict as printed (one entry of :func:`verdicts`)."""
    line = f"{v['case']:<27} {v['best_host_kind']} submit share {v['host_submit_share']:6.1%}  ->  {v['verdict']}"
    if "per_segment_host_share" in v:
        line += (
            f"; vs one submission per segment (share {v['per_segment_host_share']:.1%}): "
            f"{v['best_device_kind']} {v['speedup_vs_per_segment_host']:.1f}x faster"
        )
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ascend_dualpath.bench.transfer", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
