#!/usr/bin/env bash
# Downloads the torch_npu wheel that matches the installed torch from PyPI and keeps only its headers
# (torch_npu/include, the wheel itself is deleted), for tools/check_npu_host_compile.sh and
# tests/npu/test_npu_host_compile.py, which never download anything themselves.
#
#   tools/fetch_torch_npu_headers.sh [cache-dir]
#
# cache-dir: default $ADP_TORCH_NPU_CACHE, else .cache/torch_npu in the repository (ignored by git). The headers
# land in <cache-dir>/<torch version>/torch_npu/include; a second run with them present does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
cache=${1:-${ADP_TORCH_NPU_CACHE:-.cache/torch_npu}}
torch_version=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
target="$cache/$torch_version"
if [ -d "$target/torch_npu/include" ]; then
    echo "torch_npu $torch_version headers: $target/torch_npu/include (present)"
    exit 0
fi
download=$(mktemp -d)
trap 'rm -rf "$download"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$download" "torch-npu==$torch_version"
mkdir -p "$target"
"$PY" - "$target" "$download"/torch_npu-*.whl <<'PYEOF'
import sys
import zipfile

target, wheel = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as archive:
    archive.extractall(target, [name for name in archive.namelist() if name.startswith("torch_npu/include/")])
PYEOF
echo "torch_npu $torch_version headers: $target/torch_npu/include"
