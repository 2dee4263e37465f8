"""The MoE benchmark command on CPU processes (gloo): every op of the baseline strategy is measured on both
clocks and the JSON is well formed."""

from __future__ import annotations

import argparse
import json

import pytest

from ascend_dualpath.bench import moe as bench

OPS = {
    "layout",
    "dispatch bf16 (cached)",
    "dispatch fp8 (cached)",
    "dispatch bf16 (with topk, layout given)",
    "combine bf16",
    "ll dispatch fp8",
    "ll combine bf16",
}


@pytest.mark.slow
def test_bench_moe_measures_every_op_on_gloo(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "moe.json"
    args = parser.parse_args(
        [
            "--ranks",
            "2",
            "--strategies",
            "alltoall",
            "--tokens",
            "32",
            "--ll-tokens",
            "8",
            "--hidden",
            "256",
            "--experts",
            "8",
            "--topk",
            "2",
            "--iters",
            "3",
            "--warmup",
            "1",
            "--deadline-s",
            "120",
            "--json",
            str(out),
        ]
    )
    assert bench.run(args) == 0
    data = json.loads(out.read_text())
    rows = {row["op"]: row for row in data["rows"]}
    assert set(rows) == OPS and all("error" not in row for row in rows.values())
    for row in rows.values():
        assert row["strategy"] == "alltoall"
        assert 0 < row["min_us"] <= row["median_us"] and row["loop_us"] > 0 and row["host_us"] > 0
    # every token of both ranks is received (top-2 of 8 experts on 2 ranks: some tokens reach both)
    assert rows["dispatch bf16 (cached)"]["logical_bytes"] >= 32 * 256 * 2
    assert "loop us" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_moe_reports_an_unavailable_strategy_instead_of_failing(tmp_path, capsys):
    """On a machine without 2 CUDA GPUs, ``--strategies cuda`` gives one error row naming why, exit 0, and the
    default ``auto`` picks only strategies that exist here."""
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("cuda is available here")
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args([]).strategies == "auto"
    out = tmp_path / "moe.json"
    args = parser.parse_args(["--ranks", "2", "--strategies", "cuda,nosuch", "--deadline-s", "60", "--json", str(out)])
    assert bench.run(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(row["strategy"], row["error"].split(":")[0]) for row in rows] == [
        ("cuda", "unavailable"),
        ("nosuch", "unavailable"),
    ]
    assert "needs a CUDA build of torch" in rows[0]["error"] and "unknown MoE strategy" in rows[1]["error"]
    assert "Traceback" not in capsys.readouterr().err
