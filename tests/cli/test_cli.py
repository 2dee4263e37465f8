import json
import subprocess
import sys

import pytest


def run_cli(*args, timeout=180):
    out = subprocess.run(
        [sys.executable, "-m", "ascend_dualpath", *args], capture_output=True, text=True, timeout=timeout
    )
    return out.returncode, out.stdout, out.stderr


def test_info_reports_backends_and_profile():
    rc, out, err = run_cli("info", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["backends"]["emulator"]["available"] is True
    assert set(report["backends"]) == {"npu", "cuda", "emulator"}
    for backend in report["backends"].values():
        assert backend["reason"]
    device = report["emulated_device"]
    assert (device["product"], device["vector_cores"], device["ub_bytes"], device["hccl_buffer_mb"]) == (
        "A2",
        48,
        196608,
        200,
    )
    assert device["aiv_dataplane_bit"].startswith("0x04 set") and (device["rdma_tc"], device["rdma_sl"]) == (132, 4)


def test_unknown_command_fails_with_usage():
    rc, out, err = run_cli("frobnicate")
    assert rc == 2 and "unknown command 'frobnicate'" in err


@pytest.mark.slow
def test_demo_serves_every_turn_correctly_through_both_read_paths():
    rc, out, err = run_cli(
        "demo",
        "--agents",
        "2",
        "--turns",
        "2",
        "--first-prompt",
        "96",
        "--append",
        "24",
        "--gen",
        "2",
        "--snic-mbps",
        "50",
    )
    assert rc == 0, err + out
    assert "every turn correct: True" in out
    assert "greedy tokens = no-cache run" in out and "4/4" in out
