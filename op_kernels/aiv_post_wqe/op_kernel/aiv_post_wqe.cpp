// AIV-direct RDMA posting: each vector core takes a contiguous slice of the segments and posts one
// 48-byte RoCE WRITE WQE per segment into its own send queue, flushing each WQE's cache lines before
// the doorbell covers it. The core rings the doorbell every `doorbell_batch` WQEs and whenever the SQ
// is full, then waits (bounded by `timeout_cycles`) for the NIC to retire WQEs before going on.
// Every WQE is signaled, so the host sees exactly one CQE per segment.
#include "adp/sq_poster.h"
#include "adp/transfer_kernels.h"
#include "kernel_operator.h"

using namespace AscendC;

extern "C" __global__ __aicore__ void aiv_post_wqe(GM_ADDR segments, GM_ADDR queues, GM_ADDR status, GM_ADDR tiling) {
    const __gm__ adp::xfer::AivPostTiling& t = *reinterpret_cast<__gm__ adp::xfer::AivPostTiling*>(tiling);
    const uint64_t core = uint64_t(GetBlockIdx());
    uint64_t begin, end;
    adp::xfer::core_share(t.num_segments, core, uint64_t(GetBlockNum()), &begin, &end);
    adp::aiv::SqPoster poster(reinterpret_cast<__gm__ adp::xfer::AivQueue*>(queues) + core, t.timeout_cycles, t.clock,
                              t.doorbell_batch);
    const __gm__ adp::xfer::Segment* segs = reinterpret_cast<__gm__ adp::xfer::Segment*>(segments);

    uint32_t code = adp::xfer::kCoreOk;
    for (uint64_t i = begin; i < end; ++i) {
        const __gm__ adp::xfer::Segment& seg = segs[i];
        if (!poster.Post(seg.local_addr, seg.lkey, seg.remote_addr, seg.rkey, seg.length, true)) {  // one CQE each
            code = adp::xfer::kCoreSqTimeout;
            break;
        }
    }
    poster.Ring();

    GlobalTensor<uint32_t> out;
    out.SetGlobalBuffer(reinterpret_cast<__gm__ uint32_t*>(status) + core * 4, 4);
    out.SetValue(0, code);
    out.SetValue(1, poster.posted());
    out.SetValue(2, poster.head());
    out.SetValue(3, poster.tail());
    DataCacheCleanAndInvalid<uint32_t, CacheLine::SINGLE_CACHE_LINE, DcciDst::CACHELINE_OUT>(out);
}
