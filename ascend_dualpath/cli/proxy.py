"""``python -m ascend_dualpath proxy --prefill URL --decode URL --port N``: the DualPath proxy for vLLM.

See :mod:`ascend_dualpath.integrations.vllm.proxy` for what it sends where, and its failure rules.
"""

from __future__ import annotations

import argparse

from ascend_dualpath import _env


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill", required=True, metavar="URL", help="prefill (PE) instance, e.g. http://127.0.0.1:8100"
    )
    parser.add_argument(
        "--decode", required=True, metavar="URL", help="decode (DE) instance, e.g. http://127.0.0.1:8200"
    )
    parser.add_argument("--port", type=int, required=True, help="port the proxy listens on")
    parser.add_argument("--host", default="127.0.0.1", help="address the proxy listens on (default 127.0.0.1)")
    parser.add_argument(
        "--prefill-kv",
        default="",
        metavar="tcp://H:P",
        help="PE side channel (default: the prefill URL's host, port + 100)",
    )
    parser.add_argument(
        "--decode-kv",
        default="",
        metavar="tcp://H:P",
        help="DE side channel (default: the decode URL's host, port + 100)",
    )
    parser.add_argument(
        "--policy",
        choices=["dual", "pe", "de"],
        default="dual",
        help="read path: dual = shorter storage read queue per request; pe / de force one",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="bound of every upstream wait in seconds (default ADP_TIMEOUT_S or 30)",
    )
    parser.add_argument(
        "--status-timeout",
        type=float,
        default=1.0,
        metavar="S",
        help="bound of one side-channel status query (default 1 s; no answer = pe path)",
    )


def run(args: argparse.Namespace) -> int:
    from ascend_dualpath.integrations.vllm.proxy import ProxyConfig, run_proxy

    cfg = ProxyConfig(
        prefill_url=args.prefill,
        decode_url=args.decode,
        prefill_kv=args.prefill_kv,
        decode_kv=args.decode_kv,
        policy=args.policy,
        timeout_s=args.timeout if args.timeout is not None else _env.timeout_s(),
        status_timeout_s=args.status_timeout,
    )
    print(
        f"proxy on http://{args.host}:{args.port} -> prefill {cfg.prefill_url} ({cfg.prefill_kv}), "
        f"decode {cfg.decode_url} ({cfg.decode_kv}), policy {cfg.policy}",
        flush=True,
    )
    run_proxy(cfg, args.host, args.port)
    return 0
