"""CANN and SOC_VERSION detection as setup.py uses it, against fake toolkits and a fake npu-smi that
prints the A2 / A3 outputs of tests/backends/data/npu_smi (see its README: reconstructed, not captured)."""

import os
import stat
from pathlib import Path

import pytest

from ascend_dualpath.backends import cann

DATA = Path(__file__).parent / "data" / "npu_smi"


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


def fake_npu_smi(directory: Path, listing: str, board: str, board_npu: int = 0) -> dict:
    """An npu-smi that prints `listing` for `info -l` and `board` for `info -t board -i <board_npu> -c 0`."""
    (directory / "list.txt").write_text(listing)
    (directory / "board.txt").write_text(board)
    script = directory / "npu-smi"
    script.write_text(f"""#!/bin/sh
case "$*" in
  "info -l") cat "{directory}/list.txt" ;;
  "info -t board -i {board_npu} -c 0") cat "{directory}/board.txt" ;;
  *) echo "unexpected arguments: $*" >&2; exit 1 ;;
esac
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": str(directory) + os.pathsep + os.environ.get("PATH", "")}


@pytest.mark.parametrize(
    ("machine", "soc"),
    [("a2", "Ascend910B3"), ("a3", "Ascend910_9391")],
)
def test_soc_version_from_npu_smi(tmp_path, machine, soc):
    env = fake_npu_smi(
        tmp_path, (DATA / f"{machine}_list.txt").read_text(), (DATA / f"{machine}_board.txt").read_text()
    )
    assert cann.find_soc_version(env) == (soc, "npu-smi (NPU 0)")


def test_chip_type_is_not_the_chip():
    # `Chip Type : Ascend` precedes `Chip Name`: taking it gave "AscendAscend"
    assert cann.soc_from_board("Chip Type : Ascend\nChip Name : 910B1\n") == "Ascend910B1"
    assert cann.soc_from_board("Chip Type : Ascend\n") is None
    # A3 with a bare chip name, and an NA NPU name, are read the same way
    assert cann.soc_from_board("Chip Name : 910\nNPU Name : 9392\n") == "Ascend910_9392"
    assert cann.soc_from_board("Chip Name : 910B4\nNPU Name : NA\n") == "Ascend910B4"


def test_first_listed_npu_is_asked(tmp_path):
    # a container that exposes NPU 4 alone
    listing = "        Total Count                    : 1\n\n        NPU ID                         : 4\n"
    env = fake_npu_smi(tmp_path, listing, (DATA / "a2_board.txt").read_text(), board_npu=4)
    assert cann.find_soc_version(env) == ("Ascend910B3", "npu-smi (NPU 4)")


def test_soc_version_from_env_beats_npu_smi(tmp_path):
    env = fake_npu_smi(tmp_path, (DATA / "a2_list.txt").read_text(), (DATA / "a2_board.txt").read_text())
    env["SOC_VERSION"] = "Ascend910_9391"
    assert cann.find_soc_version(env) == ("Ascend910_9391", "$SOC_VERSION")


def test_soc_version_misses_say_why(tmp_path):
    assert cann.find_soc_version({"PATH": str(tmp_path)}) == (None, "SOC_VERSION is unset and npu-smi is absent")
    env = fake_npu_smi(tmp_path, "Total Count : 0\n", "")
    assert cann.find_soc_version(env) == (None, "npu-smi info -l listed no NPU")
    env = fake_npu_smi(tmp_path, (DATA / "a2_list.txt").read_text(), "Board ID : 0x33\n")
    assert cann.find_soc_version(env) == (None, "npu-smi printed no chip name for NPU 0")
