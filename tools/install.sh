#!/usr/bin/env bash
# Installs ascend_dualpath and what its tests need into the current Python environment.
# torch comes first and pinned to the CPU build on disk (torch==2.13.0) unless a torch is already
# installed, so nothing ever pulls a multi-GB CUDA build; the extension then builds against it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==${ADP_TORCH_VERSION:-2.13.0}"
fi
"$PY" -m pip install -q pybind11 ninja "setuptools>=64" wheel
"$PY" -m pip install -q --no-build-isolation -e ".[test]"
