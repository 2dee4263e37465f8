// Vector-core launcher of the emulator: runs an AscendC kernel body on `block_dim` threads, each an
// emulated AIV core with its own unified buffer (UB), and the GM-side bookkeeping that lets the
// emulator punish what hardware punishes.
//
// What is checked (op_kernels/emu/kernel_operator.h calls into here):
//  - UB: every core owns `ub_bytes` (192 KB on A2/A3); TPipe allocations past it raise CapacityError.
//  - SQ rings: GM ranges registered as a QueuePair's WQE ring. A scalar or DataCopy write into a ring
//    marks the 64-byte cache lines it touched and sets the slot's `dirty` byte (the byte the NIC
//    refuses a WQE for); DataCacheCleanAndInvalid clears the lines it covers, and a slot's dirty byte
//    once none of its lines is dirty. A doorbell rung before the flush yields an UNFLUSHED_WQE CQE.
//  - SyncAll: a barrier over the launch's cores, bounded by the launch timeout; a core that fails
//    aborts the launch, so the others leave their barriers and spin loops instead of hanging.
// Adversarial scheduling (tests only): ADP_EMU_MTE2_STALL_US=N, read at each launch, makes every GM -> UB
// copy of that launch's cores take N more microseconds of wall time: a core slow to read GM, which real
// hardware may always be relative to a remote rank. It widens the window of any cross-rank ordering bug.
// The data cache itself is not modelled: scalar writes land in memory at once; only their
// visibility to the NIC is gated by the flush. ENTIRE_DATA_CACHE flushes every registered ring.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "emulator/common.h"

namespace adp::emu::kernel {

constexpr uint32_t kCacheLineBytes = 64;
constexpr uint64_t kSystemCycleHz = 50000000;  // GetSystemCycle() counts at 50 MHz on A2/A3

class Launch;

// Per-thread context of one emulated vector core.
struct CoreContext {
    Launch* launch = nullptr;
    uint32_t block_idx = 0;
    uint32_t block_num = 0;
    std::vector<uint8_t> ub;  // the unified buffer (ub_base is its first 32-byte aligned byte)
    uint8_t* ub_base = nullptr;
    uint32_t ub_bytes = 0;      // capacity of the unified buffer
    uint32_t ub_used = 0;       // bytes handed out by TPipe::InitBuffer
    int64_t flags[16][8] = {};  // SetFlag/WaitFlag balance per (HardEvent, event id)
};

CoreContext& current_core();  // throws ProtocolError outside a kernel launch
bool in_kernel();

// ---- SQ ring registry ---------------------------------------------------------------------------
// Registers a QP's ring (for dirty tracking) and its doorbell. A doorbell store from a core waits
// (bounded) until the NIC has consumed everything the previous doorbell covered, as a doorbell FIFO of
// depth one would: the emulated NIC keeps one post-time word per QP, so without the latch a fast
// poster would stamp earlier WQEs with a later virtual post time. The stall costs wall time only.
void register_sq_ring(uint64_t ring_addr, uint32_t depth, uint32_t slot_bytes, uint64_t dirty_addr,
                      uint64_t doorbell_addr, uint64_t tail_addr);
void unregister_sq_ring(uint64_t ring_addr);
void note_gm_write(uint64_t addr, uint64_t bytes);  // a scalar/DataCopy write: dirty what it touches
void before_gm_store(uint64_t addr);                // a scalar store is about to happen (doorbell latch)
void flush_cache_line(uint64_t addr);               // DataCacheCleanAndInvalid, SINGLE_CACHE_LINE
void flush_entire_cache();                          // DataCacheCleanAndInvalid, ENTIRE_DATA_CACHE

// ---- HCCL server hooks (AscendC::Hccl in the emulated headers) -----------------------------------
uint64_t hccl_batch_write(void* context, uint64_t items_addr, uint32_t num_items, uint32_t core_id);
// 0 on success; on failure -1 and the error is recorded on the launch.
int32_t hccl_batch_write_wait(void* context, uint64_t handle);

// ---- the launch ---------------------------------------------------------------------------------
struct CoreResult {
    bool finished = false;
    std::exception_ptr error;
};

class Launch {
   public:
    // Starts `block_dim` cores running `body` (which reads GetBlockIdx() etc. from its CoreContext).
    // `hccl_context` is what GetHcclContext<0>() returns inside the kernel (an HcclComm*).
    Launch(std::string name, uint32_t block_dim, uint32_t ub_bytes, double timeout_s, void* hccl_context,
           std::function<void()> body);
    ~Launch();
    Launch(const Launch&) = delete;
    Launch& operator=(const Launch&) = delete;

    const std::string& name() const { return name_; }
    uint32_t block_dim() const { return block_dim_; }
    double timeout_s() const { return timeout_s_; }
    void* hccl_context() const { return hccl_context_; }
    bool done() const;
    // Waits (bounded) for every core; rethrows the first core's error, if any.
    void wait(double timeout_s);
    bool aborted() const { return aborted_.load(); }
    void check_aborted() const;  // throws when another core of the launch failed

    void sync_all();  // SyncAll(): barrier over all cores of the launch
    void stall_mte2() const;  // the ADP_EMU_MTE2_STALL_US delay of a GM -> UB copy (none when unset)
    void record_hccl_error(const std::string& message, ErrorKind kind);
    double hccl_done_vtime_ns() const { return hccl_done_vtime_ns_.load(); }
    void note_hccl_done_vtime(double t);

   private:
    void run_core(uint32_t idx, std::function<void()> body);

    std::string name_;
    uint32_t block_dim_, ub_bytes_;
    double timeout_s_;
    void* hccl_context_;
    uint32_t mte2_stall_us_ = 0;
    std::vector<std::thread> threads_;
    mutable std::mutex mutex_;
    std::condition_variable cv_;
    std::vector<CoreResult> results_;
    uint32_t finished_ = 0;
    std::atomic<bool> aborted_{false};
    // barrier
    uint32_t barrier_count_ = 0;
    uint64_t barrier_generation_ = 0;
    std::string hccl_error_;
    ErrorKind hccl_error_kind_ = ErrorKind::kGeneric;
    std::atomic<double> hccl_done_vtime_ns_{0};
};

}  // namespace adp::emu::kernel
