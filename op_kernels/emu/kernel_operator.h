// AscendC subset for running the kernels of op_kernels/ on the CPU, unchanged.
//
// The names and signatures follow CANN's AscendC (asc-devkit: kernel_operator.h, kernel_tpipe.h,
// kernel_operator_data_copy_intf.h, kernel_operator_sync_intf.h, hccl/hccl.h); only what the kernels
// of this project use is here. Each vector core is a thread started by the emulator's launcher
// (csrc/emulator/kernel_runner.h), which owns its 192 KB unified buffer. What hardware would punish
// raises here: a DataCopy whose length is not a multiple of 32 bytes or whose UB address is not
// 32-byte aligned (AlignmentError), UB allocations past the buffer (CapacityError), a WaitFlag with
// no SetFlag before it (ProtocolError: a hang on hardware), and scalar/DataCopy writes into an SQ ring
// that are not flushed by DataCacheCleanAndInvalid before the doorbell (the NIC fails the WQE).
// The HCCL kernel API is in lib/hccl/hccl.h, as in AscendC: a kernel that uses Hccl includes it.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "emulator/common.h"
#include "emulator/kernel_runner.h"

#if !defined(ADP_EMULATOR)
#error "op_kernels/emu is the CPU emulator's AscendC: build it with ADP_EMULATOR defined (setup.py does)"
#endif

#define __aicore__
#define __global__
#define __gm__
#define GM_ADDR uint8_t*

// bisheng's built-in 16-bit float of the AI core; the host compiler's is _Float16.
using half = _Float16;

// KERNEL_TASK_TYPE_DEFAULT (kernel_macros.h): the launch type of a kernel, here only type-checked.
enum KernelMetaType {
    KERNEL_TYPE_AIV_ONLY,
    KERNEL_TYPE_AIC_ONLY,
    KERNEL_TYPE_MIX_AIV_1_0,
    KERNEL_TYPE_MIX_AIC_1_0,
    KERNEL_TYPE_MIX_AIC_1_1,
    KERNEL_TYPE_MIX_AIC_1_2,
};
#define KERNEL_TASK_TYPE_DEFAULT(type)                                                                          \
    static_assert(std::is_same_v<std::remove_cv_t<decltype(type)>, KernelMetaType>, "KERNEL_TASK_TYPE_DEFAULT " \
                                                                                    "takes a KernelMetaType")

enum pipe_t { PIPE_S = 0, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_ALL };

namespace AscendC {

namespace emu_detail {
using adp::emu::ErrorKind;
using adp::emu::fail;
namespace rt = adp::emu::kernel;
constexpr uint32_t kBlockBytes = 32;  // DataCopy granularity (one "block" of UB)

inline void check_copy(const char* api, uint64_t bytes, const void* ub_addr) {
    if (bytes % kBlockBytes != 0)
        fail(ErrorKind::kAlignment, api, ": ", bytes, " bytes is not a multiple of ", kBlockBytes,
             " (use DataCopyPad for unaligned lengths)");
    if (reinterpret_cast<uint64_t>(ub_addr) % kBlockBytes != 0)
        fail(ErrorKind::kAlignment, api, ": UB address ", adp::emu::hex(reinterpret_cast<uint64_t>(ub_addr)),
             " is not ", kBlockBytes, "-byte aligned");
}
}  // namespace emu_detail

enum class TPosition : uint8_t {
    GM,
    A1,
    A2,
    B1,
    B2,
    C1,
    C2,
    CO1,
    CO2,
    VECIN,
    VECOUT,
    VECCALC,
    LCM = VECCALC,
    SPM,
    SHM,
    TSCM,
    MAX
};
using QuePosition = TPosition;

enum class HardEvent : uint8_t {
    MTE2_MTE1,
    MTE1_MTE2,
    MTE1_M,
    M_MTE1,
    MTE2_V,
    V_MTE2,
    MTE3_V,
    V_MTE3,
    M_V,
    V_M,
    V_V,
    MTE3_MTE1,
    MTE1_MTE3,
    MTE1_V,
    MTE2_M,
    M_MTE2,
    V_MTE1,
    M_FIX,
    FIX_M,
    MTE3_MTE2,
    MTE2_MTE3,
    S_V,
    V_S,
    S_MTE2,
    MTE2_S,
    S_MTE3,
    MTE3_S,
    MAX
};

enum class CacheLine : uint64_t { SINGLE_CACHE_LINE = 0, ENTIRE_DATA_CACHE };
enum class DcciDst : uint64_t { CACHELINE_ALL = 0, CACHELINE_UB, CACHELINE_OUT, CACHELINE_ATOMIC };

inline int64_t GetBlockIdx() { return emu_detail::rt::current_core().block_idx; }
inline int64_t GetBlockNum() { return emu_detail::rt::current_core().block_num; }

// 50 MHz system counter. Kernels bound their spin loops with it; in the emulator it also throws
// once another core of the launch failed, so that no core spins on after an abort.
inline int64_t GetSystemCycle() {
    emu_detail::rt::current_core().launch->check_aborted();
    const auto ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(adp::emu::Clock::now().time_since_epoch()).count();
    return int64_t(ns / (1000000000 / emu_detail::rt::kSystemCycleHz));
}

// ---- tensors ------------------------------------------------------------------------------------

template <typename T>
class GlobalTensor {
   public:
    using PrimType = T;
    void SetGlobalBuffer(__gm__ T* buffer, uint64_t bufferSize) {
        address_ = buffer;
        size_ = bufferSize;
    }
    void SetGlobalBuffer(__gm__ T* buffer) { SetGlobalBuffer(buffer, 0); }
    __gm__ T* GetPhyAddr() const { return address_; }
    __gm__ T* GetPhyAddr(uint64_t offset) const { return address_ + offset; }
    uint64_t GetSize() const { return size_; }

    // Scalar access goes through the core's data cache: a write reaches the NIC only after a flush.
    T GetValue(uint64_t offset) const {
        check(offset);
        if constexpr (sizeof(T) <= 8 && std::is_trivially_copyable_v<T> && (sizeof(T) & (sizeof(T) - 1)) == 0)
            return __atomic_load_n(address_ + offset, __ATOMIC_ACQUIRE);
        else
            return address_[offset];
    }
    void SetValue(uint64_t offset, T value) const {
        check(offset);
        emu_detail::rt::before_gm_store(reinterpret_cast<uint64_t>(address_ + offset));
        if constexpr (sizeof(T) <= 8 && std::is_trivially_copyable_v<T> && (sizeof(T) & (sizeof(T) - 1)) == 0)
            __atomic_store_n(address_ + offset, value, __ATOMIC_RELEASE);
        else
            address_[offset] = value;
        emu_detail::rt::note_gm_write(reinterpret_cast<uint64_t>(address_ + offset), sizeof(T));
    }
    GlobalTensor operator[](uint64_t offset) const {
        GlobalTensor t;
        t.address_ = address_ + offset;
        t.size_ = size_ > offset ? size_ - offset : 0;
        return t;
    }

   private:
    void check(uint64_t offset) const {
        if (size_ && offset >= size_)
            emu_detail::fail(emu_detail::ErrorKind::kBounds, "GlobalTensor element ", offset, " is outside its ", size_,
                             " elements");
    }
    __gm__ T* address_ = nullptr;
    uint64_t size_ = 0;  // elements; 0 = unknown (no bounds check)
};

template <typename T>
class LocalTensor {
   public:
    using PrimType = T;
    LocalTensor() = default;
    LocalTensor(T* address, uint32_t elements, uint32_t buffer_id)
        : address_(address), size_(elements), buffer_id_(buffer_id) {}
    T GetValue(uint32_t index) const {
        check(index, 1);
        return address_[index];
    }
    void SetValue(uint32_t index, T value) const {
        check(index, 1);
        address_[index] = value;
    }
    LocalTensor operator[](uint32_t offset) const {
        check(offset, 0);
        return LocalTensor(address_ + offset, size_ - offset, buffer_id_);
    }
    template <typename U>
    LocalTensor<U> ReinterpretCast() const {
        return LocalTensor<U>(reinterpret_cast<U*>(address_), uint32_t(uint64_t(size_) * sizeof(T) / sizeof(U)),
                              buffer_id_);
    }
    uint64_t GetPhyAddr() const { return reinterpret_cast<uint64_t>(address_); }
    uint32_t GetSize() const { return size_; }
    T* emu_data() const { return address_; }
    uint32_t emu_buffer_id() const { return buffer_id_; }
    void emu_check(uint64_t elements, const char* api) const {
        if (elements > size_)
            emu_detail::fail(emu_detail::ErrorKind::kBounds, api, ": ", elements,
                             " elements overrun the LocalTensor of ", size_, " elements");
    }

   private:
    void check(uint64_t index, uint64_t count) const {
        if (index + count > size_)
            emu_detail::fail(emu_detail::ErrorKind::kBounds, "LocalTensor element ", index, " is outside its ", size_,
                             " elements");
    }
    T* address_ = nullptr;
    uint32_t size_ = 0;
    uint32_t buffer_id_ = 0;
};

// ---- TPipe / TQue / TBuf --------------------------------------------------------------------------

namespace emu_detail {
inline uint8_t* ub_alloc(uint32_t bytes, const char* what) {
    rt::CoreContext& core = rt::current_core();
    const uint32_t aligned = (bytes + kBlockBytes - 1) / kBlockBytes * kBlockBytes;
    const uint64_t limit = core.ub_bytes;
    if (uint64_t(core.ub_used) + aligned > limit)
        fail(ErrorKind::kCapacity, "UB overflow on vector core ", core.block_idx, ": ", what, " needs ", aligned,
             " bytes with ", core.ub_used, " already in use; the unified buffer holds ", limit, " bytes");
    uint8_t* p = core.ub_base + core.ub_used;
    core.ub_used += aligned;
    return p;
}
}  // namespace emu_detail

template <TPosition src, TPosition dst, int32_t depth, auto mask = 0>
class TQueBind {
   public:
    template <typename T>
    LocalTensor<T> AllocTensor() {
        for (int32_t i = 0; i < num_; ++i) {
            const int32_t b = (next_ + i) % num_;
            if (!in_use_[b]) {
                in_use_[b] = true;
                next_ = (b + 1) % num_;
                return LocalTensor<T>(reinterpret_cast<T*>(base_ + uint64_t(b) * len_), len_ / sizeof(T), uint32_t(b));
            }
        }
        emu_detail::fail(emu_detail::ErrorKind::kProtocol, "TQue::AllocTensor: all ", num_,
                         " buffers are in use (a FreeTensor is missing)");
    }
    template <typename T>
    bool EnQue(const LocalTensor<T>& tensor) {
        if (count_ == kMaxDepth) emu_detail::fail(emu_detail::ErrorKind::kProtocol, "TQue::EnQue on a full queue");
        queue_[(head_ + count_++) % kMaxDepth] = tensor.emu_buffer_id();
        return true;
    }
    template <typename T>
    LocalTensor<T> DeQue() {
        if (count_ == 0)
            emu_detail::fail(emu_detail::ErrorKind::kProtocol, "TQue::DeQue on an empty queue (a hang on hardware)");
        const uint32_t b = queue_[head_];
        head_ = (head_ + 1) % kMaxDepth;
        --count_;
        return LocalTensor<T>(reinterpret_cast<T*>(base_ + uint64_t(b) * len_), len_ / sizeof(T), b);
    }
    template <typename T>
    void FreeTensor(LocalTensor<T>& tensor) {
        in_use_[tensor.emu_buffer_id()] = false;
    }
    void emu_init(uint8_t num, uint32_t len) {
        if (num == 0 || num > kMaxDepth)
            emu_detail::fail(emu_detail::ErrorKind::kConfig, "TPipe::InitBuffer: buffer count ", uint32_t(num),
                             " must be in [1, ", kMaxDepth, "]");
        len_ = (len + 31) / 32 * 32;
        num_ = num;
        base_ = emu_detail::ub_alloc(uint32_t(num) * len_, "TPipe::InitBuffer(TQue)");
    }

   private:
    static constexpr int32_t kMaxDepth = 8;
    uint8_t* base_ = nullptr;
    uint32_t len_ = 0;
    int32_t num_ = 0, next_ = 0, head_ = 0, count_ = 0;
    bool in_use_[kMaxDepth] = {};
    uint32_t queue_[kMaxDepth] = {};
};

template <TPosition pos, int32_t depth, auto mask = 0>
class TQue : public TQueBind<pos, pos, depth, mask> {};

template <TPosition pos = TPosition::LCM>
class TBuf {
   public:
    template <typename T>
    LocalTensor<T> Get() {
        return LocalTensor<T>(reinterpret_cast<T*>(base_), len_ / sizeof(T), 0);
    }
    template <typename T>
    LocalTensor<T> Get(uint32_t len) {
        if (len * sizeof(T) > len_)
            emu_detail::fail(emu_detail::ErrorKind::kBounds, "TBuf::Get: ", len, " elements overrun the ", len_,
                             "-byte buffer");
        return LocalTensor<T>(reinterpret_cast<T*>(base_), len, 0);
    }
    void emu_init(uint32_t len) {
        len_ = (len + 31) / 32 * 32;
        base_ = emu_detail::ub_alloc(len_, "TPipe::InitBuffer(TBuf)");
    }

   private:
    uint8_t* base_ = nullptr;
    uint32_t len_ = 0;
};

// Owns the UB allocations made through it; destroying it returns them.
class TPipe {
   public:
    TPipe() : mark_(emu_detail::rt::current_core().ub_used) {}
    ~TPipe() { Destroy(); }
    template <class T>
    bool InitBuffer(T& que, uint8_t num, uint32_t len) {
        que.emu_init(num, len);
        return true;
    }
    template <TPosition pos>
    bool InitBuffer(TBuf<pos>& buf, uint32_t len) {
        buf.emu_init(len);
        return true;
    }
    void Destroy() {
        if (emu_detail::rt::in_kernel()) emu_detail::rt::current_core().ub_used = mark_;
    }

   private:
    uint32_t mark_;
};

// ---- data movement ------------------------------------------------------------------------------

struct DataCopyExtParams {
    DataCopyExtParams() = default;
    DataCopyExtParams(uint16_t count, uint32_t len, uint32_t srcStrideIn, uint32_t dstStrideIn, uint32_t rsvIn)
        : blockCount(count), blockLen(len), srcStride(srcStrideIn), dstStride(dstStrideIn), rsv(rsvIn) {}
    uint16_t blockCount = 1;
    uint32_t blockLen = 0;   // bytes per block
    uint32_t srcStride = 0;  // GM side: bytes between blocks; UB side: 32-byte blocks between blocks
    uint32_t dstStride = 0;
    uint32_t rsv = 0;
};

template <typename T>
struct DataCopyPadExtParams {
    DataCopyPadExtParams() = default;
    DataCopyPadExtParams(bool isPadIn, uint8_t left, uint8_t right, T value)
        : isPad(isPadIn), leftPadding(left), rightPadding(right), paddingValue(value) {}
    bool isPad = false;
    uint8_t leftPadding = 0;
    uint8_t rightPadding = 0;
    T paddingValue = 0;
};

template <typename T>
void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const uint32_t calCount) {
    const uint64_t bytes = uint64_t(calCount) * sizeof(T);
    emu_detail::check_copy("DataCopy(GM->UB)", bytes, dst.emu_data());
    dst.emu_check(calCount, "DataCopy(GM->UB)");
    emu_detail::rt::current_core().launch->stall_mte2();
    std::memcpy(dst.emu_data(), src.GetPhyAddr(), bytes);
}

template <typename T>
void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const uint32_t calCount) {
    const uint64_t bytes = uint64_t(calCount) * sizeof(T);
    emu_detail::check_copy("DataCopy(UB->GM)", bytes, src.emu_data());
    src.emu_check(calCount, "DataCopy(UB->GM)");
    std::memcpy(dst.GetPhyAddr(), src.emu_data(), bytes);
    emu_detail::rt::note_gm_write(reinterpret_cast<uint64_t>(dst.GetPhyAddr()), bytes);
}

template <typename T>
void DataCopy(const LocalTensor<T>& dst, const LocalTensor<T>& src, const uint32_t calCount) {
    const uint64_t bytes = uint64_t(calCount) * sizeof(T);
    emu_detail::check_copy("DataCopy(UB->UB)", bytes, dst.emu_data());
    emu_detail::check_copy("DataCopy(UB->UB)", bytes, src.emu_data());
    dst.emu_check(calCount, "DataCopy(UB->UB)");
    src.emu_check(calCount, "DataCopy(UB->UB)");
    std::memmove(dst.emu_data(), src.emu_data(), bytes);
}

// GM -> UB with any byte length: each block lands at a 32-byte boundary of UB, padded up to it.
template <typename T>
void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyExtParams& params,
                 const DataCopyPadExtParams<T>& padParams) {
    emu_detail::check_copy("DataCopyPad(GM->UB)", 0, dst.emu_data());
    const uint64_t padded = (uint64_t(params.blockLen) + 31) / 32 * 32;
    const uint64_t ub_step = padded + uint64_t(params.dstStride) * 32;
    const uint64_t gm_step = uint64_t(params.blockLen) + params.srcStride;
    dst.emu_check((uint64_t(params.blockCount) - 1) * ub_step / sizeof(T) + padded / sizeof(T), "DataCopyPad(GM->UB)");
    emu_detail::rt::current_core().launch->stall_mte2();
    auto* out = reinterpret_cast<uint8_t*>(dst.emu_data());
    const auto* in = reinterpret_cast<const uint8_t*>(src.GetPhyAddr());
    for (uint32_t b = 0; b < params.blockCount; ++b) {
        std::memcpy(out + b * ub_step, in + b * gm_step, params.blockLen);
        if (padParams.isPad)
            for (uint64_t i = params.blockLen / sizeof(T); i < padded / sizeof(T); ++i)
                reinterpret_cast<T*>(out + b * ub_step)[i] = padParams.paddingValue;
    }
}

// UB -> GM with any byte length: only blockLen bytes of each block reach GM.
template <typename T>
void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyExtParams& params) {
    emu_detail::check_copy("DataCopyPad(UB->GM)", 0, src.emu_data());
    const uint64_t padded = (uint64_t(params.blockLen) + 31) / 32 * 32;
    const uint64_t ub_step = padded + uint64_t(params.srcStride) * 32;
    const uint64_t gm_step = uint64_t(params.blockLen) + params.dstStride;
    src.emu_check(
        (uint64_t(params.blockCount) - 1) * ub_step / sizeof(T) + (params.blockLen + sizeof(T) - 1) / sizeof(T),
        "DataCopyPad(UB->GM)");
    auto* out = reinterpret_cast<uint8_t*>(dst.GetPhyAddr());
    const auto* in = reinterpret_cast<const uint8_t*>(src.emu_data());
    for (uint32_t b = 0; b < params.blockCount; ++b) {
        std::memcpy(out + b * gm_step, in + b * ub_step, params.blockLen);
        emu_detail::rt::note_gm_write(reinterpret_cast<uint64_t>(out + b * gm_step), params.blockLen);
    }
}

// ---- synchronization and cache --------------------------------------------------------------------

// Execution in the emulator is in program order, so flags only have to balance: a WaitFlag with no
// SetFlag before it would hang the pipe on hardware.
template <HardEvent event>
void SetFlag(int32_t eventID) {
    emu_detail::rt::current_core().flags[uint32_t(event) % 16][eventID & 7] += 1;
}
template <HardEvent event>
void WaitFlag(int32_t eventID) {
    int64_t& balance = emu_detail::rt::current_core().flags[uint32_t(event) % 16][eventID & 7];
    if (balance <= 0)
        emu_detail::fail(emu_detail::ErrorKind::kProtocol, "WaitFlag<", uint32_t(event), ">(", eventID,
                         ") without a matching SetFlag: the pipe would hang");
    balance -= 1;
}
template <pipe_t pipe>
void PipeBarrier() {}

template <bool isAIVOnly = true>
void SyncAll() {
    emu_detail::rt::current_core().launch->sync_all();
}

template <typename T, CacheLine entireType, DcciDst dcciDst>
void DataCacheCleanAndInvalid(const GlobalTensor<T>& dstTensor) {
    if constexpr (entireType == CacheLine::ENTIRE_DATA_CACHE)
        emu_detail::rt::flush_entire_cache();
    else
        emu_detail::rt::flush_cache_line(reinterpret_cast<uint64_t>(dstTensor.GetPhyAddr()));
}

template <typename T, CacheLine entireType>
void DataCacheCleanAndInvalid(const GlobalTensor<T>& dstTensor) {
    DataCacheCleanAndInvalid<T, entireType, DcciDst::CACHELINE_OUT>(dstTensor);
}

}  // namespace AscendC
