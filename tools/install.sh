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
log=$(mktemp)
if ! "$PY" -m pip install -v --no-build-isolation -e ".[test]" >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "install failed; full log: $log" >&2
    exit 1
fi
sed -n '/ascend_dualpath build summary/,/^ *$/p' "$log" | sed 's/^  //'
rm -f "$log"
