"""Planning a cluster with the simulator, from files: is DualPath's second read path worth it here?

Two cluster files beside this script, ``cluster/small_1p1d.toml`` (DeepSeek 27B on one prefill and one decode
node, 10 Gbps storage NICs) and ``cluster/small_1p1d_fast_storage.toml`` (the same with 100 Gbps), run one agent
trace, ``cluster/agents.jsonl`` (16 multi-turn agents in the simulator's trace format, written by
``python3 -m ascend_dualpath simulate --write-trace cluster/agents.jsonl --agents 16 --max-len 32768``), through
three modes: ``basic`` (every hit read through the prefill node's storage NIC), ``dualpath`` (round robin over
both read paths) and ``scheduler`` (the paper's scheduler choosing the path per request). The file formats are in
docs/simulator.md §5; the same run from the command line is
``python3 -m ascend_dualpath simulate --cluster examples/cluster/small_1p1d.toml --trace examples/cluster/agents.jsonl``.

Run::

    python3 examples/plan_a_cluster.py

Prints each cluster's job completion time, TTFT and storage bytes per read path by mode; exits 1 unless the
second read path reads on the decode side and makes the storage-bound cluster finish the trace at least 1.2x
faster than ``basic``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ascend_dualpath.sim.cluster import Mode
from ascend_dualpath.sim.cluster_file import load_cluster
from ascend_dualpath.sim.plan import cluster_warnings, run_modes
from ascend_dualpath.sim.trace_file import read_agent_trace

HERE = Path(__file__).resolve().parent / "cluster"
MODES = [Mode.BASIC, Mode.DUALPATH, Mode.SCHEDULER]
MIN_GAIN = 1.2  # the storage-bound cluster's JCT, basic over scheduler


def plan(cluster: Path, agents: list) -> dict[str, dict]:
    """Every mode's summary (``ascend_dualpath.sim.experiments.summarise``) of ``agents`` on ``cluster``."""
    spec = load_cluster(cluster)
    for warning in cluster_warnings(spec):
        print(f"warning: {warning}")
    summaries = run_modes(spec, agents, MODES)
    print(
        f"{cluster.name}: {len(agents)} agents, binding resource under basic: {summaries['basic']['binding_resource']}"
    )
    for mode, summary in summaries.items():
        read = summary["read_bytes_by_path"]
        print(
            f"  {mode:>9}: JCT {summary['jct_s']:7.1f} s, TTFT p50 {summary['ttft_s']['p50']:5.2f} s, "
            f"storage read {read.get('pe', 0) / 1e9:6.1f} GB on the PE side, {read.get('de', 0) / 1e9:6.1f} GB on the DE side"
        )
    gain = summaries["basic"]["jct_s"] / summaries["scheduler"]["jct_s"]
    print(f"  scheduler vs basic: {gain:.2f}x")
    return summaries


def main() -> int:
    agents = read_agent_trace(HERE / "agents.jsonl")
    slow = plan(HERE / "small_1p1d.toml", agents)
    plan(HERE / "small_1p1d_fast_storage.toml", agents)
    failures = []
    if slow["basic"]["read_bytes_by_path"].get("de", 0) != 0:
        failures.append("basic read through the decode side")
    if not slow["scheduler"]["read_bytes_by_path"].get("de", 0) > 0:
        failures.append("the scheduler read nothing through the decode side")
    gain = slow["basic"]["jct_s"] / slow["scheduler"]["jct_s"]
    if not gain >= MIN_GAIN:
        failures.append(f"the storage-bound cluster gained {gain:.2f}x < {MIN_GAIN}x")
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr)
        return 1
    print(f"the second read path pays where storage binds: {gain:.2f}x shorter job on small_1p1d.toml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
