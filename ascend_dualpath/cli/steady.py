"""``simulate --online --steady-state``: the online capacity search at steady state (docs/simulator.md §3).

Poisson arrivals of Table-2 agents on ``--cluster`` (default the paper's DS-660B 2P4D), warm-up and drain
excluded (:mod:`ascend_dualpath.sim.online`); per mode the bisection's points, the capacity with the
search's tolerance and the simulated run length per point; ``online_slo_attainment_<cluster>.png`` under
``--out`` and,
with ``--json``, every point.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from ascend_dualpath import _args, _json
from ascend_dualpath._progress import ProgressLines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--steady-state",
        action="store_true",
        help="with --online: search the APS capacity at steady state (warm-up and drain excluded)",
    )
    parser.add_argument(
        "--warmup-s", type=_args.nonneg_float(1e7), default=600.0, help="steady state: warm-up excluded (s)"
    )
    parser.add_argument(
        "--measure-s", type=_args.positive_float(1e7), default=1200.0, help="steady state: measured window (s)"
    )
    parser.add_argument(
        "--drain-s", type=_args.nonneg_float(1e7), default=300.0, help="steady state: drain after the window (s)"
    )
    parser.add_argument(
        "--slo-target", type=_args.positive_float(1.0), default=0.9, help="steady state: SLO attainment to reach"
    )
    parser.add_argument(
        "--online-min-aps", type=_args.positive_float(1e6), default=0.05, help="lower end of the APS bisection"
    )
    parser.add_argument("--online-iterations", type=_args.positive_int(64), default=6, help="bisection steps")


def steady_run(args: argparse.Namespace) -> int:
    """Run the search for ``--modes`` (default basic and scheduler) and report it."""
    from rich.console import Console
    from rich.markup import escape

    from ascend_dualpath.cli.simulate import DEFAULT_MODES
    from ascend_dualpath.sim.cluster_file import load_cluster
    from ascend_dualpath.sim.online import SteadyState, plot_slo_attainment, steady_capacity
    from ascend_dualpath.sim.plan import cluster_warnings, parse_modes

    console = Console(width=None if sys.stdout.isatty() else 150)  # files and pipes get whole lines
    spec = load_cluster(args.cluster if args.cluster is not None else "ds660b_2p4d")
    modes = parse_modes("basic,scheduler" if args.modes == DEFAULT_MODES else args.modes)
    shape = SteadyState(
        warmup_s=args.warmup_s,
        measure_s=args.measure_s,
        drain_s=args.drain_s,
        ttft_slo_s=spec.slo.ttft_s,
        tpot_slo_s=spec.slo.tpot_s,
        target=args.slo_target,
        max_len=args.max_len,
        rounds_per_agent=args.rounds,
        seed=args.seed,
    )
    for warning in cluster_warnings(spec):
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}")
    console.print(
        f"steady state on {escape(spec.source)}: run {shape.run_s:.0f} s per point (warm-up {shape.warmup_s:.0f} s, "
        f"measured {shape.measure_s:.0f} s, drain {shape.drain_s:.0f} s); SLO TTFT <= {shape.ttft_slo_s} s, "
        f"TPOT <= {1000 * shape.tpot_slo_s:.0f} ms for >= {shape.target:.0%} of the window's requests"
    )
    results = {"shape": asdict(shape), "run_s": shape.run_s, "modes": {}}
    curves = {}
    lines = ProgressLines("simulate")
    for index, mode in enumerate(modes):
        lines.step(f"steady-state capacity {mode.value}: mode", index + 1, len(modes))
        with console.status(f"steady-state capacity {mode.value}"):
            capacity = steady_capacity(
                spec.config, mode, args.online_min_aps, args.online_max_aps, shape, args.online_iterations
            )
        curves[mode] = capacity.points
        for point in sorted(capacity.points, key=lambda p: p.aps):
            console.print(
                f"  {mode.value} {point.aps:.3f} APS: {point.requests} requests, SLO met {point.attainment:.1%}, "
                f"TTFT mean {point.mean_ttft_s:.2f} s p99 {point.p99_ttft_s:.2f} s, TPOT {1000 * point.mean_tpot_s:.1f} ms"
            )
        console.print(
            f"capacity ({mode.value}): {capacity.aps:.3f} APS, tolerance {capacity.tolerance:.3f} APS "
            f"(boundary in [{capacity.aps:.3f}, {capacity.aps + capacity.tolerance:.3f})), run {capacity.run_s:.0f} s"
        )
        results["modes"][mode.value] = {**asdict(capacity), "points": [asdict(p) for p in capacity.points]}
    args.out.mkdir(parents=True, exist_ok=True)
    name = Path(spec.source).stem
    title = f"{name}: steady state, {shape.measure_s:.0f} s measured after {shape.warmup_s:.0f} s warm-up"
    figure = plot_slo_attainment(args.out / f"online_slo_attainment_{name}.png", curves, shape, title)
    console.print(f"figure: {escape(figure)}")
    if args.json is not None:
        args.json.write_text(_json.dumps(results, indent=2, default=str))
        console.print(f"results: {escape(str(args.json))}")
    return 0
