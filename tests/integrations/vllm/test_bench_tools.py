"""The serving benchmarks leave nothing in the temporary directory: the tiny model they make is removed when the
run ends, after an error and after SIGTERM too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm")  # the benchmarks' clients and tiny model need the vLLM install (aiohttp, transformers)

TOOLS = Path(__file__).resolve().parents[3] / "tools"


def _models(root: str) -> set[str]:
    return {name for name in os.listdir(root) if name.startswith("adp-bench-model-")}


def test_the_tiny_model_is_removed_after_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.syspath_prepend(str(TOOLS))
    from bench_vllm_serving import model_dir

    with pytest.raises(RuntimeError, match="boom"), model_dir(None) as model:
        assert Path(model, "config.json").is_file()
        assert _models(str(tmp_path))
        raise RuntimeError("boom")
    assert not _models(str(tmp_path))
    with model_dir(str(tmp_path / "given")) as model:  # a model the user gave is not the tool's to remove
        assert model == str(tmp_path / "given")


def test_the_tiny_model_is_removed_on_sigterm(tmp_path):
    script = (
        "import os, signal, sys, time; sys.path.insert(0, sys.argv[1]); from bench_vllm_serving import model_dir\n"
        "with model_dir(None) as model:\n"
        "    print(model, flush=True); os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(TOOLS)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-2000:]
    assert proc.stdout.strip().startswith(str(tmp_path))
    assert not _models(str(tmp_path))
