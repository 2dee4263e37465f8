"""The CUDA engine's bookkeeping without a GPU (its device work replaced, ``tests/transport/fake_cuda.py``): which
submissions reuse a pattern's work and graph, the values published and waited for, bounded waits."""

from __future__ import annotations

import pytest

from ascend_dualpath import errors
from ascend_dualpath.transport import TransferKind
from ascend_dualpath.transport.cuda_engine import GRAPH_FIRST_MAGIC, GRAPH_MAGIC_STRIDE
from ascend_dualpath.transport.engine import TransferResult
from tests.transport.fake_cuda import FakeWord, blocks, fake_engine


def _work(engine, ticket):
    return engine._plans[(TransferKind.AIV, id(ticket.pieces), 0)][1]


def test_the_second_plain_submission_of_a_pattern_captures_its_graph_and_later_ones_replay_it():
    engine = fake_engine()
    sources, slot = blocks(8, 4096)
    results = [engine.submit(sources, slot, notify_slot=0).wait() for _ in range(4)]
    magics = [r.notify_magic for r in results]
    assert magics[0] < GRAPH_FIRST_MAGIC <= magics[1] and magics[1:] == list(range(magics[1], magics[1] + 3))
    assert engine._copier.captures == 1
    ticket = engine.submit(sources, slot, notify_slot=0)
    work = _work(engine, ticket)
    assert work.graph is not None and work.plans[0].runs == [magics[0]]  # one eager launch, then replays
    ticket.wait()


def test_a_list_changed_in_place_or_other_sources_to_the_same_slot_are_routed_again():
    engine = fake_engine()
    sources, slot = blocks(6, 4096)
    first = engine.submit(sources, slot)
    first.wait()
    assert [p.local_addr for p in first.pieces] == [s.addr for s in sources]
    sources.reverse()
    again = engine.submit(sources, slot)
    again.wait()
    assert [p.local_addr for p in again.pieces] == [s.addr for s in sources]  # the reversed order
    other, _ = blocks(6, 4096, base=0x90_0000)
    moved = engine.submit(other, slot)
    moved.wait()
    assert moved.pieces[0].local_addr == 0x90_0000
    equal = engine.submit(tuple(sources), slot)  # equal sources, another container: the same routing and work
    equal.wait()
    assert equal.pieces is again.pieces


def test_equal_new_segment_objects_reuse_the_pattern():
    engine = fake_engine()
    sources, slot = blocks(4, 4096)
    engine.submit(sources, slot).wait()
    rebuilt, _ = blocks(4, 4096)  # new objects, the same values
    ticket = engine.submit(rebuilt, slot)
    ticket.wait()
    assert engine._copier.captures == 1  # the second sighting of the pattern


def test_without_graphs_every_submission_launches_and_values_only_grow():
    engine = fake_engine(graphs=False)
    sources, slot = blocks(4, 4096)
    prepared = engine.prepare(sources, slot, notify_slot=0)
    values = [prepared.submit().wait().notify_magic for _ in range(3)]
    values += [engine.submit(sources, slot, notify_slot=0).wait().notify_magic for _ in range(3)]
    assert values == sorted(values) and len(set(values)) == 6 and max(values) < GRAPH_FIRST_MAGIC
    assert engine._copier.captures == 0


def test_a_new_capture_replaces_the_patterns_graph_and_submissions_follow_it():
    engine = fake_engine()
    sources, slot = blocks(4, 4096)
    prepared = engine.prepare(sources, slot, notify_slot=0)
    assert prepared.submit().wait().notify_magic == GRAPH_FIRST_MAGIC
    graphed = engine.capture(prepared, 1000)
    assert graphed.replay(0) == 1000
    assert prepared.submit().wait().notify_magic == 1001
    other = engine.prepare(blocks(4, 4096, base=0x80_0000)[0], slot, notify_slot=0)
    assert other.submit().wait().notify_magic == GRAPH_FIRST_MAGIC + GRAPH_MAGIC_STRIDE  # its own range


@pytest.mark.parametrize("graphs", [True, False])
def test_a_kernel_publishing_into_a_slot_waits_for_a_tail_write_to_it_that_has_not_landed(graphs):
    engine = fake_engine(graphs=graphs)
    sources, slot = blocks(4, 4096)
    pending, landed = FakeWord(), FakeWord()
    landed._view[0] = 9
    engine._tail_notify.update({0: (pending, 5), 1: (landed, 9)})
    for _ in range(3):  # eager, then (with graphs) capture and replays
        engine.submit(sources, slot, notify_slot=0).wait()
    engine.submit(sources, slot, notify_slot=1).wait()
    engine.submit(sources, slot).wait()
    assert engine._tail.joins == 1  # once, for the write still in flight; then the slot's order is the stream's
    assert engine._tail_notify == {}


def test_a_wait_for_a_value_that_never_lands_is_bounded_and_names_the_ticket():
    engine = fake_engine(publish=False)
    sources, slot = blocks(4, 4096)
    ticket = engine.submit(sources, slot, notify_slot=0)
    for _ in range(2):  # a timeout ends nothing (the bytes may still land): a later wait looks again
        with pytest.raises(errors.WaitTimeout, match=rf"4 pieces \(16384 bytes, aiv\) of ticket {ticket.id} "):
            ticket.wait(timeout_s=0.01)
    assert not ticket.finished and ticket.error is None


def test_a_result_with_its_notify_equals_one_built_whole_and_leaves_the_template_alone():
    template = TransferResult(TransferKind.AIV, None, 4096, 1, staging_bytes=0)
    result = template.with_notify(7)
    assert result == TransferResult(TransferKind.AIV, None, 4096, 1, 0.0, 0.0, 0.0, 0, 7)
    assert template.notify_magic is None
    with pytest.raises(AttributeError):
        result.notify_magic = 8  # still frozen


@pytest.mark.parametrize("graphs", [True, False])
def test_the_callers_notify_value_reaches_the_kernel_while_the_host_word_keeps_growing(graphs):
    """Plain and prepared submissions with and without a caller's value: the ticket and result carry the caller's
    value, the kernel (or the graph replay) is handed exactly it, and the values without one stay fresh."""
    engine = fake_engine(graphs=graphs)
    sources, slot = blocks(4, 4096)
    chosen = [7000, None, 3000, 1 << 62, None, 5000]  # far from the engine's own magics (which count from 1)
    prepared = engine.prepare(sources, slot, notify_slot=0)
    published = []
    for value in chosen:
        for submit in (lambda v: engine.submit(sources, slot, notify_slot=0, notify_value=v), prepared.submit):
            ticket = submit(value)
            result = ticket.wait()
            assert ticket.notify_value == value and result.notify_magic == ticket.notify_magic
            assert value is None or result.notify_magic == value
            published.append(result.notify_magic)
    work = _work(engine, ticket)
    handed = work.plans[0].runs + ([] if work.graph is None else work.graph.flag_values)
    assert sorted(handed) == sorted(published)  # every submission's value went to the device, none other
    fresh = [p for p, c in zip(published, [c for c in chosen for _ in range(2)], strict=True) if c is None]
    assert fresh == sorted(fresh) and len(set(fresh)) == len(fresh) and not set(fresh) & set(chosen)
    assert (work.graph is not None) == graphs


def test_a_callers_notify_value_is_checked_before_anything_is_enqueued():
    engine = fake_engine()
    sources, slot = blocks(4, 4096)
    prepared = engine.prepare(sources, slot, notify_slot=0)
    with pytest.raises(errors.BoundsError, match="notify_value 0 is outside"):
        prepared.submit(0)
    with pytest.raises(errors.ProtocolError, match="without a notify_slot"):
        engine.submit(sources, slot, notify_value=4)
    assert prepared.state["work"].plans[0].runs == []
