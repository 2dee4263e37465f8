"""The harness itself, on vLLM's real Scheduler: a scripted connector and vLLM's own ExampleConnector."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from tests.integrations.vllm.scheduler_harness import (  # noqa: E402
    BLOCK_SIZE,
    make_request,
    make_scheduler,
    model_output,
    step,
)

SCRIPTED = ("ScriptedConnector", "tests.integrations.vllm.scheduler_harness")
PROMPT = list(range(1, 101))  # 100 tokens: 3 full blocks and a partial one


def scripted(vllm_config_for, policy="recompute"):
    config = vllm_config_for(*SCRIPTED, policy=policy)
    return config, make_scheduler(config)


def test_sync_hit_is_loaded_before_the_prefill_of_the_rest(vllm_config_for):
    config, scheduler = scripted(vllm_config_for)
    request = make_request(config, "r", PROMPT, kv_transfer_params={"scripted": {"hit": 64}})
    scheduler.add_request(request)
    scheduled, _ = step(scheduler)
    (new,) = scheduled.scheduled_new_reqs
    assert new.num_computed_tokens == 64 and scheduled.num_scheduled_tokens == {"r": 36}
    assert scheduler.connector.calls[0] == ("match", "r", 0)
    assert scheduler.connector.calls[1][:3] == ("alloc", "r", 64)
    assert scheduled.kv_connector_metadata.loads == {"r": list(new.block_ids[0])}
    assert len(request.block_hashes) == len(PROMPT) // BLOCK_SIZE  # hashes of the full blocks only
    assert scheduled.new_block_ids_to_zero is None  # uniform-precision attention caches are not zeroed
    assert request.status == RequestStatus.RUNNING and list(request.output_token_ids) == [7]


def test_async_hit_parks_the_request_until_finished_recving(vllm_config_for):
    config, scheduler = scripted(vllm_config_for)
    request = make_request(config, "r", PROMPT, kv_transfer_params={"scripted": {"hit": 64, "async": True}})
    scheduler.add_request(request)
    scheduled, _ = step(scheduler)
    assert scheduled.scheduled_new_reqs == [] and scheduled.num_scheduled_tokens == {}
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and request.num_computed_tokens == 64
    assert set(scheduled.kv_connector_metadata.loads) == {"r"}  # blocks allocated, recorded at alloc time
    scheduled, _ = step(scheduler)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and scheduled.num_scheduled_tokens == {}
    step(scheduler, finished_recving={"r"})
    scheduled, _ = step(scheduler)
    assert scheduled.num_scheduled_tokens == {"r": 36} and request.status == RequestStatus.RUNNING
    assert [c[0] for c in scheduler.connector.calls].count("match") == 1  # asked once


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_invalid_block_of_a_sync_load(vllm_config_for, policy):
    config, scheduler = scripted(vllm_config_for, policy)
    request = make_request(config, "r", PROMPT, kv_transfer_params={"scripted": {"hit": 64}})
    scheduler.add_request(request)
    scheduled = scheduler.schedule()
    (new,) = scheduled.scheduled_new_reqs
    second = new.block_ids[0][1]
    outputs = scheduler.update_from_output(
        scheduled, model_output(scheduler, scheduled, KVConnectorOutput(invalid_block_ids={second}))
    )
    if policy == "recompute":
        assert request.status == RequestStatus.RUNNING and request.num_computed_tokens == BLOCK_SIZE
        scheduled, _ = step(scheduler)
        assert scheduled.num_scheduled_tokens == {"r": len(PROMPT) - BLOCK_SIZE}
    else:
        assert request.status == RequestStatus.FINISHED_ERROR
        (out,) = outputs[0].outputs
        assert out.finish_reason is not None and out.finish_reason.name == "ERROR"


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("bad_block", [0, 1])
def test_invalid_block_of_an_async_load(vllm_config_for, policy, bad_block):
    """recompute: the load is cut at the first bad block; with nothing valid left (bad block 0) vLLM frees the
    blocks and asks the connector again from 0 (a connector that offers the same hit parks the request again),
    else it resumes after the valid prefix without asking. fail: the request ends FINISHED_ERROR."""
    config, scheduler = scripted(vllm_config_for, policy)
    request = make_request(config, "r", PROMPT, kv_transfer_params={"scripted": {"hit": 64, "async": True}})
    scheduler.add_request(request)
    scheduled, _ = step(scheduler)
    bad = scheduled.kv_connector_metadata.loads["r"][bad_block]
    _, outputs = step(scheduler, finished_recving={"r"}, invalid_block_ids={bad})
    if policy == "fail":
        assert request.status == RequestStatus.FINISHED_ERROR
        assert outputs[0].outputs[0].finish_reason.name == "ERROR"
        assert scheduler.connector.calls[-1] == ("finished", "r", RequestStatus.FINISHED_ERROR)
        return
    scheduled, _ = step(scheduler)
    matches = [call for call in scheduler.connector.calls if call[0] == "match"]
    if bad_block == 0:
        assert matches == [("match", "r", 0), ("match", "r", 0)]
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and scheduled.num_scheduled_tokens == {}
    else:
        assert matches == [("match", "r", 0)]
        assert scheduled.num_scheduled_tokens == {"r": len(PROMPT) - BLOCK_SIZE}
        assert request.status == RequestStatus.RUNNING


def test_vllms_example_connector_stores_then_loads_a_prefix(vllm_config_for, tmp_path):
    """vLLM's own ExampleConnector through the harness: a miss is scheduled as a store, and once its folder
    exists a fresh scheduler loads the block-aligned prefix below the prompt length (sync)."""
    config = vllm_config_for("ExampleConnector", shared_storage_path=str(tmp_path))
    scheduler = make_scheduler(config)
    scheduler.add_request(make_request(config, "a", PROMPT))
    scheduled, _ = step(scheduler)
    (meta,) = scheduled.kv_connector_metadata.requests
    assert meta.is_store and len(meta.token_ids) == 96
    scheduler.connector._generate_foldername_debug(meta.token_ids, [], create_folder=True)

    scheduler = make_scheduler(config)
    scheduler.add_request(make_request(config, "b", PROMPT))
    scheduled, _ = step(scheduler)
    (meta,) = scheduled.kv_connector_metadata.requests
    assert not meta.is_store and scheduled.scheduled_new_reqs[0].num_computed_tokens == 96
    assert scheduled.num_scheduled_tokens == {"b": 4}


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("with_finished_recving", [True, False])
def test_a_failed_receive_reported_per_request(vllm_config_for, policy, with_finished_recving):
    """``failed_recving`` (request-level failure): fail ends the request FINISHED_ERROR at once; recompute
    only restarts it from 0 once it is also in ``finished_recving`` (alone, the request stays parked)."""
    config, scheduler = scripted(vllm_config_for, policy)
    request = make_request(config, "r", PROMPT, kv_transfer_params={"scripted": {"hit": 64, "async": True}})
    scheduler.add_request(request)
    step(scheduler)
    report = {"failed_recving": {"r"}} | ({"finished_recving": {"r"}} if with_finished_recving else {})
    step(scheduler, **report)
    step(scheduler)
    matches = [call for call in scheduler.connector.calls if call[0] == "match"]
    if policy == "fail":
        assert request.status == RequestStatus.FINISHED_ERROR
    elif with_finished_recving:  # freed and asked again from 0; the scripted hit parks it again
        assert matches == [("match", "r", 0)] * 2 and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    else:
        assert matches == [("match", "r", 0)] and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert request.num_computed_tokens == 0
