"""``python -m ascend_dualpath bench <name> [options]``: run one microbenchmark of :mod:`ascend_dualpath.bench`."""

from __future__ import annotations

import argparse
import importlib

from ascend_dualpath._args import CliParser, UsageError
from ascend_dualpath.bench import BENCHES
from ascend_dualpath.errors import BackendUnavailable, ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(BENCHES), help="; ".join(f"{k}: {v[1]}" for k, v in BENCHES.items()))
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (see `bench NAME -h`)")


def build_parser(name: str) -> CliParser:
    """The argument parser of benchmark ``name`` (a key of BENCHES); ModuleNotFoundError if this build lacks it."""
    module_name, help_text = BENCHES[name]
    module = importlib.import_module(module_name)
    parser = CliParser(prog=f"python -m ascend_dualpath bench {name}", description=help_text, command=f"bench {name}")
    module.add_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        parser = build_parser(args.name)
    except ModuleNotFoundError as exc:
        raise UsageError(f"bench {args.name}", f"not available in this build: {exc}") from None
    try:
        return int(importlib.import_module(BENCHES[args.name][0]).run(parser.parse_args(args.rest)) or 0)
    except (ConfigError, BackendUnavailable) as error:  # named after the benchmark, not `bench`
        raise UsageError(getattr(error, "command", parser.command), str(error)) from None
