"""The transfer benchmark command on the emulator: every kind runs, rows and verdicts are well formed."""

from __future__ import annotations

import argparse
import json

from ascend_dualpath.bench import transfer as bench


def test_bench_runs_every_kind_and_writes_json(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "t.json"
    args = parser.parse_args(["--quick", "--repeats", "2", "--block-dim", "2", "--json", str(out)])
    assert bench.run(args) == 0
    data = json.loads(out.read_text())
    kinds = {r["kind"] for r in data["rows"]}
    assert kinds == set(bench.EMULATOR_KINDS)
    assert len(data["rows"]) == 3 * len(bench.EMULATOR_KINDS)
    for row in data["rows"]:
        assert row["latency_us_p50"] <= row["latency_us_p99"]
        assert 0 < row["submit_share"] <= 1
        assert (row["staging_peak_bytes"] > 0) == (row["kind"] == "staging")
    assert data["meta"]["cost_model"]["host_submit_ns"] > 0
    assert {v["case"] for v in data["verdicts"]} == {"16x4K", "1x1M", "61x42K layer blocks"}
    assert "cost.aiv_submit_ns" in capsys.readouterr().out


def test_verdict_follows_the_stop_condition():
    def row(kind, p50, share):
        return bench.Row(kind, "c", 1, 1, 0.0, share * p50, p50, p50, 0.0, 0.0, 0, share, "virtual")

    [keep] = bench.verdicts([row("aiv", 50.0, 0.01), row("host", 100.0, 0.04)])
    assert keep["verdict"].startswith("keep host path (submit < 5%")
    [pays] = bench.verdicts([row("aiv", 50.0, 0.01), row("host", 100.0, 0.30), row("host/seg", 200.0, 0.9)])
    assert pays["verdict"] == "aiv pays off: 50% lower latency than host" and pays["speedup_vs_per_segment_host"] == 4.0
    [slower] = bench.verdicts([row("aiv", 150.0, 0.01), row("host", 100.0, 0.30)])
    assert slower["verdict"] == "keep host path (aiv is 50% slower than host)"


def test_table_and_progress_show_submit_and_gpu_time_when_measured():
    row = bench.Row(
        "device",
        "61x42K layer blocks",
        61,
        43008,
        0.1,
        6.1,
        20.0,
        25.0,
        262.4,
        6.0,
        0,
        0.305,
        "measured",
        {},
        10.0,
        12.0,
    )
    table = bench.format_table([row])
    assert "gpu p50 us" in table.splitlines()[0]
    assert "      6.1       10.0       12.0       20.0" in table.splitlines()[2]
    assert "submit       6.1 us (0.100/seg)  gpu      10.0 us     262.4 GB/s" in bench.progress_line(row)
    emulated = bench.Row("aiv", "c", 1, 1, 0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0, 0.5, "virtual")
    assert "gpu" not in bench.format_table([emulated]) and "gpu" not in bench.progress_line(emulated)


def test_cuda_kinds_are_the_engine_vocabulary_and_primitives_need_the_flag():
    import pytest

    from ascend_dualpath import errors
    from ascend_dualpath.bench.cuda_transfer import DEFAULT_KINDS, parse_kind

    assert DEFAULT_KINDS == ("aiv", "aicpu", "staging", "host", "foreach", "copy")
    assert all(parse_kind(kind, primitives=False) == (kind, {}) for kind in DEFAULT_KINDS)
    with pytest.raises(errors.ConfigError, match="raw primitives need --primitives"):
        parse_kind("device", primitives=False)
    with pytest.raises(errors.ConfigError, match="--primitives kinds"):
        parse_kind("aiv", primitives=True)
    assert parse_kind("graph:64:4:8", True) == (
        "graph",
        {"config": {"tile_bytes": 65536, "programs_per_sm": 4, "num_warps": 8}},
    )
    assert parse_kind("device:-:2:-:stream", True) == ("device", {"config": {"programs_per_sm": 2, "streaming": True}})
    assert parse_kind("staging:65536", True) == ("staging", {"chunk_bytes": 64 << 20})
    for removed in (
        "staged",
        "device-jit",
        "device-runner",
        "device-new",
        "device:4:8:4:prefetch",
        "device:32:6:1:bulk+split2",
    ):
        with pytest.raises(errors.ConfigError):
            parse_kind(removed, primitives=True)


def test_primitives_are_refused_on_the_emulator():
    import pytest

    from ascend_dualpath import errors

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(errors.ConfigError, match="--primitives .* needs --backend cuda"):
        bench.run(parser.parse_args(["--quick", "--primitives"]))
