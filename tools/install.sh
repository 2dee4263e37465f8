#!/usr/bin/env bash
# Installs ascend_dualpath and what its tests need into the current Python environment.
# torch comes first and pinned to the CPU build on disk (torch==2.13.0) unless a torch is already
# installed, so nothing ever pulls a multi-GB CUDA build; the extension then builds against it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# one line per step on stderr, so a run in CI or piped to a file shows where it is
step() { echo "install.sh: [$1/3] $2" >&2; }
if ! "$PY" -c "import torch" 2>/dev/null; then
    step 1 "installing torch ${ADP_TORCH_VERSION:-2.13.0} (CPU build; a few minutes)..."
    "$PY" -m pip install -q "torch==${ADP_TORCH_VERSION:-2.13.0}"
else
    step 1 "torch already installed: $("$PY" -c "import torch; print(torch.__version__)")"
fi
step 2 "installing the build tools (pybind11, ninja, setuptools, wheel)..."
"$PY" -m pip install -q pybind11 ninja "setuptools>=64" wheel
log=$(mktemp)
step 3 "building the C++ extension and installing ascend_dualpath with its test extra (about 1-5 min; log $log)..."
if ! "$PY" -m pip install -v --no-build-isolation -e ".[test]" >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "install failed; full log: $log" >&2
    exit 1
fi
sed -n '/ascend_dualpath build summary/,/^ *$/p' "$log" | sed 's/^  //'
rm -f "$log"
echo "install.sh: done" >&2
