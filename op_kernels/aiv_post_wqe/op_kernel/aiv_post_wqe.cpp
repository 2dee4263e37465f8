// AIV-direct RDMA posting: each vector core takes a contiguous slice of the segments and posts one
// 48-byte RoCE WRITE WQE per segment into its own send queue, flushing each WQE's cache lines before
// the doorbell covers it. The core rings the doorbell every `doorbell_batch` WQEs and whenever the SQ
// is full, then waits (bounded by `timeout_cycles`) for the NIC to retire WQEs before going on.
// Every WQE is signaled, so the host sees exactly one CQE per segment.
#include "adp/transfer_kernels.h"
#include "adp/wqe_hns.h"
#include "kernel_operator.h"

using namespace AscendC;

namespace {

constexpr uint32_t kLineBytes = 64;

class AivPoster {
   public:
    __aicore__ inline AivPoster(__gm__ adp::xfer::AivQueue* queue, const adp::xfer::AivPostTiling& tiling)
        : q_(*queue), tiling_(tiling) {
        sq_.SetGlobalBuffer(reinterpret_cast<__gm__ uint32_t*>(q_.sq_addr), uint64_t(q_.depth) * q_.wqe_size / 4);
        head_word_.SetGlobalBuffer(reinterpret_cast<__gm__ uint32_t*>(q_.head_addr), 1);
        tail_word_.SetGlobalBuffer(reinterpret_cast<__gm__ uint32_t*>(q_.tail_addr), 1);
        doorbell_.SetGlobalBuffer(reinterpret_cast<__gm__ uint64_t*>(q_.doorbell_addr), 1);
        post_vtime_.SetGlobalBuffer(reinterpret_cast<__gm__ uint64_t*>(q_.post_vtime_addr), 1);
        Refresh(head_word_);
        head_ = head_word_.GetValue(0);
        rung_ = head_;
        vtime_ns_ = tiling_.start_vtime_ns;
    }

    // Returns false when the SQ stayed full for `timeout_cycles`.
    __aicore__ inline bool Post(const adp::xfer::Segment& seg) {
        if (!WaitForSpace()) return false;
        const adp::wqe::RcSendWqe w =
            adp::wqe::encode_rc_wqe(adp::wqe::kOpcodeWrite, adp::wqe::owner_for_index(head_, q_.owner_shift), true,
                                    seg.length, seg.rkey, seg.remote_addr, seg.lkey, seg.local_addr);
        const uint64_t slot_words = uint64_t(head_ % q_.depth) * q_.wqe_size / 4;
        const uint32_t* words = reinterpret_cast<const uint32_t*>(&w);
        for (uint32_t i = 0; i < adp::wqe::kWqeBytes / 4; ++i) sq_.SetValue(slot_words + i, words[i]);
        // write the WQE's cache lines back to GM, where the NIC reads it
        const uint64_t slot_bytes = slot_words * 4;  // the ring starts on a cache line
        for (uint64_t line = slot_bytes / kLineBytes * kLineBytes; line < slot_bytes + adp::wqe::kWqeBytes;
             line += kLineBytes)
            DataCacheCleanAndInvalid<uint32_t, CacheLine::SINGLE_CACHE_LINE, DcciDst::CACHELINE_OUT>(sq_[line / 4]);
        ++head_;
        vtime_ns_ += tiling_.submit_ns;
        if (head_ - rung_ >= tiling_.doorbell_batch) Ring();
        return true;
    }

    __aicore__ inline void Ring() {
        if (head_ == rung_) return;
        uint64_t vbits;
        static_assert(sizeof(vbits) == sizeof(vtime_ns_), "virtual time is a double");
        __builtin_memcpy(&vbits, &vtime_ns_, sizeof(vbits));
        post_vtime_.SetValue(0, vbits);
        Flush(post_vtime_);
        head_word_.SetValue(0, head_);
        Flush(head_word_);
        doorbell_.SetValue(0, adp::wqe::encode_sq_doorbell(q_.qpn, head_, q_.sl));
        Flush(doorbell_);
        rung_ = head_;
    }

    __aicore__ inline uint32_t head() const { return head_; }
    __aicore__ inline uint32_t tail() const { return tail_; }

   private:
    template <typename T>
    __aicore__ inline void Flush(const GlobalTensor<T>& t) {
        DataCacheCleanAndInvalid<T, CacheLine::SINGLE_CACHE_LINE, DcciDst::CACHELINE_OUT>(t);
    }
    template <typename T>
    __aicore__ inline void Refresh(const GlobalTensor<T>& t) {  // drop a stale cached copy before reading
        DataCacheCleanAndInvalid<T, CacheLine::SINGLE_CACHE_LINE, DcciDst::CACHELINE_OUT>(t);
    }

    // At most depth - 1 WQEs outstanding, so that head == tail always means an empty queue.
    __aicore__ inline bool WaitForSpace() {
        Refresh(tail_word_);
        tail_ = tail_word_.GetValue(0);
        if (head_ - tail_ + 1 <= q_.depth - 1) return true;
        Ring();  // the NIC only retires what a doorbell covers
        const int64_t start = GetSystemCycle();
        while (head_ - tail_ + 1 > q_.depth - 1) {
            if (uint64_t(GetSystemCycle() - start) > tiling_.timeout_cycles) return false;
            Refresh(tail_word_);
            tail_ = tail_word_.GetValue(0);
        }
        return true;
    }

    adp::xfer::AivQueue q_;
    adp::xfer::AivPostTiling tiling_;
    GlobalTensor<uint32_t> sq_, head_word_, tail_word_;
    GlobalTensor<uint64_t> doorbell_, post_vtime_;
    uint32_t head_ = 0, rung_ = 0, tail_ = 0;
    double vtime_ns_ = 0;
};

}  // namespace

extern "C" __global__ __aicore__ void aiv_post_wqe(GM_ADDR segments, GM_ADDR queues, GM_ADDR status, GM_ADDR tiling) {
    const adp::xfer::AivPostTiling t = *reinterpret_cast<__gm__ adp::xfer::AivPostTiling*>(tiling);
    const uint64_t core = uint64_t(GetBlockIdx());
    uint64_t begin, end;
    adp::xfer::core_share(t.num_segments, core, uint64_t(GetBlockNum()), &begin, &end);
    AivPoster poster(reinterpret_cast<__gm__ adp::xfer::AivQueue*>(queues) + core, t);
    const __gm__ adp::xfer::Segment* segs = reinterpret_cast<__gm__ adp::xfer::Segment*>(segments);

    uint32_t code = adp::xfer::kCoreOk, posted = 0;
    for (uint64_t i = begin; i < end; ++i, ++posted) {
        if (!poster.Post(segs[i])) {
            code = adp::xfer::kCoreSqTimeout;
            break;
        }
    }
    poster.Ring();

    GlobalTensor<uint32_t> out;
    out.SetGlobalBuffer(reinterpret_cast<__gm__ uint32_t*>(status) + core * 4, 4);
    out.SetValue(0, code);
    out.SetValue(1, posted);
    out.SetValue(2, poster.head());
    out.SetValue(3, poster.tail());
    DataCacheCleanAndInvalid<uint32_t, CacheLine::SINGLE_CACHE_LINE, DcciDst::CACHELINE_OUT>(out);
}
