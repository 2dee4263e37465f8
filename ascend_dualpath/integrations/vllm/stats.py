"""The connector's counters in vLLM's own metrics: ``KVConnectorStats`` and its Prometheus metrics.

The worker hands vLLM, once per step, what changed since its last hand-over (:class:`DualPathKVConnectorStats`);
vLLM's engine core sends it to the front end, whose Prometheus logger calls :class:`DualPathPromMetrics` (built by
``DualPathConnector.build_prom_metrics``), so the counters appear in the instance's own ``/metrics`` as
``vllm:dualpath_*`` with vLLM's ``model_name`` and ``engine`` labels. docs/vllm.md lists the names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

# Counters of the instance (dualpath.counters.Counters field or read-queue figure) -> (metric name, help, label value of ``path``).
# Loads and split blocks carry the read path as a label; the others have none.
COUNTERS: dict[str, tuple[str, str, str | None]] = {
    "loads_pe": ("loads", "requests whose storage hits loaded, by read path", "pe"),
    "loads_de": ("loads", "requests whose storage hits loaded, by read path", "de"),
    "loads_split": ("loads", "requests whose storage hits loaded, by read path", "split"),
    "split_blocks_pe": ("split_blocks", "hit blocks of split requests, by the engine that read them", "pe"),
    "split_blocks_de": ("split_blocks", "hit blocks of split requests, by the engine that read them", "de"),
    "snic_read_bytes": ("snic_read_bytes", "bytes this instance's storage NIC read from the block store", None),
    "snic_read_blocks": ("snic_read_blocks", "blocks this instance's storage NIC read from the block store", None),
    "fallbacks": ("fallbacks", "loads that failed and fell back (recompute or the other path)", None),
    "takeovers": ("takeovers", "loads whose DE half failed and the PE read it itself (the other path)", None),
    "failures": ("failures", "failed loads, pushes and persists", None),
    "checksum_errors": ("checksum_errors", "stored blocks whose checksum did not match", None),
    "persisted_blocks": ("persisted_blocks", "blocks written to the block store", None),
    "quarantined_leases": ("quarantined_leases", "host leases kept out of the pool after a failure", None),
    "quarantined_slots": ("quarantined_slots", "window slots kept out of the pool after a failure", None),
    "reclaimed_leases": ("reclaimed_leases", "quarantined host leases given back", None),
    "reclaimed_slots": ("reclaimed_slots", "quarantined window slots given back", None),
    "expired_plans": ("expired_plans", "plans no request took within the timeout", None),
    "side_refused": ("side_refused", "side-channel frames refused before decoding (token, replay, size, format)", None),
}
LAYER_WAIT = "layer_wait_s"  # seconds the PE waited for each pushed layer's notify, one sample per wait
QUARANTINED_BYTES = "quarantined_bytes"  # held now, not a count: by rank, each rank's latest value wins
# Layer waits range from a poll period (a pushed layer already there) to the connector's timeout.
LAYER_WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclasses.dataclass
class DualPathKVConnectorStats(KVConnectorStats):
    """What the workers counted in an interval: ``data`` holds each :data:`COUNTERS` key's increment (int), the
    layer waits (list of float seconds) and the quarantined bytes each tensor-parallel rank held at its end
    (``{str(rank): bytes}``; a rank that reported no change is absent). vLLM sums the workers' stats of a step
    (``aggregate``), so a count is the instance's total, and the bytes held stay apart per rank until observed.

    Only plain ints, floats, lists and dicts, as vLLM sends ``data`` between processes with msgspec.

    Examples
    --------
    >>> a = DualPathKVConnectorStats.from_counters({"loads_de": 1, "snic_read_bytes": 4096}, [0.002], 0)
    >>> b = DualPathKVConnectorStats.from_counters({"loads_de": 2}, [], 8192, rank=1)
    >>> merged = a.aggregate(b)
    >>> merged.data["loads_de"], merged.data["snic_read_bytes"], merged.data["quarantined_bytes"]
    (3, 4096, {'0': 0, '1': 8192})
    >>> merged.reduce()["quarantined_bytes"]
    8192
    """

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    @classmethod
    def from_counters(
        cls, increments: dict[str, int], layer_waits: list[float], quarantined_bytes: int | None, rank: int = 0
    ) -> DualPathKVConnectorStats:
        """Stats of tensor-parallel rank ``rank``'s increments (keys of :data:`COUNTERS`), layer-wait samples and
        the quarantined bytes it holds now (None: unknown)."""
        unknown = set(increments) - set(COUNTERS)
        if unknown:
            raise ValueError(f"unknown DualPath counters {sorted(unknown)}; known: {sorted(COUNTERS)}")
        negative = {k: v for k, v in increments.items() if v < 0}
        if negative:
            raise ValueError(f"DualPath counter increments must be >= 0, got {negative}")
        stats = cls()
        stats.data.update(increments)
        stats.data[LAYER_WAIT] = list(layer_waits)
        stats.data[QUARANTINED_BYTES] = {} if quarantined_bytes is None else {str(rank): quarantined_bytes}
        return stats

    def reset(self) -> None:
        self.data = {**dict.fromkeys(COUNTERS, 0), LAYER_WAIT: [], QUARANTINED_BYTES: {}}

    def aggregate(self, other: KVConnectorStats) -> DualPathKVConnectorStats:
        """Sums the counters, joins the layer waits; a rank's quarantined bytes are ``other``'s where it knows them
        (another rank's of the same step, or a later interval's)."""
        for key in COUNTERS:
            self.data[key] = self.data.get(key, 0) + other.data.get(key, 0)
        self.data[LAYER_WAIT] = [*self.data.get(LAYER_WAIT, []), *other.data.get(LAYER_WAIT, [])]
        self.data[QUARANTINED_BYTES] = {
            **(self.data.get(QUARANTINED_BYTES) or {}),
            **(other.data.get(QUARANTINED_BYTES) or {}),
        }
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval for vLLM's log line: every counter's sum, the layer waits' count, mean and max (ms)."""
        waits = self.data.get(LAYER_WAIT, [])
        out: dict[str, int | float] = {key: self.data.get(key, 0) for key in COUNTERS}
        out["layer waits"] = len(waits)
        out["avg layer wait (ms)"] = round(1e3 * sum(waits) / len(waits), 3) if waits else 0.0
        out["max layer wait (ms)"] = round(1e3 * max(waits), 3) if waits else 0.0
        if held := self.data.get(QUARANTINED_BYTES):
            out[QUARANTINED_BYTES] = sum(held.values())  # of the ranks that reported one in this interval
        return out

    def is_empty(self) -> bool:
        """Nothing counted and no layer waited (a changed quarantined-bytes figure alone is not logged)."""
        return not any(self.data.get(key, 0) for key in COUNTERS) and not self.data.get(LAYER_WAIT)


class DualPathPromMetrics(KVConnectorPromMetrics):
    """``vllm:dualpath_*`` metrics: a counter per :data:`COUNTERS` name (``_total``; loads and split blocks by
    ``path``), the gauge ``vllm:dualpath_quarantined_bytes`` (the sum of what each rank of the engine last reported)
    and the histogram ``vllm:dualpath_layer_wait_seconds``, each with vLLM's per-engine labels."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        families: dict[str, PromMetric] = {}
        self.counters: dict[str, dict[int, PromMetric]] = {}  # COUNTERS key -> engine index -> child
        for key, (name, documentation, path) in COUNTERS.items():
            if name not in families:
                families[name] = self._counter_cls(
                    name=f"vllm:dualpath_{name}",
                    documentation=f"DualPath: {documentation}.",
                    labelnames=labelnames + (["path"] if path else []),
                )
            extra = [path] if path else []
            values = {idx: [*labelvalues, *extra] for idx, labelvalues in per_engine_labelvalues.items()}
            self.counters[key] = create_metric_per_engine(families[name], values)
        quarantined = self._gauge_cls(
            name="vllm:dualpath_quarantined_bytes",
            documentation="DualPath: bytes of host leases and window slots held in quarantine now.",
            labelnames=labelnames,
            multiprocess_mode="mostrecent",
        )
        self.quarantined_bytes = create_metric_per_engine(quarantined, per_engine_labelvalues)
        self._held: dict[int, dict[str, int]] = {idx: {} for idx in per_engine_labelvalues}  # engine -> rank -> bytes
        layer_wait = self._histogram_cls(
            name="vllm:dualpath_layer_wait_seconds",
            documentation="DualPath: seconds the prefill engine waited for a layer the decode engine pushed.",
            labelnames=labelnames,
            buckets=list(LAYER_WAIT_BUCKETS),
        )
        self.layer_wait = create_metric_per_engine(layer_wait, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Adds one interval's :class:`DualPathKVConnectorStats` ``data`` to engine ``engine_idx``'s metrics."""
        for key, children in self.counters.items():
            if increment := transfer_stats_data.get(key, 0):
                children[engine_idx].inc(increment)
        for seconds in transfer_stats_data.get(LAYER_WAIT, []):
            self.layer_wait[engine_idx].observe(seconds)
        if held := transfer_stats_data.get(QUARANTINED_BYTES):
            self._held[engine_idx].update(held)
            self.quarantined_bytes[engine_idx].set(sum(self._held[engine_idx].values()))
