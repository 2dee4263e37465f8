"""``DualPathConnector``: DualPath KV loading as a vLLM ``KVConnectorBase_V1``.

One instance per role and process: the SCHEDULER role (in vLLM's engine core) delegates to
:class:`~ascend_dualpath.integrations.vllm.scheduler.DualPathScheduler`, the WORKER role to
:class:`~ascend_dualpath.integrations.vllm.worker.DualPathWorker`. docs/vllm.md describes the request flow.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from ascend_dualpath.dualpath.settings import UNCAPPED_BYTES_PER_S, ConnectorSettings, rank_port
from ascend_dualpath.errors import ConfigError
from ascend_dualpath.integrations.vllm.metadata import DualPathMetadata, DualPathWorkerMeta
from ascend_dualpath.integrations.vllm.scheduler import DualPathScheduler
from ascend_dualpath.integrations.vllm.settings import from_kv_transfer_config, store_namespace
from ascend_dualpath.integrations.vllm.stats import DualPathKVConnectorStats, DualPathPromMetrics
from ascend_dualpath.kv.layout import KVLayout
from ascend_dualpath.kv.store import LocalBlockStore

# metadata.py stays free of vLLM (the worker half is tested without it)
KVConnectorMetadata.register(DualPathMetadata)
KVConnectorWorkerMetadata.register(DualPathWorkerMeta)


def model_kv_layout(vllm_config: Any) -> KVLayout:
    """The token rows of the served model's whole KV cache (GQA/MHA: every KV head, whatever the tensor-parallel
    size; MLA latents), one Full Block per vLLM block: the store's layout, so its namespace and fingerprint are the
    same at every tensor-parallel size and a store written at one size is read at another."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ConfigError(
            f"the DualPath connector does not support pipeline parallelism (pipeline_parallel_size "
            f"{parallel.pipeline_parallel_size}, supported: 1): a stage holds only its own layers, and a Full Block's "
            "layers would have to be read and pushed per stage, with a side channel per stage (docs/vllm.md)"
        )
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        raise ConfigError(
            f"the DualPath connector stores the model's own KV dtype; cache_dtype {cache_dtype!r} is not supported"
        )
    dtype: torch.dtype = model.dtype
    layers = model.get_num_layers(parallel)
    block = vllm_config.cache_config.block_size
    if model.use_mla:
        return KVLayout.mla(layers, model.get_head_size(), dtype, block_tokens=block)
    return KVLayout.gqa(layers, model.get_total_num_kv_heads(), model.get_head_size(), dtype, block_tokens=block)


def worker_settings(settings: ConnectorSettings, parallel: Any) -> ConnectorSettings:
    """One worker's settings from its instance's (``settings``: what its config says, for its first worker).

    vLLM runs ``data_parallel_size`` engines of ``tensor_parallel_size`` workers each behind one server, and
    every worker has its own connector: worker ``index = data-parallel rank x tp + tensor-parallel rank`` gets
    the side channel at the configured port + ``index`` (:func:`~ascend_dualpath.dualpath.settings.rank_port`,
    where the proxy finds each engine's) and emulated device ``device_id + index`` (``serve`` spaces the
    instances' device ids by their workers). With ``tp > 1`` its node is ``<node>.tp<rank>`` in metrics and its
    storage-NIC cap the configured one / ``tp``: an engine's ranks share their node's storage NIC, each is paced
    at its share and together they read at the cap.
    """
    tp = parallel.tensor_parallel_size
    tp_rank = 0
    if tp > 1:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank()
    index = getattr(parallel, "data_parallel_index", 0) * tp + tp_rank
    side_port = None if settings.side_port is None else rank_port(settings.side_port, index)
    worker = dataclasses.replace(
        settings, tp_size=tp, tp_rank=tp_rank, side_port=side_port, device_id=settings.device_id + index
    )
    if tp == 1:
        return worker
    capped = settings.snic_bytes_per_s < UNCAPPED_BYTES_PER_S
    return dataclasses.replace(
        worker,
        node=f"{settings.node}.tp{tp_rank}",
        snic_bytes_per_s=settings.snic_bytes_per_s / tp if capped else settings.snic_bytes_per_s,
    )


def _rank_group(settings: ConnectorSettings) -> Any:
    """The worker's tensor-parallel ranks for the copies between replicas (:mod:`~ascend_dualpath.dualpath.replicas`):
    vLLM's tensor-parallel group's gloo ``cpu_group``, whose ranks are the engine's workers; None at size 1."""
    if settings.tp_size == 1:
        return None
    from vllm.distributed.parallel_state import get_tp_group

    from ascend_dualpath.dualpath.replicas import LEAD_WAITS, RankGroup

    return RankGroup(get_tp_group().cpu_group, LEAD_WAITS * settings.timeout_s)


class DualPathConnector(KVConnectorBase_V1):
    """DualPath's PE and DE read paths inside vLLM (``kv_producer`` = PE, ``kv_consumer`` = DE).

    vLLM creates the connector from its KV transfer config, once per role (scheduler, worker); ``serve``
    (docs/vllm.md) launches a PE/DE pair and the proxy with these configs.

    Examples
    --------
    The decode engine's config (``kv_connector_extra_config`` is read by
    :func:`~ascend_dualpath.integrations.vllm.settings.from_kv_transfer_config`, which needs no vLLM):

    >>> from types import SimpleNamespace
    >>> from ascend_dualpath.integrations.vllm.settings import from_kv_transfer_config
    >>> kv_transfer_config = SimpleNamespace(
    ...     kv_connector="DualPathConnector", kv_connector_module_path="ascend_dualpath.integrations.vllm.connector",
    ...     kv_role="kv_consumer", kv_connector_extra_config={"store": "/tmp/adp-store", "side_port": 7601})
    >>> settings = from_kv_transfer_config(kv_transfer_config)
    >>> settings.role, settings.side_port
    ('decode', 7601)

    With vLLM, the same config on the command line:
    ``vllm serve MODEL --kv-transfer-config '{"kv_connector": "DualPathConnector", "kv_connector_module_path":
    "ascend_dualpath.integrations.vllm.connector", "kv_role": "kv_consumer", "kv_connector_extra_config":
    {"store": "/tmp/adp-store", "side_port": 7601}}'``.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = from_kv_transfer_config(vllm_config.kv_transfer_config)
        if role != KVConnectorRole.SCHEDULER:
            self.settings = worker_settings(self.settings, vllm_config.parallel_config)
        else:  # it waits for every tensor-parallel worker's report of a read ahead
            self.settings = dataclasses.replace(self.settings, tp_size=vllm_config.parallel_config.tensor_parallel_size)
        algo = vllm_config.cache_config.prefix_caching_hash_algo
        if not str(algo).startswith("sha256"):
            raise ConfigError(
                f"prefix_caching_hash_algo {algo!r} is not reproducible across instances; the "
                "DualPath connector keys its store by vLLM's block hashes and needs sha256 or "
                "sha256_cbor"
            )
        self.layout = model_kv_layout(vllm_config)
        self.namespace = store_namespace(vllm_config.model_config.model, self.layout.fingerprint())
        store = LocalBlockStore(self.settings.store, self.layout)
        self._scheduler: DualPathScheduler | None = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = DualPathScheduler(self.settings, self.layout.block_tokens, store, self.namespace)
        else:
            from ascend_dualpath.integrations.vllm.layouts import adapter_for
            from ascend_dualpath.integrations.vllm.worker import DualPathWorker

            def adapter(layer_name: str, cache: torch.Tensor) -> Any:  # once the attention layers exist
                backend = _attention_backend_name(vllm_config)
                layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
                options = {"isa": layer.isa} if backend == "CPU_ATTN" else {}
                return adapter_for(backend, cache, **options)

            self._worker = DualPathWorker(self.settings, self.layout, store, adapter, group=_rank_group(self.settings))

    # -- scheduler side -------------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> DualPathMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    # -- worker side ----------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        self._worker.register_kv_caches(kv_caches, extract_layer_index)

    def bind_connector_metadata(self, connector_metadata: DualPathMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker.start_step(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Nothing left to start: loads began when the step's metadata was bound (``start_step``)."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._worker.save_kv_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._worker.get_finished(finished_req_ids)
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> DualPathWorkerMeta | None:
        """The reads ahead that ended since the last step (None: none), for the scheduler's next step."""
        return self._worker.build_worker_meta()

    # -- vLLM's metrics (stats.py) ----------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> DualPathKVConnectorStats | None:
        """Worker: what was counted since the last call (None when nothing changed); the scheduler side counts none."""
        if self._worker is None or (changed := self._worker.stats_since_last()) is None:
            return None
        return DualPathKVConnectorStats.from_counters(*changed, rank=self._worker.settings.tp_rank)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> DualPathKVConnectorStats:
        return DualPathKVConnectorStats(data=data) if data is not None else DualPathKVConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> DualPathPromMetrics:
        return DualPathPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()


def _attention_backend_name(vllm_config: Any) -> str:
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    backends = get_current_attn_backends(vllm_config)
    if len(backends) != 1:
        raise ConfigError(f"the DualPath connector needs one attention backend, got {[b.get_name() for b in backends]}")
    return backends[0].get_name()
