#!/usr/bin/env bash
# Installs ascend_dualpath and what its tests need into the current Python environment.
# torch comes first and pinned to the CPU build on disk (torch==2.13.0) unless a torch is already
# installed, so nothing ever pulls a multi-GB CUDA build; the extension then builds against it.
# ADP_EXTRAS=mooncake (comma-separated extras) adds optional parts: `mooncake` installs the CPU wheel of the
# Mooncake Transfer Engine and, where missing, the Debian libraries it links even for TCP (docs/mooncake.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# one line per step on stderr, so a run in CI or piped to a file shows where it is
step() { echo "install.sh: [$1/3] $2" >&2; }
EXTRAS=test${ADP_EXTRAS:+,$ADP_EXTRAS}
# Mooncake's engine.so needs libibverbs.so.1 and libnl-route-3.so.200 (no RDMA NIC needed for TCP)
if [[ ",$EXTRAS," == *",mooncake,"* ]] && ! { ldconfig -p | grep -q libibverbs.so.1 && ldconfig -p | grep -q libnl-route-3.so.200; }; then
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
        echo "install.sh: the mooncake extra needs libibverbs1 and libnl-route-3-200: install them as root (apt-get install -y libibverbs1 libnl-route-3-200)" >&2
        exit 1
    fi
    echo "install.sh: installing libibverbs1 and libnl-route-3-200 for Mooncake..." >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq libibverbs1 libnl-route-3-200 >/dev/null 2>&1 ||
        { apt-get update -qq >/dev/null && apt-get install -y -qq libibverbs1 libnl-route-3-200 >/dev/null; }
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
    step 1 "installing torch ${ADP_TORCH_VERSION:-2.13.0} (CPU build; a few minutes)..."
    "$PY" -m pip install -q "torch==${ADP_TORCH_VERSION:-2.13.0}"
else
    step 1 "torch already installed: $("$PY" -c "import torch; print(torch.__version__)")"
fi
step 2 "installing the build tools (pybind11, ninja, setuptools, wheel)..."
"$PY" -m pip install -q pybind11 ninja "setuptools>=64" wheel
log=$(mktemp)
step 3 "building the C++ extension and installing ascend_dualpath with the extras $EXTRAS (about 1-5 min; log $log)..."
if ! "$PY" -m pip install -v --no-build-isolation -e ".[$EXTRAS]" >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "install failed; full log: $log" >&2
    exit 1
fi
sed -n '/ascend_dualpath build summary/,/^ *$/p' "$log" | sed 's/^  //'
rm -f "$log"
echo "install.sh: done" >&2
