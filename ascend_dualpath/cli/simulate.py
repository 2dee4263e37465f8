"""``python -m ascend_dualpath simulate``: the DualPath cluster simulator.

Two uses. **Planning** (``--cluster CLUSTER.toml`` and/or ``--trace TRACE.jsonl``): the operator's cluster and
agent trace (formats in docs/simulator.md) through ``--modes``, optionally ``--transfer-kinds``; prints a table
per run and writes every figure to ``--json``. **The paper's reproduction** (neither given): the offline
ablation on Table-2 agents, a JCT sweep over agent counts, optionally the Mooncake trace and the online SLO
capacity; writes figures (jct_vs_agents.png, ablation.png, snic_utilisation.png) and results.json to ``--out``.
``--write-trace`` writes the Table-2 generator's agents (or, with ``--mooncake``, the Mooncake trace) as a
TRACE.jsonl. ``--online --steady-state`` searches the online capacity at steady state (:mod:`ascend_dualpath.cli.steady`).
A bad file or a request that can never fit ends the command with one line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ascend_dualpath import _args, _json
from ascend_dualpath._progress import ProgressLines
from ascend_dualpath.cli import steady

DEFAULT_MODES = "basic,layerwise,dualpath,scheduler,oracle"  # the paper's ablation
AGENTS_MAX = 1 << 20  # agents (and rounds per agent) one run may simulate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cluster",
        type=Path,
        default=None,
        help="CLUSTER.toml, or a shipped example's name (ds660b_2p4d, ds660b_2p8d, ds27b_1p1d, qwen32b_1p1d)",
    )
    parser.add_argument("--trace", type=Path, default=None, help="TRACE.jsonl(.gz): one agent per line")
    parser.add_argument(
        "--modes",
        default=DEFAULT_MODES,
        help=f"modes to run with --cluster/--trace (default {DEFAULT_MODES}; also split: the scheduler with each "
        "request's hit read through both its PE's and its DE's storage NIC)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the planning figures per mode to this file")
    parser.add_argument(
        "--transfer-kinds",
        default=None,
        help="with --cluster/--trace: run the scheduler once per kind (aiv,aicpu,host,host-batched,"
        "staging) and report the submission share of the critical path",
    )
    parser.add_argument(
        "--write-trace",
        type=Path,
        default=None,
        help="write the Table-2 agents (--agents, --max-len, --seed) or the --mooncake trace as TRACE.jsonl and stop",
    )
    parser.add_argument("--model", default="ds660b", help="ds660b | ds27b | qwen32b (default ds660b)")
    parser.add_argument("--pd", default="2P4D", help="prefill and decode node counts, e.g. 2P4D")
    parser.add_argument(
        "--max-len", type=_args.positive_int(65536), default=65536, help="Table-2 bucket: 32768, 49152 or 65536"
    )
    parser.add_argument(
        "--agents", type=_args.positive_int(AGENTS_MAX), default=2048, help="agents in the ablation run"
    )
    parser.add_argument(
        "--rounds",
        type=_args.positive_int(AGENTS_MAX),
        default=None,
        help="replay a window of this many rounds per agent (default: whole trajectories)",
    )
    parser.add_argument(
        "--sweep",
        type=_args.NumberList(_args.positive_int(AGENTS_MAX), allow_empty=True),
        default="256,512,1024,2048",
        help="agent counts for the JCT sweep ('' skips)",
    )
    parser.add_argument(
        "--mooncake",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="also replay the Mooncake conversation trace (default $ADP_TRACE_DIR, else the shipped one)",
    )
    parser.add_argument(
        "--online",
        action="store_true",
        help="with --trace: agents arrive at their start_s; else search the online APS capacity (slow)",
    )
    parser.add_argument(
        "--online-duration", type=_args.positive_float(1e7), default=900.0, help="seconds simulated per online point"
    )
    parser.add_argument(
        "--online-max-aps", type=_args.positive_float(1e6), default=8.0, help="upper end of the APS bisection"
    )
    steady.add_arguments(parser)
    parser.add_argument("--seed", type=_args.SEED, default=0)
    parser.add_argument("--out", type=Path, default=Path("out/simulate"), help="directory for figures and results")


def _parse_pd(text: str) -> tuple[int, int]:
    from ascend_dualpath.errors import ConfigError

    upper = text.upper()
    if "P" not in upper or not upper.endswith("D"):
        raise ConfigError(f"--pd must look like 2P4D, got {text!r}")
    prefill, decode = upper[:-1].split("P")
    return int(prefill), int(decode)


def run(args: argparse.Namespace) -> int:
    from ascend_dualpath.errors import AdpError, ConfigError

    try:
        if args.write_trace is not None:
            return _write_trace(args)
        if args.steady_state:
            if not args.online or args.trace is not None:
                raise ConfigError("--steady-state needs --online and Table-2 agents (no --trace)")
            return steady.steady_run(args)
        if args.cluster is not None or args.trace is not None:
            return _plan_run(args)
        return _paper_run(args)
    except (AdpError, OSError) as error:
        print(f"simulate: {error}", file=sys.stderr)
        return 2


def _write_trace(args: argparse.Namespace) -> int:
    from ascend_dualpath.sim.trace_file import mooncake_trace, table2_trace, write_agent_trace

    agents = (
        mooncake_trace(args.mooncake or None)
        if args.mooncake is not None
        else table2_trace(args.agents, args.max_len, args.seed)
    )
    path = write_agent_trace(args.write_trace, agents)
    print(f"wrote {len(agents)} agents to {path}")
    return 0


def _plan_run(args: argparse.Namespace) -> int:
    """The operator's cluster and trace through the chosen modes (and transfer kinds)."""
    from rich.console import Console
    from rich.markup import escape

    from ascend_dualpath.sim.cluster_file import load_cluster
    from ascend_dualpath.sim.plan import cluster_warnings, parse_modes, run_modes, run_transfer_kinds
    from ascend_dualpath.sim.trace_file import read_agent_trace, table2_trace
    from ascend_dualpath.sim.transfer import TransferKind, parse_kinds

    console = Console(width=None if sys.stdout.isatty() else 170)  # files and pipes get whole tables
    spec = load_cluster(args.cluster if args.cluster is not None else "ds660b_2p4d")
    agents = (
        read_agent_trace(args.trace) if args.trace is not None else table2_trace(args.agents, args.max_len, args.seed)
    )
    modes = parse_modes(args.modes)
    kinds = parse_kinds(args.transfer_kinds) if args.transfer_kinds else None
    warnings = cluster_warnings(spec)
    for warning in warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}")
    lines = ProgressLines("simulate")
    runs = len(modes) + (len({*kinds, TransferKind.FREE}) if kinds else 0)  # the kinds run against a free one
    labels: list[str] = []  # each run's label, in the order they start
    with console.status("simulating") as status:

        def progress(label: str, done: int, total: int) -> None:
            status.update(f"simulating {label}: {done}/{total} rounds")
            labels.extend([label] if label not in labels else [])
            lines.step(f"run {labels.index(label) + 1}/{runs} {label}:", done, total, " rounds")

        results: dict = {
            "cluster": spec.source,
            "trace": str(args.trace) if args.trace else "table2",
            "agents": len(agents),
            "online": args.online,
            "warnings": warnings,
            "modes": run_modes(spec, agents, modes, args.online, progress),
        }
        if kinds:
            results["transfer_kinds"] = run_transfer_kinds(spec, agents, kinds, online=args.online, progress=progress)
    console.print(_modes_table(results))
    if kinds:
        console.print(_kinds_table(results["transfer_kinds"]))
        for kind, verdict in results["transfer_kinds"]["verdict"].items() or [("host", "no host kind was run")]:
            console.print(escape(f"verdict ({kind}): {verdict}"))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(_json.dumps(results, indent=2))
        console.print(f"results: {escape(str(args.json))}")
    return 0


def _modes_table(results: dict):
    from rich.markup import escape
    from rich.table import Table

    table = Table(
        title=escape(
            f"{results['cluster']}: {results['agents']} agents from {results['trace']}"
            f"{' (online arrivals)' if results['online'] else ''}"
        )
    )
    for column in (
        "mode",
        "JCT (s)",
        "finish p50/p99 (s)",
        "TTFT p50/p99 (s)",
        "TPOT p50/p99 (ms)",
        "rounds/s",
        "SLO met",
        "SNIC max/avg",
        "SNIC util. avg/max node",
        "binding (util.)",
    ):
        table.add_column(column, justify="right")
    for mode, summary in results["modes"].items():
        binding = summary["binding_resource"]
        balance = summary["snic_max_over_avg"]
        table.add_row(
            mode,
            f"{summary['jct_s']:.1f}",
            f"{summary['agent_finish_s']['p50']:.1f}/{summary['agent_finish_s']['p99']:.1f}",
            f"{summary['ttft_s']['p50']:.2f}/{summary['ttft_s']['p99']:.2f}",
            f"{1000 * summary['tpot_s']['p50']:.1f}/{1000 * summary['tpot_s']['p99']:.1f}",
            f"{summary['throughput']['rounds_per_s']:.1f}",
            f"{100 * summary['slo']['attainment']:.1f}%",
            "-" if balance is None else f"{balance:.2f}",
            f"{100 * summary['utilisation']['storage_nic']:.0f}%/{100 * max(summary['snic_utilisation_by_node'].values()):.0f}%",
            f"{binding} ({100 * summary['utilisation'][binding]:.0f}%)",
        )
    return table


def _kinds_table(report: dict):
    from rich.table import Table

    table = Table(title=f"Transfer kinds ({report['mode']}): submission of the layer blocks")
    for column in (
        "kind",
        "JCT (s)",
        "vs free",
        "TTFT p50/p99 (s)",
        "request share mean/p99",
        "prefill-pass share",
        "Amdahl bound",
    ):
        table.add_column(column, justify="right")
    for kind, summary in report["kinds"].items():
        share = summary["submit_share"]
        table.add_row(
            kind,
            f"{summary['jct_s']:.1f}",
            f"{share['jct_over_free']:.4f}x",
            f"{summary['ttft_s']['p50']:.3f}/{summary['ttft_s']['p99']:.3f}",
            f"{100 * share['mean']:.2f}%/{100 * share['p99']:.2f}%",
            f"{100 * share['prefill_pass']:.2f}%",
            f"{share['amdahl_bound']:.4f}x",
        )
    return table


def _paper_run(args: argparse.Namespace) -> int:
    """The paper reproduction: ablation, sweep, Mooncake and online capacity on built-in Table-2 agents."""
    from rich.console import Console
    from rich.markup import escape

    from ascend_dualpath.sim.cluster import ClusterConfig
    from ascend_dualpath.sim.experiments import plot_figures
    from ascend_dualpath.sim.models import get_model

    console = Console()
    prefill_nodes, decode_nodes = _parse_pd(args.pd)
    config = ClusterConfig(get_model(args.model), prefill_nodes=prefill_nodes, decode_nodes=decode_nodes)
    sweep_counts = list(args.sweep)
    results: dict = {
        "config": {
            "model": args.model,
            "pd": args.pd,
            "max_len": args.max_len,
            "agents": args.agents,
            "rounds": args.rounds,
            "seed": args.seed,
        }
    }
    ablation, sweep, mooncake = _paper_simulations(args, config, sweep_counts, console)
    _report_ablation(args, ablation, console, results)
    _report_sweep(sweep, sweep_counts, console, results)
    _report_mooncake_and_online(args, config, console, mooncake, results)
    if sweep_counts:
        written = plot_figures(args.out, sweep, ablation)
        console.print("figures: " + escape(", ".join(map(str, written))))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(_json.dumps(results, indent=2, default=str))
    console.print(f"results: {escape(str(args.out / 'results.json'))}")
    return 0


def _paper_simulations(args: argparse.Namespace, config, sweep_counts: list[int], console) -> tuple[dict, dict, dict]:
    """Run, under one progress display, the ablation (every mode), the JCT sweep (basic, scheduler, oracle at
    each of ``sweep_counts`` agents) and, with ``--mooncake``, the Mooncake replay. Returns the ablation's
    results per mode, the sweep's (count, JCT) points per mode and the Mooncake results per mode."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ascend_dualpath.sim.cluster import PAPER_MODES, ClusterSim, Mode
    from ascend_dualpath.sim.experiments import agentic_agents, run_ablation
    from ascend_dualpath.sim.traces import load_mooncake

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} rounds"),
        TimeElapsedColumn(),
    )
    compared = (Mode.BASIC, Mode.SCHEDULER, Mode.ORACLE)  # the sweep's and the Mooncake replay's modes
    runs = len(PAPER_MODES) + len(compared) * (len(sweep_counts) + (args.mooncake is not None))
    lines = ProgressLines("simulate")
    with Progress(*columns, console=console) as progress:

        def task(description: str, total: int):
            """A progress callback (done, total) for the next run, on the live display and as lines."""
            index = len(progress.tasks) + 1
            task_id = progress.add_task(description, total=total)

            def update(done: int, total: int) -> None:
                progress.update(task_id, completed=done)
                lines.step(f"run {index}/{runs} {description}:", done, total, " rounds")

            return update

        agents = agentic_agents(args.agents, args.max_len, args.rounds, seed=args.seed)
        tasks = {mode: task(f"ablation {mode.value}", sum(map(len, agents))) for mode in PAPER_MODES}
        ablation = run_ablation(config, agents, progress=lambda mode, done, total: tasks[mode](done, total))
        sweep = {mode: [] for mode in compared}
        for count in sweep_counts:
            sweep_agents = agentic_agents(count, args.max_len, args.rounds, seed=args.seed)
            for mode in sweep:
                update = task(f"sweep {count} {mode.value}", sum(map(len, sweep_agents)))
                sweep[mode].append((count, ClusterSim(config, mode, sweep_agents).run(progress=update).jct_s))
        mooncake = {}
        if args.mooncake is not None:
            rounds = load_mooncake(args.mooncake or None)
            for mode in compared:
                update = task(f"mooncake {mode.value}", len(rounds))
                mooncake[mode] = ClusterSim(
                    config, mode, [[r] for r in rounds], agent_start_s=[r.arrival_s for r in rounds]
                ).run(progress=update)
    return ablation, sweep, mooncake


def _report_ablation(args: argparse.Namespace, ablation: dict, console, results: dict) -> None:
    """Print (and add to ``results``) the offline ablation against Basic."""
    from rich.markup import escape
    from rich.table import Table

    from ascend_dualpath.sim.cluster import Mode
    from ascend_dualpath.sim.experiments import reductions_vs_basic, snic_max_over_avg

    reductions = reductions_vs_basic(ablation)
    table = Table(
        title=escape(f"Offline ablation: {args.model} {args.pd}, {args.agents} agents, max len {args.max_len}")
    )
    for column in ("mode", "JCT (s)", "vs basic", "reduction", "mean TTFT (s)", "mean TPOT (ms)", "SNIC max/avg"):
        table.add_column(column, justify="right")
    basic_jct = ablation[Mode.BASIC].jct_s
    results["ablation"] = {}
    for mode, result in ablation.items():
        balance = snic_max_over_avg(result) if mode is not Mode.ORACLE else float("nan")
        row = {
            "jct_s": result.jct_s,
            "speedup": basic_jct / result.jct_s,
            "reduction": reductions[mode],
            "mean_ttft_s": result.mean_ttft_s,
            "mean_tpot_s": result.mean_tpot_s,
            "snic_max_over_avg": balance,
            "read_bytes": result.read_bytes_by_path,
        }
        results["ablation"][mode.value] = row
        table.add_row(
            mode.value,
            f"{result.jct_s:.1f}",
            f"{row['speedup']:.2f}x",
            f"{100 * reductions[mode]:.1f}%",
            f"{result.mean_ttft_s:.2f}",
            f"{1000 * result.mean_tpot_s:.1f}",
            f"{balance:.2f}",
        )
    console.print(table)


def _report_sweep(sweep: dict, sweep_counts: list[int], console, results: dict) -> None:
    """Add the JCT sweep to ``results`` and, when it ran, print it."""
    from rich.table import Table

    results["sweep"] = {mode.value: points for mode, points in sweep.items()}
    if sweep_counts:
        sweep_table = Table(title="JCT (s) against agent count")
        sweep_table.add_column("agents", justify="right")
        for mode in sweep:
            sweep_table.add_column(mode.value, justify="right")
        for index, count in enumerate(sweep_counts):
            sweep_table.add_row(str(count), *(f"{sweep[mode][index][1]:.1f}" for mode in sweep))
        console.print(sweep_table)


def _report_mooncake_and_online(args: argparse.Namespace, config, console, mooncake: dict, results: dict) -> None:
    """Print (and add to ``results``) the Mooncake replay and, with ``--online``, the APS capacity search."""
    from rich.table import Table

    from ascend_dualpath.sim.cluster import Mode
    from ascend_dualpath.sim.experiments import online_capacity

    if mooncake:
        mc_table = Table(title="Mooncake conversation trace (timed arrivals)")
        for column in ("mode", "JCT (s)", "mean TTFT (s)", "mean TPOT (ms)"):
            mc_table.add_column(column, justify="right")
        results["mooncake"] = {}
        for mode, result in mooncake.items():
            results["mooncake"][mode.value] = {
                "jct_s": result.jct_s,
                "mean_ttft_s": result.mean_ttft_s,
                "mean_tpot_s": result.mean_tpot_s,
            }
            mc_table.add_row(
                mode.value, f"{result.jct_s:.1f}", f"{result.mean_ttft_s:.2f}", f"{1000 * result.mean_tpot_s:.1f}"
            )
        console.print(mc_table)
    if args.online:
        results["online_aps"] = {}
        lines = ProgressLines("simulate")
        for index, mode in enumerate((Mode.BASIC, Mode.SCHEDULER)):
            lines.step(f"online capacity {mode.value}: mode", index + 1, 2)
            with console.status(f"online capacity {mode.value}"):
                aps = online_capacity(
                    config,
                    mode,
                    args.online_duration,
                    low=0.05,
                    high=args.online_max_aps,
                    seed=args.seed,
                    max_len=args.max_len,
                )
            results["online_aps"][mode.value] = aps
            console.print(f"online APS capacity ({mode.value}): {aps:.3f}")
