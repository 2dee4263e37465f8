from __future__ import annotations

import json

from ascend_dualpath.cli import main


def test_simulate_command_writes_tables_figures_and_results(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", "--agents", "64", "--rounds", "2", "--sweep", "16,32", "--out", str(out)]) == 0
    for name in ("jct_vs_agents.png", "ablation.png", "snic_utilisation.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "results.json").read_text())
    assert set(results["ablation"]) == {"basic", "layerwise", "dualpath", "scheduler", "oracle"}
    assert [count for count, _ in results["sweep"]["scheduler"]] == [16, 32]
    assert "Offline ablation" in capsys.readouterr().out
