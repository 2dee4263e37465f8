"""``python -m ascend_dualpath proxy (--prefill URL ... --decode URL ... | --cluster FILE) --port N``: the DualPath
proxy for vLLM over N PEs and M DEs.

See :mod:`ascend_dualpath.integrations.vllm.proxy` for what it sends where and its failure rules,
:mod:`~ascend_dualpath.integrations.vllm.cluster` for the instance syntax and the JSON file, and
:mod:`~ascend_dualpath.integrations.vllm.placement` for the placements.
"""

from __future__ import annotations

import argparse

from ascend_dualpath import _args, _env
from ascend_dualpath.integrations.vllm.cached_prefixes import DEFAULT_CAPACITY_BLOCKS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill", action="append", default=[], metavar="URL[,node=N][,kv=tcp://H:P]",
        help="a prefill (PE) instance, e.g. http://127.0.0.1:8100,node=n0 (repeat for more)",
    )  # fmt: skip
    parser.add_argument(
        "--decode", action="append", default=[], metavar="URL[,node=N][,group=G][,kv=tcp://H:P]",
        help="a decode (DE) instance, e.g. http://127.0.0.1:8200,node=n1,group=0 (repeat for more)",
    )  # fmt: skip
    parser.add_argument("--cluster", default=None, metavar="FILE", help="the instances as a JSON file (docs/vllm.md)")
    parser.add_argument("--port", type=_args.PORT, required=True, help="port the proxy listens on")
    parser.add_argument("--host", default="127.0.0.1", help="address the proxy listens on (default 127.0.0.1)")
    parser.add_argument("--prefill-kv", default="", metavar="tcp://H:P", help="side channel of the single PE")
    parser.add_argument("--decode-kv", default="", metavar="tcp://H:P", help="side channel of the single DE")
    parser.add_argument(
        "--placement", choices=["scheduler", "round-robin"], default="scheduler",
        help="scheduler = the paper's placement on the engines' live state (default); round-robin = the baseline",
    )  # fmt: skip
    parser.add_argument(
        "--policy", choices=["dual", "pe", "de"], default="dual",
        help="read path: dual = shorter storage read queue per request; pe / de force one",
    )  # fmt: skip
    parser.add_argument("--split", action="store_true", help="read each request's hits through both storage NICs")
    parser.add_argument("--alpha-tokens", type=_args.positive_int(10**9), default=None, metavar="T",
                        help="alpha: node read-queue threshold (default: the storage-NIC caps' 3 s of reads)")  # fmt: skip
    parser.add_argument("--beta-tokens", type=_args.positive_int(10**9), default=None, metavar="T",
                        help="beta: PE unfinished-token threshold (default: 5 s of a timed warm-up prefill)")  # fmt: skip
    parser.add_argument("--kv-bytes-per-token", type=_args.positive_int(1 << 30), default=None, metavar="B",
                        help="KV bytes of one token (all layers), for alpha from the storage-NIC caps")  # fmt: skip
    parser.add_argument("--compute-quota", type=_args.nonneg_float(3600.0), default=0.0, metavar="S",
                        help="hold requests to a PE over this predicted attention time (paper: 0.3; default 0 = off)")  # fmt: skip
    parser.add_argument("--cached-capacity-blocks", type=_args.positive_int(1 << 32), default=DEFAULT_CAPACITY_BLOCKS, metavar="N",
                        help="KV blocks the proxy's estimate of the store's hits remembers, least recently used out "
                        "(default %(default)s)")  # fmt: skip
    parser.add_argument(
        "--timeout", type=_args.TIMEOUT_S, default=None, metavar="S",
        help="bound of every upstream wait and of a request's wait for an engine (default ADP_TIMEOUT_S or 30)",
    )  # fmt: skip
    parser.add_argument(
        "--startup-timeout", type=_args.TIMEOUT_S, default=300.0, metavar="S",
        help="how long measuring alpha/beta waits for the instances to answer /health (default 300)",
    )  # fmt: skip
    parser.add_argument(
        "--side-token-file", default=None, metavar="FILE",
        help="the deployment token of the instances' side channels (default: ADP_SIDE_TOKEN; none: loopback only)",
    )  # fmt: skip
    parser.add_argument(
        "--status-timeout", type=_args.TIMEOUT_S, default=1.0, metavar="S",
        help="bound of one side-channel status or /metrics query (default 1 s; no answer = pe path)",
    )  # fmt: skip


def _cluster(args: argparse.Namespace):
    from ascend_dualpath.errors import ConfigError
    from ascend_dualpath.integrations.vllm.cluster import cluster_from_flags, load_cluster

    if args.cluster and (args.prefill or args.decode):
        raise ConfigError("give either --cluster FILE or --prefill / --decode flags, not both")
    if args.cluster:
        return load_cluster(args.cluster)
    single = len(args.prefill) == len(args.decode) == 1
    if (args.prefill_kv or args.decode_kv) and not single:
        raise ConfigError(
            "--prefill-kv / --decode-kv name the side channels of a single PE and DE; use kv= per instance"
        )
    return cluster_from_flags(
        [f"{u},kv={args.prefill_kv}" if args.prefill_kv else u for u in args.prefill],
        [f"{u},kv={args.decode_kv}" if args.decode_kv else u for u in args.decode],
    )


def run(args: argparse.Namespace) -> int:
    import asyncio
    import dataclasses

    from ascend_dualpath.dualpath.side_channel import load_token
    from ascend_dualpath.integrations.vllm.proxy import ProxyConfig, run_proxy
    from ascend_dualpath.integrations.vllm.thresholds import measure_thresholds

    cfg = ProxyConfig(
        cluster=_cluster(args), policy=args.policy, placement=args.placement, split=args.split,
        alpha_tokens=args.alpha_tokens, beta_tokens=args.beta_tokens, compute_quota_s=args.compute_quota,
        timeout_s=args.timeout if args.timeout is not None else _env.timeout_s(), status_timeout_s=args.status_timeout,
        cached_capacity_blocks=args.cached_capacity_blocks, side_token=load_token(args.side_token_file, "--side-token-file"),
    )  # fmt: skip
    how = "thresholds not used by round-robin"
    if cfg.placement == "scheduler":
        alpha, beta, how = asyncio.run(
            measure_thresholds(cfg, args.kv_bytes_per_token, startup_timeout_s=args.startup_timeout)
        )
        cfg = dataclasses.replace(cfg, alpha_tokens=alpha, beta_tokens=beta)
    instances = ", ".join(f"{i.name} {i.url} ({i.kv}, node {i.node})" for i in cfg.cluster.instances)
    print(f"proxy on http://{args.host}:{args.port} -> {instances}; placement {cfg.placement}, policy "
          f"{cfg.policy}, split {cfg.split}; {how}", flush=True)  # fmt: skip
    run_proxy(cfg, args.host, args.port)
    return 0
