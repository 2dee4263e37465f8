#!/usr/bin/env bash
# Compiles the NPU host code (csrc/npu/*.cpp, with ADP_WITH_NPU defined) against the headers of the real
# torch_npu wheel that matches the installed torch, without CANN: a syntax and type check of every call
# into torch_npu, ACL and HCCL. It cannot link (no CANN libraries) and does not cover the AscendC kernels.
# It downloads nothing: tools/fetch_torch_npu_headers.sh fetches the headers first (exit 2 when they are missing).
#
#   tools/check_npu_host_compile.sh [cache-dir]   (default $ADP_TORCH_NPU_CACHE, else .cache/torch_npu)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
cache=${1:-${ADP_TORCH_NPU_CACHE:-.cache/torch_npu}}
torch_version=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")
include="$cache/$torch_version/torch_npu/include"
if [ ! -d "$include" ]; then
    echo "no torch_npu $torch_version headers in $cache; run tools/fetch_torch_npu_headers.sh first" >&2
    exit 2
fi
torch_includes=$("$PY" -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))")
python_include=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
abi=$("$PY" -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
status=0
for source in csrc/npu/*.cpp; do
    # shellcheck disable=SC2086
    if g++ -std=c++17 -fsyntax-only -DADP_WITH_NPU -D_GLIBCXX_USE_CXX11_ABI="$abi" $torch_includes -I"$python_include" \
        -I"$include" -I"$include/third_party/acl/inc" -I"$include/third_party/hccl/inc" -Icsrc -Iop_kernels/include \
        "$source"; then
        echo "ok: $source compiles against torch_npu $torch_version headers"
    else
        status=1
    fi
done
exit $status
