"""DualPath as a vLLM KV connector (``KVConnectorBase_V1``), with its proxy and launcher.

Load it in vLLM with::

    KVTransferConfig(kv_connector="DualPathConnector",
                     kv_connector_module_path="ascend_dualpath.integrations.vllm.connector",
                     kv_role="kv_producer",  # the PE; "kv_consumer" for the DE, "kv_both" standalone
                     kv_connector_extra_config={"store": "/path/to/store", "side_port": 8100})

Importing this package needs neither vLLM nor ZMQ; ``connector`` (and the modules it uses) need both. Tested
with vLLM 0.32.0 (``TESTED_VLLM_VERSION``); docs/vllm.md has the design.
"""

TESTED_VLLM_VERSION = "0.32.0"
