#!/usr/bin/env bash
# Strict device-rule check of the AscendC kernels, without CANN: each kernel is compiled (syntax only)
# against op_kernels/check/include, declarations written from the documented AscendC signatures, by
# clang standing in for bisheng's device pass:
#   1. CUDA device mode, __aicore__ = the device attribute: an __aicore__ function may call only
#      __aicore__ functions (a plain inline helper called from a kernel is an error);
#   2. C++ mode, __gm__ = address_space(1): a GM pointer is not a plain pointer, and a struct in GM is
#      read field by field, not copied out with its (generic address space) copy constructor;
#   3. on the preprocessed kernel: a kernel that calls SyncAll declares
#      KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIV_1_0), and device code holds no lambda.
# Both compiles force-include op_kernels/check/builtins.h (bisheng's half/bfloat16_t; double, _Float16
# and __builtin_mem* poisoned) and run with -Werror (deprecated Hccl::Init/SetCcTiling fail).
#
# -Wno-undefined-internal: the declarations are never defined, and Hccl's DEFAULT_CFG (static constexpr,
# as in the real header) gives its members internal linkage.
# op_kernels/emu/emu_probe.cpp (the emulator's self-test kernel, never built for the device) is checked
# from a copy in a temporary directory: beside it, its quoted includes would find the emulator's
# kernel_operator.h instead of the declarations.
#
#   tools/check_ascendc.sh [kernel.cpp ...]     default: every kernel under op_kernels/
#   CLANG=clang-14 (default), ADP_CHECK_EXTRA_INCLUDE=<dir> adds an include directory (tests)
set -euo pipefail
cd "$(dirname "$0")/.."
clang=${CLANG:-clang-14}
if ! command -v "$clang" >/dev/null; then
    echo "check_ascendc: $clang not found (apt-get install -y clang-14)" >&2
    exit 2
fi
if [ "$#" -eq 0 ]; then
    set -- op_kernels/*/op_kernel/*.cpp op_kernels/emu/emu_probe.cpp
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
include=(-Iop_kernels/check/include -Iop_kernels/include)
if [ -n "${ADP_CHECK_EXTRA_INCLUDE:-}" ]; then include+=(-I"$ADP_CHECK_EXTRA_INCLUDE"); fi
common=(-std=c++17 -fsyntax-only -Werror -Wno-undefined-internal -D__CCE_AICORE__=220 -DADP_ASCENDC_CHECK -D__global__=
        -include op_kernels/check/builtins.h "${include[@]}")
cuda=(-x cuda --cuda-device-only -nocudainc -nocudalib --cuda-gpu-arch=sm_70 -Wno-unknown-cuda-version
      '-D__aicore__=__attribute__((device))' -D__gm__=)
cxx=(-x c++ -D__aicore__= '-D__gm__=__attribute__((address_space(1)))')

status=0
for kernel in "$@"; do
    ok=1
    source=$kernel
    if [ "$(dirname "$kernel")" = op_kernels/emu ]; then
        source=$scratch/$(basename "$kernel")
        cp "$kernel" "$source"
    fi
    "$clang" "${common[@]}" "${cuda[@]}" "$source" || { echo "FAIL (call rule): $kernel"; ok=0; }
    "$clang" "${common[@]}" "${cxx[@]}" "$source" || { echo "FAIL (address spaces): $kernel"; ok=0; }
    if pre=$("$clang" "${common[@]/-fsyntax-only/-E}" "${cxx[@]}" -P "$source" 2>/dev/null); then
        # a call, not the declaration `void SyncAll();`
        if grep -Pq '(?<!void )\bSyncAll\s*(<[^>]*>)?\s*\(\s*\)\s*;' <<<"$pre" &&
            ! grep -q 'adp_check_kernel_task_type(KERNEL_TYPE_MIX_AIV_1_0)' <<<"$pre"; then
            echo "$kernel: calls SyncAll without KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIV_1_0)"
            echo "FAIL (kernel type): $kernel"
            ok=0
        fi
        lambda_re='(?<!operator)\[[^\]\[]*\]\s*\([^()]*\)\s*(mutable\s*)?(->\s*[\w:]+\s*)?\{'
        if lambda=$(grep -Pn "$lambda_re" <<<"$pre"); then
            echo "$kernel: lambda in device code (bisheng: not an __aicore__ function): $lambda"
            echo "FAIL (lambda): $kernel"
            ok=0
        fi
    fi
    if [ "$ok" -eq 1 ]; then echo "ok: $kernel"; else status=1; fi
done
exit $status
