"""Microbenchmarks, one module per area, each with ``add_arguments(parser)`` and ``run(args) -> int``.

Benchmarks measure; tests never assert on time. Every published figure comes from one of these
modules and is recorded in ``docs/benchmarks.md`` with its command, hardware and date.
"""

BENCHES = {
    "emulator": ("ascend_dualpath.bench.emulator", "emulated NIC: WQE rate per SQ and copy bandwidth vs memcpy"),
    "transfer": ("ascend_dualpath.bench.transfer", "three-way layer-block transfer (aiv / aicpu / staging / host)"),
    "moe": ("ascend_dualpath.bench.moe", "MoE dispatch/combine against the all-to-all baseline"),
}
