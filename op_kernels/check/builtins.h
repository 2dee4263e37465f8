// Forced first include of tools/check_ascendc.sh (clang -include): what bisheng provides before any
// header, and what AI-core code must not use.
//
// `half` and `bfloat16_t` are bisheng's built-in 16-bit float types: here opaque classes that convert
// to and from float only through __aicore__ members. The system headers the kernels may include are
// included here once, before the poison below, so that their own uses of the poisoned names pass.
// Poisoned: host-only types and builtins (double: no double-precision scalar on the AI core; _Float16
// and __fp16: host compiler types, the device spelling is `half`; __builtin_mem*: the AI core has no
// libc, a GM or UB copy is a DataCopy and a bit cast is a union or LocalTensor::ReinterpretCast).
#pragma once

#include <cstddef>
#include <cstdint>

class half {
   public:
    __aicore__ half();
    __aicore__ half(float value);
    __aicore__ operator float() const;

   private:
    uint16_t bits_;
};

class bfloat16_t {
   public:
    __aicore__ bfloat16_t();
    __aicore__ bfloat16_t(float value);
    __aicore__ operator float() const;

   private:
    uint16_t bits_;
};

#pragma GCC poison double _Float16 __fp16 __builtin_memcpy __builtin_memmove __builtin_memset
