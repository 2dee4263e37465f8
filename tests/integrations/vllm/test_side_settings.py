"""The side channel's settings in ``kv_connector_extra_config``: its address, the deployment token and the frame
limit, each refused with one line naming the key and the value."""

from __future__ import annotations

import pytest

from ascend_dualpath.dualpath.side_channel import DEFAULT_MAX_FRAME_BYTES, TOKEN_ENV, write_token
from ascend_dualpath.errors import ConfigError
from ascend_dualpath.integrations.vllm.settings import from_kv_transfer_config

TOKEN = "a-deployment-token-of-32-bytes!!"


def config(role="kv_consumer", **extra):
    return type("C", (), {"kv_role": role, "kv_connector_extra_config": {"store": "/s", "side_port": 7000, **extra}})


@pytest.fixture(autouse=True)
def no_token_in_env(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def test_loopback_by_default_without_a_token():
    settings = from_kv_transfer_config(config())
    assert (settings.side_host, settings.side_advertise, settings.side_token) == ("127.0.0.1", None, None)
    assert settings.side_max_bytes == DEFAULT_MAX_FRAME_BYTES


def test_beyond_loopback_the_token_is_required_from_the_environment_or_a_file(monkeypatch, tmp_path):
    with pytest.raises(ConfigError, match=r"\['side_host'\] is '10\.0\.0\.5', beyond loopback.*side_token_file"):
        from_kv_transfer_config(config(side_host="10.0.0.5"))
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert from_kv_transfer_config(config(side_host="10.0.0.5")).side_token == TOKEN.encode()
    monkeypatch.delenv(TOKEN_ENV)
    path = str(tmp_path / "token")
    token = write_token(path)
    settings = from_kv_transfer_config(config(side_host="0.0.0.0", side_advertise="pe-host.lan", side_token_file=path))
    assert (settings.side_host, settings.side_advertise, settings.side_token) == ("0.0.0.0", "pe-host.lan", token)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"side_host": "0.0.0.0", "side_token_file": ""}, r"\['side_token_file'\] must be a file path, got ''"),
        ({"side_host": "0.0.0.0"}, r"\['side_host'\] is '0\.0\.0\.0' \(every interface\): set .*side_advertise"),
        ({"side_host": "my-host"}, r"\['side_host'\] must be an IPv4 address to bind, got 'my-host'"),
        ({"side_advertise": "tcp://x:1"}, r"\['side_advertise'\] must be a host name or address.*'tcp://x:1'"),
        ({"side_token_file": "/nonexistent/token"}, r"\['side_token_file'\]='/nonexistent/token' cannot be read"),
        ({"side_max_bytes": 100}, r"\['side_max_bytes'\] must be an int in \[4096, 1073741824\], got 100"),
        ({"side_max_bytes": True}, r"\['side_max_bytes'\] must be an int"),
        ({"side_max_bytes": "1M"}, r"\['side_max_bytes'\] must be an int"),
    ],
)
def test_bad_values_are_refused_by_name(extra, match):
    with pytest.raises(ConfigError, match=match):
        from_kv_transfer_config(config(**extra))


def test_a_short_token_file_is_refused(tmp_path):
    path = tmp_path / "token"
    path.write_text("short\n")
    with pytest.raises(ConfigError, match=r"side_token_file'\]='.*' has 5 bytes, at least 16 needed"):
        from_kv_transfer_config(config(side_token_file=str(path)))


def test_the_kv_engine_is_the_emulator_unless_mooncake_or_cuda_is_asked_for():
    settings = from_kv_transfer_config(config())
    assert (settings.engine, settings.mooncake_protocol, settings.mooncake_host) == ("emulator", "tcp", None)
    settings = from_kv_transfer_config(config(engine="mooncake", mooncake_protocol="rdma", mooncake_host="10.0.0.5"))
    assert (settings.engine, settings.mooncake_protocol, settings.mooncake_host) == ("mooncake", "rdma", "10.0.0.5")
    assert from_kv_transfer_config(config(engine="cuda")).engine == "cuda"


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"engine": "npu"}, r"\['engine'\] 'npu': the npu engine is not wired into the connector yet"),
        ({"engine": "nixl"}, r"\['engine'\] must be one of emulator, mooncake, cuda, got 'nixl'"),
        (
            {"engine": "mooncake", "mooncake_protocol": "udp"},
            r"\['mooncake_protocol'\] must be one of tcp, rdma.*'udp'",
        ),
        (
            {"engine": "mooncake", "mooncake_host": "0.0.0.0"},
            r"\['mooncake_host'\] must be an address peers.*'0\.0\.0\.0'",
        ),
    ],
)
def test_a_bad_kv_engine_setting_is_one_line_naming_the_key_and_value(extra, match):
    with pytest.raises(ConfigError, match=match) as error:
        from_kv_transfer_config(config(**extra))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("tp", "tp_rank", "dp_index", "index"), [(1, 0, 0, 0), (1, 0, 1, 1), (2, 1, 0, 1), (2, 1, 1, 3)]
)
def test_each_worker_of_a_parallel_instance_gets_its_own_side_port_and_device(
    monkeypatch, tp, tp_rank, dp_index, index
):
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.distributed import parallel_state

    from ascend_dualpath.integrations.vllm.connector import worker_settings

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: tp_rank)
    base = from_kv_transfer_config(config("kv_consumer", side_port=7601, device_id=4))
    got = worker_settings(base, SimpleNamespace(tensor_parallel_size=tp, data_parallel_index=dp_index))
    assert (got.side_port, got.device_id, got.tp_size, got.tp_rank) == (7601 + index, 4 + index, tp, tp_rank)
    assert got.snic_bytes_per_s == base.snic_bytes_per_s and got.store == base.store
