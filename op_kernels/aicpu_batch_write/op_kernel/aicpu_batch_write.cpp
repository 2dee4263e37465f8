// AICPU BatchWrite: the vector cores fill 32-byte BatchWrite items (one per segment) in UB and copy
// them to the item array in GM; after SyncAll, core 0 alone (it owns the hcclMsgArea) hands the array
// to the AICPU server and waits for it. The AICPU then posts the WQEs; the cores post none.
#include "adp/hccl_batch_write.h"
#include "adp/transfer_kernels.h"
#include "adp/wqe_hns.h"
#include "kernel_operator.h"

using namespace AscendC;

extern "C" __global__ __aicore__ void aicpu_batch_write(GM_ADDR segments, GM_ADDR items, GM_ADDR status,
                                                        GM_ADDR tiling) {
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIV_1_0);  // SyncAll below
    const __gm__ adp::xfer::BatchWriteTiling& t = *reinterpret_cast<__gm__ adp::xfer::BatchWriteTiling*>(tiling);
    const uint64_t core = uint64_t(GetBlockIdx());
    uint64_t begin, end;
    adp::xfer::core_share(t.num_segments, core, uint64_t(GetBlockNum()), &begin, &end);
    const __gm__ adp::xfer::Segment* segs = reinterpret_cast<__gm__ adp::xfer::Segment*>(segments);
    constexpr uint32_t kWordsPerItem = sizeof(adp::wqe::BatchWriteItem) / sizeof(uint64_t);

    TPipe pipe;
    TBuf<TPosition::VECCALC> staging;
    pipe.InitBuffer(staging, t.items_per_round * sizeof(adp::wqe::BatchWriteItem));
    LocalTensor<uint64_t> ub = staging.Get<uint64_t>();
    GlobalTensor<uint64_t> gm;
    gm.SetGlobalBuffer(reinterpret_cast<__gm__ uint64_t*>(items), uint64_t(t.num_segments) * kWordsPerItem);

    for (uint64_t first = begin; first < end; first += t.items_per_round) {
        const uint64_t n = end - first < t.items_per_round ? end - first : t.items_per_round;
        for (uint64_t i = 0; i < n; ++i) {
            const __gm__ adp::xfer::Segment& s = segs[first + i];
            ub.SetValue(uint32_t(i * kWordsPerItem + 0), s.local_addr);
            ub.SetValue(uint32_t(i * kWordsPerItem + 1), s.remote_addr);
            ub.SetValue(uint32_t(i * kWordsPerItem + 2), uint64_t(s.length));  // INT8: count = bytes
            ub.SetValue(uint32_t(i * kWordsPerItem + 3),
                        uint64_t(adp::xfer::kHcclDataTypeInt8) | (uint64_t(t.remote_rank) << 32));
        }
        SetFlag<HardEvent::S_MTE3>(0);  // scalar writes to UB before MTE3 reads them
        WaitFlag<HardEvent::S_MTE3>(0);
        DataCopy(gm[first * kWordsPerItem], ub, uint32_t(n * kWordsPerItem));  // 32 bytes per item: aligned
        SetFlag<HardEvent::MTE3_S>(0);  // MTE3 done before the scalar unit overwrites UB
        WaitFlag<HardEvent::MTE3_S>(0);
    }
    SyncAll();

    GlobalTensor<uint32_t> out;
    out.SetGlobalBuffer(reinterpret_cast<__gm__ uint32_t*>(status) + core * 4, 4);
    uint32_t code = adp::xfer::kCoreOk;
    if (core == 0 && !adp::hccl::batch_write(&t.hccl, items, t.num_segments)) code = adp::xfer::kCoreBatchWriteFailed;
    out.SetValue(0, code);
    out.SetValue(1, uint32_t(end - begin));
    out.SetValue(2, 0);
    out.SetValue(3, 0);
}
