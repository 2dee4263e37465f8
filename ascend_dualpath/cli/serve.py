"""``python -m ascend_dualpath serve --model DIR [options] [-- vllm serve args...]``: PE + DE + proxy.

See :mod:`ascend_dualpath.integrations.vllm.serve` for what starts, the CPU defaults and the clean-up.
"""

from __future__ import annotations

import argparse

from ascend_dualpath import _env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="model directory (e.g. from make-tiny-model)")
    parser.add_argument("--port", type=int, default=8000, help="the proxy's port (default 8000)")
    parser.add_argument(
        "--policy",
        choices=["dual", "pe", "de"],
        default="dual",
        help="read path: dual = shorter storage read queue per request; pe / de force one",
    )
    parser.add_argument(
        "--store",
        default=None,
        metavar="DIR",
        help="block-store directory, kept afterwards (default: a temporary one, removed at exit)",
    )
    parser.add_argument(
        "--snic-mbps",
        type=float,
        default=None,
        metavar="X",
        help="storage-NIC cap of each instance in MB/s (default: uncapped)",
    )
    parser.add_argument("--block-size", type=int, default=32, help="vLLM block size (multiple of 32; default 32)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="bound of every wait in the connectors and the proxy (default ADP_TIMEOUT_S or 30)",
    )
    parser.add_argument(
        "--on-load-failure",
        choices=["recompute", "fail"],
        default="recompute",
        help="vLLM's kv_load_failure_policy: a KV load that fails is recomputed (default) or fails its request",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="how long every part may take to answer /health (default 300)",
    )
    parser.add_argument(
        "vllm_args",
        nargs="*",
        metavar="-- VLLM_ARGS",
        help="arguments after -- go to both vllm serve processes unchanged",
    )


def run(args: argparse.Namespace) -> int:
    from ascend_dualpath.integrations.vllm.serve import ServeOptions, serve

    opts = ServeOptions(
        model=args.model, port=args.port, policy=args.policy, store=args.store, snic_mbps=args.snic_mbps,
        block_size=args.block_size, timeout_s=args.timeout if args.timeout is not None else _env.timeout_s(),
        startup_timeout_s=args.startup_timeout, vllm_args=tuple(args.vllm_args),
        load_failure_policy=args.on_load_failure,
    )  # fmt: skip
    return serve(opts)
