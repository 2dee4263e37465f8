"""The connector's counters in vLLM's metrics: the stats class, its Prometheus metrics through vLLM's own
``KVConnectorProm``, the worker's increments after a real load, and (slow) a served instance's ``/metrics``."""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm  # noqa: E402

from ascend_dualpath.dualpath.counters import Counters  # noqa: E402
from ascend_dualpath.integrations.vllm.stats import COUNTERS, DualPathKVConnectorStats  # noqa: E402

KV_TRANSFER = KVTransferConfig(
    kv_connector="DualPathConnector",
    kv_connector_module_path="ascend_dualpath.integrations.vllm.connector",
    kv_role="kv_consumer",
)

increments = st.dictionaries(st.sampled_from(sorted(COUNTERS)), st.integers(0, 2**40), max_size=len(COUNTERS))
intervals = st.lists(
    st.tuples(
        increments,
        st.lists(st.floats(0, 30, allow_nan=False), max_size=5),
        st.one_of(st.none(), st.integers(0, 2**40)),
        st.integers(0, 3),
    ),
    min_size=1,
    max_size=6,
)


def test_every_worker_counter_has_a_metric():
    assert set(COUNTERS) == {f.name for f in dataclasses.fields(Counters)} | {"snic_read_bytes", "snic_read_blocks"}


@settings(max_examples=60, deadline=None)
@given(intervals)
def test_aggregated_intervals_sum_their_parts(parts):
    # through the payload vLLM sends between processes (to_dict, then build_kv_connector_stats)
    # parts: the workers' (ranks') stats of the steps of one interval, in the order vLLM aggregates them
    built = [
        DualPathKVConnectorStats(data=DualPathKVConnectorStats.from_counters(*p[:3], rank=p[3]).to_dict())
        for p in parts
    ]
    total = built[0]
    for other in built[1:]:
        total = total.aggregate(other)
    for key in COUNTERS:
        assert total.data[key] == sum(inc.get(key, 0) for inc, *_ in parts), key
    assert total.data["layer_wait_s"] == [w for _, waits, *_ in parts for w in waits]
    latest = {str(rank): held for _, _, held, rank in parts if held is not None}  # each rank's last known
    assert total.data["quarantined_bytes"] == latest
    reduced = total.reduce()
    assert reduced.get("quarantined_bytes") == (sum(latest.values()) if latest else None)
    assert {k: reduced[k] for k in COUNTERS} == {k: total.data[k] for k in COUNTERS}
    assert reduced["layer waits"] == len(total.data["layer_wait_s"])
    assert total.is_empty() == (not any(total.data[k] for k in COUNTERS) and not total.data["layer_wait_s"])
    total.reset()
    assert total.is_empty() and total.data["quarantined_bytes"] == {} and total.reduce()["loads_pe"] == 0


def test_bad_counters_are_refused_with_their_names():
    with pytest.raises(ValueError, match="unknown DualPath counters \\['loads_x'\\]"):
        DualPathKVConnectorStats.from_counters({"loads_x": 1}, [], 0)
    with pytest.raises(ValueError, match="must be >= 0, got \\{'fallbacks': -1\\}"):
        DualPathKVConnectorStats.from_counters({"fallbacks": -1}, [], 0)


def _private_prom(registry: CollectorRegistry) -> type[KVConnectorProm]:
    """vLLM's ``KVConnectorProm`` on a private registry (as vLLM's Ray logger swaps the metric classes)."""
    return type(
        "PrivateProm",
        (KVConnectorProm,),
        {
            "_gauge_cls": functools.partial(Gauge, registry=registry),
            "_counter_cls": functools.partial(Counter, registry=registry),
            "_histogram_cls": functools.partial(Histogram, registry=registry),
        },
    )


def _samples(text: str) -> dict[tuple, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_vllms_prometheus_logger_path_registers_and_observes_the_metrics():
    registry = CollectorRegistry()
    config = types.SimpleNamespace(kv_transfer_config=KV_TRANSFER)
    prom = _private_prom(registry)(config, ["model_name", "engine"], {0: ["m", "0"]})
    first = DualPathKVConnectorStats.from_counters({"loads_de": 2, "snic_read_bytes": 8192}, [0.002, 0.2], 4096)
    second = DualPathKVConnectorStats.from_counters({"loads_split": 1, "checksum_errors": 1}, [], 0)
    for stats in (first, second):
        prom.observe(stats.to_dict(), engine_idx=0)
    got = _samples(generate_latest(registry).decode())
    engine = (("engine", "0"), ("model_name", "m"))

    def value(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted((*engine, *labels.items()))))]

    assert value("vllm:dualpath_loads_total", path="de") == 2
    assert value("vllm:dualpath_loads_total", path="split") == 1
    assert value("vllm:dualpath_loads_total", path="pe") == 0
    assert value("vllm:dualpath_snic_read_bytes_total") == 8192
    assert value("vllm:dualpath_checksum_errors_total") == 1
    assert value("vllm:dualpath_fallbacks_total") == 0
    assert value("vllm:dualpath_quarantined_bytes") == 0  # the later interval's figure
    assert value("vllm:dualpath_layer_wait_seconds_count") == 2
    assert value("vllm:dualpath_layer_wait_seconds_bucket", le="0.0025") == 1
    assert value("vllm:dualpath_layer_wait_seconds_sum") == pytest.approx(0.202)
    # vLLM's log line: the same class rebuilt from the payload, through the connector's class method
    logged = []
    logging = KVConnectorLogging(KV_TRANSFER)
    logging.observe(first.to_dict())
    logging.observe(second.to_dict())
    logging.log(lambda fmt, text: logged.append(text))
    assert re.search(r"loads_de=2, loads_split=1, .*snic_read_bytes=8192", logged[0]), logged


def test_the_quarantined_bytes_gauge_is_the_sum_of_each_ranks_latest_figure():
    """Tensor parallelism: each rank's worker reports its own held bytes when they change; the engine's gauge is
    the sum of every rank's latest figure, whichever ranks reported in an interval (a rank's old figure stays)."""
    registry = CollectorRegistry()
    config = types.SimpleNamespace(kv_transfer_config=KV_TRANSFER)
    prom = _private_prom(registry)(config, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    gauge = ("vllm:dualpath_quarantined_bytes", (("engine", "0"), ("model_name", "m")))

    def interval(*reports: tuple[int, int]) -> float:  # (rank, held) reports, as vLLM aggregates one step's
        stats = DualPathKVConnectorStats()
        for rank, held in reports:
            stats = stats.aggregate(DualPathKVConnectorStats.from_counters({}, [], held, rank=rank))
        prom.observe(stats.to_dict(), engine_idx=0)
        return _samples(generate_latest(registry).decode())[gauge]

    assert interval((0, 4096), (1, 8192)) == 12288
    assert interval((1, 0)) == 4096  # rank 0 reported nothing new: it still holds 4096
    assert interval((0, 0), (0, 1024)) == 1024  # a later report of the same rank replaces its earlier one
    prom.observe(DualPathKVConnectorStats.from_counters({}, [], 512, rank=0).to_dict(), engine_idx=1)
    assert _samples(generate_latest(registry).decode())[gauge] == 1024  # another engine's ranks are its own


def test_the_worker_hands_over_what_changed_since_its_last_call(tmp_path):
    from tests.integrations.vllm.worker_harness import LAYERS, LAYOUT, Deployment, run_request

    d = Deployment(tmp_path / "store", 1, 1)
    try:
        pe, de = d.instances["pe0"].worker, d.instances["de0"].worker
        assert pe.stats_since_last() == ({}, [], 0) and pe.stats_since_last() is None  # then nothing changed
        de.stats_since_last()
        run_request(d, "pe0", "de0", 29, 6, "de", False, 7)
        increments, waits, held = pe.stats_since_last()
        assert increments == {"loads_de": 1} and len(waits) == LAYERS and held == 0  # one wait per pushed layer
        increments, waits, held = de.stats_since_last()
        assert increments["snic_read_bytes"] == 6 * LAYOUT.full_block_bytes and increments["snic_read_blocks"] == 6
        assert pe.stats_since_last() is None
        assert pe.counters.loads_de == 1  # the worker keeps the running totals
    finally:
        d.close()


# -- slow: a served instance's own /metrics ---------------------------------------------------------------------------


def _metrics_of(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        return reply.read().decode()


@pytest.mark.slow
def test_served_instances_show_the_counters_in_their_own_metrics(tmp_path_factory):
    from ascend_dualpath.models.tiny_hf import make_tiny_model
    from tests.integrations.vllm import test_serve_e2e as e2e

    model = str(make_tiny_model(tmp_path_factory.mktemp("tiny-model")))
    tmp = tmp_path_factory.mktemp("serve")
    proc, url, log = e2e._serve(model, tmp, "--policy", "de")
    try:
        prompt = e2e._conversation(model, 0)[0]
        first = e2e._complete(url, model, prompt)
        e2e._complete(url, model, prompt + first)  # the second turn: its prefix is a storage hit
        ready = [x for x in log.read_text().splitlines() if x.startswith("serve: ready at")]
        assert ready, log.read_text()[-3000:]
        instances = {node: port for port, node in re.findall(r":(\d+) node (\w+)", ready[0])}
        assert set(instances) == {"pe0", "de0"}, ready
        own = {name: _metrics_of(f"http://127.0.0.1:{port}") for name, port in instances.items()}
        for text in own.values():
            assert "vllm:dualpath_loads_total" in text and "vllm:dualpath_layer_wait_seconds" in text
        assert e2e._metric(own["pe0"], "vllm:dualpath_loads_total", path="de") >= 1, own["pe0"]
        assert e2e._metric(own["pe0"], "vllm:dualpath_layer_wait_seconds_count") >= 1, own["pe0"]
        assert e2e._metric(own["de0"], "vllm:dualpath_snic_read_bytes_total") > 0, own["de0"]
        assert e2e._metric(own["pe0"], "vllm:dualpath_snic_read_bytes_total") == 0, own["pe0"]
        federated = _metrics_of(url)  # the proxy relabels every instance's metrics
        assert e2e._metric(federated, "vllm:dualpath_loads_total", path="de") >= 1, federated
    finally:
        e2e._stop(proc)
