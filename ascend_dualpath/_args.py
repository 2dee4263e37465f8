"""The command line's one rule for a bad value: every number a command takes is parsed here, and every refusal is
one line naming the option, the value and the limit (``demo: --first-prompt -1 must be an integer in [1, 65536]``).

Each numeric option's ``type=`` is one of the parsers below; each refuses what is not a number, NaN, infinity and
anything outside ``[low, high]``. Every bound has an upper limit (a cap chosen per option, named in the message),
so a huge size or repeat count is refused before any work starts; limits that depend on several options or on
the machine (memory, disk) are checked by the command itself before it starts, as ConfigError. :class:`CliParser` turns argparse's own errors
(a missing option, an unknown choice, a bad number) into one :class:`UsageError` instead of usage text and
``SystemExit``; ``python -m ascend_dualpath`` prints it as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import math
import re

from ascend_dualpath.errors import ConfigError

SEED_MAX = 2**32 - 1  # numpy's seed range
TIMEOUT_MAX_S = 7 * 86400.0  # a bound on every wait: a week


class UsageError(ConfigError):
    """A command-line argument the command refuses; ``command`` names the command (``bench moe``)."""

    def __init__(self, command: str, message: str) -> None:
        super().__init__(message)
        self.command = command


class Number:
    """An argparse ``type``: text -> ``int`` (``integer``) or ``float`` within ``[low, high]`` (``low`` excluded
    with ``low_open``), refusing non-numbers, NaN and infinity with an ``ArgumentTypeError`` naming the limit."""

    def __init__(self, low: float, high: float, *, integer: bool, low_open: bool = False) -> None:
        self.low, self.high, self.integer, self.low_open = low, high, integer, low_open
        if integer:
            self.rule = f"an integer in [{low}, {high}]"
        else:
            self.rule = f"a number {'>' if low_open else '>='} {low:g} and <= {high:g}"
        self.__name__ = self.rule  # argparse names the type in some messages

    def __call__(self, text: str) -> int | float:
        try:
            value: int | float = int(text, 10) if self.integer else float(text)
        except (TypeError, ValueError):
            value = math.nan
        too_low = value <= self.low if self.low_open else value < self.low
        if not math.isfinite(value) or too_low or value > self.high:
            raise argparse.ArgumentTypeError(f"{text} must be {self.rule}")
        return value


def positive_int(high: int) -> Number:
    """Integers in [1, ``high``]."""
    return Number(1, high, integer=True)


def nonneg_int(high: int) -> Number:
    """Integers in [0, ``high``] (0 meaning what the option's help says)."""
    return Number(0, high, integer=True)


def positive_float(high: float) -> Number:
    """Finite numbers in (0, ``high``]."""
    return Number(0, high, integer=False, low_open=True)


def nonneg_float(high: float) -> Number:
    """Finite numbers in [0, ``high``]."""
    return Number(0, high, integer=False)


SEED = nonneg_int(SEED_MAX)
TIMEOUT_S = positive_float(TIMEOUT_MAX_S)
PORT = positive_int(65535)


class NumberList:
    """An argparse ``type``: comma-separated numbers, each parsed by ``item``; '' is the empty tuple where
    ``allow_empty``."""

    def __init__(self, item: Number, *, allow_empty: bool = False) -> None:
        self.item, self.allow_empty = item, allow_empty
        self.__name__ = f"comma-separated {item.rule.replace('an integer', 'integers').replace('a number', 'numbers')}"
        if allow_empty:
            self.__name__ += " (or '')"

    def __call__(self, text: str) -> tuple:
        parts = [part.strip() for part in text.split(",") if part.strip()]
        try:
            if not parts and not self.allow_empty:
                raise argparse.ArgumentTypeError(text)
            return tuple(self.item(part) for part in parts)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{text!r} must be {self.__name__}") from None


class CliParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise one :class:`UsageError` (``--flag VALUE must be ...``) for
    ``command``, instead of printing the usage and exiting."""

    def __init__(self, *args, command: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.command = command

    def error(self, message: str):  # argparse's hook for every parse error
        match = re.fullmatch(r"argument ([^:]+): (.*)", message, flags=re.DOTALL)
        if match is not None:
            flag = match.group(1).split("/")[-1]  # "-h/--help" -> "--help"
            message = f"{flag} {match.group(2)}"
        raise UsageError(self.command, " ".join(message.split()))


def one_line(error: BaseException) -> str:
    """``error``'s message on one line (a message never spreads over several lines of the terminal)."""
    return " ".join(str(error).split())
