"""Multi-turn agents through a 2 PE x 2 DE deployment on real vLLM (CPU): round-robin placement vs the scheduler
vs the scheduler with request splitting, on an even and a skewed load, in one run.

    python3 tools/bench_vllm_cluster.py [--agents 8] [--turns 3] [--snic-mbps 1.5] [--slow-node pe0] [--out r.json]

Each agent opens with a long prompt and appends a short message per turn, so later turns are almost all storage
hits. Every instance's storage NIC is capped (``--snic-mbps``) so reads bind; on the skewed load one node's cap
(``--slow-node``) is ``--skew`` times lower, so the same bytes keep it busier. Per deployment: job completion time
(all agents, all turns), TTFT p50, each node's storage-NIC utilisation (bytes it read / (its cap x the job
completion time)) with max/avg over the nodes, and how many turns' greedy text equals a plain vLLM server's (no
connector, one agent at a time): informational, since vLLM's CPU kernels are batch-variant and the agents run
concurrently (token identity is tested one request at a time in tests/integrations/vllm).

Round robin sends requests to the PEs and DEs in turn and picks the read path by the shorter queue (so placement
is the only difference from the scheduler); the scheduler is the library's, in the proxy, on live status.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_vllm_serving import (
    ENV,
    ROOT,
    _stop,
    _stream,
    _wait,
    add_workload_arguments,
    conversations,
    model_dir,
    plain_server,
    run_agents,
)

DEPLOYMENTS = {  # name -> serve arguments
    "round-robin": ["--placement", "round-robin"],
    "scheduler": ["--placement", "scheduler"],
    "scheduler+split": ["--placement", "scheduler", "--split"],
}
NODES = ("pe0", "pe1", "de0", "de1")


def node_caps(args, skewed: bool) -> dict[str, float]:
    """Storage-NIC cap of each node in MB/s."""
    caps = dict.fromkeys(NODES, args.snic_mbps)
    if skewed:
        caps[args.slow_node] = args.snic_mbps / args.skew
    return caps


def bench_deployment(model: str, extra: list[str], caps: dict[str, float], args, port: int, convs) -> dict:
    """Start ``serve --prefill 2 --decode 2`` with ``extra``, run the agents, read the nodes' storage-NIC bytes."""
    import urllib.request

    with tempfile.TemporaryDirectory(prefix="adp-bench-cluster-") as tmp:
        argv = [
            sys.executable, "-m", "ascend_dualpath", "serve", "--model", model, "--port", str(port),
            "--prefill", "2", "--decode", "2", "--snic-mbps", str(args.snic_mbps),
            *(f"--node-snic-mbps={node}={cap}" for node, cap in caps.items()),
            "--store", f"{tmp}/store", "--timeout", "300", "--startup-timeout", "900", *extra,
        ]  # fmt: skip
        with open(f"{tmp}/serve.log", "w") as log:
            proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **ENV}, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            _wait(f"{url}/health", proc, f"{tmp}/serve.log")

            async def target(session, body):
                text, ttft, _ = await _stream(session, f"{url}/v1/completions", body)
                return text, ttft

            result = asyncio.run(run_agents(target, model, convs, args.gen))
            metrics = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
            decisions = json.loads(urllib.request.urlopen(f"{url}/debug/decisions", timeout=30).read())
        except BaseException:  # the deployment's own account of what broke goes before the temporary dir does
            sys.stderr.write("".join(Path(f"{tmp}/serve.log").read_text(errors="replace").splitlines(True)[-80:]))
            raise
        finally:
            _stop(proc)
    read = snic_read_bytes(metrics)
    util = {node: read.get(node, 0.0) / (caps[node] * 1e6 * result["jct_s"]) for node in caps}
    mean = sum(util.values()) / len(util)
    result.update(snic_read_bytes=read, snic_util=util, util_max_avg=max(util.values()) / mean if mean else 0.0)
    result["decisions"] = len(decisions)
    return result


def snic_read_bytes(metrics: str) -> dict[str, float]:
    """``adp_snic_read_bytes`` per node from the proxy's Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        s.labels["node"]: s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name == "adp_snic_read_bytes" and "node" in s.labels
    }


def plain_reference(model: str, port: int, convs, gen: int) -> list[list[str]]:
    """Greedy texts of one plain vLLM server, one agent at a time (vLLM's CPU output is batch-variant)."""
    with plain_server(model, port) as target:
        return [asyncio.run(run_agents(target, model, [c], gen))["texts"][0] for c in convs]


def report(results: dict, reference: list[list[str]], args) -> None:
    turns = args.agents * args.turns
    print(f"2 PE x 2 DE, {args.agents} agents x {args.turns} turns, storage NICs {args.snic_mbps} MB/s "
          f"(skewed: {args.slow_node} at 1/{args.skew:g})")  # fmt: skip
    print(f"{'load':<8}{'deployment':<17}{'JCT s':>8}{'TTFT p50':>10}{'max/avg':>9}  util pe0/pe1/de0/de1  text")
    for load, by_name in results.items():
        for name, r in by_name.items():
            same = sum(a == b for x, y in zip(r["texts"], reference, strict=True) for a, b in zip(x, y, strict=True))
            util = "/".join(f"{r['snic_util'][n]:.2f}" for n in NODES)
            print(f"{load:<8}{name:<17}{r['jct_s']:>8.1f}{r['ttft_p50_s']:>10.2f}{r['util_max_avg']:>9.2f}  "
                  f"{util:<21}{same}/{turns}")  # fmt: skip
        base = by_name["scheduler"]["jct_s"]
        print(f"{load:<8}split vs scheduler: {base / by_name['scheduler+split']['jct_s']:.2f}x job completion time")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(parser, agents=8, turns=3, gen=8, snic_mbps=1.5)
    parser.add_argument("--slow-node", default="pe0", choices=NODES, help="the node whose cap the skew lowers")
    parser.add_argument("--skew", type=float, default=4.0, help="how many times lower its cap is on the skewed load")
    parser.add_argument("--loads", default="even,skewed", help="which loads to run (even, skewed)")
    args = parser.parse_args()
    with model_dir(args.model) as model:
        return run(args, model)


def run(args, model: str) -> int:
    from ascend_dualpath.integrations.vllm.serve import pick_instance_ports

    convs = conversations(model, args.agents, args.turns, args.opening, args.append)
    loads = [load.strip() for load in args.loads.split(",")]
    ports = iter(pick_instance_ports(1 + len(loads) * len(DEPLOYMENTS)))
    reference = plain_reference(model, next(ports), convs, args.gen)
    results: dict[str, dict] = {}
    for load in loads:
        caps = node_caps(args, skewed=load == "skewed")
        results[load] = {
            name: bench_deployment(model, extra, caps, args, next(ports), convs) for name, extra in DEPLOYMENTS.items()
        }
    report(results, reference, args)
    if args.out:
        strip = {load: {n: {k: v for k, v in r.items() if k != "texts"} for n, r in by.items()}
                 for load, by in results.items()}  # fmt: skip
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": strip}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
