#include "emulator/device.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>

namespace adp::emu {

using namespace adp::wqe;

namespace {
template <typename T>
std::atomic<T>& atomic_at(const Region& r, uint64_t offset) {
    return *reinterpret_cast<std::atomic<T>*>(r.data() + offset);
}
uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }
void check_depth(const char* what, uint32_t depth, uint32_t max_depth) {
    if (!is_power_of_two(depth) || depth < 2 || depth > max_depth)
        fail(ErrorKind::kConfig, what, " depth must be a power of two in [2, ", max_depth, "], got ", depth);
}
}  // namespace

// ---- CompletionQueue ------------------------------------------------------------------------

CompletionQueue::CompletionQueue(std::shared_ptr<Fabric> fabric, uint32_t pd, uint32_t device_id, uint32_t depth)
    : depth_(depth) {
    check_depth("CQ", depth, 1u << 22);
    region_ = std::make_shared<Region>(std::move(fabric), MemKind::kDeviceGm, kEntriesOffset + uint64_t(depth) * kCqeBytes,
                                       kLocalWrite, pd, device_id);
}

bool CompletionQueue::push(uint8_t* base, uint32_t depth, Cqe cqe) {
    auto& reserve = *reinterpret_cast<std::atomic<uint32_t>*>(base);
    auto& consumer = *reinterpret_cast<std::atomic<uint32_t>*>(base + 64);
    auto& overrun = *reinterpret_cast<std::atomic<uint32_t>*>(base + 128);
    const uint32_t pi = reserve.fetch_add(1, std::memory_order_acq_rel);
    if (pi - consumer.load(std::memory_order_acquire) >= depth) {
        overrun.fetch_add(1, std::memory_order_acq_rel);  // counts the completions lost
        return false;
    }
    auto* slot = reinterpret_cast<Cqe*>(base + kEntriesOffset + uint64_t(pi % depth) * kCqeBytes);
    const uint32_t byte_4 = (cqe.byte_4 & ~kOwnerBit) | (cqe_owner_for_index(pi, depth) << 7);
    cqe.byte_4 = 0;
    std::memcpy(reinterpret_cast<uint8_t*>(slot) + 4, reinterpret_cast<uint8_t*>(&cqe) + 4, kCqeBytes - 4);
    // the owner bit is published last: a consumer that sees it sees the whole entry
    reinterpret_cast<std::atomic<uint32_t>*>(&slot->byte_4)->store(byte_4, std::memory_order_release);
    return true;
}

void CompletionQueue::check_open(const char* what) const {
    if (closed()) fail(ErrorKind::kQueue, "CQ (lkey ", hex(lkey()), ", depth ", depth_, ") is closed: cannot ", what);
}

uint32_t CompletionQueue::consumer_index() const { return atomic_at<uint32_t>(*region_, 64).load(); }

std::vector<Completion> CompletionQueue::poll(uint32_t max_entries, double timeout_s) {
    check_timeout(timeout_s);
    check_open("poll");
    uint8_t* base = region_->data();
    auto& consumer = atomic_at<uint32_t>(*region_, 64);
    auto& overrun = atomic_at<uint32_t>(*region_, 128);
    auto entry_ready = [&](uint32_t ci) {
        auto* slot = reinterpret_cast<std::atomic<uint32_t>*>(base + kEntriesOffset + uint64_t(ci % depth_) * kCqeBytes);
        return ((slot->load(std::memory_order_acquire) >> 7) & 1u) == cqe_owner_for_index(ci, depth_);
    };
    // An overrun is an error of the whole CQ (IBV_EVENT_CQ_ERR on RoCE): its entries can no longer be trusted to be
    // all the completions, so every poll after it raises, the first included, instead of handing out a partial list.
    auto check_overrun = [&] {
        if (const uint32_t lost = overrun.load(std::memory_order_acquire))
            fail(ErrorKind::kQueue, "CQ (lkey ", hex(lkey()), ", depth ", depth_, ") overran: ", lost,
                 " completions found it full and were lost; the CQ is in error. Size the CQ to at least the number "
                 "of outstanding signaled WQEs");
    };
    check_overrun();
    std::vector<Completion> out;
    uint32_t ci = consumer.load(std::memory_order_relaxed);
    if (timeout_s > 0 && !entry_ready(ci) && !wait_until([&] { return entry_ready(ci) || overrun.load(); }, timeout_s)) {
        fail(ErrorKind::kTimeout, "timed out after ", timeout_s, " s waiting for a completion on CQ (lkey ", hex(lkey()),
             ", depth ", depth_, ", consumer index ", ci, ")");
    }
    while (out.size() < max_entries && entry_ready(ci)) {
        Completion c;
        std::memcpy(&c.cqe, base + kEntriesOffset + uint64_t(ci % depth_) * kCqeBytes, kCqeBytes);
        if (c.status() != kStatusSuccess) {
            std::lock_guard<std::mutex> guard(detail_mutex_);
            auto it = details_.find({c.cqe.qpn, c.cqe.wqe_index});
            if (it != details_.end()) {
                c.detail = std::move(it->second);
                details_.erase(it);
            }
        }
        out.push_back(std::move(c));
        ++ci;
        consumer.store(ci, std::memory_order_release);
    }
    check_overrun();
    return out;
}

void CompletionQueue::record_detail(uint32_t qpn, uint32_t wqe_index, std::string detail) {
    std::lock_guard<std::mutex> guard(detail_mutex_);
    if (details_.size() >= 4096) details_.erase(details_.begin());  // bounded: oldest unpolled details go first
    details_[{qpn, wqe_index}] = std::move(detail);
}

// ---- QueuePair ------------------------------------------------------------------------------

QueuePair::QueuePair(std::shared_ptr<Fabric> fabric, std::shared_ptr<Nic> nic, uint32_t pd, uint32_t device_id,
                     std::shared_ptr<CompletionQueue> send_cq, std::shared_ptr<CompletionQueue> recv_cq,
                     uint32_t depth, uint32_t wqe_size, uint32_t sl)
    : fabric_(std::move(fabric)), nic_(std::move(nic)), send_cq_(std::move(send_cq)), recv_cq_(std::move(recv_cq)),
      pd_(pd), device_id_(device_id), depth_(depth), wqe_size_(wqe_size), sl_(sl) {
    check_depth("SQ", depth, 32768);  // the owner bit of a WQE sits at bit 15 of the index at most
    if (wqe_size < kWqeBytes || wqe_size % 16 != 0 || wqe_size > 256)
        fail(ErrorKind::kConfig, "wqe_size must be a multiple of 16 in [", kWqeBytes, ", 256], got ", wqe_size);
    if (sl > 7) fail(ErrorKind::kConfig, "service level must be in [0, 7], got ", sl);
    if (!send_cq_) fail(ErrorKind::kConfig, "a queue pair needs a send CQ");
    send_cq_->check_open("create a queue pair on it (send CQ)");
    if (recv_cq_) recv_cq_->check_open("create a queue pair on it (receive CQ)");
    ring_offset_ = align_up(kDirtyOffset + depth, 4096);
    region_ = std::make_shared<Region>(fabric_, MemKind::kDeviceGm, ring_offset_ + uint64_t(depth) * wqe_size,
                                       kLocalWrite, pd, device_id);
    qpn_ = fabric_->register_qp(device_id, recv_cq_ ? recv_cq_->lkey() : 0, recv_cq_ ? recv_cq_->depth() : 0);
}

QueuePair::~QueuePair() { close(); }

void QueuePair::close() {
    if (closed_.exchange(true)) return;
    nic_->detach(this);
    fabric_->deregister_qp(qpn_);
    region_->close();
}

std::atomic<uint32_t>& QueuePair::head_ref() const { return atomic_at<uint32_t>(*region_, kHeadOffset); }
std::atomic<uint32_t>& QueuePair::tail_ref() const { return atomic_at<uint32_t>(*region_, kTailOffset); }
std::atomic<uint64_t>& QueuePair::doorbell_ref() const { return atomic_at<uint64_t>(*region_, kDoorbellOffset); }
std::atomic<uint64_t>& QueuePair::post_vtime_ref() const { return atomic_at<uint64_t>(*region_, kPostVtimeOffset); }
uint32_t QueuePair::head() const { return head_ref().load(std::memory_order_acquire); }
uint32_t QueuePair::tail() const { return tail_ref().load(std::memory_order_acquire); }

void QueuePair::check_open(const char* what) const {
    if (closed_.load()) fail(ErrorKind::kQueue, "qpn ", qpn_, " is closed: cannot ", what);
    if (send_cq_->closed())
        fail(ErrorKind::kQueue, "qpn ", qpn_, ": its send CQ (lkey ", hex(send_cq_->lkey()), ") is closed: cannot ", what);
}

void QueuePair::connect(uint32_t dest_qpn) {
    check_open("connect");
    QpInfo info;
    if (!fabric_->lookup_qp(dest_qpn, &info))
        fail(ErrorKind::kInvalidKey, "qpn ", dest_qpn, " names no live queue pair on fabric '", fabric_->name(), "'");
    dest_qpn_.store(dest_qpn);
}

void QueuePair::wait_for_space(uint32_t head, uint32_t needed, double timeout_s) {
    // As the kernels do: at most depth - 1 WQEs outstanding, so head == tail always means empty.
    auto has_space = [&] { return head - tail() + needed <= depth_ - 1; };
    if (!wait_until(has_space, timeout_s))
        fail(ErrorKind::kTimeout, "timed out after ", timeout_s, " s waiting for SQ space on qpn ", qpn_, ": head=", head,
             " tail=", tail(), " depth=", depth_, " (the NIC retired nothing; is it stopped or the QP stuck?)");
}

uint32_t QueuePair::post(const std::vector<WorkRequest>& requests, double submit_cost_ns, double timeout_s, int sl) {
    check_open("post");
    std::lock_guard<std::mutex> guard(post_mutex_);
    uint32_t head = head_ref().load(std::memory_order_relaxed);
    const uint32_t shift = owner_shift();
    size_t done = 0;
    while (done < requests.size()) {
        // post as many as fit, then ring once: one doorbell per batch, as the kernels do
        const uint32_t batch = uint32_t(std::min<size_t>(requests.size() - done, depth_ / 2));
        wait_for_space(head, batch, timeout_s);
        uint8_t* ring = region_->data() + ring_offset_;
        for (uint32_t i = 0; i < batch; ++i, ++head) {
            const WorkRequest& r = requests[done + i];
            const RcSendWqe w = encode_rc_wqe(r.opcode, owner_for_index(head, shift), r.signaled, r.length, r.rkey,
                                              r.remote_addr, r.lkey, r.local_addr, r.imm);
            std::memcpy(ring + uint64_t(head % depth_) * wqe_size_, &w, sizeof(w));
            poster_vtime_ns_ += submit_cost_ns;
        }
        done += batch;
        head_ref().store(head, std::memory_order_release);
        ring_doorbell(encode_sq_doorbell(qpn_, head, sl < 0 ? sl_ : uint32_t(sl)), poster_vtime_ns_);
    }
    return head;
}

void QueuePair::write_wqe_bytes(uint32_t index, const uint8_t* bytes, uint32_t size) {
    check_open("write a WQE");
    if (size > wqe_size_) fail(ErrorKind::kPayloadTooLarge, "WQE of ", size, " bytes exceeds the slot size ", wqe_size_);
    std::memcpy(region_->data() + ring_offset_ + uint64_t(index % depth_) * wqe_size_, bytes, size);
}

void QueuePair::set_head(uint32_t head) {
    check_open("set the head");
    head_ref().store(head, std::memory_order_release);
}

void QueuePair::ring_doorbell(uint64_t value, double post_vtime_ns) {
    check_open("ring the doorbell");
    uint64_t bits;
    std::memcpy(&bits, &post_vtime_ns, sizeof(bits));
    post_vtime_ref().store(bits, std::memory_order_relaxed);
    doorbell_ref().store(value, std::memory_order_release);
}

void QueuePair::drain(double timeout_s) {
    if (closed_.load()) fail(ErrorKind::kQueue, "qpn ", qpn_, " is closed: cannot drain");
    const uint32_t target = head();
    if (!wait_until([&] { return tail() == target; }, timeout_s))
        fail(ErrorKind::kTimeout, "timed out after ", timeout_s, " s draining qpn ", qpn_, ": head=", target,
             " tail=", tail(), " (WQEs written but no doorbell covering them, or the NIC is stopped)");
}

void QueuePair::reset(double timeout_s) {
    drain(timeout_s);
    // the NIC thread has retired everything and touches this QP again only after a new doorbell
    nic_sl_bad_ = false;
    state_.store(QpState::kReadyToSend);
}

// ---- Nic ------------------------------------------------------------------------------------

Nic::Nic(std::shared_ptr<Fabric> fabric, uint32_t device_id, uint32_t pd, CostModel cost)
    : fabric_(std::move(fabric)), device_id_(device_id), pd_(pd), cost_(cost) {
    for (auto& w : sl_weight_) w.store(1);
    thread_ = std::thread([this] { run(); });
}

Nic::~Nic() { stop(); }

void Nic::stop() {
    if (running_.exchange(false) && thread_.joinable()) thread_.join();
    std::vector<std::shared_ptr<QueuePair>> released;
    {
        std::lock_guard<std::mutex> guard(qps_mutex_);
        released.swap(qps_);
    }
    // the QPs may die here, and their close() detaches from this NIC: not under qps_mutex_
    released.clear();
}

void Nic::attach(std::shared_ptr<QueuePair> qp) {
    if (!running_.load()) fail(ErrorKind::kQueue, "the NIC of device ", device_id_, " is stopped");
    std::lock_guard<std::mutex> guard(qps_mutex_);
    qps_.push_back(std::move(qp));
    qps_version_.fetch_add(1);
}

void Nic::detach(const QueuePair* qp) {
    std::lock_guard<std::mutex> guard(qps_mutex_);
    for (auto it = qps_.begin(); it != qps_.end(); ++it)
        if (it->get() == qp) {
            qps_.erase(it);
            qps_version_.fetch_add(1);
            return;
        }
}

void Nic::set_sl_weights(const std::vector<uint32_t>& weights) {
    if (weights.size() != kNumServiceLevels)
        fail(ErrorKind::kConfig, "need one weight per service level (", kNumServiceLevels, "), got ", weights.size());
    for (uint32_t sl = 0; sl < kNumServiceLevels; ++sl) {
        if (weights[sl] < 1 || weights[sl] > 1000)
            fail(ErrorKind::kConfig, "weight of SL ", sl, " must be in [1, 1000], got ", weights[sl]);
        sl_weight_[sl].store(weights[sl]);
    }
}

std::vector<uint32_t> Nic::sl_weights() const {
    std::vector<uint32_t> out;
    for (const auto& w : sl_weight_) out.push_back(w.load());
    return out;
}

void Nic::run() {
    std::vector<std::shared_ptr<QueuePair>> snapshot;
    uint64_t seen_version = ~0ull;
    uint32_t idle_rounds = 0;
    while (running_.load(std::memory_order_relaxed)) {
        if (qps_version_.load(std::memory_order_acquire) != seen_version) {
            std::lock_guard<std::mutex> guard(qps_mutex_);
            snapshot = qps_;
            seen_version = qps_version_.load();
        }
        bool busy = false;
        if (!paused_.load(std::memory_order_relaxed)) {
            for (auto& qp : snapshot) busy |= take_doorbell(*qp);
            busy |= arbitrate(snapshot);
        }
        if (busy) {
            idle_rounds = 0;
        } else if (++idle_rounds > 512) {  // idle: back off so the posters get the cores
            std::this_thread::sleep_for(std::chrono::microseconds(idle_rounds > 4096 ? 100 : 10));
        } else if (idle_rounds > 64) {
            std::this_thread::yield();
        }
    }
}

bool Nic::take_doorbell(QueuePair& qp) {
    const uint64_t db = qp.doorbell_ref().load(std::memory_order_acquire);
    if (db == qp.nic_last_doorbell_) return false;
    qp.nic_last_doorbell_ = db;
    uint64_t vbits = qp.post_vtime_ref().load(std::memory_order_relaxed);
    double ready_ns;
    std::memcpy(&ready_ns, &vbits, sizeof(ready_ns));

    const uint32_t pending_after = (doorbell_pi(db) - (qp.nic_ci_ & 0xffffu)) & 0xffffu;
    if (doorbell_qpn(db) != qp.qpn_ || doorbell_cmd(db) != kDoorbellCmdSq || pending_after >= qp.depth_) {
        // nothing in it can be trusted: fail the QP and retire nothing
        const std::string detail = cat("doorbell ", hex(db), " on qpn ", qp.qpn_, " is malformed: qpn ", doorbell_qpn(db),
                                       ", cmd ", doorbell_cmd(db), ", ", pending_after, " WQEs pending of depth ", qp.depth_);
        qp.state_.store(QpState::kError);
        Cqe cqe{};
        cqe.byte_4 = (status_for(kSynBadDoorbell) << 8) | (kSynBadDoorbell << 16);
        cqe.qpn = qp.qpn_;
        cqe.wqe_index = qp.nic_ci_;
        if (!qp.send_cq_->closed()) {
            qp.send_cq_->record_detail(qp.qpn_, qp.nic_ci_, detail);
            CompletionQueue::push(qp.send_cq_->region()->data(), qp.send_cq_->depth(), cqe);
        }
        return true;
    }
    const uint32_t target = qp.nic_ci_ + pending_after;
    if (doorbell_sl(db) != qp.sl_ && !qp.nic_sl_bad_) {
        qp.nic_sl_bad_ = true;
        qp.nic_sl_bad_from_ = qp.nic_target_;
        qp.nic_sl_detail_ = cat("doorbell SL ", doorbell_sl(db), " differs from the communicator's configured SL ", qp.sl_,
                                " on qpn ", qp.qpn_);
    }
    qp.nic_target_ = target;
    qp.nic_ready_.emplace_back(target, ready_ns);
    return true;
}

bool Nic::arbitrate(const std::vector<std::shared_ptr<QueuePair>>& qps) {
    uint32_t backlogged_sls = 0;
    for (const auto& qp : qps)
        if (qp->nic_ci_ != qp->nic_target_) backlogged_sls |= 1u << qp->sl_;
    for (uint32_t sl = 0; sl < kNumServiceLevels; ++sl) {
        if (!(backlogged_sls & (1u << sl))) {
            deficit_[sl] = 0;  // an idle class keeps no credit
            continue;
        }
        // the QPs of this class with WQEs waiting, visited round robin from where the class stopped last
        std::vector<QueuePair*>& backlogged = backlogged_;
        backlogged.clear();
        for (const auto& qp : qps)
            if (qp->sl_ == sl && qp->nic_ci_ != qp->nic_target_) backlogged.push_back(qp.get());
        deficit_[sl] += uint64_t(kQuantumBytes) * sl_weight_[sl].load(std::memory_order_relaxed);
        const size_t n = backlogged.size();
        for (size_t visited = 0; visited < n; ++visited) {
            QueuePair& qp = *backlogged[(rr_cursor_[sl] + visited) % n];
            while (qp.nic_ci_ != qp.nic_target_) {
                uint32_t len;
                std::memcpy(&len, qp.region_->data() + qp.ring_offset_ + uint64_t(qp.nic_ci_ % qp.depth_) * qp.wqe_size_ +
                                      offsetof(RcSendWqe, msg_len), sizeof(len));
                const uint64_t cost = std::max<uint64_t>(len, 1);
                if (cost > deficit_[sl]) break;
                deficit_[sl] -= cost;
                retire_one(qp);
            }
            if (qp.nic_ci_ != qp.nic_target_) {  // out of credit: resume with this QP next round
                rr_cursor_[sl] = uint32_t((rr_cursor_[sl] + visited) % n);
                break;
            }
        }
    }
    return backlogged_sls != 0;
}

void Nic::retire_one(QueuePair& qp) {
    const uint32_t index = qp.nic_ci_;
    while (!qp.nic_ready_.empty() && int32_t(qp.nic_ready_.front().first - index) <= 0) qp.nic_ready_.pop_front();
    const double ready_ns = qp.nic_ready_.empty() ? 0.0 : qp.nic_ready_.front().second;
    RcSendWqe w;
    std::memcpy(&w, qp.region_->data() + qp.ring_offset_ + uint64_t(index % qp.depth_) * qp.wqe_size_, sizeof(w));
    const uint8_t* dirty = qp.region_->data() + QueuePair::kDirtyOffset;
    std::string detail;
    double vtime = ready_ns;
    uint32_t syndrome;
    // a closed send CQ takes no CQE: the QP goes to ERROR and its WQEs are flushed without one
    const bool cq_open = !qp.send_cq_->closed();
    if (!cq_open) qp.state_.store(QpState::kError);
    if (qp.state_.load() == QpState::kError) {
        syndrome = kSynFlushed;
        detail = cat("qpn ", qp.qpn_, " is in the ERROR state: WQE ", index, " flushed without executing");
    } else if (qp.nic_sl_bad_ && int32_t(index - qp.nic_sl_bad_from_) >= 0) {
        syndrome = kSynSlMismatch;
        detail = qp.nic_sl_detail_;
    } else if (dirty[index % qp.depth_]) {
        syndrome = kSynUnflushedWqe;
        detail = cat("doorbell rang before WQE ", index, " of qpn ", qp.qpn_,
                     " was flushed from the cache (missing DataCacheCleanAndInvalid)");
    } else {
        syndrome = execute(qp, w, index, &detail, &vtime);
    }
    if (syndrome != kSynNone) qp.state_.store(QpState::kError);  // RC semantics: the first error kills the QP
    if (cq_open && (syndrome != kSynNone || (w.byte_4 & kSignaledBit))) {
        Cqe cqe{};
        cqe.byte_4 = (w.byte_4 & kOpcodeMask) | (status_for(syndrome) << 8) | (syndrome << 16);
        cqe.qpn = qp.qpn_;
        cqe.wqe_index = index;
        cqe.byte_cnt = syndrome == kSynNone ? w.msg_len : 0;
        cqe.vtime_ns = uint64_t(vtime);
        if (syndrome != kSynNone) qp.send_cq_->record_detail(qp.qpn_, index, std::move(detail));
        CompletionQueue::push(qp.send_cq_->region()->data(), qp.send_cq_->depth(), cqe);
    }
    qp.nic_ci_ = index + 1;
    qp.tail_ref().store(qp.nic_ci_, std::memory_order_release);
}

uint32_t Nic::execute(QueuePair& qp, const RcSendWqe& w, uint32_t index, std::string* detail, double* vtime_ns) {
    const uint32_t opcode = w.byte_4 & kOpcodeMask;
    if (opcode != kOpcodeWrite && opcode != kOpcodeWriteWithImm && opcode != kOpcodeRead) {
        *detail = cat("WQE ", index, " of qpn ", qp.qpn_, " has opcode ", opcode, "; supported: WRITE=3, WRITE_WITH_IMM=4, READ=5");
        return kSynBadOpcode;
    }
    if ((w.byte_16 >> kNumSgeShift) != 1) {
        *detail = cat("WQE ", index, " has num_sge ", (w.byte_16 >> kNumSgeShift), "; the emulated NIC takes exactly 1");
        return kSynBadNumSge;
    }
    const uint32_t expected_bit = (~owner_for_index(index, qp.owner_shift()) & 1u);
    if (((w.byte_4 >> 7) & 1u) != expected_bit) {
        *detail = cat("WQE ", index, " of qpn ", qp.qpn_, " has owner bit ", (w.byte_4 >> 7) & 1u, ", expected ", expected_bit,
                      " for that index (a stale WQE from the previous pass of the ring)");
        return kSynOwnerMismatch;
    }
    if (w.msg_len == 0) {
        *detail = cat("WQE ", index, " has length 0; transfers must move at least 1 byte");
        return kSynZeroLength;
    }
    if (w.sge_len != w.msg_len) {
        *detail = cat("WQE ", index, " SGE length ", w.sge_len, " differs from message length ", w.msg_len);
        return kSynLengthMismatch;
    }
    if (w.msg_len > kMaxMessageBytes) {
        *detail = cat("WQE ", index, " length ", w.msg_len, " exceeds the RoCE maximum message of ", kMaxMessageBytes, " bytes");
        return kSynMessageTooLarge;
    }
    const bool is_read = opcode == kOpcodeRead;
    AccessCheck local = fabric_->check_local(w.sge_lkey, pd_, w.sge_va, w.sge_len, is_read);
    if (!local.ok()) {
        *detail = std::move(local.detail);
        return local.syndrome;
    }
    AccessCheck remote = fabric_->check_remote(w.rkey, w.remote_va, w.msg_len, is_read ? kRemoteRead : kRemoteWrite);
    if (!remote.ok()) {
        *detail = std::move(remote.detail);
        return remote.syndrome;
    }
    QpInfo dest{};
    uint8_t* recv_cq = nullptr;
    if (opcode == kOpcodeWriteWithImm) {
        RegionInfo cq_region;
        if (!fabric_->lookup_qp(qp.dest_qpn(), &dest) || dest.recv_cq_depth == 0 ||
            !fabric_->lookup_lkey(dest.recv_cq_lkey, &cq_region) || !(recv_cq = mapper_.translate(*fabric_, cq_region, cq_region.base_va))) {
            *detail = cat("WRITE_WITH_IMM on qpn ", qp.qpn_, " needs a connected remote QP with a receive CQ; dest qpn ",
                          qp.dest_qpn(), " has none");
            return kSynNoRemoteQp;
        }
    }
    uint8_t* remote_ptr = mapper_.translate(*fabric_, remote.region, w.remote_va);
    if (!remote_ptr) {  // deregistered and unlinked between the check and the mapping
        *detail = cat("rkey ", hex(w.rkey), " was deregistered while WQE ", index, " executed");
        return kSynBadRkey;
    }
    uint8_t* local_ptr = reinterpret_cast<uint8_t*>(w.sge_va);
    if (is_read) std::memmove(local_ptr, remote_ptr, w.msg_len);
    else std::memmove(remote_ptr, local_ptr, w.msg_len);

    // virtual clock: the NIC serializes egress; host DRAM on either side crosses PCIe
    const bool loopback = remote.region.device_id == device_id_;
    double bytes_per_ns = loopback ? cost_.local_bytes_per_ns : cost_.link_bytes_per_ns;
    double latency_ns = loopback ? 0.0 : cost_.link_latency_ns;
    if (local.region.kind == MemKind::kHostDram || remote.region.kind == MemKind::kHostDram) {
        bytes_per_ns = std::min(bytes_per_ns, cost_.pcie_bytes_per_ns);
        latency_ns += cost_.pcie_latency_ns;
    }
    const double start = std::max(vclock_ns_.load(std::memory_order_relaxed), *vtime_ns);
    const double end = start + cost_.nic_wqe_ns + double(w.msg_len) / bytes_per_ns;
    vclock_ns_.store(end, std::memory_order_relaxed);
    *vtime_ns = end + latency_ns;
    wqes_executed_.fetch_add(1, std::memory_order_relaxed);
    bytes_moved_.fetch_add(w.msg_len, std::memory_order_relaxed);

    if (recv_cq) {
        Cqe cqe{};
        cqe.byte_4 = kCqeOpcodeRecvWriteImm;
        cqe.immtdata = w.immtdata;
        cqe.qpn = dest.qpn;
        cqe.byte_cnt = w.msg_len;
        cqe.vtime_ns = uint64_t(*vtime_ns);
        if (!CompletionQueue::push(recv_cq, dest.recv_cq_depth, cqe)) {
            *detail = cat("receive CQ of qpn ", dest.qpn, " overran (depth ", dest.recv_cq_depth, "); the data was written");
            return kSynRemoteCqOverrun;
        }
    }
    return kSynNone;
}

// ---- models ---------------------------------------------------------------------------------

void check_cost_model(const CostModel& c) {
    const std::pair<const char*, double> positive[] = {
        {"link_bytes_per_ns", c.link_bytes_per_ns},   {"pcie_bytes_per_ns", c.pcie_bytes_per_ns},
        {"local_bytes_per_ns", c.local_bytes_per_ns}, {"link_latency_ns", c.link_latency_ns},
        {"pcie_latency_ns", c.pcie_latency_ns}};
    for (const auto& [name, v] : positive)
        if (!std::isfinite(v) || v <= 0) fail(ErrorKind::kConfig, "CostModel.", name, " must be finite and > 0, got ", v);
    const std::pair<const char*, double> non_negative[] = {
        {"aiv_submit_ns", c.aiv_submit_ns},   {"aicpu_issue_ns", c.aicpu_issue_ns}, {"aicpu_wqe_ns", c.aicpu_wqe_ns},
        {"host_submit_ns", c.host_submit_ns}, {"nic_wqe_ns", c.nic_wqe_ns}};
    for (const auto& [name, v] : non_negative)
        if (!std::isfinite(v) || v < 0) fail(ErrorKind::kConfig, "CostModel.", name, " must be finite and >= 0, got ", v);
}

void check_product_profile(const ProductProfile& p) {
    auto in_range = [](const char* name, uint64_t v, uint64_t lo, uint64_t hi) {
        if (v < lo || v > hi) fail(ErrorKind::kConfig, "ProductProfile.", name, " ", v, " is outside [", lo, ", ", hi, "]");
    };
    in_range("vector_cores", p.vector_cores, 1, 1024);  // the kernels' block_dim limit
    in_range("ub_bytes", p.ub_bytes, 32, 1u << 30);
    in_range("hccl_buffsize_mb", p.hccl_buffsize_mb, 1, 1u << 20);
    in_range("default_expansion_mode", p.default_expansion_mode, 0, 3);
    in_range("rdma_tc", p.rdma_tc, 0, 255);
    in_range("rdma_sl", p.rdma_sl, 0, 7);
    in_range("sq_depth", p.sq_depth, 2, 32768);
    in_range("hbm_bytes", p.hbm_bytes, 1, ~0ull);
    if (p.ub_bytes % 32 != 0) fail(ErrorKind::kConfig, "ProductProfile.ub_bytes ", p.ub_bytes, " is not a multiple of 32");
    if (p.rdma_tc % 4 != 0) fail(ErrorKind::kConfig, "ProductProfile.rdma_tc ", p.rdma_tc, " is not a multiple of 4");
    if (!is_power_of_two(p.sq_depth))
        fail(ErrorKind::kConfig, "ProductProfile.sq_depth ", p.sq_depth, " is not a power of two");
}

// ---- Device ---------------------------------------------------------------------------------

Device::Device(std::shared_ptr<Fabric> fabric, uint32_t device_id, ProductProfile profile, CostModel cost)
    : fabric_(std::move(fabric)), device_id_(device_id), profile_(std::move(profile)) {
    check_product_profile(profile_);
    check_cost_model(cost);
    pd_ = fabric_->allocate_pd();
    nic_ = std::make_shared<Nic>(fabric_, device_id_, pd_, cost);
}

Device::~Device() { close(); }

void Device::close() {
    nic_->stop();
    std::lock_guard<std::mutex> guard(made_mutex_);
    if (closed_) return;
    closed_ = true;
    for (auto& w : qps_)
        if (auto qp = w.lock()) qp->close();
    for (auto& w : cqs_)
        if (auto cq = w.lock()) cq->close();
    for (auto& w : regions_)
        if (auto r = w.lock()) r->close();
}

namespace {
template <typename T>
void remember(std::vector<std::weak_ptr<T>>& made, const std::shared_ptr<T>& item) {
    if (made.size() >= 64)  // drop the ones already gone so the list stays proportional to what lives
        made.erase(std::remove_if(made.begin(), made.end(), [](const std::weak_ptr<T>& w) { return w.expired(); }),
                   made.end());
    made.push_back(item);
}
}  // namespace

std::shared_ptr<Region> Device::alloc_region(uint64_t size, MemKind kind, uint32_t access) {
    auto region = std::make_shared<Region>(fabric_, kind, size, access, pd_, device_id_);
    std::lock_guard<std::mutex> guard(made_mutex_);
    if (closed_) fail(ErrorKind::kQueue, "device ", device_id_, " is closed");
    remember(regions_, region);
    return region;
}

std::shared_ptr<CompletionQueue> Device::create_cq(uint32_t depth) {
    auto cq = std::make_shared<CompletionQueue>(fabric_, pd_, device_id_, depth);
    std::lock_guard<std::mutex> guard(made_mutex_);
    if (closed_) fail(ErrorKind::kQueue, "device ", device_id_, " is closed");
    remember(cqs_, cq);
    return cq;
}

std::shared_ptr<QueuePair> Device::create_qp(std::shared_ptr<CompletionQueue> send_cq,
                                             std::shared_ptr<CompletionQueue> recv_cq, uint32_t depth, uint32_t sl,
                                             uint32_t wqe_size) {
    auto qp = std::make_shared<QueuePair>(fabric_, nic_, pd_, device_id_, std::move(send_cq), std::move(recv_cq), depth,
                                          wqe_size, sl);
    nic_->attach(qp);
    std::lock_guard<std::mutex> guard(made_mutex_);
    remember(qps_, qp);
    return qp;
}

}  // namespace adp::emu
