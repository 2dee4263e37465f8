// Declarations only: the subset of AscendC's lib/hccl/hccl.h (asc-devkit, CANN 8.x) that the kernels use,
// with the documented signatures. Init and SetCcTiling are deprecated for InitV2 and SetCcTilingV2 and
// carry the same [[deprecated]] here, so that tools/check_ascendc.sh (-Werror) rejects them.
#pragma once

#include "kernel_operator.h"

namespace AscendC {

using HcclHandle = int8_t;

// Unscoped, as in the real header: HCCL_SERVER_TYPE_AICPU is also a name of namespace AscendC.
enum HcclServerType {
    HCCL_SERVER_TYPE_AICPU = 0,
    HCCL_SERVER_TYPE_CCU,
    HCCL_SERVER_TYPE_END,
};

enum class CoreType : uint8_t { DEFAULT, ON_AIV, ON_AIC };

struct HcclServerConfig {
    CoreType type;
    int64_t blockId;
};

static constexpr HcclServerConfig DEFAULT_CFG = {CoreType::DEFAULT, 0};

template <int32_t index>
__aicore__ GM_ADDR GetHcclContext();

template <HcclServerType serverType = HcclServerType::HCCL_SERVER_TYPE_AICPU, const auto& config = DEFAULT_CFG>
class Hccl {
   public:
    __aicore__ Hccl();
    [[deprecated("It is obsolete and use InitV2 instead.")]] __aicore__ void Init(GM_ADDR context,
                                                                                   __gm__ void* initTiling = nullptr);
    __aicore__ void InitV2(GM_ADDR context, const void* initTiling = nullptr);
    [[deprecated("It is obsolete and use SetCcTilingV2 instead.")]] __aicore__ int32_t SetCcTiling(
        __gm__ void* ccOpTilingData);
    __aicore__ int32_t SetCcTilingV2(uint64_t offset);
    template <bool commit = false>
    __aicore__ HcclHandle BatchWrite(GM_ADDR batchWriteInfo, uint32_t itemNum, uint16_t queueID = 0U);
    __aicore__ void Commit(HcclHandle handleId);
    __aicore__ int32_t Wait(HcclHandle handleId);
    template <bool sync = true>
    __aicore__ void Finalize();
    __aicore__ uint32_t GetRankId();
    __aicore__ uint32_t GetRankDim();
};

}  // namespace AscendC
