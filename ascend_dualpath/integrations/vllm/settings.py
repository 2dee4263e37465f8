"""The connector's settings, read once from vLLM's ``KVTransferConfig``, and the store ids of vLLM's block hashes."""

from __future__ import annotations

import hashlib
import math
from typing import Any

from ascend_dualpath import _env
from ascend_dualpath.dualpath.dataplane import check_engine
from ascend_dualpath.dualpath.settings import UNCAPPED_BYTES_PER_S, ConnectorSettings
from ascend_dualpath.dualpath.side_channel import MAX_FRAME_BYTES, MIN_FRAME_BYTES, check_bind, load_token
from ascend_dualpath.errors import ConfigError
from ascend_dualpath.kv.layout import BLOCK_ID_BYTES
from ascend_dualpath.transport.mooncake import PROTOCOLS

# vLLM's kv_role -> what this instance is in DualPath
INSTANCE_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "standalone"}
DEFAULT_NODES = {"prefill": "pe", "decode": "de", "standalone": "node0"}
DEFAULT_DEVICE_IDS = {"prefill": 0, "decode": 1, "standalone": 0}  # so a 1P1D config needs none


def from_kv_transfer_config(kv_transfer_config: Any) -> ConnectorSettings:
    """``kv_connector_extra_config`` of one instance, validated (ConfigError names the key and the value)."""
    kv_role = kv_transfer_config.kv_role
    if kv_role not in INSTANCE_ROLES:
        raise ConfigError(f"kv_role must be one of {sorted(INSTANCE_ROLES)}, got {kv_role!r}")
    role = INSTANCE_ROLES[kv_role]
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    if not extra.get("store"):
        raise ConfigError("kv_connector_extra_config['store'] (the block-store directory) is required")
    side_port = extra.get("side_port")
    if role != "standalone" and side_port is None:
        raise ConfigError(f"kv_connector_extra_config['side_port'] is required for kv_role {kv_role!r}")
    if side_port is not None and not (isinstance(side_port, int) and 0 < side_port < 65536):
        raise ConfigError(f"kv_connector_extra_config['side_port'] must be a TCP port, got {side_port!r}")
    mbps = extra.get("snic_mbps")
    snic = UNCAPPED_BYTES_PER_S if mbps is None else _positive("snic_mbps", mbps) * 1e6
    timeout = _positive("timeout_s", extra["timeout_s"]) if "timeout_s" in extra else _env.timeout_s()
    device_id = extra.get("device_id", DEFAULT_DEVICE_IDS[role])
    if not (isinstance(device_id, int) and not isinstance(device_id, bool) and device_id >= 0):
        raise ConfigError(f"kv_connector_extra_config['device_id'] must be an int >= 0, got {device_id!r}")
    side = _side_settings(extra) if side_port is not None else {}
    return ConnectorSettings(
        role=role,
        store=str(extra["store"]),
        node=str(extra.get("node", DEFAULT_NODES[role])),
        snic_bytes_per_s=snic,
        side_port=side_port,
        fabric=str(extra.get("fabric", "adpvllm")),
        timeout_s=timeout,
        device_id=device_id,
        persist_wait_s=_positive("persist_wait_s", extra.get("persist_wait_s", 5.0)),
        hold_s=_positive("hold_s", extra.get("hold_s", 120.0)),
        **_buffer_settings(extra),
        **side,
        **_engine_settings(extra),
    )


def _engine_settings(extra: dict) -> dict:
    """The KV engine and, on ``mooncake``, its protocol and listening address (ConfigError names key and value)."""
    engine = check_engine(extra.get("engine", "emulator"), _key("engine"))
    protocol, host = extra.get("mooncake_protocol", "tcp"), extra.get("mooncake_host")
    if protocol not in PROTOCOLS:
        raise ConfigError(f"{_key('mooncake_protocol')} must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if host is not None and not (isinstance(host, str) and host and host != "0.0.0.0"):
        raise ConfigError(f"{_key('mooncake_host')} must be an address peers can reach, got {host!r}")
    return {"engine": engine, "mooncake_protocol": protocol, "mooncake_host": host}


def _buffer_settings(extra: dict) -> dict:
    """The HCCL window, the host buffer and the cap of reads ahead in it (ConfigError names the key and value)."""
    host_mb = int(_positive("host_buffer_mb", extra.get("host_buffer_mb", 256)))
    prefetch_mb = _positive("prefetch_max_mb", extra.get("prefetch_max_mb", min(128, host_mb)))
    if prefetch_mb > host_mb:
        raise ConfigError(f"{_key('prefetch_max_mb')} must be <= host_buffer_mb ({host_mb}), got {prefetch_mb}")
    hccl_mb = int(_positive("hccl_buffer_mb", extra.get("hccl_buffer_mb", 64)))
    return {"hccl_buffer_mb": hccl_mb, "host_buffer_mb": host_mb, "prefetch_max_mb": prefetch_mb}


def _side_settings(extra: dict) -> dict:
    """The side channel's address, token and frame limit (ConfigError names the key and the value)."""
    host, advertise = extra.get("side_host", "127.0.0.1"), extra.get("side_advertise")
    token_file = extra.get("side_token_file")
    if token_file is not None and not (isinstance(token_file, str) and token_file):
        raise ConfigError(f"{_key('side_token_file')} must be a file path, got {token_file!r}")
    token = load_token(token_file, _key("side_token_file"))
    check_bind(str(host), advertise, token, _key)
    max_bytes = extra.get("side_max_bytes", None)
    if max_bytes is not None and not (
        isinstance(max_bytes, int)
        and not isinstance(max_bytes, bool)
        and MIN_FRAME_BYTES <= max_bytes <= MAX_FRAME_BYTES
    ):
        raise ConfigError(
            f"{_key('side_max_bytes')} must be an int in [{MIN_FRAME_BYTES}, {MAX_FRAME_BYTES}], got {max_bytes!r}"
        )
    side = {"side_host": str(host), "side_advertise": advertise, "side_token": token}
    return side | ({"side_max_bytes": max_bytes} if max_bytes is not None else {})


def _key(name: str) -> str:
    return f"kv_connector_extra_config[{name!r}]"


def _positive(name: str, value: Any) -> float:
    """``value`` as a finite float > 0, else ConfigError naming ``name``."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"kv_connector_extra_config[{name!r}] must be a number, got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(f"kv_connector_extra_config[{name!r}] must be finite and > 0, got {value!r}")
    return number


def store_namespace(model: str, layout_fingerprint: bytes) -> bytes:
    """Salt of the store ids: the model and the KV layout, so two models never share a block."""
    return hashlib.blake2b(model.encode() + b"|" + layout_fingerprint, digest_size=BLOCK_ID_BYTES).digest()


def store_ids(namespace: bytes, block_hashes: Any) -> list[bytes]:
    """Store ids of vLLM block hashes (``blake2b_128(namespace || hash)``); vLLM's hashes already chain."""
    return [hashlib.blake2b(namespace + bytes(h), digest_size=BLOCK_ID_BYTES).digest() for h in block_hashes]
