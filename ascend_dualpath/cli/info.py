"""``python -m ascend_dualpath info``: version, torch, each backend's availability, the emulated device."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--product", choices=["A2", "A3"], default=None, help="emulated product (default A2 or ADP_EMU_PRODUCT)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def collect(product: str | None = None) -> dict:
    import torch

    from ascend_dualpath import _ext
    from ascend_dualpath.backends import Backend, capabilities
    from ascend_dualpath.version import __version__

    report = {
        "ascend_dualpath": __version__,
        "torch": torch.__version__,
        "compiled_backends": list(_ext.compiled_backends()),
        "backends": {},
    }
    for backend in Backend:
        caps = capabilities(backend)
        report["backends"][backend.value] = {
            "available": caps.available,
            "reason": caps.reason,
            "transfer_kinds": list(caps.transfer_kinds),
            "collectives": caps.collective_backend,
        }
    if report["backends"]["emulator"]["available"]:
        from ascend_dualpath.backends import emulator

        report["emulated_device"] = emulator.device_profile_summary(product)
    return report


def run(args: argparse.Namespace) -> int:
    report = collect(args.product)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"ascend_dualpath {report['ascend_dualpath']}  (torch {report['torch']}; "
        f"compiled: {', '.join(report['compiled_backends']) or 'nothing'})"
    )
    print("backends:")
    for name, b in report["backends"].items():
        state = "available  " if b["available"] else "unavailable"
        kinds = f"  [{', '.join(b['transfer_kinds'])}; {b['collectives']}]" if b["available"] else ""
        print(f"  {name:<9} {state}  {b['reason']}{kinds}")
    if "emulated_device" in report:
        print("emulated device profile:")
        for key, value in report["emulated_device"].items():
            print(f"  {key:<18} {value}")
    return 0
