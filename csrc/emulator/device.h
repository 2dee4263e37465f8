// Emulated Ascend device: protection domain, registered memory, completion queues, RoCE queue pairs
// and the NIC engine thread that executes real 48-byte WQEs after their doorbell.
//
// Memory layout of a queue pair (all inside one registered device-GM region, as on hardware, so that
// vector-core kernels can post WQEs themselves):
//   +0    u32 head         producer index, written by posters after each WQE
//   +64   u32 tail         consumer index, written by the NIC as it retires WQEs
//   +128  u64 doorbell     the SQ doorbell register (qpn | PI << 32 | SL << 48)
//   +192  u64 post_vtime   emulator: virtual time at which the poster rang the doorbell
//   +256  u8  dirty[depth] emulator: WQE slots written but not yet flushed (DataCacheCleanAndInvalid)
//   +ring_offset           depth * wqe_size bytes of WQEs
// Completion queue: +0 u32 reserve (producer), +64 u32 consumer index, +128 u32 overrun, +256 CQEs.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "adp/wqe_hns.h"
#include "emulator/cost_model.h"
#include "emulator/fabric.h"

namespace adp::emu {

class Nic;

struct Completion {
    wqe::Cqe cqe;
    std::string detail;  // why it failed, naming the value and the limit; empty on success
    uint32_t opcode() const { return cqe.byte_4 & wqe::kOpcodeMask; }
    uint32_t owner() const { return (cqe.byte_4 >> 7) & 1u; }
    uint32_t status() const { return (cqe.byte_4 >> 8) & 0xffu; }
    uint32_t syndrome() const { return (cqe.byte_4 >> 16) & 0xffu; }
};

class CompletionQueue {
   public:
    static constexpr uint64_t kEntriesOffset = 256;

    CompletionQueue(std::shared_ptr<Fabric> fabric, uint32_t pd, uint32_t device_id, uint32_t depth);
    uint32_t depth() const { return depth_; }
    uint32_t lkey() const { return region_->info().lkey; }
    const std::shared_ptr<Region>& region() const { return region_; }
    // A closed CQ refuses polls, new queue pairs and posts on the queue pairs that complete into it;
    // the NIC flushes such WQEs without writing a CQE.
    void close() { region_->close(); }
    bool closed() const { return !region_->registered(); }
    // QueueError naming this CQ when it is closed; `what` says what was refused.
    void check_open(const char* what) const;

    // Producer side; `base` is this CQ's ring as mapped by the caller (possibly another process).
    // Returns false (and sets the overrun flag) when the consumer has not freed a slot.
    static bool push(uint8_t* base, uint32_t depth, wqe::Cqe cqe);

    // Consumer side: up to `max_entries` completions; waits up to `timeout_s` for the first one
    // (0 = do not wait). Raises QueueError after an overrun.
    std::vector<Completion> poll(uint32_t max_entries, double timeout_s);
    uint32_t consumer_index() const;

    // Details of failed completions, recorded by the NIC of this process, keyed by (qpn, wqe index).
    void record_detail(uint32_t qpn, uint32_t wqe_index, std::string detail);

   private:
    std::shared_ptr<Region> region_;
    uint32_t depth_;
    std::mutex detail_mutex_;
    std::map<std::pair<uint32_t, uint32_t>, std::string> details_;
};

enum class QpState : uint32_t { kReadyToSend = 0, kError = 1 };

// Arguments of one work request posted from the host side (tests, the host/AICPU paths).
struct WorkRequest {
    uint32_t opcode = wqe::kOpcodeWrite;
    uint64_t local_addr = 0;
    uint32_t lkey = 0;
    uint32_t length = 0;
    uint64_t remote_addr = 0;
    uint32_t rkey = 0;
    bool signaled = true;
    uint32_t imm = 0;
};

class QueuePair {
   public:
    static constexpr uint64_t kHeadOffset = 0, kTailOffset = 64, kDoorbellOffset = 128, kPostVtimeOffset = 192,
                              kDirtyOffset = 256;

    QueuePair(std::shared_ptr<Fabric> fabric, std::shared_ptr<Nic> nic, uint32_t pd, uint32_t device_id,
              std::shared_ptr<CompletionQueue> send_cq, std::shared_ptr<CompletionQueue> recv_cq, uint32_t depth,
              uint32_t wqe_size, uint32_t sl);
    ~QueuePair();
    void close();

    uint32_t qpn() const { return qpn_; }
    uint32_t depth() const { return depth_; }
    uint32_t wqe_size() const { return wqe_size_; }
    uint32_t sl() const { return sl_; }
    uint32_t owner_shift() const { return log2_exact(depth_); }
    uint32_t dest_qpn() const { return dest_qpn_.load(); }
    void connect(uint32_t dest_qpn);
    QpState state() const { return state_.load(); }
    uint32_t head() const;
    uint32_t tail() const;
    const std::shared_ptr<Region>& region() const { return region_; }
    const std::shared_ptr<CompletionQueue>& send_cq() const { return send_cq_; }
    uint64_t ring_offset() const { return ring_offset_; }
    uint64_t sq_addr() const { return region_->addr() + ring_offset_; }
    uint64_t head_addr() const { return region_->addr() + kHeadOffset; }
    uint64_t tail_addr() const { return region_->addr() + kTailOffset; }
    uint64_t doorbell_addr() const { return region_->addr() + kDoorbellOffset; }
    uint64_t post_vtime_addr() const { return region_->addr() + kPostVtimeOffset; }
    uint64_t dirty_addr() const { return region_->addr() + kDirtyOffset; }

    // Host-side posting: waits (bounded) while the SQ is full, writes and flushes each WQE, then
    // rings the doorbell once. `sl` overrides the doorbell's SL (to exercise the SL check).
    // Returns the producer index after the last WQE.
    uint32_t post(const std::vector<WorkRequest>& requests, double submit_cost_ns, double timeout_s, int sl = -1);
    // Raw access for tests and kernels: write bytes into WQE slot (index mod depth) and ring.
    void write_wqe_bytes(uint32_t index, const uint8_t* bytes, uint32_t size);
    void set_head(uint32_t head);
    void ring_doorbell(uint64_t value, double post_vtime_ns);
    // Waits (bounded) until the NIC has consumed everything posted.
    void drain(double timeout_s);
    // ERROR -> ready-to-send once the NIC has flushed every posted WQE.
    void reset(double timeout_s);
    double poster_vtime_ns() const { return poster_vtime_ns_; }
    void set_poster_vtime_ns(double t) { poster_vtime_ns_ = t; }

   private:
    friend class Nic;
    std::atomic<uint32_t>& head_ref() const;
    std::atomic<uint32_t>& tail_ref() const;
    std::atomic<uint64_t>& doorbell_ref() const;
    std::atomic<uint64_t>& post_vtime_ref() const;
    void wait_for_space(uint32_t head, uint32_t needed, double timeout_s);
    void check_open(const char* what) const;

    std::shared_ptr<Fabric> fabric_;
    std::shared_ptr<Nic> nic_;
    std::shared_ptr<CompletionQueue> send_cq_, recv_cq_;
    std::shared_ptr<Region> region_;
    uint32_t pd_, device_id_, depth_, wqe_size_, sl_, qpn_ = 0;
    uint64_t ring_offset_;
    std::atomic<uint32_t> dest_qpn_{0};
    std::atomic<QpState> state_{QpState::kReadyToSend};
    std::mutex post_mutex_;      // serializes host-side posters
    double poster_vtime_ns_ = 0; // virtual clock of the host-side poster (under post_mutex_)
    // NIC-private state (touched only by the NIC thread)
    uint32_t nic_ci_ = 0;        // next WQE to execute
    uint32_t nic_target_ = 0;    // producer index of the newest accepted doorbell
    uint64_t nic_last_doorbell_ = 0;
    std::deque<std::pair<uint32_t, double>> nic_ready_;  // (target index, poster time) per doorbell
    bool nic_sl_bad_ = false;    // a doorbell carried the wrong SL: WQEs from nic_sl_bad_from_ fail
    uint32_t nic_sl_bad_from_ = 0;
    std::string nic_sl_detail_;
    std::atomic<bool> closed_{false};
};

// The NIC engine: one thread per device. It takes doorbells from every attached QP, then executes
// pending WQEs with deficit round robin across service levels (weights per SL, as ETS/VL arbitration
// does on real NICs), so a heavily weighted class (model collectives) keeps its share of the wire
// while a low class (KV) still always progresses.
class Nic {
   public:
    static constexpr uint32_t kNumServiceLevels = 8;
    static constexpr uint32_t kQuantumBytes = 4096;

    Nic(std::shared_ptr<Fabric> fabric, uint32_t device_id, uint32_t pd, CostModel cost);
    ~Nic();
    void attach(std::shared_ptr<QueuePair> qp);
    void detach(const QueuePair* qp);
    void stop();
    double virtual_time_ns() const { return vclock_ns_.load(); }
    uint64_t wqes_executed() const { return wqes_executed_.load(); }
    uint64_t bytes_moved() const { return bytes_moved_.load(); }
    const CostModel& cost() const { return cost_; }
    // Arbitration weight of each service level (>= 1 each; default all 1).
    void set_sl_weights(const std::vector<uint32_t>& weights);
    std::vector<uint32_t> sl_weights() const;
    // Quiesce: while paused the NIC accepts no doorbell and executes nothing (debugging, tests).
    void set_paused(bool paused) { paused_.store(paused); }

   private:
    void run();
    bool take_doorbell(QueuePair& qp);
    bool arbitrate(const std::vector<std::shared_ptr<QueuePair>>& qps);
    void retire_one(QueuePair& qp);
    uint32_t execute(QueuePair& qp, const wqe::RcSendWqe& w, uint32_t index, std::string* detail,
                     double* vtime_ns);

    std::shared_ptr<Fabric> fabric_;
    uint32_t device_id_, pd_;
    CostModel cost_;
    RegionMapper mapper_;
    std::mutex qps_mutex_;
    std::vector<std::shared_ptr<QueuePair>> qps_;
    std::atomic<uint64_t> qps_version_{0};
    std::atomic<bool> running_{true};
    std::atomic<bool> paused_{false};
    std::atomic<uint32_t> sl_weight_[kNumServiceLevels];
    uint64_t deficit_[kNumServiceLevels] = {};
    uint32_t rr_cursor_[kNumServiceLevels] = {};
    std::vector<QueuePair*> backlogged_;  // scratch of arbitrate(), kept to avoid allocating per round
    std::atomic<double> vclock_ns_{0};
    std::atomic<uint64_t> wqes_executed_{0}, bytes_moved_{0};
    std::thread thread_;
};

class Device {
   public:
    Device(std::shared_ptr<Fabric> fabric, uint32_t device_id, ProductProfile profile, CostModel cost);
    ~Device();
    // Stops the NIC and closes every QP, CQ and region this device made: their keys and queue
    // numbers die and their shared memory is unlinked, whoever still holds a reference.
    void close();

    uint32_t device_id() const { return device_id_; }
    uint32_t pd() const { return pd_; }
    const ProductProfile& profile() const { return profile_; }
    const std::shared_ptr<Fabric>& fabric() const { return fabric_; }
    const std::shared_ptr<Nic>& nic() const { return nic_; }

    std::shared_ptr<Region> alloc_region(uint64_t size, MemKind kind, uint32_t access);
    std::shared_ptr<CompletionQueue> create_cq(uint32_t depth);
    std::shared_ptr<QueuePair> create_qp(std::shared_ptr<CompletionQueue> send_cq,
                                         std::shared_ptr<CompletionQueue> recv_cq, uint32_t depth, uint32_t sl,
                                         uint32_t wqe_size = 64);

   private:
    std::shared_ptr<Fabric> fabric_;
    uint32_t device_id_, pd_;
    ProductProfile profile_;
    std::shared_ptr<Nic> nic_;
    // what this device made, closed with it (weak: the caller's references decide the lifetime)
    std::mutex made_mutex_;
    std::vector<std::weak_ptr<Region>> regions_;
    std::vector<std::weak_ptr<CompletionQueue>> cqs_;
    std::vector<std::weak_ptr<QueuePair>> qps_;
    bool closed_ = false;
};

}  // namespace adp::emu
