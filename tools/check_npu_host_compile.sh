#!/usr/bin/env bash
# Compiles the NPU host code (csrc/npu/*.cpp, with ADP_WITH_NPU defined) against the headers of the real
# torch_npu wheel, without CANN: a syntax and type check of every call into torch_npu, ACL and HCCL. It cannot
# link (no CANN libraries) and does not cover the AscendC kernels. It downloads nothing:
# tools/fetch_torch_npu_headers.sh fetches the headers first (exit 2 when they are missing).
#
#   tools/check_npu_host_compile.sh [cache-dir]
#
# Headers, first found: $ADP_TORCH_NPU_INCLUDE (a torch_npu/include directory), else
# <cache-dir>/<version>/torch_npu/include with cache-dir defaulting to $ADP_TORCH_NPU_CACHE, else the repo-local,
# git-ignored .cache/torch_npu. <version> is $ADP_TORCH_NPU_VERSION, else the installed torch's.
# $ADP_NPU_HOST_SOURCES (space-separated files) replaces csrc/npu/*.cpp (the test plants a violation this way).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
version=${ADP_TORCH_NPU_VERSION:-$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")}
if [ -n "${ADP_TORCH_NPU_INCLUDE:-}" ]; then
    include=$ADP_TORCH_NPU_INCLUDE
else
    cache=${1:-${ADP_TORCH_NPU_CACHE:-.cache/torch_npu}}
    include="$cache/$version/torch_npu/include"
    if [ ! -d "$include" ]; then
        echo "no torch_npu $version headers at $include; run tools/fetch_torch_npu_headers.sh first" >&2
        exit 2
    fi
fi
if [ ! -f "$include/torch_npu/csrc/framework/OpCommand.h" ]; then
    echo "$include is not a torch_npu include directory (no torch_npu/csrc/framework/OpCommand.h)" >&2
    exit 2
fi
torch_includes=$("$PY" -c "import torch.utils.cpp_extension as c; print(' '.join('-isystem ' + p for p in c.include_paths()))")
python_include=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
pybind_include=$("$PY" -c "import pybind11; print(pybind11.get_include())" 2>/dev/null || true)
abi=$("$PY" -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
status=0
# shellcheck disable=SC2206
sources=(${ADP_NPU_HOST_SOURCES:-csrc/npu/*.cpp})
for source in "${sources[@]}"; do
    # shellcheck disable=SC2086
    if g++ -std=c++17 -fsyntax-only -Wall -Werror=return-type -DADP_WITH_NPU -D_GLIBCXX_USE_CXX11_ABI="$abi" \
        $torch_includes -isystem "$python_include" ${pybind_include:+-isystem "$pybind_include"} -isystem "$include" \
        -isystem "$include/third_party/acl/inc" -isystem "$include/third_party/hccl/inc" -Icsrc -Iop_kernels/include \
        "$source"; then
        echo "ok: $source compiles against torch_npu $version headers ($include)"
    else
        status=1
    fi
done
exit $status
