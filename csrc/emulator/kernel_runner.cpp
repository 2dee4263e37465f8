#include "emulator/kernel_runner.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>

#include "adp/wqe_hns.h"
#include "emulator/hccl_comm.h"

namespace adp::emu::kernel {

namespace {

thread_local CoreContext* t_core = nullptr;

// One registered SQ ring: which cache lines hold unflushed scalar writes, per slot.
struct Ring {
    uint64_t addr = 0, bytes = 0;
    uint32_t depth = 0, slot_bytes = 0;
    uint8_t* dirty = nullptr;         // the QP's dirty[depth] bytes, read by the NIC
    std::vector<uint8_t> line_dirty;  // one flag per cache line of the ring
    uint64_t doorbell = 0;
    uint32_t refs = 0;
};

std::mutex g_rings_mutex;
std::map<uint64_t, Ring> g_rings;               // keyed by ring address
std::map<uint64_t, uint64_t> g_doorbell_tails;  // doorbell address -> tail (consumer index) address
std::atomic<uint32_t> g_num_rings{0};

Ring* ring_containing(uint64_t addr) {
    auto it = g_rings.upper_bound(addr);
    if (it == g_rings.begin()) return nullptr;
    --it;
    return addr < it->second.addr + it->second.bytes ? &it->second : nullptr;
}

void refresh_slot_dirty(Ring& ring, uint64_t slot) {
    const uint64_t lines_per_slot = std::max<uint64_t>(1, ring.slot_bytes / kCacheLineBytes);
    const uint64_t first = slot * ring.slot_bytes / kCacheLineBytes;
    bool any = false;
    for (uint64_t l = first; l < first + lines_per_slot && l < ring.line_dirty.size(); ++l)
        any |= ring.line_dirty[l] != 0;
    __atomic_store_n(ring.dirty + slot, uint8_t(any ? 1 : 0), __ATOMIC_RELEASE);
}

}  // namespace

CoreContext& current_core() {
    if (!t_core) fail(ErrorKind::kProtocol, "an AscendC kernel API was called outside an emulated kernel launch");
    return *t_core;
}

bool in_kernel() { return t_core != nullptr; }

void register_sq_ring(uint64_t ring_addr, uint32_t depth, uint32_t slot_bytes, uint64_t dirty_addr,
                      uint64_t doorbell_addr, uint64_t tail_addr) {
    if (slot_bytes % kCacheLineBytes != 0 && kCacheLineBytes % slot_bytes != 0)
        fail(ErrorKind::kConfig, "SQ slot size ", slot_bytes, " does not tile ", kCacheLineBytes, "-byte cache lines");
    std::lock_guard<std::mutex> guard(g_rings_mutex);
    Ring& ring = g_rings[ring_addr];
    if (ring.refs++ == 0) {
        ring.addr = ring_addr;
        ring.depth = depth;
        ring.slot_bytes = slot_bytes;
        ring.bytes = uint64_t(depth) * slot_bytes;
        ring.dirty = reinterpret_cast<uint8_t*>(dirty_addr);
        ring.line_dirty.assign((ring.bytes + kCacheLineBytes - 1) / kCacheLineBytes, 0);
        ring.doorbell = doorbell_addr;
        g_doorbell_tails[doorbell_addr] = tail_addr;
        g_num_rings.fetch_add(1);
    }
}

void unregister_sq_ring(uint64_t ring_addr) {
    std::lock_guard<std::mutex> guard(g_rings_mutex);
    auto it = g_rings.find(ring_addr);
    if (it == g_rings.end()) return;
    if (--it->second.refs == 0) {
        g_doorbell_tails.erase(it->second.doorbell);
        g_rings.erase(it);
        g_num_rings.fetch_sub(1);
    }
}

void note_gm_write(uint64_t addr, uint64_t bytes) {
    if (g_num_rings.load(std::memory_order_relaxed) == 0 || bytes == 0) return;
    std::lock_guard<std::mutex> guard(g_rings_mutex);
    for (uint64_t a = addr; a < addr + bytes;) {
        Ring* ring = ring_containing(a);
        if (!ring) {  // skip to the next line; rings are line-aligned
            a = (a / kCacheLineBytes + 1) * kCacheLineBytes;
            continue;
        }
        const uint64_t end = std::min(addr + bytes, ring->addr + ring->bytes);
        for (uint64_t l = (a - ring->addr) / kCacheLineBytes; l <= (end - 1 - ring->addr) / kCacheLineBytes; ++l)
            ring->line_dirty[l] = 1;
        const uint64_t first_slot = (a - ring->addr) / ring->slot_bytes,
                       last_slot = (end - 1 - ring->addr) / ring->slot_bytes;
        for (uint64_t s = first_slot; s <= last_slot; ++s)
            __atomic_store_n(ring->dirty + s, uint8_t(1), __ATOMIC_RELEASE);
        a = end;
    }
}

void before_gm_store(uint64_t addr) {
    if (g_num_rings.load(std::memory_order_relaxed) == 0) return;
    uint64_t tail_addr;
    {
        std::lock_guard<std::mutex> guard(g_rings_mutex);
        auto it = g_doorbell_tails.find(addr);
        if (it == g_doorbell_tails.end()) return;
        tail_addr = it->second;
    }
    const uint64_t previous = __atomic_load_n(reinterpret_cast<uint64_t*>(addr), __ATOMIC_ACQUIRE);
    if (previous == 0) return;  // first doorbell of the QP
    const uint32_t previous_pi = adp::wqe::doorbell_pi(previous);
    auto* tail = reinterpret_cast<uint32_t*>(tail_addr);
    Launch* launch = in_kernel() ? current_core().launch : nullptr;
    // bounded: a stopped NIC leaves the latch closed, and the store then proceeds after the timeout
    wait_until(
        [&] {
            return (__atomic_load_n(tail, __ATOMIC_ACQUIRE) & 0xffffu) == previous_pi || (launch && launch->aborted());
        },
        launch ? launch->timeout_s() : 1.0);
}

void flush_cache_line(uint64_t addr) {
    if (g_num_rings.load(std::memory_order_relaxed) == 0) return;
    std::lock_guard<std::mutex> guard(g_rings_mutex);
    Ring* ring = ring_containing(addr);
    if (!ring) return;
    const uint64_t line = (addr - ring->addr) / kCacheLineBytes;
    ring->line_dirty[line] = 0;
    const uint64_t first_slot = line * kCacheLineBytes / ring->slot_bytes;
    const uint64_t last_slot =
        std::min<uint64_t>(ring->depth - 1, ((line + 1) * kCacheLineBytes - 1) / ring->slot_bytes);
    for (uint64_t s = first_slot; s <= last_slot; ++s) refresh_slot_dirty(*ring, s);
}

void flush_entire_cache() {
    std::lock_guard<std::mutex> guard(g_rings_mutex);
    for (auto& [addr, ring] : g_rings) {
        std::fill(ring.line_dirty.begin(), ring.line_dirty.end(), 0);
        for (uint64_t s = 0; s < ring.depth; ++s) __atomic_store_n(ring.dirty + s, uint8_t(0), __ATOMIC_RELEASE);
    }
}

// ---- HCCL hooks -------------------------------------------------------------------------------

uint64_t hccl_batch_write(void* context, uint64_t items_addr, uint32_t num_items, uint32_t core_id) {
    if (!context)
        fail(ErrorKind::kProtocol, "Hccl::BatchWrite without a communicator context (GetHcclContext<0>() is null)");
    return static_cast<HcclComm*>(context)->batch_write(items_addr, num_items, core_id);
}

int32_t hccl_batch_write_wait(void* context, uint64_t handle) {
    Launch* launch = current_core().launch;
    try {
        const double done = static_cast<HcclComm*>(context)->batch_write_wait(handle, launch->timeout_s());
        launch->note_hccl_done_vtime(done);
        return 0;
    } catch (const Error& e) {
        launch->record_hccl_error(e.what(), e.kind());
        return -1;
    }
}

// ---- Launch -------------------------------------------------------------------------------------

Launch::Launch(std::string name, uint32_t block_dim, uint32_t ub_bytes, double timeout_s, void* hccl_context,
               std::function<void()> body)
    : name_(std::move(name)),
      block_dim_(block_dim),
      ub_bytes_(ub_bytes),
      timeout_s_(timeout_s),
      hccl_context_(hccl_context) {
    if (block_dim == 0) fail(ErrorKind::kConfig, "kernel ", name_, ": block_dim must be >= 1");
    check_timeout(timeout_s);
    if (const char* stall = std::getenv("ADP_EMU_MTE2_STALL_US")) {
        char* end = nullptr;
        const unsigned long us = std::strtoul(stall, &end, 10);
        if (*stall == '\0' || *end != '\0' || us > 1000000)
            fail(ErrorKind::kConfig, "ADP_EMU_MTE2_STALL_US='", stall, "' must be an integer in [0, 1000000]");
        mte2_stall_us_ = uint32_t(us);
    }
    results_.resize(block_dim);
    threads_.reserve(block_dim);
    for (uint32_t i = 0; i < block_dim; ++i) threads_.emplace_back([this, i, body] { run_core(i, body); });
}

Launch::~Launch() {
    aborted_.store(true);  // releases barriers and spin loops of cores still running
    cv_.notify_all();
    for (auto& t : threads_)
        if (t.joinable()) t.join();
}

void Launch::run_core(uint32_t idx, std::function<void()> body) {
    CoreContext core;
    core.launch = this;
    core.block_idx = idx;
    core.block_num = block_dim_;
    core.ub_bytes = ub_bytes_;
    core.ub.resize(size_t(ub_bytes_) + 32);
    const uint64_t base = reinterpret_cast<uint64_t>(core.ub.data());
    core.ub_base = core.ub.data() + ((32 - base % 32) % 32);
    t_core = &core;
    std::exception_ptr error;
    try {
        body();
    } catch (...) {
        error = std::current_exception();
    }
    t_core = nullptr;
    std::lock_guard<std::mutex> guard(mutex_);
    results_[idx].finished = true;
    results_[idx].error = error;
    if (error) aborted_.store(true);
    ++finished_;
    cv_.notify_all();
}

bool Launch::done() const {
    std::lock_guard<std::mutex> guard(mutex_);
    return finished_ == block_dim_;
}

void Launch::check_aborted() const {
    if (aborted_.load(std::memory_order_relaxed))
        fail(ErrorKind::kProtocol, "kernel ", name_, " aborted: another core of the launch failed");
}

void Launch::wait(double timeout_s) {
    check_timeout(timeout_s);
    std::unique_lock<std::mutex> lock(mutex_);
    if (!cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return finished_ == block_dim_; }))
        fail(ErrorKind::kTimeout, "timed out after ", timeout_s, " s waiting for kernel ", name_, ": ",
             block_dim_ - finished_, " of ", block_dim_, " vector cores still running");
    // the root cause first: a core's own error, not the abort it triggered in the others
    std::exception_ptr first, aborted;
    for (const auto& r : results_) {
        if (!r.error) continue;
        try {
            std::rethrow_exception(r.error);
        } catch (const Error& e) {
            const bool is_abort = std::string(e.what()).find(" aborted: another core") != std::string::npos;
            if (is_abort && !aborted) aborted = r.error;
            if (!is_abort && !first) first = r.error;
        } catch (...) {
            if (!first) first = r.error;
        }
    }
    if (first) std::rethrow_exception(first);
    if (aborted) std::rethrow_exception(aborted);
    if (!hccl_error_.empty()) throw Error(hccl_error_kind_, hccl_error_);
}

void Launch::stall_mte2() const {
    if (mte2_stall_us_) std::this_thread::sleep_for(std::chrono::microseconds(mte2_stall_us_));
}

void Launch::sync_all() {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t generation = barrier_generation_;
    if (++barrier_count_ == block_dim_) {
        barrier_count_ = 0;
        ++barrier_generation_;
        cv_.notify_all();
        return;
    }
    const bool released = cv_.wait_for(lock, std::chrono::duration<double>(timeout_s_),
                                       [&] { return barrier_generation_ != generation || aborted_.load(); });
    if (barrier_generation_ != generation) return;
    lock.unlock();
    check_aborted();
    if (!released)
        fail(ErrorKind::kTimeout, "kernel ", name_, ": SyncAll timed out after ", timeout_s_, " s; ", barrier_count_,
             " of ", block_dim_, " cores arrived (a core skipped SyncAll or is stuck)");
}

void Launch::record_hccl_error(const std::string& message, ErrorKind kind) {
    std::lock_guard<std::mutex> guard(mutex_);
    if (hccl_error_.empty()) {
        hccl_error_ = message;
        hccl_error_kind_ = kind;
    }
}

void Launch::note_hccl_done_vtime(double t) {
    double cur = hccl_done_vtime_ns_.load();
    while (t > cur && !hccl_done_vtime_ns_.compare_exchange_weak(cur, t)) {
    }
}

}  // namespace adp::emu::kernel
