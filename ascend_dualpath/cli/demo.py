"""``python -m ascend_dualpath demo``: DualPath KV loading end to end, prefill and decode engines as processes.

Starts a prefill engine (PE, rank 0) and a decode engine (DE, rank 1) on this machine (emulated NPUs on one
fabric, control over gloo), replays synthetic multi-turn agent conversations (Table 2 of the paper, scaled
down), and reads each turn's cached prefix through the PE or the DE storage NIC as the scheduler decides.
Prints per turn the path, bytes read through each storage NIC, time to first token and fallbacks, then a
summary; every turn is checked against a no-cache run. ``--compare`` also runs the PE-only baseline.

What a run leaves behind is removed whichever way it ends: the engines' fabric (``/dev/shm/adp.demo<pid>x<n>*``)
and the block store (``$TMPDIR/adp-demo-store-<pid>-*``) by this process on a normal end, an error, SIGINT or
SIGTERM (the engines are stopped first); by the engines themselves when this process is killed (each engine
watches its parent and, once it is gone, removes both and exits within 0.2 s); and, should the engines have been
killed too, by the next ``demo`` start, which removes the leftovers of every demo whose process is dead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import tempfile
import time

from ascend_dualpath import _args

SHM_DIR = "/dev/shm"
# Tokens one conversation may reach: longer contexts overflow the engines' default transfer buffers (a 32K-token
# prompt fails its every read path) and take minutes of CPU prefill per turn.
MAX_CONTEXT = 16384
MAX_TOTAL_TOKENS = 1 << 22  # tokens of all conversations: this process and both engines hold each as a Python int
STORE_PREFIX = "adp-demo-store-"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--agents", type=_args.positive_int(1024), default=8, help="concurrent agent conversations")
    parser.add_argument(
        "--turns",
        type=_args.positive_int(1024),
        default=None,
        help="turns per conversation (default 4; 8 with --compare, so the cold first turn, which "
        "has no cached prefix to load, does not dominate the comparison)",
    )
    parser.add_argument(
        "--first-prompt", type=_args.positive_int(MAX_CONTEXT), default=384, help="tokens of the first turn's prompt"
    )
    parser.add_argument(
        "--append", type=_args.positive_int(MAX_CONTEXT), default=64, help="mean tokens appended per later turn"
    )
    parser.add_argument("--gen", type=_args.positive_int(1024), default=4, help="tokens generated per turn")
    parser.add_argument(
        "--snic-mbps",
        type=_args.positive_float(1e7),
        default=1.0,
        help="storage-NIC read cap of each engine node, MB/s (scaled down with the model)",
    )
    parser.add_argument(
        "--mode",
        choices=("dual", "pe", "de", "split"),
        default="dual",
        help="read-path policy (split: every turn's hit blocks read through both storage NICs)",
    )
    parser.add_argument("--compare", action="store_true", help="also run the PE-only baseline, side by side")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--no-verify", action="store_true", help="skip the no-cache correctness checks")
    parser.add_argument("--seed", type=_args.SEED, default=0)
    parser.add_argument(
        "--backend",
        choices=("emulator", "auto", "npu", "cuda"),
        default="emulator",
        help="only the emulator runs this demo",
    )
    parser.add_argument("--timeout", type=_args.TIMEOUT_S, default=None, help="bound of every wait, seconds")
    parser.add_argument(
        "--kill-pe-after", type=_args.positive_int(1 << 20), default=None, help=argparse.SUPPRESS
    )  # fault test


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _remove_run_files(fabric_name: str, store_root: str | None) -> None:
    """Remove the shared memory of fabric ``fabric_name`` (its table and every region) and the store directory."""
    table = f"adp.{fabric_name}"
    for name in os.listdir(SHM_DIR):
        if name == table or name.startswith(table + "."):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
    if store_root is not None:
        shutil.rmtree(store_root, ignore_errors=True)


def reap_dead_runs() -> list[str]:
    """Remove the fabrics and stores of demos whose process is dead (killed with its engines); returns the paths.

    Both carry the demo's pid: fabrics are ``adp.demo<pid>x<n>*`` in /dev/shm, stores ``adp-demo-store-<pid>-*``
    in the temporary directory.
    """
    from ascend_dualpath._process import reap_dead_owners

    return reap_dead_owners(SHM_DIR, "adp.demo", "x") + reap_dead_owners(tempfile.gettempdir(), STORE_PREFIX, "-")


def _engine_child(parent_pid: int, rank: int, port: int, fabric_name: str, config, job: dict, events) -> None:
    """An engine process that removes the run's fabric and store and exits if the demo process dies."""
    from ascend_dualpath._process import watch_parent
    from ascend_dualpath.dualpath.bootstrap import engine_process

    watch_parent(parent_pid, lambda: _remove_run_files(fabric_name, config.store_root))
    engine_process(rank, port, fabric_name, config, job, events)


class _JobWatch:
    """The parent's view of a running job, from the engines' events: the DE summary, the first error, turns."""

    ROLES = ("prefill engine", "decode engine")

    def __init__(self, procs: list, timeout_s: float, on_event, kill_pe_after: int | None) -> None:
        self.procs, self.timeout_s, self.on_event, self.kill_pe_after = procs, timeout_s, on_event, kill_pe_after
        self.summary: dict | None = None
        self.error: str | None = None
        self.turns = 0
        self.pe_pid: int | None = None
        self.death_seen: float | None = None

    def check_processes(self, queue_empty: bool) -> None:
        """No event for a while: an engine that died with nothing left to report is the error."""
        dead = [rank for rank, p in enumerate(self.procs) if p.exitcode not in (None, 0)]
        if not dead or not queue_empty:
            return
        self.death_seen = self.death_seen or time.monotonic()
        # a survivor notices within its own bounded waits and reports the error it saw: prefer that
        survivor_may_report = self.procs[1].exitcode is None and time.monotonic() - self.death_seen < 2 * self.timeout_s
        if not survivor_may_report:
            self.error = "; ".join(f"{self.ROLES[r]} process exited with code {self.procs[r].exitcode}" for r in dead)

    def handle(self, event: tuple) -> None:
        import signal

        kind = event[0]
        if kind == "pe_pid":
            self.pe_pid = event[1]
        elif kind == "error":
            self.error = f"{event[1]}: {event[2]}"
        elif kind == "done":
            self.summary = event[1]
        else:
            if kind == "turn":
                self.turns += 1
                if self.kill_pe_after is not None and self.turns == self.kill_pe_after and self.pe_pid is not None:
                    os.kill(self.pe_pid, signal.SIGKILL)
            self.on_event(event)


def run_job(config, job: dict, on_event, kill_pe_after: int | None = None) -> dict:
    """Run the two engine processes for one job; ``on_event`` sees every event; returns the DE summary.

    Raises RuntimeError naming the engine and its error if either fails or the job does not finish in time.
    Whichever way it ends (an interrupt included), the engines are stopped and the fabric is removed.
    """
    import multiprocessing as mp

    from ascend_dualpath._process import sigint_blocked, stop
    from ascend_dualpath.backends.emulator import new_fabric_name

    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    fabric_name = new_fabric_name("demo")
    port = _free_port()
    procs = [
        ctx.Process(target=_engine_child, args=(os.getpid(), rank, port, fabric_name, config, job, events))
        for rank in range(2)
    ]
    with sigint_blocked():  # Ctrl-C is for this process; it stops the engines
        for p in procs:
            p.start()
    watch = _JobWatch(procs, config.timeout_s, on_event, kill_pe_after)
    deadline = time.monotonic() + config.idle_timeout_s
    ended = False
    try:
        while watch.summary is None and watch.error is None:
            if time.monotonic() > deadline:
                watch.error = f"job not done after {config.idle_timeout_s} s"
                break
            try:
                event = events.get(timeout=1.0)
            except Exception:  # queue.Empty: check the processes
                watch.check_processes(events.empty())
                continue
            watch.handle(event)
        ended = True
    finally:
        # a finished job's engines exit on their own (bounded); after an error or an interrupt they are stopped
        stop([(p, False) for p in procs], grace_s=5.0, exit_wait_s=10.0 if ended else 0.0)
        _remove_run_files(fabric_name, None)
    summary, error = watch.summary, watch.error
    if error is not None:
        raise RuntimeError(error)
    return summary


def _aggregate(summary: dict, turns: list[dict]) -> dict:
    return {
        "jct_s": summary["jct_s"],
        "pe_bytes": sum(w["pe_read_bytes"] for w in summary["waves"]),
        "de_bytes": sum(w["de_read_bytes"] for w in summary["waves"]),
        "mean_ttft_s": sum(t["ttft_s"] for t in turns) / max(1, len(turns)),
        "fallbacks": sum(len(t["fallbacks"]) for t in turns),
        "deferred": summary["deferred"],
        "failed": summary["failed"],
        "nic_vtime_ns": summary["nic_vtime_ns"],
        "nic_bytes": summary["nic_bytes"],
        "transfer_kinds": summary["transfer_kinds"],
        "checks": summary["checks"],
    }


def _run_mode(args, mode: str, console) -> dict | None:
    from rich.markup import escape
    from rich.progress import Progress
    from rich.table import Table

    from ascend_dualpath._progress import ProgressLines
    from ascend_dualpath.dualpath.nodes import EngineConfig
    from ascend_dualpath.dualpath.workload import synthetic_conversations

    conversations = synthetic_conversations(
        args.agents, args.turns, args.first_prompt, args.append, args.gen, seed=args.seed
    )
    longest = max(c.max_context() for c in conversations)
    timeout = args.timeout or 30.0
    with tempfile.TemporaryDirectory(prefix=f"{STORE_PREFIX}{os.getpid()}-") as root:
        config = EngineConfig(
            root,
            dtype=args.dtype,
            max_tokens=max(256, -(-longest // 256) * 256),
            pe_snic_bytes_per_s=args.snic_mbps * 1e6,
            de_snic_bytes_per_s=args.snic_mbps * 1e6,
            timeout_s=timeout,
            idle_timeout_s=max(120.0, 20 * timeout),
            verify=not args.no_verify,
        )
        turns: list[dict] = []
        total = args.agents * args.turns
        table = Table(title=f"{mode}: per turn", show_lines=False)
        for column in ("agent", "turn", "path", "prompt", "hit", "PE SNIC KiB", "DE SNIC KiB", "TTFT ms", "fallback"):
            table.add_column(column, justify="right")
        lines = ProgressLines("demo")  # the live display shows nothing off a terminal
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task(escape(f"[{mode}] turns served"), total=total)
            check_task = progress.add_task(escape(f"[{mode}] turns verified"), total=total, visible=not args.no_verify)

            def on_event(event) -> None:
                if event[0] == "turn":
                    t = event[1]
                    turns.append(t)
                    progress.advance(task)
                    lines.step(f"[{mode}] turns served", len(turns), total)
                    table.add_row(
                        str(t["agent_id"]),
                        str(t["turn"]),
                        t["path"],
                        str(t["prompt_tokens"]),
                        str(t["hit_tokens"]),
                        f"{t['pe_read_bytes'] / 1024:.0f}",
                        f"{t['de_read_bytes'] / 1024:.0f}",
                        f"{t['ttft_s'] * 1e3:.0f}",
                        escape("; ".join(t["fallbacks"] + ([t["error"]] if t["error"] else []))[:60]),
                    )
                elif event[0] == "verified":
                    progress.advance(check_task)

            try:
                summary = run_job(config, {"conversations": conversations, "mode": mode}, on_event, args.kill_pe_after)
            except RuntimeError as error:
                console.print(f"[red]demo ({mode}) failed: {escape(str(error))}")
                return None
    console.print(table)
    return _aggregate(summary, turns)


def _summary_rows() -> list:
    """(row name, formatter of one mode's aggregate) of the summary table."""
    from rich.markup import escape

    return [
        ("job completion time (wall)", lambda r: f"{r['jct_s']:.2f} s"),
        ("bytes read, PE SNIC", lambda r: f"{r['pe_bytes'] / 2**20:.2f} MiB"),
        ("bytes read, DE SNIC", lambda r: f"{r['de_bytes'] / 2**20:.2f} MiB"),
        ("mean TTFT", lambda r: f"{r['mean_ttft_s'] * 1e3:.0f} ms"),
        ("fallbacks / deferred / failed turns", lambda r: f"{r['fallbacks']} / {r['deferred']} / {r['failed']}"),
        (
            "DE NIC virtual clock (transfers)",
            lambda r: f"{r['nic_vtime_ns'] / 1e3:.0f} us, {r['nic_bytes'] / 2**20:.1f} MiB",
        ),
        (
            "DE transfer requests by kind",
            lambda r: escape(", ".join(f"{k} {n}" for k, n in sorted(r["transfer_kinds"].items())) or "-"),
        ),
        ("loaded KV bit-exact", lambda r: _count(r, "loaded_exact")),
        (
            "KV within tolerance of float64",
            lambda r: (
                _count(r, "kv_ok")
                + (f" (worst {max(c['kv_max_err'] for c in r['checks']):.3f})" if r["checks"] else "")
            ),
        ),
        ("greedy tokens = no-cache run", lambda r: _count(r, "tokens_equal")),
    ]


def _print_summary(console, results: dict[str, dict]) -> bool:
    from rich.table import Table

    table = Table(title="summary")
    table.add_column("")
    for mode in results:
        table.add_column("DualPath" if mode == "dual" else f"{mode.upper()}-only", justify="right")
    rows = _summary_rows()
    for name, fmt in rows:
        table.add_row(name, *[fmt(r) for r in results.values()])
    console.print(table)
    if "dual" in results and "pe" in results:
        _print_gain(console, results["dual"], results["pe"])
    ok = all(c["loaded_exact"] and c["kv_ok"] and c["tokens_equal"] for r in results.values() for c in r["checks"])
    ok &= not any(r["failed"] for r in results.values())
    console.print(f"every turn correct: {ok}" if any(r["checks"] for r in results.values()) else "not verified")
    return ok


def _print_gain(console, dual: dict, base: dict) -> None:
    console.print(f"DualPath vs PE-only: job completion time {base['jct_s'] / dual['jct_s']:.2f}x better")


def _count(result: dict, key: str) -> str:
    checks = result["checks"]
    return f"{sum(c[key] for c in checks)}/{len(checks)}" if checks else "-"


def check_sizes(args: argparse.Namespace) -> None:
    """Refuse, before any work, a workload whose longest conversation exceeds :data:`MAX_CONTEXT` tokens or whose
    block store (every agent's KV, in the temporary directory) exceeds the free space there (ConfigError)."""
    import shutil

    import torch

    from ascend_dualpath.errors import ConfigError
    from ascend_dualpath.models.tiny_llama import TinyLlamaConfig

    # the synthetic workload appends at most 3/2 of --append per later turn
    longest = args.first_prompt + (args.turns - 1) * (args.append * 3 // 2) + args.turns * args.gen
    if longest > MAX_CONTEXT:
        raise ConfigError(
            f"--first-prompt {args.first_prompt}, --turns {args.turns}, --append {args.append} and --gen {args.gen} "
            f"reach {longest} tokens in one conversation; the limit is {MAX_CONTEXT}"
        )
    token_bytes = TinyLlamaConfig().kv_layout(getattr(torch, args.dtype)).token_bytes
    if args.agents * longest > MAX_TOTAL_TOKENS:
        raise ConfigError(
            f"--agents {args.agents} conversations of up to {longest} tokens hold {args.agents * longest} tokens; "
            f"the limit is {MAX_TOTAL_TOKENS}"
        )
    store_bytes = args.agents * longest * token_bytes
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if store_bytes > free:
        raise ConfigError(
            f"--agents {args.agents} conversations of up to {longest} tokens need {store_bytes / 2**20:.0f} MiB of "
            f"KV in {tempfile.gettempdir()}; {free / 2**20:.0f} MiB are free there"
        )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ascend_dualpath.backends import Backend, get_backend
    from ascend_dualpath.errors import ConfigError

    if get_backend(args.backend) is not Backend.EMULATOR:
        raise ConfigError(f"--backend {args.backend} is not supported by this demo yet; use --backend emulator")
    if args.turns is None:
        args.turns = 8 if args.compare else 4
    check_sizes(args)
    reap_dead_runs()
    console = Console()
    console.print(
        f"DualPath demo: {args.agents} agents x {args.turns} turns, first prompt {args.first_prompt} "
        f"tokens, +{args.append} per turn, {args.gen} generated; storage NIC cap {args.snic_mbps} MB/s "
        f"per engine node; tiny Llama ({args.dtype}) on 2 emulated NPUs"
    )
    modes = ["dual", "pe"] if args.compare else [args.mode]
    results = {}
    for mode in modes:
        result = _run_mode(args, mode, console)
        if result is None:
            return 1
        results[mode] = result
    return 0 if _print_summary(console, results) else 1
