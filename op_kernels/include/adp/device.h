// ADP_HOST_DEVICE: the one qualifier of the helpers that AscendC kernels and host code (csrc/, the CPU
// emulator) both call (wqe_hns.h, transfer_kernels.h). An __aicore__ function may call only __aicore__
// functions, so a plain inline helper called from a kernel does not compile with bisheng.
//   bisheng (CANN, either pass): force-inlined and callable from host and AI core, [host, aicore];
//   tools/check_ascendc.sh (clang standing in for bisheng's device pass): __aicore__, so that a helper
//     calling host-only code fails the check;
//   any other compiler (g++: host code and the kernels on the CPU emulator): plain inline.
// ADP_EMULATOR (set by setup.py for the _C extension) guards what only the emulator has, such as its
// virtual clock; kernels built by CANN never see it.
#pragma once

#if defined(ADP_ASCENDC_CHECK)
#define ADP_HOST_DEVICE __aicore__ inline
#elif defined(__CCE__)
#define ADP_HOST_DEVICE __forceinline__[host, aicore]
#else
#define ADP_HOST_DEVICE inline
#endif
