"""``python -m ascend_dualpath bench <name> [options]``: run one microbenchmark of :mod:`ascend_dualpath.bench`."""

from __future__ import annotations

import argparse
import importlib
import sys

from ascend_dualpath.bench import BENCHES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(BENCHES), help="; ".join(f"{k}: {v[1]}" for k, v in BENCHES.items()))
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (see `bench NAME -h`)")


def run(args: argparse.Namespace) -> int:
    module_name, help_text = BENCHES[args.name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        print(f"benchmark {args.name!r} is not available in this build: {exc}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"python -m ascend_dualpath bench {args.name}", description=help_text)
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(args.rest)) or 0)
