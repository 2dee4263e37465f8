import pathlib
import re

import pytest

import ascend_dualpath
from ascend_dualpath import _env
from ascend_dualpath.backends import Backend, capabilities, get_backend
from ascend_dualpath.errors import BackendUnavailable


def test_parse_names_and_reject_unknown():
    assert Backend.parse("NPU") is Backend.NPU
    assert Backend.parse(Backend.CUDA) is Backend.CUDA
    with pytest.raises(ValueError, match="unknown backend 'tpu'.*auto, npu, cuda, emulator"):
        Backend.parse("tpu")


def test_emulator_is_always_available():
    caps = capabilities("emulator")
    assert caps.available and caps.device_type == "cpu" and caps.collective_backend == "gloo"
    assert all(caps.supports(kind) for kind in ("aiv", "aicpu", "staging", "host"))


def test_unavailable_backend_says_why(monkeypatch):
    npu = capabilities("npu")
    if not npu.available:
        assert npu.reason and not npu.supports("aiv")
        with pytest.raises(BackendUnavailable, match="backend 'npu' is unavailable: "):
            get_backend("npu")


def test_auto_resolution_order(monkeypatch):
    monkeypatch.delenv("ADP_BACKEND", raising=False)
    expected = next(b for b in (Backend.NPU, Backend.CUDA, Backend.EMULATOR) if capabilities(b).available)
    assert get_backend("auto") is expected
    assert get_backend(None) is expected


def test_env_supplies_the_default_but_explicit_wins(monkeypatch):
    monkeypatch.setenv("ADP_BACKEND", "emulator")
    assert get_backend() is Backend.EMULATOR
    monkeypatch.setenv("ADP_BACKEND", "no-such-backend")
    with pytest.raises(ValueError, match="no-such-backend"):
        get_backend("auto")
    assert get_backend("emulator") is Backend.EMULATOR  # explicit argument ignores the bad variable


def test_timeout_env(monkeypatch):
    monkeypatch.delenv("ADP_TIMEOUT_S", raising=False)
    monkeypatch.delenv("ADP_FAST_DEBUG", raising=False)
    assert _env.timeout_s() == _env.DEFAULT_TIMEOUT_S
    monkeypatch.setenv("ADP_FAST_DEBUG", "1")
    assert _env.timeout_s() == _env.FAST_DEBUG_TIMEOUT_S
    monkeypatch.setenv("ADP_TIMEOUT_S", "7.5")
    assert _env.timeout_s() == 7.5
    monkeypatch.setenv("ADP_TIMEOUT_S", "-1")
    with pytest.raises(ValueError, match="ADP_TIMEOUT_S must be > 0"):
        _env.timeout_s()


def test_every_adp_variable_is_read_in_one_module():
    root = pathlib.Path(ascend_dualpath.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "_env.py":
            continue
        text = path.read_text()
        if re.search(r"environ[^\n]*[\"']ADP_|getenv\([\"']ADP_", text):
            offenders.append(str(path.relative_to(root)))
    assert offenders == [], f"ADP_* read outside _env.py: {offenders}"
