"""Memory a late write may still reach: kept out of its pool while it might, given back once nothing can reach it.

A host lease or a pair of window slots whose last reads, sends or pushes outlived their bounded waits cannot go back
to its pool: the next request would get bytes a late write still lands in. :class:`Quarantine` holds such memory
with a test of whether its writers ended (the worker's own tickets, and where a peer writes, that peer's word over
the side channel) and gives it back when a sweep finds the test true, so a long run with some timeouts does not
drain its buffers. A test that raises (a peer that does not answer) counts as "not yet". Sweeps run on a thread of
their own while anything is held (a peer's answer may take up to the side channel's bound, which vLLM's step must
not wait for).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from ascend_dualpath.errors import ConfigError

log = logging.getLogger(__name__)
SWEEP_S = 1.0  # how often the sweeper tests what is held: its tests may ask a peer over the side channel
KINDS = ("leases", "slots")


@dataclasses.dataclass
class _Held:
    kind: str
    what: str
    nbytes: int
    release: Callable[[], None]
    ended: Callable[[], bool]


class Quarantine:
    """The worker's quarantined memory.

    Parameters
    ----------
    counters :
        The worker's ``Counters``: ``quarantined_<kind>`` counts what was held, ``reclaimed_<kind>`` what was given
        back (kinds: ``leases``, ``slots``).
    sweep_s : float
        Time between two sweeps of the sweeper thread.
    """

    def __init__(self, counters: Any, sweep_s: float = SWEEP_S) -> None:
        self.counters, self.sweep_s = counters, sweep_s
        self._held: list[_Held] = []
        self._lock = threading.Lock()
        self._sweep_lock = threading.Lock()  # one sweep at a time: each held entry is released once
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None

    def retire(
        self,
        kind: str,
        what: str,
        nbytes: int,
        release: Callable[[], None],
        safe: bool,
        ended: Callable[[], bool],
        why: str,
    ) -> None:
        """Give ``what`` back now (``release()``) if ``safe``, else hold it until ``ended()`` is true at a sweep."""
        if kind not in KINDS:
            raise ConfigError(f"quarantine kind {kind!r} is not one of {KINDS}")
        if safe:
            release()
            return
        with self._lock:
            self._held.append(_Held(kind, what, nbytes, release, ended))
            if self._sweeper is None and not self._stop.is_set():
                self._sweeper = threading.Thread(target=self._sweep_until_closed, name="adp-quarantine", daemon=True)
                self._sweeper.start()
        name = f"quarantined_{kind}"
        setattr(self.counters, name, getattr(self.counters, name) + 1)
        log.warning("DualPath: %s (%d bytes) quarantined: %s", what, nbytes, why)

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(h.nbytes for h in self._held)

    def sweep(self) -> int:
        """Give back everything whose writers ended; returns how many (the sweeper calls it every ``sweep_s``)."""
        with self._sweep_lock:
            with self._lock:
                held = list(self._held)
            reclaimed = [h for h in held if _ended(h)]
            for h in reclaimed:
                with self._lock:
                    self._held.remove(h)
                h.release()
                name = f"reclaimed_{h.kind}"
                setattr(self.counters, name, getattr(self.counters, name) + 1)
                log.info("DualPath: %s (%d bytes) reclaimed from quarantine", h.what, h.nbytes)
            return len(reclaimed)

    def _sweep_until_closed(self) -> None:
        while not self._stop.wait(self.sweep_s):
            self.sweep()

    def close(self, timeout_s: float) -> None:
        """Stop the sweeper (waiting at most ``timeout_s`` for a sweep in progress); what is held stays held."""
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join(timeout_s)


def tickets_ended(reads, transfers) -> bool:
    """Whether none of a lease's storage reads (read-queue tickets) or transfers (transfer-leg tickets) into or out
    of it is in flight: the usual test before the lease goes back."""
    return all(t.done for t in reads) and all(t.done() for t in transfers)


def _ended(held: _Held) -> bool:
    try:
        return bool(held.ended())
    except Exception:  # noqa: BLE001 - a peer that cannot answer now may answer at the next sweep
        return False
