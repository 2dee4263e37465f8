"""Command line: ``python -m ascend_dualpath {info, demo, bench, ...}``.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``; only
the chosen command's module is imported, so ``info`` never pays for the simulator's imports. Every command runs
inside :func:`~ascend_dualpath._process.handle_signals`: SIGINT or SIGTERM stops the command's children and
ends it with one line on stderr and exit status 130 or 143. A user's mistake (a bad option value, a
:class:`~ascend_dualpath.errors.ConfigError` raised before or while the command runs, a backend named that
cannot run here) ends it with one line on
stderr, ``<command>: <what is wrong>``, and exit status 2; every numeric option is parsed by :mod:`ascend_dualpath._args`.
"""

from __future__ import annotations

import importlib
import sys

from ascend_dualpath._args import CliParser, one_line
from ascend_dualpath._process import handle_signals
from ascend_dualpath.errors import BackendUnavailable, ConfigError

COMMANDS = {
    "info": ("ascend_dualpath.cli.info", "version, backends and the emulated device profile"),
    "demo": ("ascend_dualpath.cli.demo", "the main job, on the emulator by default"),
    "bench": ("ascend_dualpath.cli.bench", "microbenchmarks (emulated NIC, transfers, MoE)"),
    "simulate": ("ascend_dualpath.cli.simulate", "DualPath cluster simulator: ablation, sweeps, figures"),
    "make-tiny-model": ("ascend_dualpath.cli.make_tiny_model", "a tiny random Llama in Hugging Face format (for vLLM)"),
    "proxy": (
        "ascend_dualpath.cli.proxy",
        "OpenAI-compatible proxy placing requests on vLLM prefill and decode instances",
    ),
    "serve": (
        "ascend_dualpath.cli.serve",
        "N prefill and M decode vLLM instances plus the proxy, on this machine; or one instance (--role)",
    ),
}


def _usage() -> str:
    lines = ["usage: python -m ascend_dualpath <command> [options]", "", "commands:"]
    lines += [f"  {name:<16} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    return "\n".join(lines)


def build_parser(name: str) -> CliParser:
    """The argument parser of command ``name`` (a key of :data:`COMMANDS`); imports only that command's module."""
    module_name, help_text = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = CliParser(prog=f"python -m ascend_dualpath {name}", description=help_text, command=name)
    module.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        args = build_parser(name).parse_args(rest)
        with handle_signals(name):
            return int(importlib.import_module(COMMANDS[name][0]).run(args) or 0)
    except (ConfigError, BackendUnavailable) as error:  # the user asked for what cannot be, or cannot run here
        print(f"{getattr(error, 'command', name)}: {one_line(error)}", file=sys.stderr)
        return 2
