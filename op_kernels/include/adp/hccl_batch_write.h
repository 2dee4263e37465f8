// Core 0's hand-off of a BatchWrite item array to the AICPU server, shared by aicpu_batch_write and the
// MoE exchange: InitV2 with the host-filled HcclTiling, SetCcTilingV2, one committed BatchWrite, Wait,
// Finalize. Only core 0 may write the hcclMsgArea, so only core 0 calls this.
#pragma once

#include <cstddef>

#include "adp/transfer_kernels.h"
#include "kernel_operator.h"
#include "lib/hccl/hccl.h"

namespace adp::hccl {

// False when the server rejects the tiling or the task, or reports the BatchWrite failed.
__aicore__ inline bool batch_write(const __gm__ adp::xfer::HcclTiling* tiling, GM_ADDR items, uint32_t num_items) {
    // InitV2 takes the tiling in local memory (the kernel's stack), as GET_TILING_DATA would leave it;
    // copied word by word, since a struct in GM is not copied out with its copy constructor.
    constexpr uint32_t kWords = sizeof(adp::xfer::HcclTiling) / sizeof(uint64_t);
    static_assert(sizeof(adp::xfer::HcclTiling) % sizeof(uint64_t) == 0, "HcclTiling is whole words");
    uint64_t local[kWords];
    const __gm__ uint64_t* words = reinterpret_cast<const __gm__ uint64_t*>(tiling);
    for (uint32_t i = 0; i < kWords; ++i) local[i] = words[i];

    AscendC::Hccl<AscendC::HCCL_SERVER_TYPE_AICPU> hccl;
    hccl.InitV2(AscendC::GetHcclContext<0>(), local);
    bool ok = hccl.SetCcTilingV2(offsetof(adp::xfer::HcclTiling, cc)) == 0;
    if (ok) {
        const AscendC::HcclHandle handle = hccl.BatchWrite<true>(items, num_items);
        ok = handle >= 0 && hccl.Wait(handle) == 0;
    }
    hccl.Finalize();
    return ok;
}

}  // namespace adp::hccl
