"""``python -m ascend_dualpath make-tiny-model DIR``: a tiny random Llama that ``vllm serve DIR`` loads offline."""

from __future__ import annotations

import argparse

from ascend_dualpath import _args
from ascend_dualpath.models.tiny_hf import TinyHFConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TinyHFConfig()
    parser.add_argument("directory", help="where to write the model (created if missing)")
    parser.add_argument("--seed", type=_args.SEED, default=defaults.seed, help=f"weight seed (default {defaults.seed})")
    parser.add_argument(
        "--layers",
        type=_args.positive_int(64),
        default=defaults.num_layers,
        help=f"decoder layers (default {defaults.num_layers})",
    )
    parser.add_argument(
        "--kv-heads",
        type=_args.positive_int(defaults.num_heads),
        default=defaults.num_kv_heads,
        help=f"KV heads, dividing the {defaults.num_heads} attention heads (default {defaults.num_kv_heads}; 1 with "
        "--tensor-parallel-size 2: vLLM replicates the head on both ranks)",
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default=defaults.dtype,
        help=f"weight dtype (default {defaults.dtype}: the faster one on vLLM's CPU backend)",
    )


def run(args: argparse.Namespace) -> int:
    from ascend_dualpath.models.tiny_hf import make_tiny_model

    cfg = TinyHFConfig(seed=args.seed, num_layers=args.layers, num_kv_heads=args.kv_heads, dtype=args.dtype)
    out = make_tiny_model(args.directory, cfg)
    print(
        f"tiny Llama ({cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_kv_heads} KV heads, vocab "
        f"{cfg.vocab_size}, {cfg.dtype}) "
        f"written to {out}"
    )
    return 0
