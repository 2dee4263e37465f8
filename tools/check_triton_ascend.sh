#!/usr/bin/env bash
# Lowers the MoE dispatch_layout Triton kernel for Ascend (triton-ascend 3.2.0 + ascendnpu-ir 1.2.0) through
# Triton IR -> linalg -> HFusion/HIVM up to CANN's hivmc, which needs a CANN install. Nothing runs on an NPU.
#
#   tools/check_triton_ascend.sh            # uses $ADP_TRITON_ASCEND_PYTHON, else .cache/triton-ascend/bin/python
#   tools/check_triton_ascend.sh --setup    # makes that repo-local venv first (pip, --no-deps, from PyPI)
#
# The packages bring their own `triton` (and triton-ascend's driver imports torch_npu lazily), so they live in a
# venv of their own, never in the Python that runs the project. Exit 0: the pipeline reached hivmc; 3: the
# packages are not installed (callers skip).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.cache/triton-ascend
if [ "${1:-}" = --setup ]; then
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --no-deps "triton-ascend==3.2.0" "ascendnpu-ir==1.2.0" pybind11
fi
PY=${ADP_TRITON_ASCEND_PYTHON:-$venv/bin/python}
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "no Python with triton-ascend at $PY (set ADP_TRITON_ASCEND_PYTHON or run $0 --setup)" >&2
    exit 3
fi
versions=$("$PY" -c "from importlib.metadata import version as v; print(v('triton-ascend'), v('ascendnpu-ir'))" \
    2>/dev/null) || { echo "$PY lacks triton-ascend or ascendnpu-ir" >&2; exit 3; }
if [ "$versions" != "3.2.0 1.2.0" ]; then
    echo "need triton-ascend 3.2.0 and ascendnpu-ir 1.2.0, $PY has: $versions" >&2
    exit 3
fi
bin=$("$PY" -c "import ascendnpuir, os; print(os.path.join(os.path.dirname(ascendnpuir.__file__), 'bin'))")
echo "triton-ascend / ascendnpu-ir: $versions"
env -u ASCEND_HOME_PATH PATH="$bin:$PATH" "$PY" tools/triton_ascend_lower.py ascend_dualpath/ops/_layout_kernel.py
