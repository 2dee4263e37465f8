"""CANN and SOC_VERSION detection as setup.py uses it, against fake toolkits and a fake npu-smi."""

import os
import stat

from ascend_dualpath.backends import cann


def test_env_vars_are_tried_in_order(tmp_path):
    home, toolkit = tmp_path / "home", tmp_path / "toolkit"
    toolkit.mkdir()
    env = {"ASCEND_HOME_PATH": str(home), "ASCEND_TOOLKIT_HOME": str(toolkit)}  # home does not exist
    assert cann.find_cann(env, default_dirs=()) == (toolkit, "$ASCEND_TOOLKIT_HOME")
    home.mkdir()
    assert cann.find_cann(env, default_dirs=()) == (home, "$ASCEND_HOME_PATH")


def test_default_dirs_then_a_clear_miss(tmp_path):
    default = tmp_path / "Ascend" / "cann"
    assert cann.find_cann({}, default_dirs=(str(default),))[0] is None
    assert "ASCEND_HOME_PATH" in cann.find_cann({}, default_dirs=(str(default),))[1]
    default.mkdir(parents=True)
    assert cann.find_cann({}, default_dirs=(str(default),)) == (default, str(default))


def fake_npu_smi(directory, output: str):
    script = directory / "npu-smi"
    script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}\nEOF\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": str(directory) + os.pathsep + os.environ.get("PATH", "")}


def test_soc_version_from_env_beats_npu_smi(tmp_path):
    env = fake_npu_smi(tmp_path, "        Chip Name                      : 910B1")
    assert cann.find_soc_version(env) == ("Ascend910B1", "npu-smi")
    env["SOC_VERSION"] = "Ascend910_9391"
    assert cann.find_soc_version(env) == ("Ascend910_9391", "$SOC_VERSION")


def test_soc_version_misses_say_why(tmp_path):
    assert cann.find_soc_version({"PATH": str(tmp_path)}) == (None, "SOC_VERSION is unset and npu-smi is absent")
    env = fake_npu_smi(tmp_path, "Board ID : 0x33")
    assert cann.find_soc_version(env) == (None, "npu-smi printed no chip name")


def test_ascendc_cmake_dir(tmp_path):
    assert cann.ascendc_cmake_dir(tmp_path) is None
    (tmp_path / "compiler/tikcpp/ascendc_kernel_cmake").mkdir(parents=True)
    assert cann.ascendc_cmake_dir(tmp_path) == tmp_path / "compiler/tikcpp/ascendc_kernel_cmake"
