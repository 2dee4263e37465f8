"""One rule for a bad command-line value, every command: one line on stderr naming the option and the value, exit
status 2, no traceback, before any work. The walk reads the parsers the CLI builds, so a new option is covered
the day it is added; the values a command legitimately takes are in ALLOWED, each with its reason."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ascend_dualpath import _args
from ascend_dualpath._progress import ProgressLines
from ascend_dualpath.bench import BENCHES
from ascend_dualpath.cli import COMMANDS, bench, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
BAD_VALUES = ("-1", "0", "nan", "inf", "-inf", str(10**12), "abc", "")
# (command, option) -> {value: why a command takes it}
ALLOWED = {
    ("demo", "--seed"): {"0": "0 is a seed like any other"},
    ("simulate", "--seed"): {"0": "0 is a seed like any other"},
    ("make-tiny-model", "--seed"): {"0": "0 is a seed like any other"},
    ("simulate", "--sweep"): {"": "'' skips the JCT sweep (documented)"},
    ("simulate", "--warmup-s"): {"0": "a steady-state run may exclude no warm-up"},
    ("simulate", "--drain-s"): {"0": "a steady-state run may have no drain"},
    ("serve", "--compute-quota"): {"0": "0 turns the PE compute quota off (the default)"},
    ("proxy", "--compute-quota"): {"0": "0 turns the PE compute quota off (the default)"},
    ("serve", "--decode-groups"): {"0": "group 0 is the default DE group"},
    ("bench moe", "--ranks"): {"0": "0 = one rank per CUDA GPU, else 2 (the default)"},
    ("bench moe", "--warmup"): {"0": "timing without warm-up calls"},
    ("bench moe", "--num-sms"): {"0": "0 = the bandwidth model picks the SM count (the default)"},
}
FAST_S = 20.0


def _parsers() -> list[tuple[list[str], str, argparse.ArgumentParser]]:
    """(argv prefix, command as errors name it, parser) of every command and every benchmark."""
    found = []
    for name in COMMANDS:
        found.append(([name], name, build_parser(name)))
    for name in BENCHES:
        try:
            found.append((["bench", name], f"bench {name}", bench.build_parser(name)))
        except ModuleNotFoundError:  # a benchmark this build lacks answers with its own line (bench.run)
            continue
    return found


PARSERS = _parsers()
NUMERIC = (_args.Number, _args.NumberList)


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def _numeric_options() -> list[tuple[list[str], str, argparse.ArgumentParser, str]]:
    return [
        (prefix, command, parser, action.option_strings[-1])
        for prefix, command, parser in PARSERS
        for action in _options(parser)
        if isinstance(action.type, NUMERIC) and action.option_strings
    ]


def _valid(action: argparse.Action) -> str:
    if isinstance(action.type, _args.Number):
        return str(max(int(action.type.low) + 1, 1))
    return "x"


def _required(parser: argparse.ArgumentParser, except_flag: str) -> list[str]:
    """The arguments the parser requires besides ``except_flag``, each with a valid value."""
    argv = []
    for action in _options(parser):
        if except_flag in action.option_strings:
            continue
        if not action.option_strings:
            if action.nargs is None:  # a positional that takes one value (nargs "*" may be empty)
                argv.insert(0, _valid(action))
        elif action.required:
            argv += [action.option_strings[-1], _valid(action)]
    return argv


NUMERIC_OPTIONS = _numeric_options()


def test_every_numeric_option_is_parsed_by_the_shared_validators():
    plain = [
        f"{command} {action.option_strings or action.dest}"
        for _, command, parser in PARSERS
        for action in _options(parser)
        if action.type in (int, float)
    ]
    assert not plain, f"use ascend_dualpath._args for {plain}"
    assert len(NUMERIC_OPTIONS) > 40  # the walk found the commands' options
    known = {(command, flag) for _, command, _, flag in NUMERIC_OPTIONS}
    assert not set(ALLOWED) - known, f"ALLOWED names options that are gone: {set(ALLOWED) - known}"


@pytest.mark.parametrize(
    ("prefix", "command", "parser", "flag"), NUMERIC_OPTIONS, ids=[f"{c} {f}" for _, c, _, f in NUMERIC_OPTIONS]
)
def test_a_bad_value_is_one_line_and_exit_2(prefix, command, parser, flag, capsys):
    allowed = ALLOWED.get((command, flag), {})
    required = _required(parser, flag)
    for value in BAD_VALUES:
        if value in allowed:
            parser.parse_args([*required, f"{flag}={value}"])  # accepted, and not run here
            continue
        start = time.monotonic()
        status = main([*prefix, *required, f"{flag}={value}"])
        elapsed = time.monotonic() - start
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert status == 2, (value, status, err)
        assert len(lines) == 1, (value, err)
        assert lines[0].startswith(f"{command}: {flag} "), (value, lines[0])
        assert value in lines[0] and "Traceback" not in err, (value, lines[0])
        assert elapsed < FAST_S, (value, elapsed)


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--agents", "1024", "--first-prompt", "16000", "--turns", "1"],  # 16M tokens
        ["demo", "--first-prompt", "16000", "--turns", "8"],  # one conversation past the demo's context
        ["bench", "transfer", "--cases", "nope"],  # ConfigError from the command itself
        ["bench", "moe", "--topk", "9", "--experts", "8"],
        ["bench", "moe", "--ranks", "1"],
        ["simulate", "--max-len", "5", "--sweep", ""],  # no Table-2 bucket
    ],
)
def test_sizes_and_combinations_are_refused_before_any_work(argv, capsys):
    start = time.monotonic()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"{argv[0]} {argv[1]}: " if argv[0] == "bench" else f"{argv[0]}: "), err
    assert time.monotonic() - start < FAST_S


@pytest.mark.parametrize("argv", [["demo", "--backend", "cuda"], ["bench", "transfer", "--backend", "cuda", "--quick"]])
def test_a_backend_that_cannot_run_here_is_one_line(argv, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA runs here")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "CUDA" in err.upper(), err


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["demo", "--first-prompt", "100000000"], "[1, 16384]"),
        (["bench", "moe", "--ranks", "-1"], "[0, 256]"),
        (["bench", "transfer", "--repeats", "-1"], "[1, 10000]"),
        (["simulate", "--sweep", "-2"], "integers in [1,"),
    ],
)
def test_the_entry_point_answers_in_one_line(argv, named, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "ascend_dualpath", *argv], capture_output=True, text=True, timeout=60, env=env,
        cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and argv[-1] in lines[0] and named in lines[0], out.stderr


@given(st.integers(-(10**6), 10**6), st.integers(-1000, 1000), st.integers(0, 1000))
def test_number_accepts_exactly_its_range(value, low, width):
    parse = _args.Number(low, low + width, integer=True)
    if low <= value <= low + width:
        assert parse(str(value)) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=f"^{value} must be an integer in"):
            parse(str(value))


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_positive_float_refuses_what_is_not_finite_and_positive(value):
    parse = _args.positive_float(1e6)
    if value == value and 0 < value <= 1e6:
        assert parse(repr(value)) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(repr(value))


def test_progress_lines_are_throttled_with_counts():
    stream = io.StringIO()
    lines = ProgressLines("cmd", every_s=3600, stream=stream)
    for done in range(1, 101):
        lines.step("run 1/2 a:", done, 100, " rounds")
    lines.step("run 1/2 a:", 100, 100, " rounds")  # a repeated completion is not printed again
    lines.step("run 2/2 b:", 1, 5)
    assert stream.getvalue().splitlines() == [
        "cmd: run 1/2 a: 1/100 rounds",
        "cmd: run 1/2 a: 100/100 rounds",
        "cmd: run 2/2 b: 1/5",
    ]


def test_simulate_off_a_terminal_prints_a_progress_line_per_run(tmp_path, capsys):
    assert main(["simulate", "--agents", "4", "--rounds", "1", "--sweep", "2", "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    runs = sorted({line.split(":")[1].strip().split()[1] for line in err.splitlines() if line.startswith("simulate:")})
    assert runs == [f"{n}/8" for n in range(1, 9)], err  # 5 ablation modes, 3 sweep modes at one count
    assert "simulate: run 8/8 sweep 2 oracle: 2/2 rounds" in err.splitlines()
    assert "simulate: run" not in out  # stdout keeps only the tables


def test_simulate_planning_off_a_terminal_counts_its_runs(tmp_path, capsys):
    argv = ["simulate", "--cluster", "ds27b_1p1d", "--agents", "2", "--modes", "basic,scheduler"]
    assert main([*argv, "--json", str(tmp_path / "plan.json")]) == 0
    err = capsys.readouterr().err.splitlines()
    runs = dict.fromkeys(line.split(":")[1].strip() for line in err if line.endswith(" rounds"))
    assert list(runs) == ["run 1/2 basic", "run 2/2 scheduler"], err
