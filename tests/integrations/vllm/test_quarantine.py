"""The quarantine of memory a late write may still reach: held while its writers may run, given back after."""

from __future__ import annotations

import dataclasses
import time

import pytest

from ascend_dualpath.dualpath.quarantine import Quarantine
from ascend_dualpath.errors import ConfigError


@dataclasses.dataclass
class _Counters:
    quarantined_leases: int = 0
    quarantined_slots: int = 0
    reclaimed_leases: int = 0
    reclaimed_slots: int = 0


def _broken_peer() -> bool:
    raise TimeoutError("the peer did not answer")


def test_safe_memory_goes_back_at_once_and_held_memory_only_once_its_writers_ended():
    counters, released = _Counters(), []
    q = Quarantine(counters, sweep_s=60.0)  # no sweep of its own during the test
    try:
        q.retire("leases", "lease a", 10, lambda: released.append("a"), True, lambda: True, "")
        assert released == ["a"] and counters.quarantined_leases == 0
        writers = {"b": False, "c": False}
        q.retire("leases", "lease b", 100, lambda: released.append("b"), False, lambda: writers["b"], "late read")
        q.retire("slots", "slots c", 1000, lambda: released.append("c"), False, lambda: writers["c"], "late push")
        q.retire("slots", "slots d", 7, lambda: released.append("d"), False, _broken_peer, "no answer")
        assert (counters.quarantined_leases, counters.quarantined_slots, q.held_bytes) == (1, 2, 1107)
        assert q.sweep() == 0 and released == ["a"]
        writers["c"] = True
        assert q.sweep() == 1 and released == ["a", "c"] and counters.reclaimed_slots == 1
        writers["b"] = True
        assert q.sweep() == 1 and q.sweep() == 0  # each entry goes back once
        assert released == ["a", "c", "b"] and q.held_bytes == 7  # the unanswered one stays
    finally:
        q.close(1.0)


def test_the_sweeper_gives_memory_back_on_its_own_and_stops_at_close():
    counters, released, ended = _Counters(), [], [False]
    q = Quarantine(counters, sweep_s=0.02)
    q.retire("leases", "lease", 1, lambda: released.append(1), False, lambda: ended[0], "late read")
    ended[0] = True
    deadline = time.monotonic() + 5
    while not released and time.monotonic() < deadline:
        time.sleep(0.01)
    assert released == [1] and counters.reclaimed_leases == 1
    q.close(1.0)
    q.retire("leases", "after close", 1, lambda: released.append(2), False, lambda: True, "")
    time.sleep(0.1)
    assert released == [1] and q.held_bytes == 1  # held for good: nothing is given back after close


def test_an_unknown_kind_is_refused():
    with pytest.raises(ConfigError, match="'buffers' is not one of"):
        Quarantine(_Counters()).retire("buffers", "x", 1, lambda: None, True, lambda: True, "")
