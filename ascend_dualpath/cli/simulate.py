"""``python -m ascend_dualpath simulate``: the DualPath cluster simulator.

Runs the offline ablation (basic, layerwise, dualpath, scheduler, oracle) on Table-2 agents, a JCT
sweep over agent counts, optionally the Mooncake trace and the online SLO capacity; prints tables and
writes figures (jct_vs_agents.png, ablation.png, snic_utilisation.png) and results.json to ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="ds660b", help="ds660b | ds27b | qwen32b (default ds660b)")
    parser.add_argument("--pd", default="2P4D", help="prefill and decode node counts, e.g. 2P4D")
    parser.add_argument("--max-len", type=int, default=65536, help="Table-2 bucket: 32768, 49152 or 65536")
    parser.add_argument("--agents", type=int, default=2048, help="agents in the ablation run")
    parser.add_argument("--rounds", type=int, default=None,
                        help="replay a window of this many rounds per agent (default: whole trajectories)")
    parser.add_argument("--sweep", default="256,512,1024,2048", help="agent counts for the JCT sweep ('' skips)")
    parser.add_argument("--mooncake", action="store_true", help="also replay the Mooncake conversation trace")
    parser.add_argument("--trace", type=Path, default=None,
                        help="Mooncake JSONL(.gz) (default $ADP_TRACE_DIR, else the shipped one)")
    parser.add_argument("--online", action="store_true", help="also search the online APS capacity (slow)")
    parser.add_argument("--online-duration", type=float, default=900.0, help="seconds simulated per online point")
    parser.add_argument("--online-max-aps", type=float, default=8.0, help="upper end of the APS bisection")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out/simulate"), help="directory for figures and results")


def _parse_pd(text: str) -> tuple[int, int]:
    from ascend_dualpath.errors import ConfigError

    upper = text.upper()
    if "P" not in upper or not upper.endswith("D"):
        raise ConfigError(f"--pd must look like 2P4D, got {text!r}")
    prefill, decode = upper[:-1].split("P")
    return int(prefill), int(decode)


def _simulate(args: argparse.Namespace, config, console, sweep_counts: list[int]):
    """The offline ablation, the agent-count sweep and (``--mooncake``) the trace replay, with progress bars.

    Returns ``(ablation {mode: result}, sweep {mode: [(agents, JCT s)]}, mooncake {mode: result})``."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from ascend_dualpath.sim.cluster import ClusterSim, Mode
    from ascend_dualpath.sim.experiments import agentic_agents, run_ablation
    from ascend_dualpath.sim.traces import load_mooncake

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} rounds"),
               TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        agents = agentic_agents(args.agents, args.max_len, args.rounds, seed=args.seed)
        tasks = {mode: progress.add_task(f"ablation {mode.value}", total=sum(map(len, agents))) for mode in Mode}
        ablation = run_ablation(config, agents,
                                progress=lambda mode, done, total: progress.update(tasks[mode], completed=done))
        sweep = {mode: [] for mode in (Mode.BASIC, Mode.SCHEDULER, Mode.ORACLE)}
        for count in sweep_counts:
            sweep_agents = agentic_agents(count, args.max_len, args.rounds, seed=args.seed)
            for mode in sweep:
                task = progress.add_task(f"sweep {count} {mode.value}", total=sum(map(len, sweep_agents)))
                result = ClusterSim(config, mode, sweep_agents).run(
                    progress=lambda done, total, task=task: progress.update(task, completed=done))
                sweep[mode].append((count, result.jct_s))
        mooncake = {}
        if args.mooncake:
            rounds = load_mooncake(args.trace)
            for mode in (Mode.BASIC, Mode.SCHEDULER, Mode.ORACLE):
                task = progress.add_task(f"mooncake {mode.value}", total=len(rounds))
                mooncake[mode] = ClusterSim(config, mode, [[r] for r in rounds],
                                            agent_start_s=[r.arrival_s for r in rounds]).run(
                    progress=lambda done, total, task=task: progress.update(task, completed=done))
    return ablation, sweep, mooncake


def _report_ablation(args: argparse.Namespace, console, ablation: dict) -> dict:
    from rich.markup import escape
    from rich.table import Table

    from ascend_dualpath.sim.cluster import Mode
    from ascend_dualpath.sim.experiments import reductions_vs_basic, snic_max_over_avg

    reductions = reductions_vs_basic(ablation)
    table = Table(title=escape(f"Offline ablation: {args.model} {args.pd}, {args.agents} agents, max len {args.max_len}"))
    for column in ("mode", "JCT (s)", "vs basic", "reduction", "mean TTFT (s)", "mean TPOT (ms)", "SNIC max/avg"):
        table.add_column(column, justify="right")
    basic_jct = ablation[Mode.BASIC].jct_s
    rows = {}
    for mode, result in ablation.items():
        balance = snic_max_over_avg(result) if mode is not Mode.ORACLE else float("nan")
        row = {"jct_s": result.jct_s, "speedup": basic_jct / result.jct_s, "reduction": reductions[mode],
               "mean_ttft_s": result.mean_ttft_s, "mean_tpot_s": result.mean_tpot_s, "snic_max_over_avg": balance,
               "read_bytes": result.read_bytes_by_path}
        rows[mode.value] = row
        table.add_row(mode.value, f"{result.jct_s:.1f}", f"{row['speedup']:.2f}x", f"{100 * reductions[mode]:.1f}%",
                      f"{result.mean_ttft_s:.2f}", f"{1000 * result.mean_tpot_s:.1f}", f"{balance:.2f}")
    console.print(table)
    return rows


def _report_sweep(console, sweep: dict, sweep_counts: list[int]) -> None:
    from rich.table import Table

    sweep_table = Table(title="JCT (s) against agent count")
    sweep_table.add_column("agents", justify="right")
    for mode in sweep:
        sweep_table.add_column(mode.value, justify="right")
    for index, count in enumerate(sweep_counts):
        sweep_table.add_row(str(count), *(f"{sweep[mode][index][1]:.1f}" for mode in sweep))
    console.print(sweep_table)


def _report_mooncake(console, mooncake: dict) -> dict:
    from rich.table import Table

    mc_table = Table(title="Mooncake conversation trace (timed arrivals)")
    for column in ("mode", "JCT (s)", "mean TTFT (s)", "mean TPOT (ms)"):
        mc_table.add_column(column, justify="right")
    rows = {}
    for mode, result in mooncake.items():
        rows[mode.value] = {"jct_s": result.jct_s, "mean_ttft_s": result.mean_ttft_s,
                            "mean_tpot_s": result.mean_tpot_s}
        mc_table.add_row(mode.value, f"{result.jct_s:.1f}", f"{result.mean_ttft_s:.2f}",
                         f"{1000 * result.mean_tpot_s:.1f}")
    console.print(mc_table)
    return rows


def _report_online(args: argparse.Namespace, console, config) -> dict:
    from ascend_dualpath.sim.cluster import Mode
    from ascend_dualpath.sim.experiments import online_capacity

    capacities = {}
    for mode in (Mode.BASIC, Mode.SCHEDULER):
        with console.status(f"online capacity {mode.value}"):
            aps = online_capacity(config, mode, args.online_duration, low=0.05, high=args.online_max_aps,
                                  seed=args.seed, max_len=args.max_len)
        capacities[mode.value] = aps
        console.print(f"online APS capacity ({mode.value}): {aps:.3f}")
    return capacities


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from ascend_dualpath.sim.cluster import ClusterConfig
    from ascend_dualpath.sim.experiments import plot_figures
    from ascend_dualpath.sim.models import get_model

    console = Console()
    prefill_nodes, decode_nodes = _parse_pd(args.pd)
    config = ClusterConfig(get_model(args.model), prefill_nodes=prefill_nodes, decode_nodes=decode_nodes)
    sweep_counts = [int(n) for n in args.sweep.split(",") if n.strip()]
    results: dict = {"config": {"model": args.model, "pd": args.pd, "max_len": args.max_len, "agents": args.agents,
                                "rounds": args.rounds, "seed": args.seed}}
    ablation, sweep, mooncake = _simulate(args, config, console, sweep_counts)
    results["ablation"] = _report_ablation(args, console, ablation)
    results["sweep"] = {mode.value: points for mode, points in sweep.items()}
    if sweep_counts:
        _report_sweep(console, sweep, sweep_counts)
    if mooncake:
        results["mooncake"] = _report_mooncake(console, mooncake)
    if args.online:
        results["online_aps"] = _report_online(args, console, config)
    if sweep_counts:
        written = plot_figures(args.out, sweep, ablation)
        console.print("figures: " + escape(", ".join(map(str, written))))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    console.print(f"results: {escape(str(args.out / 'results.json'))}")
    return 0
