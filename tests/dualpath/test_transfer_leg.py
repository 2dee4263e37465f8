"""The transfer leg over the emulator's engines: the caller's magic reaches the peer's notify slot through the engine
(``notify_value``), only after every byte of the layer; the leg runs no thread of its own, and a caller that polls
publishes its own notifies."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ascend_dualpath.dualpath.transfer_leg import (
    FaultInjectingLeg,
    Segment,
    TransferFailed,
    TransportTransferLeg,
    contiguous,
    wait_notify,
)
from ascend_dualpath.errors import QueueError, WaitTimeout
from tests.conftest import POISON

PIECE = 4096


@pytest.fixture
def pair(comms):
    """Rank 0 sending into rank 1's window (poisoned), rank 0's out-window a known pattern."""
    src, dst = comms
    np.frombuffer(src.windows_out, np.uint8)[: 16 * PIECE] = np.arange(16 * PIECE) % 253
    np.frombuffer(dst.windows_in, np.uint8)[:] = POISON
    return src, dst


def _views(src, dst):
    return np.frombuffer(src.windows_out, np.uint8), np.frombuffer(dst.windows_in, np.uint8)


def _two_runs(src) -> list[Segment]:
    """Two back-to-back runs at the destination with a gap between them: two engine requests."""
    base = src.windows_out.addr
    return [Segment(base, 3 * PIECE, 0), Segment(base + 5 * PIECE, 2 * PIECE, 4 * PIECE)]


def test_the_leg_runs_no_thread_and_the_peer_reads_the_callers_magics(pair):
    src, dst = pair
    out, landing = _views(src, dst)
    threads = threading.active_count()
    leg = TransportTransferLeg(src, 5.0)
    magics = [src.next_magic() for _ in range(6)]
    tickets = [
        leg.submit(
            layer,
            contiguous([(src.windows_out.addr + layer * PIECE, PIECE)]),
            1,
            dst.windows_in.addr + layer * PIECE,
            layer,
            magics[layer],
        )
        for layer in range(5)
    ]
    empty = leg.submit(5, [], 1, dst.windows_in.addr, 5, magics[5])  # nothing to move: the notify still goes
    assert threading.active_count() == threads, "submitting started a thread"
    for ticket in tickets:
        leg.wait(ticket)
    leg.wait(empty)
    assert [dst.notify_value(slot) for slot in range(6)] == magics
    assert np.array_equal(landing[: 5 * PIECE], out[: 5 * PIECE])
    assert leg.bytes_sent == 5 * PIECE and sum(leg.kinds_used.values()) == 5
    leg.close()
    assert threading.active_count() == threads, "the leg left a thread behind"
    with pytest.raises(QueueError, match="the transfer leg is closed"):
        leg.submit(6, contiguous([(src.windows_out.addr, 8)]), 1, dst.windows_in.addr, 6, src.next_magic())


def test_a_layer_of_several_requests_notifies_only_after_all_its_bytes(pair):
    src, dst = pair
    out, landing = _views(src, dst)
    leg = TransportTransferLeg(src, 5.0)
    magic, seen = src.next_magic(), {}

    def watch():  # the receiver snapshots its window the moment the flag flips
        deadline = time.monotonic() + 10
        while dst.notify_value(3) != magic and time.monotonic() < deadline:
            pass
        seen["landing"] = landing[: 6 * PIECE].copy()

    watcher = threading.Thread(target=watch)
    watcher.start()
    leg.wait(leg.submit(3, _two_runs(src), 1, dst.windows_in.addr, 3, magic))
    watcher.join()
    expected = np.full(6 * PIECE, POISON, np.uint8)
    expected[: 3 * PIECE] = out[: 3 * PIECE]
    expected[4 * PIECE :] = out[5 * PIECE : 7 * PIECE]
    assert dst.notify_value(3) == magic
    assert np.array_equal(seen["landing"], expected), "the notify came before every byte of the layer landed"
    assert sum(leg.kinds_used.values()) == 2
    leg.close()


class _FailingAfterTheFirstRun:
    """The emulator's engine, whose blocking ``transfer`` (a layer's runs before its last) fails once its bytes
    landed: a fault after the first piece of the layer."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def transfer(self, *args, **kwargs):
        self.engine.transfer(*args, **kwargs)
        raise QueueError("injected completion error after the first run")


def test_a_fault_after_the_first_request_leaves_the_notify_unset(pair):
    from ascend_dualpath.transport import create_engine

    src, dst = pair
    out, landing = _views(src, dst)
    engine = _FailingAfterTheFirstRun(create_engine("emulator", src, 1, timeout_s=5.0))
    leg = TransportTransferLeg(engines=[engine, engine], timeout_s=5.0)
    ticket = leg.submit(4, _two_runs(src), 1, dst.windows_in.addr, 4, src.next_magic())
    with pytest.raises(TransferFailed, match="layer 4 .*injected completion error"):
        leg.wait(ticket)
    assert dst.notify_value(4) == 0, "the notify of a layer whose first request failed was set"
    assert np.array_equal(landing[: 3 * PIECE], out[: 3 * PIECE])  # the first request landed
    assert bool((landing[3 * PIECE : 6 * PIECE] == POISON).all()), "the request after the failed one moved bytes"
    assert leg.bytes_sent == 0 and ticket.done()
    leg.close()
    engine.close()


def test_a_caller_polling_for_its_peer_publishes_its_own_notify(pair):
    """No thread finishes a request: the submitter's ``raise_if_failed`` poll (``wait_notify``'s check) does."""
    src, dst = pair
    leg = TransportTransferLeg(src, 5.0)
    magic = src.next_magic()
    ticket = leg.submit(2, contiguous([(src.windows_out.addr, 2 * PIECE)]), 1, dst.windows_in.addr, 2, magic)
    wait_notify(dst, 2, magic, "layer 2", timeout_s=5.0, check=lambda: leg.raise_if_failed(ticket))
    assert ticket.done() and leg.wait(ticket, 0) >= 0
    leg.close()


def test_the_injected_failure_fails_its_layer_only(pair):
    src, dst = pair
    leg = FaultInjectingLeg(TransportTransferLeg(src, 5.0))
    leg.fail_after(1)
    segments = contiguous([(src.windows_out.addr, PIECE)])
    magics = [src.next_magic() for _ in range(3)]
    tickets = [leg.submit(layer, segments, 1, dst.windows_in.addr, layer, magics[layer]) for layer in range(3)]
    with pytest.raises(TransferFailed, match="injected transfer failure in the middle of layer 1"):
        leg.raise_if_failed(tickets[1])
    for layer in (0, 2):
        leg.wait(tickets[layer])
    assert [dst.notify_value(slot) for slot in range(3)] == [magics[0], 0, magics[2]]
    leg.close()


def test_threads_sharing_a_leg_each_get_their_layers_and_notifies(pair):
    src, dst = pair
    out, landing = _views(src, dst)
    leg = TransportTransferLeg(src, 5.0)
    magics = {slot: src.next_magic() for slot in range(8)}
    errors = []

    def send(first):
        try:
            for slot in range(first, 8, 2):
                addr = src.windows_out.addr + slot * PIECE
                ticket = leg.submit(slot, contiguous([(addr, PIECE)]), 1, dst.windows_in.addr + slot * PIECE)
                leg.wait(ticket)
                leg.wait(leg.submit(slot, [], 1, dst.windows_in.addr, slot, magics[slot]))
        except Exception as error:  # reported below, with the thread's layers
            errors.append(error)

    senders = [threading.Thread(target=send, args=(first,)) for first in (0, 1)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    assert not errors
    assert {slot: dst.notify_value(slot) for slot in range(8)} == magics
    assert np.array_equal(landing[: 8 * PIECE], out[: 8 * PIECE])
    leg.close()


def test_a_timed_out_layer_stays_not_done_until_its_bytes_landed(pair):
    """A wait that timed out ends nothing: the layer's bytes may still land, so ``done()`` (what a lease's return
    waits on) stays False, and the next submit fails, bounded, instead of overtaking it."""
    from ascend_dualpath.transport import create_engine

    src, dst = pair
    out, landing = _views(src, dst)
    engine = create_engine("emulator", src, 1, timeout_s=5.0)
    leg = TransportTransferLeg(engines=[engine, engine], timeout_s=0.2)
    magic, segments = src.next_magic(), contiguous([(src.windows_out.addr, 2 * PIECE)])
    src.device.nic.set_paused(True)  # the NIC executes nothing: the posts fit in the SQ, no CQE comes
    ticket = leg.submit(2, segments, 1, dst.windows_in.addr, 2, magic)
    with pytest.raises(WaitTimeout, match=r"transfer of layer 2 .* not done after 0.05 s: .*0 of 1 posted WQEs"):
        leg.wait(ticket, 0.05)
    assert not ticket.done() and not ticket.done() and ticket.error is None
    later = leg.submit(3, segments, 1, dst.windows_in.addr + 4 * PIECE, 3, src.next_magic())
    assert later.done()
    with pytest.raises(WaitTimeout, match="transfer of layer 3 .* not done"):
        leg.wait(later)
    assert not ticket.done() and dst.notify_value(2) == 0
    assert bool((landing[: 8 * PIECE] == POISON).all())
    src.device.nic.set_paused(False)  # the late bytes land
    assert leg.wait(ticket, 5.0) >= 0 and ticket.done()
    assert dst.notify_value(2) == magic and np.array_equal(landing[: 2 * PIECE], out[: 2 * PIECE])
    assert leg.bytes_sent == 2 * PIECE
    leg.close()
    engine.close()
