// HCCL-buffer staging: copies `total_bytes` from a source (device GM, or host DRAM mapped for the
// device) into the registered HCCL window, so that the vector cores can post RDMA WRITEs from it.
// Each core takes a 32-byte-aligned contiguous span and moves it through UB in `chunk_bytes` pieces
// with `buffer_num` buffers in flight: DataCopy for the 32-byte multiple, DataCopyPad for the tail.
#include "adp/transfer_kernels.h"
#include "kernel_operator.h"

using namespace AscendC;

namespace {

constexpr uint64_t kAlign = 32;

class Stager {
   public:
    __aicore__ inline Stager(GM_ADDR src, GM_ADDR dst, const __gm__ adp::xfer::StageTiling& t, uint64_t begin,
                             uint64_t end)
        : begin_(begin), end_(end), chunk_(t.chunk_bytes) {
        src_.SetGlobalBuffer(src, t.total_bytes);
        dst_.SetGlobalBuffer(dst, t.total_bytes);
        pipe_.InitBuffer(queue_, uint8_t(t.buffer_num), t.chunk_bytes);
    }

    __aicore__ inline void Process() {
        for (uint64_t off = begin_; off < end_; off += chunk_) {
            const uint32_t len = uint32_t(end_ - off < chunk_ ? end_ - off : chunk_);
            CopyIn(off, len);
            CopyOut(off, len);
        }
    }

   private:
    __aicore__ inline void CopyIn(uint64_t off, uint32_t len) {
        LocalTensor<uint8_t> buf = queue_.AllocTensor<uint8_t>();
        const uint32_t body = uint32_t(len / kAlign * kAlign);
        if (body) DataCopy(buf, src_[off], body);
        if (len > body) {
            DataCopyExtParams params(1, len - body, 0, 0, 0);
            DataCopyPadExtParams<uint8_t> pad(false, 0, 0, 0);
            DataCopyPad(buf[body], src_[off + body], params, pad);
        }
        queue_.EnQue(buf);
    }

    __aicore__ inline void CopyOut(uint64_t off, uint32_t len) {
        LocalTensor<uint8_t> buf = queue_.DeQue<uint8_t>();
        const uint32_t body = uint32_t(len / kAlign * kAlign);
        if (body) DataCopy(dst_[off], buf, body);
        if (len > body) {
            DataCopyExtParams params(1, len - body, 0, 0, 0);
            DataCopyPad(dst_[off + body], buf[body], params);
        }
        queue_.FreeTensor(buf);
    }

    TPipe pipe_;
    TQueBind<TPosition::VECIN, TPosition::VECOUT, 2> queue_;
    GlobalTensor<uint8_t> src_, dst_;
    uint64_t begin_, end_, chunk_;
};

}  // namespace

extern "C" __global__ __aicore__ void hccl_stage(GM_ADDR src, GM_ADDR dst, GM_ADDR tiling) {
    const __gm__ adp::xfer::StageTiling& t = *reinterpret_cast<__gm__ adp::xfer::StageTiling*>(tiling);
    // spans in whole 32-byte blocks, so that only the last core handles an unaligned tail
    const uint64_t blocks = (t.total_bytes + kAlign - 1) / kAlign;
    uint64_t first, last;
    adp::xfer::core_share(blocks, uint64_t(GetBlockIdx()), uint64_t(GetBlockNum()), &first, &last);
    const uint64_t begin = first * kAlign;
    const uint64_t end = last * kAlign < t.total_bytes ? last * kAlign : t.total_bytes;
    if (begin >= end) return;
    Stager stager(src, dst, t, begin, end);
    stager.Process();
}
