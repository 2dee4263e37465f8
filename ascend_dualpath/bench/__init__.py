"""Benchmarks; each module exposes ``add_arguments(parser)`` and ``run(args) -> int`` for ``python -m ascend_dualpath bench``."""
