// Declarations only: the subset of AscendC's kernel_operator.h (asc-devkit, CANN 8.x) that the kernels of
// op_kernels/ use, with the documented signatures (API reference of the basic APIs: tensors, TPipe,
// DataCopy/DataCopyPad, SetFlag/WaitFlag, SyncAll, DataCacheCleanAndInvalid, GetBlockIdx/GetBlockNum,
// GetSystemCycle, KERNEL_TASK_TYPE_DEFAULT). tools/check_ascendc.sh compiles each kernel against it
// twice with clang: once in CUDA device mode with __aicore__ as the device attribute (an __aicore__
// function may call only __aicore__ functions) and once in C++ mode with __gm__ as address space 1 (a
// GM pointer is not a plain pointer, and a struct in GM is not copied out with its copy constructor).
// Nothing here is defined: the check never links or runs. What the kernels do not use is left out, so a
// kernel that starts using more fails here first and the declaration is added from the reference.
#pragma once

#include <cstdint>

#define GM_ADDR __gm__ uint8_t*

// Kernel types of KERNEL_TASK_TYPE_DEFAULT (kernel_macros.h). A kernel that calls SyncAll declares
// KERNEL_TYPE_MIX_AIV_1_0: the hardware barrier needs the mixed launch, and without it the docs say to
// expect a hang. tools/check_ascendc.sh enforces that pairing on the preprocessed kernel.
enum KernelMetaType {
    KERNEL_TYPE_AIV_ONLY,
    KERNEL_TYPE_AIC_ONLY,
    KERNEL_TYPE_MIX_AIV_1_0,
    KERNEL_TYPE_MIX_AIC_1_0,
    KERNEL_TYPE_MIX_AIC_1_1,
    KERNEL_TYPE_MIX_AIC_1_2,
};
__aicore__ void adp_check_kernel_task_type(KernelMetaType type);
#define KERNEL_TASK_TYPE_DEFAULT(type) adp_check_kernel_task_type(type)

namespace AscendC {

enum class TPosition : uint8_t { GM, A1, A2, B1, B2, C1, C2, CO1, CO2, VECIN, VECOUT, VECCALC, LCM = VECCALC, MAX };

enum class HardEvent : uint8_t {
    MTE2_MTE1, MTE1_MTE2, MTE1_M, M_MTE1, MTE2_V, V_MTE2, MTE3_V, V_MTE3, M_V, V_M, V_V, MTE3_MTE1, MTE1_MTE3,
    MTE1_V, MTE2_M, M_MTE2, V_MTE1, M_FIX, FIX_M, MTE3_MTE2, MTE2_MTE3, S_V, V_S, S_MTE2, MTE2_S, S_MTE3, MTE3_S,
    MAX
};

enum class CacheLine : uint64_t { SINGLE_CACHE_LINE = 0, ENTIRE_DATA_CACHE };
enum class DcciDst : uint64_t { CACHELINE_ALL = 0, CACHELINE_UB, CACHELINE_OUT, CACHELINE_ATOMIC };

__aicore__ int64_t GetBlockIdx();
__aicore__ int64_t GetBlockNum();
__aicore__ int64_t GetSystemCycle();

template <typename T>
class GlobalTensor {
   public:
    using PrimType = T;
    __aicore__ GlobalTensor();
    __aicore__ void SetGlobalBuffer(__gm__ T* buffer, uint64_t bufferSize);
    __aicore__ void SetGlobalBuffer(__gm__ T* buffer);
    __aicore__ __gm__ T* GetPhyAddr() const;
    __aicore__ __gm__ T* GetPhyAddr(const uint64_t offset) const;
    __aicore__ uint64_t GetSize() const;
    __aicore__ T GetValue(const uint64_t offset) const;
    __aicore__ void SetValue(const uint64_t offset, T value);
    __aicore__ GlobalTensor operator[](const uint64_t offset) const;

   private:
    __gm__ T* address_;
    uint64_t size_;
};

template <typename T>
class LocalTensor {
   public:
    using PrimType = T;
    __aicore__ LocalTensor();
    __aicore__ T GetValue(const uint32_t index) const;
    template <typename U>
    __aicore__ void SetValue(const uint32_t index, const U value) const;
    __aicore__ LocalTensor operator[](const uint32_t offset) const;
    template <typename U>
    __aicore__ LocalTensor<U> ReinterpretCast() const;
    __aicore__ uint64_t GetPhyAddr() const;
    __aicore__ uint32_t GetSize() const;

   private:
    uint64_t address_;
};

template <TPosition src, TPosition dst, int32_t depth, auto mask = 0>
class TQueBind {
   public:
    __aicore__ TQueBind();
    template <typename T>
    __aicore__ LocalTensor<T> AllocTensor();
    template <typename T>
    __aicore__ bool EnQue(const LocalTensor<T>& tensor);
    template <typename T>
    __aicore__ LocalTensor<T> DeQue();
    template <typename T>
    __aicore__ void FreeTensor(LocalTensor<T>& tensor);
};

template <TPosition pos, int32_t depth, auto mask = 0>
class TQue : public TQueBind<pos, pos, depth, mask> {
   public:
    __aicore__ TQue();
};

template <TPosition pos = TPosition::LCM>
class TBuf {
   public:
    __aicore__ TBuf();
    template <typename T>
    __aicore__ LocalTensor<T> Get();
    template <typename T>
    __aicore__ LocalTensor<T> Get(uint32_t len);
};

class TPipe {
   public:
    __aicore__ TPipe();
    __aicore__ ~TPipe();
    template <class T>
    __aicore__ bool InitBuffer(T& que, uint8_t num, uint32_t len);
    template <TPosition pos>
    __aicore__ bool InitBuffer(TBuf<pos>& buf, uint32_t len);
    __aicore__ void Destroy();
};

struct DataCopyExtParams {
    __aicore__ DataCopyExtParams();
    __aicore__ DataCopyExtParams(const uint16_t count, const uint32_t len, const uint32_t srcStrideIn,
                                 const uint32_t dstStrideIn, const uint32_t rsvIn);
    uint16_t blockCount;
    uint32_t blockLen;
    uint32_t srcStride;
    uint32_t dstStride;
    uint32_t rsv;
};

template <typename T>
struct DataCopyPadExtParams {
    __aicore__ DataCopyPadExtParams();
    __aicore__ DataCopyPadExtParams(const bool isPadValue, const uint8_t leftPadValue, const uint8_t rightPadValue,
                                    T padValue);
    bool isPad;
    uint8_t leftPadding;
    uint8_t rightPadding;
    T paddingValue;
};

template <typename T>
__aicore__ void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const uint32_t count);
template <typename T>
__aicore__ void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const uint32_t count);
template <typename T>
__aicore__ void DataCopy(const LocalTensor<T>& dst, const LocalTensor<T>& src, const uint32_t count);
template <typename T>
__aicore__ void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src,
                            const DataCopyExtParams& dataCopyParams, const DataCopyPadExtParams<T>& padParams);
template <typename T>
__aicore__ void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src,
                            const DataCopyExtParams& dataCopyParams);

template <HardEvent event>
__aicore__ void SetFlag(int32_t eventID);
template <HardEvent event>
__aicore__ void WaitFlag(int32_t eventID);

template <bool isAIVOnly = true>
__aicore__ void SyncAll();

template <typename T, CacheLine entireType, DcciDst dcciDst>
__aicore__ void DataCacheCleanAndInvalid(const GlobalTensor<T>& dst);

}  // namespace AscendC
