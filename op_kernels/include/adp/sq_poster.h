// AIV-direct send-queue poster: a vector core writes 48-byte RoCE WRITE WQEs into the ring of one queue
// pair, flushes each WQE's cache lines to GM (the NIC reads the ring from HBM, not from the core's data
// cache), publishes the producer index and rings the 64-bit doorbell. Shared by the aiv_post_wqe transfer
// kernel and the MoE exchange (moe_dispatch / moe_combine). One poster per queue pair for the whole launch:
// the producer index lives in the poster between doorbells.
//
// AscendC names only (GlobalTensor, DataCacheCleanAndInvalid, GetSystemCycle): compiled by CANN's
// ascendc_library for the device and, unchanged, through op_kernels/emu on the CPU emulator.
#pragma once

#include "adp/transfer_kernels.h"
#include "adp/wqe_hns.h"
#include "kernel_operator.h"

#if defined(ADP_EMULATOR)
#include <thread>
#endif

namespace adp::aiv {

constexpr uint32_t kCacheLineBytes = 64;

// Spin-loop pause: nothing on the AI core; on the CPU emulator, give the host cores to other ranks.
__aicore__ inline void relax() {
#if defined(ADP_EMULATOR)
    std::this_thread::yield();
#endif
}

template <typename T>
__aicore__ inline AscendC::GlobalTensor<T> gm_at(uint64_t addr, uint64_t elements) {
    AscendC::GlobalTensor<T> t;
    t.SetGlobalBuffer(reinterpret_cast<__gm__ T*>(addr), elements);
    return t;
}

// Writes the cache line holding t[0] back to GM and drops it, so the next read of it comes from GM.
template <typename T>
__aicore__ inline void flush(const AscendC::GlobalTensor<T>& t) {
    AscendC::DataCacheCleanAndInvalid<T, AscendC::CacheLine::SINGLE_CACHE_LINE, AscendC::DcciDst::CACHELINE_OUT>(t);
}

class SqPoster {
   public:
    // `queue`: the queue pair's descriptor in GM (read field by field: a struct in GM is not copied out).
    // `timeout_cycles` bounds each wait for SQ space (GetSystemCycle() units); `doorbell_batch` > 0 rings the
    // doorbell every that many WQEs (0: only in Ring() and when the SQ is full). `clock` is the emulator's
    // virtual clock (the time posting starts, the cost of one WQE); the device never reads it.
    __aicore__ inline SqPoster(const __gm__ adp::xfer::AivQueue* queue, uint64_t timeout_cycles,
                               const __gm__ adp::xfer::EmulatorClock& clock, uint32_t doorbell_batch = 0)
        : depth_(queue->depth), wqe_size_(queue->wqe_size), owner_shift_(queue->owner_shift),
          qpn_(queue->qpn), sl_(queue->sl), timeout_cycles_(timeout_cycles), doorbell_batch_(doorbell_batch) {
        sq_ = gm_at<uint32_t>(queue->sq_addr, uint64_t(depth_) * wqe_size_ / 4);
        head_word_ = gm_at<uint32_t>(queue->head_addr, 1);
        tail_word_ = gm_at<uint32_t>(queue->tail_addr, 1);
        doorbell_ = gm_at<uint64_t>(queue->doorbell_addr, 1);
#if defined(ADP_EMULATOR)
        post_vtime_ = gm_at<uint64_t>(queue->post_vtime_addr, 1);
        vtime_ns_ = clock.start_vtime_ns;
        submit_ns_ = clock.submit_ns;
#else
        (void)clock;
#endif
        flush(head_word_);
        head_ = head_word_.GetValue(0);
        rung_ = head_;
    }

    // One RDMA WRITE of `length` bytes from local (lkey) to remote (rkey); `signaled` asks for a CQE.
    // False when the SQ stayed full for timeout_cycles.
    __aicore__ inline bool Post(uint64_t local, uint32_t lkey, uint64_t remote, uint32_t rkey, uint32_t length,
                                bool signaled) {
        if (!WaitForSpace()) return false;
        const adp::wqe::RcSendWqe w = adp::wqe::encode_rc_wqe(
            adp::wqe::kOpcodeWrite, adp::wqe::owner_for_index(head_, owner_shift_), signaled, length, rkey, remote,
            lkey, local);
        const uint64_t slot_words = uint64_t(head_ % depth_) * wqe_size_ / 4;
        const uint32_t* words = reinterpret_cast<const uint32_t*>(&w);
        for (uint32_t i = 0; i < adp::wqe::kWqeBytes / 4; ++i) sq_.SetValue(slot_words + i, words[i]);
        const uint64_t slot_bytes = slot_words * 4;  // the ring starts on a cache line
        for (uint64_t line = slot_bytes / kCacheLineBytes * kCacheLineBytes; line < slot_bytes + adp::wqe::kWqeBytes;
             line += kCacheLineBytes)
            flush(sq_[line / 4]);
        ++head_;
        ++posted_;
#if defined(ADP_EMULATOR)
        vtime_ns_ += submit_ns_;
#endif
        if (doorbell_batch_ && head_ - rung_ >= doorbell_batch_) Ring();
        return true;
    }

    // Publishes the producer index and rings the doorbell for every WQE posted since the last ring.
    __aicore__ inline void Ring() {
        if (head_ == rung_) return;
#if defined(ADP_EMULATOR)
        uint64_t vbits;
        static_assert(sizeof(vbits) == sizeof(vtime_ns_), "virtual time is a double");
        __builtin_memcpy(&vbits, &vtime_ns_, sizeof(vbits));
        post_vtime_.SetValue(0, vbits);
        flush(post_vtime_);
#endif
        head_word_.SetValue(0, head_);
        flush(head_word_);
        doorbell_.SetValue(0, adp::wqe::encode_sq_doorbell(qpn_, head_, sl_));
        flush(doorbell_);
        rung_ = head_;
    }

    __aicore__ inline uint32_t posted() const { return posted_; }  // WQEs this poster wrote
    __aicore__ inline uint32_t head() const { return head_; }      // producer index
    __aicore__ inline uint32_t tail() const { return tail_; }      // consumer index last read

   private:
    // At most depth - 1 WQEs outstanding, so that head == tail always means an empty queue.
    __aicore__ inline bool WaitForSpace() {
        flush(tail_word_);  // drop a stale cached copy: the NIC advances the tail behind the core's back
        tail_ = tail_word_.GetValue(0);
        if (head_ - tail_ + 1 <= depth_ - 1) return true;
        Ring();  // the NIC retires only what a doorbell covers
        const int64_t start = AscendC::GetSystemCycle();
        while (head_ - tail_ + 1 > depth_ - 1) {
            if (uint64_t(AscendC::GetSystemCycle() - start) > timeout_cycles_) return false;
            relax();
            flush(tail_word_);
            tail_ = tail_word_.GetValue(0);
        }
        return true;
    }

    uint32_t depth_, wqe_size_, owner_shift_, qpn_, sl_;  // of the queue pair
    uint64_t timeout_cycles_;
    uint32_t doorbell_batch_;
    AscendC::GlobalTensor<uint32_t> sq_, head_word_, tail_word_;
    AscendC::GlobalTensor<uint64_t> doorbell_;
#if defined(ADP_EMULATOR)
    AscendC::GlobalTensor<uint64_t> post_vtime_;
    double vtime_ns_ = 0, submit_ns_ = 0;
#endif
    uint32_t head_ = 0, rung_ = 0, tail_ = 0, posted_ = 0;
};

}  // namespace adp::aiv
