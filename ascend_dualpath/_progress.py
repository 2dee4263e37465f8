"""Progress of a long command as plain lines on stderr (``simulate: run 3/12 ablation dualpath: 800/2048 rounds``),
for runs whose output goes to a file or a pipe, where a live display (rich) shows nothing until the end.

One mechanism for every command: :class:`ProgressLines`. Lines go to stderr, so stdout (tables, JSON) stays the
same; on a terminal they are left to the command's live display unless it has none (``on_tty=True``).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressLines:
    """Throttled progress lines ``<command>: <what> <done>/<total><unit>`` on ``stream`` (default stderr).

    A step is printed when its ``what`` changes, when it completes (``done == total``, once) and otherwise at most
    once every ``every_s`` seconds, so a loop reporting every round costs one line per few seconds.
    """

    def __init__(self, command: str, *, every_s: float = 5.0, on_tty: bool = False, stream: TextIO | None = None):
        self.command, self.every_s = command, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = on_tty or not self.stream.isatty()
        self._printed: tuple[str, int] | None = None  # (what, done) of the last line
        self._last = 0.0

    def step(self, what: str, done: int, total: int, unit: str = "") -> None:
        """Report ``done`` of ``total`` for ``what`` (e.g. ``run 3/12 sweep 512 basic``, 800, 2048, " rounds")."""
        if not self.enabled:
            return
        now = time.monotonic()
        same = self._printed is not None and self._printed[0] == what
        if same and (done == self._printed[1] or (done < total and now - self._last < self.every_s)):
            return
        self._printed, self._last = (what, done), now
        print(f"{self.command}: {what} {done}/{total}{unit}", file=self.stream, flush=True)
