"""The DualPath connector's scheduler half on vLLM's real Scheduler (no model, no worker).

Hits from the block store are counted block-aligned and below the prompt length; a hit is read before the batch:
the request is skipped (its read ahead in the step's metadata) until the worker reports the reads ended, then
scheduled with the good prefix; the read path the proxy chose reaches the worker in the metadata; the DE receives asynchronously (``WAITING_FOR_REMOTE_KVS`` until
``finished_recving``); an injected load error (``invalid_block_ids``) under ``recompute`` and ``fail``; finished
requests persist their new full blocks.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

pytest.importorskip("vllm")

from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from ascend_dualpath.integrations.vllm.metadata import DualPathWorkerMeta  # noqa: E402
from ascend_dualpath.integrations.vllm.settings import store_ids  # noqa: E402
from ascend_dualpath.kv.store import LocalBlockStore
from tests.integrations.vllm.scheduler_harness import (  # noqa: E402
    BLOCK_SIZE,
    SAMPLED_TOKEN,
    make_request,
    make_scheduler,
    model_output,
    step,
)

DUALPATH = ("DualPathConnector", "ascend_dualpath.integrations.vllm.connector")
PEER = "tcp://127.0.0.1:5599"


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    """One block store for the module (a new store would mean a new VllmConfig); prompts differ per test."""
    return tmp_path_factory.mktemp("store")


@pytest.fixture
def instance(vllm_config_for, store_dir):
    def make(role="kv_both", policy="recompute"):
        extra = {"store": str(store_dir)} | ({"side_port": 5598} if role != "kv_both" else {})
        config = vllm_config_for(*DUALPATH, role=role, policy=policy, **extra)
        return config, make_scheduler(config)

    return make


def prompt(seed: int, length: int) -> list[int]:
    """Tokens unique to one test (so no test hits another test's stored blocks)."""
    return random.Random(seed).choices(range(1, 512), k=length)


def dualpath(role: str, path: str = "pe", xfer_id: str = "x") -> dict:
    return {"dualpath": {"xfer_id": xfer_id, "role": role, "path": path, "peer": PEER}}


def persist_prefix(scheduler, request, num_blocks: int) -> list[bytes]:
    """Store the first ``num_blocks`` full blocks of ``request`` as another instance would (zero KV bytes)."""
    connector = scheduler.connector
    store = LocalBlockStore(connector.settings.store, connector.layout)
    ids = store_ids(connector.namespace, request.block_hashes[:num_blocks])
    for index, block_id in enumerate(ids):
        store.write_block(block_id, ids[index - 1] if index else None, bytes(connector.layout.full_block_bytes))
    store.close()
    return store_ids(connector.namespace, request.block_hashes)


def report_read(scheduler, req_id: str, good: int | None = None):
    """The read ahead of ``req_id``: its first step emits it (no block table yet) and schedules nothing of the
    request; the next step's output reports the reads ended with ``good`` tokens (default: the whole hit). Returns
    the read ahead; the step after schedules the request."""
    scheduled, _ = step(scheduler)
    (spec,) = [p for p in scheduled.kv_connector_metadata.prefetches if p.req_id == req_id]
    assert req_id not in scheduled.num_scheduled_tokens and spec.block_ids == []
    report = DualPathWorkerMeta({req_id: spec.hit_tokens if good is None else good})
    scheduled, _ = step(scheduler, kv_connector_worker_meta=report)
    assert req_id not in scheduled.num_scheduled_tokens and scheduled.kv_connector_metadata.prefetches == []
    return spec


def read_ahead(scheduler, req_id: str, good: int | None = None):
    """:func:`report_read`, then the step that schedules the request: ``(scheduled, outputs)``."""
    report_read(scheduler, req_id, good)
    return step(scheduler)


# -- hits ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("length", "stored", "hit"),
    [(100, 3, 96), (96, 3, 64), (100, 1, 32), (100, 2, 64), (70, 0, 0), (31, 0, 0)],
)
def test_store_hits_are_block_aligned_and_below_the_prompt_length(instance, length, stored, hit):
    config, scheduler = instance()
    request = make_request(config, "r", prompt(1000 * length + stored, length))
    ids = persist_prefix(scheduler, request, stored)
    scheduler.add_request(request)
    scheduled, _ = read_ahead(scheduler, "r") if hit else step(scheduler)

    (new,) = scheduled.scheduled_new_reqs
    assert new.num_computed_tokens == hit and scheduled.num_scheduled_tokens == {"r": length - hit}
    assert hit % BLOCK_SIZE == 0 and hit < length
    loads = scheduled.kv_connector_metadata.loads
    if hit == 0:
        assert loads == []
        return
    (load,) = loads
    assert (load.req_id, load.xfer, load.computed, load.hit_tokens, load.prompt_tokens) == ("r", None, 0, hit, length)
    assert load.block_ids == list(new.block_ids[0]) and load.store_ids == ids
    assert scheduled.new_block_ids_to_zero is None
    assert list(request.output_token_ids) == [SAMPLED_TOKEN]


def test_a_local_prefix_cache_hit_is_not_loaded_again(instance):
    config, scheduler = instance()
    tokens = prompt(7, 100)
    first = make_request(config, "a", tokens, max_tokens=1)
    scheduler.add_request(first)
    step(scheduler)  # computes and caches the three full blocks locally, finishes (max_tokens=1)
    persist_prefix(scheduler, first, 3)
    second = make_request(config, "b", tokens)
    scheduler.add_request(second)
    scheduled, _ = step(scheduler)
    (new,) = scheduled.scheduled_new_reqs
    assert new.num_computed_tokens == 96 and scheduled.kv_connector_metadata.loads == []


# -- the path chosen ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["pe", "de"])
def test_the_path_chosen_reaches_the_worker_in_the_metadata(instance, path):
    config, scheduler = instance("kv_producer")
    request = make_request(config, "p", prompt(11, 100), max_tokens=1, kv_transfer_params=dualpath("prefill", path))
    persist_prefix(scheduler, request, 2)
    scheduler.add_request(request)
    scheduled, _ = read_ahead(scheduler, "p")

    meta = scheduled.kv_connector_metadata
    (load,) = meta.loads
    assert (load.xfer.path.value, load.xfer.xfer_id, load.xfer.role) == (path, "x", "prefill")
    assert (load.computed, load.hit_tokens) == (0, 64)
    (save,) = meta.saves  # the tokens this step computes go to the DE
    assert (save.xfer.path.value, save.start, save.end) == (path, 64, 100)

    config, decoder = instance("kv_consumer")
    request = make_request(config, "d", prompt(12, 100), kv_transfer_params=dualpath("decode", path))
    decoder.add_request(request)
    scheduled, _ = step(decoder)
    (recv,) = scheduled.kv_connector_metadata.recvs
    assert recv.xfer.path.value == path


def test_a_prefill_request_without_a_hit_still_gets_a_plan(instance):
    config, scheduler = instance("kv_producer")
    request = make_request(config, "p", prompt(13, 70), max_tokens=1, kv_transfer_params=dualpath("prefill", "de"))
    scheduler.add_request(request)
    scheduled, _ = step(scheduler)
    (load,) = scheduled.kv_connector_metadata.loads
    assert (load.computed, load.hit_tokens, load.prompt_tokens) == (0, 0, 70)


# -- the async receive on the DE --------------------------------------------------------------------------------------
def test_the_decode_instance_receives_the_prompt_asynchronously(instance):
    config, scheduler = instance("kv_consumer")
    request = make_request(config, "d", prompt(21, 100), kv_transfer_params=dualpath("decode", "de"))
    scheduler.add_request(request)
    scheduled, _ = step(scheduler)

    assert scheduled.scheduled_new_reqs == [] and scheduled.num_scheduled_tokens == {}
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (recv,) = scheduled.kv_connector_metadata.recvs
    # The DE takes the full blocks below the last prompt token and computes the partial tail itself; while it
    # waits, vLLM has allocated only the blocks of the received tokens.
    assert (recv.req_id, recv.computed, recv.end, len(recv.block_ids)) == ("d", 0, 96, 3)
    for _ in range(2):  # nothing moves until the worker reports the receive
        scheduled, _ = step(scheduler)
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and scheduled.num_scheduled_tokens == {}
        assert scheduled.kv_connector_metadata.recvs == []
    step(scheduler, finished_recving={"d"})
    scheduled, _ = step(scheduler)
    assert scheduled.num_scheduled_tokens == {"d": 100 - 96} and request.status == RequestStatus.RUNNING
    (new,) = scheduled.scheduled_new_reqs  # scheduled as new once received, with the tail block added
    assert new.num_computed_tokens == 96 and list(new.block_ids[0][:3]) == recv.block_ids and len(new.block_ids[0]) == 4
    assert list(request.output_token_ids) == [SAMPLED_TOKEN]


def test_a_request_finished_while_receiving_keeps_vllm_stepping_until_its_receive_is_reported(instance):
    """vLLM keeps a request it finishes in WAITING_FOR_REMOTE_KVS (an abort, a grammar error) until the worker reports
    its receive, which happens only in a step: the connector asks vLLM to keep stepping until then."""
    config, scheduler = instance("kv_consumer")
    request = make_request(config, "d", prompt(22, 100), kv_transfer_params=dualpath("decode", "de"))
    scheduler.add_request(request)
    step(scheduler)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not scheduler.connector.has_pending_push_work()  # vLLM steps for a waiting request anyway
    scheduler.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests() and "d" in scheduler.requests  # its blocks wait for the receive
    assert scheduler.connector.has_pending_push_work()
    step(scheduler)
    assert scheduler.connector.has_pending_push_work()
    step(scheduler, finished_recving={"d"}, failed_recving={"d"})  # the worker's receive timed out (or completed)
    assert "d" not in scheduler.requests and not scheduler.connector.has_pending_push_work()


# -- load errors -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_bad_block_of_a_store_load(instance, policy):
    """The worker reports the bad block in the output of the step that loaded it. recompute: vLLM cuts the
    request back to the last good block and computes the rest; fail: FINISHED_ERROR, nothing persisted."""
    config, scheduler = instance(policy=policy)
    request = make_request(config, "r", prompt(41 if policy == "fail" else 42, 100))
    persist_prefix(scheduler, request, 3)
    scheduler.add_request(request)
    report_read(scheduler, "r")
    scheduled = scheduler.schedule()
    (load,) = scheduled.kv_connector_metadata.loads
    outputs = scheduler.update_from_output(
        scheduled, model_output(scheduler, scheduled, KVConnectorOutput(invalid_block_ids={load.block_ids[1]}))
    )
    if policy == "fail":
        assert request.status == RequestStatus.FINISHED_ERROR
        assert outputs[0].outputs[0].finish_reason.name == "ERROR"
        scheduled, _ = step(scheduler)
        assert scheduled.kv_connector_metadata.persists == []
        return
    assert request.status == RequestStatus.RUNNING and request.num_computed_tokens == BLOCK_SIZE
    assert list(request.output_token_ids) == []  # the sampled token of the bad step is dropped
    scheduled, _ = step(scheduler)
    assert scheduled.num_scheduled_tokens == {"r": 100 - BLOCK_SIZE}
    assert scheduled.kv_connector_metadata.loads == []  # vLLM does not ask the connector again


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_bad_block_of_the_decode_receive_with_a_valid_prefix(instance, policy):
    config, scheduler = instance("kv_consumer", policy)
    request = make_request(
        config, "d", prompt(51 if policy == "fail" else 52, 100), kv_transfer_params=dualpath("decode")
    )
    scheduler.add_request(request)
    scheduled, _ = step(scheduler)
    (recv,) = scheduled.kv_connector_metadata.recvs
    _, outputs = step(scheduler, finished_recving={"d"}, invalid_block_ids={recv.block_ids[1]})
    if policy == "fail":
        assert request.status == RequestStatus.FINISHED_ERROR
        assert outputs[0].outputs[0].finish_reason.name == "ERROR"
        return
    scheduled, _ = step(scheduler)  # the valid first block is kept, the rest computed locally
    assert scheduled.num_scheduled_tokens == {"d": 100 - BLOCK_SIZE} and request.status == RequestStatus.RUNNING
    assert scheduled.kv_connector_metadata.recvs == []


def test_a_decode_receive_that_failed_from_its_first_block_is_computed_locally(instance):
    """recompute, first block bad: vLLM frees the blocks and asks the connector again from 0 tokens. A decode
    request whose PE already finished must then be computed locally; answering with another async receive parks
    it in WAITING_FOR_REMOTE_KVS for a transfer nobody will send."""
    config, scheduler = instance("kv_consumer")
    request = make_request(config, "d", prompt(61, 100), kv_transfer_params=dualpath("decode"))
    scheduler.add_request(request)
    scheduled, _ = step(scheduler)
    (recv,) = scheduled.kv_connector_metadata.recvs
    step(scheduler, finished_recving={"d"}, invalid_block_ids={recv.block_ids[0]})
    scheduled, _ = step(scheduler)
    assert request.status == RequestStatus.RUNNING and scheduled.num_scheduled_tokens == {"d": 100}


# -- persisting at the end -------------------------------------------------------------------------------------------
def test_a_finished_request_persists_its_new_full_blocks_and_keeps_them_until_sent(instance):
    config, scheduler = instance()
    request = make_request(config, "r", prompt(71, 100), max_tokens=2)
    scheduler.add_request(request)
    step(scheduler)
    step(scheduler)  # the second output token: FINISHED_LENGTH_CAPPED
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert scheduler.connector.has_pending_push_work() and "r" in scheduler.requests  # blocks held
    scheduled, _ = step(scheduler)
    (persist,) = scheduled.kv_connector_metadata.persists
    assert (persist.first_block, len(persist.store_ids), len(persist.block_ids)) == (0, 3, 4)
    step(scheduler, finished_sending={"r"})
    assert not scheduler.connector.has_pending_push_work() and "r" not in scheduler.requests


def test_a_failed_decode_receive_under_fail_ends_the_request(instance):
    config, scheduler = instance("kv_consumer", "fail")
    request = make_request(config, "d", prompt(81, 100), kv_transfer_params=dualpath("decode"))
    scheduler.add_request(request)
    step(scheduler)
    _, outputs = step(scheduler, failed_recving={"d"}, finished_recving={"d"})
    assert request.status == RequestStatus.FINISHED_ERROR
    assert outputs[0].outputs[0].finish_reason.name == "ERROR"


def test_a_failed_decode_receive_under_recompute_is_computed_locally(instance):
    config, scheduler = instance("kv_consumer")
    request = make_request(config, "d", prompt(82, 100), kv_transfer_params=dualpath("decode"))
    scheduler.add_request(request)
    step(scheduler)
    step(scheduler, failed_recving={"d"}, finished_recving={"d"})
    scheduled, _ = step(scheduler)
    assert request.status == RequestStatus.RUNNING and scheduled.num_scheduled_tokens == {"d": 100}


def test_the_next_turn_on_another_instance_waits_for_the_blocks_being_persisted(instance):
    config, finishing = instance()
    _, other = instance()  # another engine sharing the store, as the next turn's PE does
    tokens = prompt(73, 100)
    first = make_request(config, "a", tokens, max_tokens=2)
    finishing.add_request(first)
    step(finishing)
    step(finishing)  # finished: its 3 full blocks are announced before the answer leaves the engine
    announced = store_ids(finishing.connector.namespace, first.block_hashes[:3])
    assert all(finishing.connector._scheduler.announcements.pending(i) for i in announced)

    second = make_request(config, "b", [*tokens, *first.output_token_ids, *prompt(74, 40)])
    other.add_request(second)
    for _ in range(3):  # held back, not even read ahead: admitting it now would recompute what the first turn writes
        scheduled, _ = step(other)
        assert scheduled.scheduled_new_reqs == [] and second.num_computed_tokens == 0
        assert scheduled.kv_connector_metadata.prefetches == []

    persist_prefix(finishing, first, 3)  # the DE's worker writes the blocks, then withdraws the announcement
    finishing.connector._scheduler.announcements.withdraw(announced)
    scheduled, _ = read_ahead(other, "b")
    (new,) = scheduled.scheduled_new_reqs
    assert new.num_computed_tokens == 96


def test_a_stale_announcement_does_not_hold_a_request_back(instance, monkeypatch):
    config, scheduler = instance()
    request = make_request(config, "r", prompt(75, 100))
    announcements = scheduler.connector._scheduler.announcements
    ids = store_ids(scheduler.connector.namespace, request.block_hashes[:3])
    announcements.announce(ids)  # a writer that died: the mark stays on disk
    monkeypatch.setattr(announcements, "wait_s", 1e-9)
    scheduler.add_request(request)
    scheduled, _ = step(scheduler)
    (new,) = scheduled.scheduled_new_reqs
    assert new.num_computed_tokens == 0  # recomputed at once, not waited for


# -- the read before the batch ---------------------------------------------------------------------------------------
def test_a_stored_hit_is_not_scheduled_before_it_has_been_read(instance):
    """However many steps pass, a request whose hit is being read is not scheduled (vLLM's other requests are) and
    its read ahead is asked once; once the worker reports it, the request is scheduled with the full hit."""
    config, scheduler = instance()
    request = make_request(config, "r", prompt(81, 100))
    persist_prefix(scheduler, request, 3)
    other = make_request(config, "o", prompt(82, 40))
    scheduler.add_request(request)
    scheduler.add_request(other)
    scheduled, _ = step(scheduler)
    (spec,) = scheduled.kv_connector_metadata.prefetches
    assert (spec.req_id, spec.computed, spec.hit_tokens, spec.prompt_tokens, spec.block_ids) == ("r", 0, 96, 100, [])
    assert set(scheduled.num_scheduled_tokens) == {"o"}  # the other request is not held up
    for _ in range(4):
        scheduled, _ = step(scheduler)
        assert "r" not in scheduled.num_scheduled_tokens and scheduled.kv_connector_metadata.prefetches == []
        assert request.num_computed_tokens == 0 and request.status == RequestStatus.WAITING
    step(scheduler, kv_connector_worker_meta=DualPathWorkerMeta({"r": 96}))
    scheduled, _ = step(scheduler)
    (new,) = scheduled.scheduled_new_reqs
    assert new.num_computed_tokens == 96 and scheduled.num_scheduled_tokens == {"r": 4}
    (load,) = scheduled.kv_connector_metadata.loads
    assert (load.computed, load.hit_tokens, load.block_ids) == (0, 96, list(new.block_ids[0]))


@pytest.mark.parametrize("good", [64, 32, 0])
def test_a_shorter_good_prefix_is_taken_and_the_rest_computed(instance, good):
    """A block of the read failed: the worker reports the prefix before it, vLLM computes the rest; nothing is
    reported invalid (the load takes only good blocks)."""
    config, scheduler = instance()
    request = make_request(config, "r", prompt(83 + good, 100))
    persist_prefix(scheduler, request, 3)
    scheduler.add_request(request)
    scheduled, _ = read_ahead(scheduler, "r", good)
    (new,) = scheduled.scheduled_new_reqs
    assert new.num_computed_tokens == good and scheduled.num_scheduled_tokens == {"r": 100 - good}
    (load,) = scheduled.kv_connector_metadata.loads  # taken even with no good block: the worker lets go of the read
    assert (load.computed, load.hit_tokens) == (0, good)


def test_a_request_aborted_while_reading_ahead_is_forgotten(instance):
    """The abort reaches the worker in ``finished_req_ids`` (it drops the read ahead); a late report is ignored."""
    config, scheduler = instance()
    request = make_request(config, "r", prompt(90, 100))
    persist_prefix(scheduler, request, 3)
    scheduler.add_request(request)
    step(scheduler)
    scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    scheduled, _ = step(scheduler, kv_connector_worker_meta=DualPathWorkerMeta({"r": 96}))
    assert "r" in scheduled.finished_req_ids and scheduled.num_scheduled_tokens == {}
    side = scheduler.connector._scheduler
    assert not side._prefetches and not side._ready and not side._hits


def test_a_preempted_prefill_is_read_ahead_again(instance):
    """vLLM preempts a running request (its blocks freed): the next time it is considered, its hit is read ahead
    again before it is scheduled."""
    config, scheduler = instance()
    request = make_request(config, "r", prompt(91, 100), max_tokens=8)
    persist_prefix(scheduler, request, 3)
    scheduler.add_request(request)
    read_ahead(scheduler, "r")
    assert request.status == RequestStatus.RUNNING
    assert scheduler.reset_prefix_cache(reset_running_requests=True)  # preempts every running request
    assert request.status == RequestStatus.PREEMPTED
    spec = report_read(scheduler, "r")
    assert (spec.computed, spec.hit_tokens) == (0, 96)
    generated = len(request.output_token_ids)
    scheduled, _ = step(scheduler)
    assert scheduled.num_scheduled_tokens["r"] == 100 + generated - 96  # the hit, then the rest computed again


def test_a_read_ahead_waits_for_every_tensor_parallel_workers_report(instance):
    """At tensor-parallel size 2 each rank reads its heads and reports on its own: one rank's report (even merged by
    vLLM's aggregate within a step) schedules nothing; the second, a step later, schedules the shortest prefix."""
    config, scheduler = instance()
    side = scheduler.connector._scheduler
    side.settings = dataclasses.replace(side.settings, tp_size=2)  # the scheduler half of a size-2 instance
    request = make_request(config, "r", prompt(91, 100))
    persist_prefix(scheduler, request, 3)
    scheduler.add_request(request)
    step(scheduler)
    scheduled, _ = step(scheduler, kv_connector_worker_meta=DualPathWorkerMeta({"r": 96}))
    scheduled, _ = step(scheduler)
    assert "r" not in scheduled.num_scheduled_tokens  # rank 1 has not reported
    step(scheduler, kv_connector_worker_meta=DualPathWorkerMeta({"r": 64}))
    scheduled, _ = step(scheduler)
    (new,) = scheduled.scheduled_new_reqs
    assert new.num_computed_tokens == 64 and scheduled.num_scheduled_tokens == {"r": 36}
    assert not side._partly_ready


def test_worker_answers_aggregate_the_shortest_prefix_and_count_the_reports():
    one, two = DualPathWorkerMeta({"a": 96, "b": 32}), DualPathWorkerMeta({"a": 64})
    merged = one.aggregate(two)
    assert (merged.ready, merged.reports) == ({"a": 64, "b": 32}, {"a": 2, "b": 1})
    assert merged.aggregate(DualPathWorkerMeta({"a": 96, "c": 0})).reports == {"a": 3, "b": 1, "c": 1}
