"""Time for the read queue: the wall clock, a manual clock for tests, and the token bucket that paces reads."""

from __future__ import annotations

import threading
import time
from typing import Protocol

from ascend_dualpath import _env
from ascend_dualpath._checks import check_bound
from ascend_dualpath.errors import WaitTimeout

# Tokens a bucket may be short by and still count as full: float sums of refills drift by a few ulps.
_TOKEN_SLACK = 1e-9


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """Wall clock: ``time.monotonic`` and ``time.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class ManualClock:
    """Virtual clock for tests and simulation.

    With ``auto_advance=True`` a ``sleep`` moves time forward at once (time passes only through sleeps). Without
    it a ``sleep`` blocks until :meth:`advance` moves time past its deadline, bounded by ``timeout_s`` of real
    time so a test that forgets to advance fails instead of hanging.
    """

    def __init__(self, start: float = 0.0, *, auto_advance: bool = False, timeout_s: float | None = None) -> None:
        self._now = start
        self._auto = auto_advance
        self._timeout_s = (
            check_bound("timeout_s", timeout_s, where="manual clock") if timeout_s is not None else _env.timeout_s()
        )
        self._cond = threading.Condition()
        self._sleepers = 0
        self.sleeps: list[float] = []

    def now(self) -> float:
        with self._cond:
            return self._now

    def sleep(self, seconds: float) -> None:
        with self._cond:
            self.sleeps.append(seconds)
            deadline = self._now + seconds
            if self._auto:
                self._now = deadline
                return
            self._sleepers += 1
            self._cond.notify_all()
            try:
                if not self._cond.wait_for(lambda: self._now >= deadline, self._timeout_s):
                    raise WaitTimeout(
                        f"manual clock: sleep until t={deadline} but time stayed at {self._now} "
                        f"for {self._timeout_s} s of real time"
                    )
            finally:
                self._sleepers -= 1

    def advance(self, seconds: float) -> None:
        with self._cond:
            self._now += seconds
            self._cond.notify_all()

    def wait_for_sleepers(self, count: int = 1, timeout_s: float | None = None) -> None:
        """Block until ``count`` threads sleep on this clock (bounded by real time)."""
        timeout = (
            check_bound("timeout_s", timeout_s, where="manual clock") if timeout_s is not None else self._timeout_s
        )
        with self._cond:
            if not self._cond.wait_for(lambda: self._sleepers >= count, timeout):
                raise WaitTimeout(f"manual clock: waited {timeout} s for {count} sleeper(s), saw {self._sleepers}")


class TokenBucket:
    """Byte pacing: ``rate`` bytes/s refill up to ``burst`` bytes.

    A request of ``n`` bytes may start once the bucket holds ``min(n, burst)`` tokens and then takes ``n``
    (the balance may go negative for ``n > burst``). Bytes started in any window of length ``w`` are thus at
    most ``burst + rate * w`` for requests no larger than ``burst``.
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: int, now: float) -> None:
        self.rate = check_bound("bandwidth_bytes_per_s", rate_bytes_per_s, where="token bucket")
        self.burst = float(check_bound("burst_bytes", burst_bytes, integer=True, where="token bucket"))
        self._tokens = float(burst_bytes)
        self._last = now

    def _refill(self, now: float) -> None:
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now

    def delay_for(self, nbytes: int, now: float) -> float:
        """Seconds until a request of ``nbytes`` may start (0 when it may start now)."""
        self._refill(now)
        need = min(float(nbytes), self.burst)
        missing = need - self._tokens
        # Rounding after a sleep of exactly the computed delay can leave a sliver missing whose delay is below the
        # clock's resolution; waiting for it would never finish.
        if missing <= need * _TOKEN_SLACK:
            return 0.0
        return missing / self.rate

    def take(self, nbytes: int, now: float) -> None:
        self._refill(now)
        self._tokens -= nbytes
