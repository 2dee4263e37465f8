"""``python -m ascend_dualpath serve --model DIR [--prefill N --decode M] [options] [-- vllm serve args...]``: N PEs,
M DEs and the proxy; ``serve --role prefill|decode --model DIR --host ADDR --port N --kv-port P --engine mooncake
--store DIR [--node NAME] [--snic-mbps X] [-- VLLM_ARGS]``: one instance of a deployment across machines.

See :mod:`ascend_dualpath.integrations.vllm.serve` for what starts, the CPU defaults and the clean-up.
"""

from __future__ import annotations

import argparse

from ascend_dualpath import _args, _env

SNIC_MBPS = _args.positive_float(1e7)  # a storage-NIC cap, MB/s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="model directory (e.g. from make-tiny-model)")
    parser.add_argument(
        "--port",
        type=_args.PORT,
        default=8000,
        help="the proxy's port; with --role this instance's HTTP port (default 8000)",
    )
    parser.add_argument(
        "--role", choices=["prefill", "decode"], default=None,
        help="start one instance of a deployment across machines (no proxy; docs/vllm.md, 'Across machines')",
    )  # fmt: skip
    parser.add_argument(
        "--host", default="127.0.0.1", metavar="ADDR",
        help="with --role: the IPv4 address the instance's HTTP API, side channel and Mooncake bind (default 127.0.0.1)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-port", type=_args.PORT, default=None, metavar="P", help="with --role: the side channel's port"
    )
    parser.add_argument(
        "--engine", default="emulator", metavar="ENGINE",
        help="what moves the KV between a PE and a DE: emulator (one host, default), mooncake (any hosts) or cuda "
        "(processes on GPUs of one host)",
    )  # fmt: skip
    parser.add_argument("--node", default=None, metavar="NAME", help="with --role: the storage NIC's name in metrics")
    parser.add_argument(
        "--side-token-file", default=None, metavar="FILE",
        help="with --role: the deployment token, the same on every host and the proxy (default ADP_SIDE_TOKEN)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill", type=_args.positive_int(64), default=1, metavar="N", help="prefill (PE) instances (default 1)"
    )
    parser.add_argument(
        "--decode", type=_args.positive_int(64), default=1, metavar="M", help="decode (DE) instances (default 1)"
    )
    parser.add_argument(
        "--nodes", type=_names, default=(), metavar="A,B,...",
        help="node of each instance, PEs then DEs (default: each its own); a node's instances share its read queue",
    )  # fmt: skip
    parser.add_argument(
        "--decode-groups",
        type=_args.NumberList(_args.nonneg_int(1023)),
        default=(),
        metavar="G,G,...",
        help="DE group of each DE (default 0)",
    )
    parser.add_argument(
        "--node-snic-mbps", action="append", type=_snic_cap, default=[], metavar="NODE=X",
        help="storage-NIC cap of the instances on NODE in MB/s (repeat per node; others get --snic-mbps)",
    )  # fmt: skip
    parser.add_argument(
        "--instance-args", action="append", type=_assignment, default=[], metavar="NAME=ARGS",
        help="vLLM arguments for one instance (e.g. decode1='--num-gpu-blocks-override 8'), after the common ones",
    )  # fmt: skip
    parser.add_argument(
        "--layout", default=None, metavar="FILE",
        help="nodes, groups, caps and vLLM arguments per instance as JSON (docs/vllm.md); gives the counts too",
    )  # fmt: skip
    parser.add_argument("--placement", choices=["scheduler", "round-robin"], default="scheduler",
                        help="the proxy's placement (default scheduler)")  # fmt: skip
    parser.add_argument("--split", action="store_true", help="read each request's hits through both storage NICs")
    parser.add_argument(
        "--alpha-tokens", type=_args.positive_int(10**9), default=None, metavar="T", help="the proxy's alpha (tokens)"
    )
    parser.add_argument(
        "--beta-tokens", type=_args.positive_int(10**9), default=None, metavar="T", help="the proxy's beta (tokens)"
    )
    parser.add_argument("--compute-quota", type=_args.nonneg_float(3600.0), default=0.0, metavar="S",
                        help="the proxy's PE compute quota in seconds (default 0 = off)")  # fmt: skip
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
        type=SNIC_MBPS,
        default=None,
        metavar="X",
        help="storage-NIC cap of each instance in MB/s (default: uncapped)",
    )
    parser.add_argument(
        "--block-size",
        type=_args.positive_int(1 << 16),
        default=32,
        help="vLLM block size (multiple of 32; default 32)",
    )
    parser.add_argument(
        "--timeout",
        type=_args.TIMEOUT_S,
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
        type=_args.TIMEOUT_S,
        default=300.0,
        metavar="S",
        help="how long every part may take to answer /health (default 300)",
    )
    parser.add_argument(
        "--log-dir", default=None, metavar="DIR",
        help="where each part's log goes, kept after exit "
        "(default: a new directory under $XDG_STATE_HOME or ~/.local/state/ascend_dualpath/serve, printed at start)",
    )  # fmt: skip
    parser.add_argument(
        "vllm_args",
        nargs="*",
        metavar="-- VLLM_ARGS",
        help="arguments after -- go to every vllm serve process unchanged",
    )


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(","))


def _assignment(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


def _snic_cap(text: str) -> tuple[str, float]:
    """NODE=X with X a storage-NIC cap in MB/s, bounded as ``--snic-mbps``."""
    node, value = _assignment(text)
    return node, SNIC_MBPS(value)


def run(args: argparse.Namespace) -> int:
    import shlex

    from ascend_dualpath.integrations.vllm.serve import ServeOptions, serve

    caps = dict(args.node_snic_mbps)
    opts = ServeOptions(
        model=args.model, port=args.port, policy=args.policy, store=args.store, snic_mbps=args.snic_mbps,
        block_size=args.block_size, timeout_s=args.timeout if args.timeout is not None else _env.timeout_s(),
        startup_timeout_s=args.startup_timeout, vllm_args=tuple(args.vllm_args),
        load_failure_policy=args.on_load_failure, prefill=args.prefill, decode=args.decode, nodes=args.nodes,
        decode_groups=args.decode_groups, node_snic_mbps=caps,
        instance_args={name: tuple(shlex.split(value)) for name, value in args.instance_args}, layout=args.layout,
        placement=args.placement, split=args.split, alpha_tokens=args.alpha_tokens, beta_tokens=args.beta_tokens,
        compute_quota_s=args.compute_quota, log_dir=args.log_dir, engine=args.engine, role=args.role, host=args.host,
        kv_port=args.kv_port, node=args.node, side_token_file=args.side_token_file,
    )  # fmt: skip
    return serve(opts)
