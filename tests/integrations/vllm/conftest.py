"""Shared vLLM configs for the scheduler tests: building a ``VllmConfig`` takes about a second, importing vLLM
about twelve, so every config is built once per session and each test makes its own ``Scheduler`` from it."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def vllm_config_for(tmp_path_factory):
    """``vllm_config_for(connector, module_path=None, role="kv_both", policy="recompute", **extra)`` -> VllmConfig."""
    from vllm.config import KVTransferConfig

    from tests.integrations.vllm import scheduler_harness

    model_dir = scheduler_harness.write_tiny_model_config(tmp_path_factory.mktemp("tiny-llama"))
    built = {}

    def build(connector, module_path=None, role="kv_both", policy="recompute", **extra):
        key = (connector, module_path, role, policy, tuple(sorted(extra.items())))
        if key not in built:
            transfer = KVTransferConfig(
                kv_connector=connector,
                kv_connector_module_path=module_path,
                kv_role=role,
                kv_connector_extra_config=dict(extra),
                kv_load_failure_policy=policy,
            )
            built[key] = scheduler_harness.make_vllm_config(model_dir, transfer)
        return built[key]

    return build
