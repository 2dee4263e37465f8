"""Shared vLLM configs for the scheduler tests: building a ``VllmConfig`` takes about a second, importing vLLM
about twelve, so every config is built once per session and each test makes its own ``Scheduler`` from it."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def deploy(tmp_path):
    """``deploy(num_pe, num_de, **kwargs)``: a :class:`worker_harness.Deployment` of connector workers, closed at
    the end of the test, its fabric's shared memory checked gone."""
    from ascend_dualpath.dualpath.dataplane import SHM_DIR
    from tests.integrations.vllm.worker_harness import Deployment

    made = []

    def make(num_pe, num_de, **kwargs):
        made.append(Deployment(tmp_path / f"store{len(made)}", num_pe, num_de, **kwargs))
        return made[-1]

    yield make
    for deployment in made:
        deployment.close()
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"adp.{deployment.fabric}")]


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
