"""Announcements of blocks being persisted: bounded waits, and the worker withdraws each once it is written."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest

from ascend_dualpath.errors import AdpError, ArgumentTypeError, ConfigError
from ascend_dualpath.integrations.vllm.metadata import PersistSpec
from ascend_dualpath.integrations.vllm.persisting import PersistAnnouncements, Persister

IDS = [bytes([i]) * 16 for i in range(4)]


@pytest.mark.parametrize("wait_s", [0, -1.0, math.nan, math.inf])
def test_the_wait_bound_is_finite_and_positive(tmp_path, wait_s):
    with pytest.raises(ConfigError, match="wait_s"):
        PersistAnnouncements(tmp_path, wait_s)


def test_the_wait_bound_is_a_number(tmp_path):
    with pytest.raises(ArgumentTypeError, match="wait_s"):
        PersistAnnouncements(tmp_path, "5")


def test_an_announcement_is_pending_until_withdrawn_or_stale(tmp_path):
    announcements = PersistAnnouncements(tmp_path, 60.0)
    announcements.announce(IDS[:2])
    assert [announcements.pending(i) for i in IDS] == [True, True, False, False]
    announcements.withdraw(IDS[:1])
    assert [announcements.pending(i) for i in IDS] == [False, True, False, False]
    assert not PersistAnnouncements(tmp_path, 1e-9).pending(IDS[1])  # older than the bound: its writer died


class _Store:
    """Writes succeed except for ``failing``; records what was written."""

    def __init__(self, failing: bytes | None = None) -> None:
        self.failing, self.written = failing, []

    def write_block(self, block_id: bytes, parent: bytes | None, payload: object) -> bool:
        if block_id == self.failing:
            raise AdpError(f"injected write failure of {block_id.hex()}")
        self.written.append(block_id)
        return True


@pytest.mark.parametrize("failing", [None, IDS[2]])
def test_the_worker_withdraws_every_announcement_written_or_not(tmp_path, failing):
    announcements = PersistAnnouncements(tmp_path, 60.0)
    spec = PersistSpec("r", 1, IDS, [0, 1, 2, 3])
    announcements.announce(IDS[1:])
    counters = SimpleNamespace(persisted_blocks=0, failures=0)
    persister = Persister(_Store(failing), announcements, counters)
    try:
        persister.persist(spec, lambda i: b"")
        deadline = time.monotonic() + 10
        while not (done := persister.finished()):
            assert time.monotonic() < deadline, "the writes did not end"
            time.sleep(0.01)
    finally:
        persister.close()
    assert done == {"r"}
    assert persister.store.written == (IDS[1:] if failing is None else IDS[1:2])
    assert (counters.persisted_blocks, counters.failures) == ((3, 0) if failing is None else (1, 1))
    assert not any(announcements.pending(i) for i in IDS)
