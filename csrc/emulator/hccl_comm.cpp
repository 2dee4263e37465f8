#include "emulator/hccl_comm.h"

#include <unistd.h>

#include <cstring>

namespace adp::emu {

using namespace adp::wqe;

// ---- configuration ----------------------------------------------------------------------------

namespace {
bool parse_u32(const char* text, uint32_t* out) {
    if (!text || !*text) return false;
    char* end = nullptr;
    unsigned long long v = std::strtoull(text, &end, 10);
    if (*end != '\0' || v > 0xffffffffull) return false;
    *out = uint32_t(v);
    return true;
}

// Picks config > env > default for one numeric field and records where the value came from.
uint32_t pick(const char* field, uint32_t config_value, const char* env_name, uint32_t default_value,
              const std::function<const char*(const char*)>& getenv_fn, ResolvedCommConfig* r) {
    if (config_value != kConfigNotSet) {
        r->origin[field] = "config";
        return config_value;
    }
    if (const char* env = getenv_fn(env_name)) {
        uint32_t v;
        if (!parse_u32(env, &v))
            fail(ErrorKind::kConfig, env_name, "='", env, "' is not a non-negative integer");
        r->origin[field] = cat("env ", env_name);
        return v;
    }
    r->origin[field] = "default";
    return default_value;
}

uint32_t expansion_from_env(const char* value, const ProductProfile& p) {
    const std::string v(value);
    // HCCL_OP_EXPANSION_MODE values per product; an unsupported value falls back to the default.
    if (v == "AIV") return 3;
    if (p.name == "A2" && (v == "HOST" || v == "HOST_TS")) return 1;
    if (v == "AI_CPU" || (p.name == "A3" && v == "AICPU_CacheDisable")) return 2;
    return p.default_expansion_mode;
}
}  // namespace

ResolvedCommConfig resolve_comm_config(const HcclCommConfig& c, const ProductProfile& p,
                                       const std::function<const char*(const char*)>& getenv_fn) {
    ResolvedCommConfig r{};
    const uint32_t mb = pick("hcclBufferSize", c.hcclBufferSize, "HCCL_BUFFSIZE", p.hccl_buffsize_mb, getenv_fn, &r);
    if (mb < 1) fail(ErrorKind::kConfig, "hcclBufferSize/HCCL_BUFFSIZE must be >= 1 MB, got ", mb, " (", r.origin["hcclBufferSize"], ")");
    r.buffer_bytes = uint64_t(mb) << 20;
    r.traffic_class = pick("hcclRdmaTrafficClass", c.hcclRdmaTrafficClass, "HCCL_RDMA_TC", p.rdma_tc, getenv_fn, &r);
    if (r.traffic_class > 255 || r.traffic_class % 4 != 0)
        fail(ErrorKind::kConfig, "RDMA traffic class must be a multiple of 4 in [0, 255], got ", r.traffic_class, " (",
             r.origin["hcclRdmaTrafficClass"], ")");
    r.service_level = pick("hcclRdmaServiceLevel", c.hcclRdmaServiceLevel, "HCCL_RDMA_SL", p.rdma_sl, getenv_fn, &r);
    if (r.service_level > 7)
        fail(ErrorKind::kConfig, "RDMA service level must be in [0, 7], got ", r.service_level, " (",
             r.origin["hcclRdmaServiceLevel"], ")");
    if (c.hcclOpExpansionMode > 3)
        fail(ErrorKind::kConfig, "hcclOpExpansionMode must be 0 (default), 1 (host), 2 (aicpu) or 3 (aiv), got ",
             c.hcclOpExpansionMode);
    if (c.hcclOpExpansionMode != 0) {
        r.expansion_mode = c.hcclOpExpansionMode;
        r.origin["hcclOpExpansionMode"] = "config";
    } else if (const char* env = getenv_fn("HCCL_OP_EXPANSION_MODE")) {
        r.expansion_mode = expansion_from_env(env, p);
        r.origin["hcclOpExpansionMode"] = "env HCCL_OP_EXPANSION_MODE";
    } else {
        r.expansion_mode = p.default_expansion_mode;
        r.origin["hcclOpExpansionMode"] = "default";
    }
    return r;
}

uint32_t hccl_data_type_size(uint32_t t) {
    // HcclDataType: INT8 0, INT16 1, INT32 2, FP16 3, FP32 4, INT64 5, UINT64 6, UINT8 7, UINT16 8,
    // UINT32 9, FP64 10, BFP16 11, INT128 12
    static const uint32_t sizes[] = {1, 2, 4, 2, 4, 8, 8, 1, 2, 4, 8, 2, 16};
    if (t >= sizeof(sizes) / sizeof(sizes[0]))
        fail(ErrorKind::kConfig, "unknown HcclDataType ", t, " (known: 0..12)");
    return sizes[t];
}

// ---- RankInfo ---------------------------------------------------------------------------------

namespace {
template <typename T>
void put(std::string& s, const T& v) { s.append(reinterpret_cast<const char*>(&v), sizeof(T)); }
template <typename T>
T take(const std::string& s, size_t& at) {
    if (at + sizeof(T) > s.size()) fail(ErrorKind::kProtocol, "truncated RankInfo (", s.size(), " bytes)");
    T v;
    std::memcpy(&v, s.data() + at, sizeof(T));
    at += sizeof(T);
    return v;
}
void put_qpns(std::string& s, const std::vector<uint32_t>& v) {
    put<uint32_t>(s, uint32_t(v.size()));
    for (uint32_t q : v) put(s, q);
}
std::vector<uint32_t> take_qpns(const std::string& s, size_t& at) {
    std::vector<uint32_t> v(take<uint32_t>(s, at));
    for (auto& q : v) q = take<uint32_t>(s, at);
    return v;
}
constexpr uint32_t kRankInfoMagic = 0x41445052;  // "ADPR"
}  // namespace

std::string RankInfo::serialize() const {
    std::string s;
    put(s, kRankInfoMagic);
    put(s, rank);
    put(s, device_id);
    put(s, windows_in);
    put(s, windows_out);
    put(s, notify);
    put_qpns(s, host_qpns);
    put_qpns(s, aicpu_qpns);
    put_qpns(s, aiv_qpns);
    return s;
}

RankInfo RankInfo::deserialize(const std::string& s) {
    size_t at = 0;
    if (take<uint32_t>(s, at) != kRankInfoMagic) fail(ErrorKind::kProtocol, "bytes are not a serialized RankInfo");
    RankInfo r;
    r.rank = take<uint32_t>(s, at);
    r.device_id = take<uint32_t>(s, at);
    r.windows_in = take<RemoteMem>(s, at);
    r.windows_out = take<RemoteMem>(s, at);
    r.notify = take<RemoteMem>(s, at);
    r.host_qpns = take_qpns(s, at);
    r.aicpu_qpns = take_qpns(s, at);
    r.aiv_qpns = take_qpns(s, at);
    return r;
}

// ---- HcclComm ---------------------------------------------------------------------------------

HcclComm::HcclComm(std::shared_ptr<Device> device, uint32_t rank, uint32_t world_size, HcclCommConfig config)
    : device_(std::move(device)), rank_(rank), world_size_(world_size), config_(std::move(config)) {
    if (world_size == 0 || rank >= world_size)
        fail(ErrorKind::kConfig, "rank ", rank, " is outside world size ", world_size);
    resolved_ = resolve_comm_config(config_, device_->profile(), [](const char* n) { return std::getenv(n); });
    const uint32_t all = kLocalWrite | kRemoteWrite | kRemoteRead;
    windows_in_ = device_->alloc_region(resolved_.buffer_bytes, MemKind::kDeviceGm, all);
    windows_out_ = device_->alloc_region(resolved_.buffer_bytes, MemKind::kDeviceGm, all);
    notify_ = device_->alloc_region(uint64_t(kNotifySlots) * kNotifySlotBytes, MemKind::kDeviceGm, all);
    scratch_ = device_->alloc_region(uint64_t(kNotifySlots) * 8, MemKind::kDeviceGm, kLocalWrite);
    host_ = make_qp_set();
    aicpu_ = make_qp_set();
    aiv_ = make_qp_set();
    magic_base_ = (uint64_t(uint32_t(getpid()) & 0xffffu) << 48) | (uint64_t(rank_ & 0xffffu) << 32);
    aicpu_thread_ = std::thread([this] { aicpu_server(); });
}

HcclComm::~HcclComm() { close(); }

void HcclComm::close() {
    {
        std::lock_guard<std::mutex> guard(aicpu_mutex_);
        if (!aicpu_running_) return;
        aicpu_running_ = false;
    }
    aicpu_cv_.notify_all();
    if (aicpu_thread_.joinable()) aicpu_thread_.join();
    for (QpSet* set : {&host_, &aicpu_, &aiv_}) {
        for (auto& qp : set->qps) qp->close();
        set->cq->close();
    }
    for (auto* r : {&windows_in_, &windows_out_, &notify_, &scratch_}) (*r)->close();
}

HcclComm::QpSet HcclComm::make_qp_set() {
    QpSet set;
    const uint32_t depth = device_->profile().sq_depth;
    set.cq = device_->create_cq(depth * 2);
    for (uint32_t peer = 0; peer < world_size_; ++peer)
        set.qps.push_back(device_->create_qp(set.cq, set.cq, depth, resolved_.service_level));
    return set;
}

const std::shared_ptr<QueuePair>& HcclComm::aiv_qp(uint32_t peer) const {
    check_peer(peer);
    return aiv_.qps[peer];
}

RankInfo HcclComm::local_info() const {
    RankInfo info;
    info.rank = rank_;
    info.device_id = device_->device_id();
    auto mem = [](const std::shared_ptr<Region>& r) { return RemoteMem{r->addr(), r->info().size, r->info().rkey}; };
    info.windows_in = mem(windows_in_);
    info.windows_out = mem(windows_out_);
    info.notify = mem(notify_);
    for (uint32_t p = 0; p < world_size_; ++p) {
        info.host_qpns.push_back(host_.qps[p]->qpn());
        info.aicpu_qpns.push_back(aicpu_.qps[p]->qpn());
        info.aiv_qpns.push_back(aiv_.qps[p]->qpn());
    }
    return info;
}

const RankInfo& HcclComm::peer_info(uint32_t peer) const {
    check_connected("peer_info");
    check_peer(peer);
    return peers_[peer];
}

void HcclComm::connect(const std::vector<RankInfo>& peers) {
    if (peers.size() != world_size_)
        fail(ErrorKind::kConfig, "connect needs one RankInfo per rank: got ", peers.size(), ", world size ", world_size_);
    for (uint32_t p = 0; p < world_size_; ++p) {
        const RankInfo& info = peers[p];
        if (info.rank != p || info.host_qpns.size() != world_size_)
            fail(ErrorKind::kProtocol, "RankInfo at position ", p, " is for rank ", info.rank, " with ",
                 info.host_qpns.size(), " QPs (world size ", world_size_, ")");
        host_.qps[p]->connect(info.host_qpns[rank_]);
        aicpu_.qps[p]->connect(info.aicpu_qpns[rank_]);
        aiv_.qps[p]->connect(info.aiv_qpns[rank_]);
    }
    peers_ = peers;
    remote_mems_.assign(world_size_, {});
    for (uint32_t p = 0; p < world_size_; ++p)
        remote_mems_[p] = {peers[p].windows_in, peers[p].windows_out, peers[p].notify};
    connected_ = true;
}

void HcclComm::register_local(std::shared_ptr<Region> region) {
    if (!region->registered()) fail(ErrorKind::kNotRegistered, "region at ", hex(region->addr()), " is closed");
    std::lock_guard<std::mutex> guard(host_mutex_);
    local_mems_.push_back(std::move(region));
}

void HcclComm::add_remote_mem(uint32_t peer, RemoteMem mem) {
    check_connected("add_remote_mem");
    check_peer(peer);
    std::lock_guard<std::mutex> guard(host_mutex_);
    remote_mems_[peer].push_back(mem);
}

std::vector<RemoteMem> HcclComm::remote_mems(uint32_t peer) const {
    check_connected("remote_mems");
    check_peer(peer);
    std::lock_guard<std::mutex> guard(host_mutex_);
    return remote_mems_[peer];
}

void HcclComm::check_connected(const char* what) const {
    if (!connected_) fail(ErrorKind::kProtocol, what, " before connect(): exchange RankInfo first");
}

void HcclComm::check_peer(uint32_t peer) const {
    if (peer >= world_size_) fail(ErrorKind::kConfig, "peer rank ", peer, " is outside world size ", world_size_);
}

namespace {
bool inside(uint64_t addr, uint64_t bytes, uint64_t base, uint64_t size) {
    return addr >= base && bytes <= size && addr - base <= size - bytes;
}
bool overlaps(uint64_t addr, uint64_t bytes, uint64_t base, uint64_t size) {
    return addr < base + size && base < addr + bytes;
}
}  // namespace

uint32_t HcclComm::local_lkey_for(uint64_t addr, uint64_t bytes, const std::string& what) const {
    const std::shared_ptr<Region>* partial = nullptr;
    for (const auto* r : {&windows_in_, &windows_out_}) {
        if (inside(addr, bytes, (*r)->addr(), (*r)->info().size)) return (*r)->info().lkey;
        if (overlaps(addr, bytes, (*r)->addr(), (*r)->info().size)) partial = r;
    }
    for (const auto& r : local_mems_) {
        if (!r->registered()) continue;
        if (inside(addr, bytes, r->addr(), r->info().size)) return r->info().lkey;
        if (overlaps(addr, bytes, r->addr(), r->info().size)) partial = &r;
    }
    if (partial)
        fail(ErrorKind::kBounds, what, ": local range [", hex(addr), ", +", bytes, ") runs past registered memory [",
             hex((*partial)->addr()), ", +", (*partial)->info().size, ")");
    fail(ErrorKind::kNotRegistered, what, ": local address ", hex(addr), " (+", bytes,
         ") is not in the communicator's windows nor in memory registered with register_local");
}

uint32_t HcclComm::remote_rkey_for(uint32_t peer, uint64_t addr, uint64_t bytes, const std::string& what) const {
    const RemoteMem* partial = nullptr;
    for (const auto& m : remote_mems_[peer]) {
        if (inside(addr, bytes, m.addr, m.size)) return m.rkey;
        if (overlaps(addr, bytes, m.addr, m.size)) partial = &m;
    }
    if (partial)
        fail(ErrorKind::kBounds, what, ": remote range [", hex(addr), ", +", bytes, ") on rank ", peer,
             " runs past its registered memory [", hex(partial->addr), ", +", partial->size, ")");
    fail(ErrorKind::kNotRegistered, what, ": remote address ", hex(addr), " (+", bytes, ") is in no memory rank ", peer,
         " registered (its windows or add_remote_mem)");
}

void HcclComm::check_local_range(uint64_t addr, uint64_t bytes, const std::string& what) const {
    std::lock_guard<std::mutex> guard(host_mutex_);
    local_lkey_for(addr, bytes, what);
}

void HcclComm::check_one_sided(uint32_t peer, uint64_t local_addr, uint64_t remote_addr, uint64_t bytes,
                               const std::string& what) const {
    check_connected(what.c_str());
    check_peer(peer);
    std::lock_guard<std::mutex> guard(host_mutex_);
    local_lkey_for(local_addr, bytes, what);
    remote_rkey_for(peer, remote_addr, bytes, what);
}

double HcclComm::run_requests(QpSet& set, const std::vector<std::pair<uint32_t, WorkRequest>>& requests,
                              double submit_cost_ns, double per_wqe_cost_ns, double start_vtime, double timeout_s) {
    std::map<uint32_t, std::vector<WorkRequest>> by_peer;
    for (const auto& [peer, req] : requests) by_peer[peer].push_back(req);
    double vtime = start_vtime + submit_cost_ns;
    for (auto& [peer, reqs] : by_peer) {
        QueuePair& qp = *set.qps[peer];
        qp.set_poster_vtime_ns(vtime);
        qp.post(reqs, per_wqe_cost_ns, timeout_s);
        vtime = qp.poster_vtime_ns();
    }
    double done = vtime;
    size_t received = 0;
    const Completion* first_error = nullptr;
    std::vector<Completion> errors;
    while (received < requests.size()) {
        std::vector<Completion> got = set.cq->poll(uint32_t(requests.size() - received), timeout_s);
        received += got.size();
        for (auto& c : got) {
            done = std::max(done, double(c.cqe.vtime_ns));
            if (c.status() != kStatusSuccess) errors.push_back(std::move(c));
        }
    }
    for (auto& c : errors)
        if (c.syndrome() != kSynFlushed) {
            first_error = &c;
            break;
        }
    if (!errors.empty()) {
        for (auto& [peer, reqs] : by_peer) set.qps[peer]->reset(timeout_s);
        const Completion& e = first_error ? *first_error : errors.front();
        fail(ErrorKind::kQueue, "transfer failed with CQE status ", hex(e.status()), " (syndrome ", e.syndrome(),
             ") on qpn ", e.cqe.qpn, ": ", e.detail);
    }
    return done;
}

double HcclComm::one_sided(uint32_t peer, const std::vector<OneSideDesc>& descs, uint32_t opcode, double timeout_s) {
    const char* api = opcode == kOpcodeRead ? "HcclBatchGet" : "HcclBatchPut";
    check_connected(api);
    check_peer(peer);
    std::lock_guard<std::mutex> guard(host_mutex_);
    std::vector<std::pair<uint32_t, WorkRequest>> requests;
    for (size_t i = 0; i < descs.size(); ++i) {  // validate everything before anything moves
        const OneSideDesc& d = descs[i];
        const std::string what = cat(api, " desc ", i);
        const uint64_t bytes = d.count * hccl_data_type_size(d.data_type);
        if (d.count == 0) fail(ErrorKind::kConfig, what, ": count must be > 0");
        if (bytes > kMaxMessageBytes)
            fail(ErrorKind::kPayloadTooLarge, what, ": ", bytes, " bytes exceed the maximum message of ", kMaxMessageBytes);
        WorkRequest r;
        r.opcode = opcode;
        r.local_addr = d.local_addr;
        r.lkey = local_lkey_for(d.local_addr, bytes, what);
        r.remote_addr = d.remote_addr;
        r.rkey = remote_rkey_for(peer, d.remote_addr, bytes, what);
        r.length = uint32_t(bytes);
        requests.emplace_back(peer, r);
    }
    if (requests.empty()) return host_vtime_ns_;
    const CostModel& cost = device_->nic()->cost();
    host_vtime_ns_ = run_requests(host_, requests, cost.host_submit_ns, 0.0, host_vtime_ns_, timeout_s);
    return host_vtime_ns_;
}

double HcclComm::batch_put(uint32_t peer, const std::vector<OneSideDesc>& descs, double timeout_s) {
    return one_sided(peer, descs, kOpcodeWrite, timeout_s);
}

double HcclComm::batch_get(uint32_t peer, const std::vector<OneSideDesc>& descs, double timeout_s) {
    return one_sided(peer, descs, kOpcodeRead, timeout_s);
}

uint64_t HcclComm::batch_write(uint64_t items_addr, uint32_t num_items, uint32_t core_id) {
    check_connected("BatchWrite");
    if (core_id != 0)
        fail(ErrorKind::kProtocol, "BatchWrite submitted from vector core ", core_id,
             "; only core 0 may write the hcclMsgArea (synchronize the cores, then submit from core 0)");
    if (num_items == 0) fail(ErrorKind::kConfig, "BatchWrite needs at least 1 item");
    const uint64_t bytes = uint64_t(num_items) * sizeof(BatchWriteItem);
    local_lkey_for(items_addr, bytes, "BatchWrite item array");
    std::lock_guard<std::mutex> guard(aicpu_mutex_);
    const uint64_t handle = next_handle_++;
    Job& job = aicpu_jobs_[handle];
    // the AICPU reads the items from GM when it serves the request; copy them now as it would
    const auto* items = reinterpret_cast<const BatchWriteItem*>(items_addr);
    for (uint32_t i = 0; i < num_items; ++i) {
        const BatchWriteItem& it = items[i];
        const std::string what = cat("BatchWrite item ", i);
        try {
            check_peer(it.remote_rank_id);
            const uint64_t n = it.count * hccl_data_type_size(it.data_type);
            if (it.count == 0) fail(ErrorKind::kConfig, what, ": count must be > 0");
            if (n > kMaxMessageBytes)
                fail(ErrorKind::kPayloadTooLarge, what, ": ", n, " bytes exceed the maximum message of ", kMaxMessageBytes);
            WorkRequest r;
            r.local_addr = it.local_buf;
            r.lkey = local_lkey_for(it.local_buf, n, what);
            r.remote_addr = it.remote_buf;
            r.rkey = remote_rkey_for(it.remote_rank_id, it.remote_buf, n, what);
            r.length = uint32_t(n);
            job.requests.push_back(r);
            job.peers.push_back(it.remote_rank_id);
        } catch (const Error& e) {  // the server rejects the whole issue; nothing moves
            job.requests.clear();
            job.error = e.what();
            job.error_kind = e.kind();
            break;
        }
    }
    aicpu_queue_.push_back(handle);
    aicpu_cv_.notify_all();
    return handle;
}

void HcclComm::aicpu_server() {
    std::unique_lock<std::mutex> lock(aicpu_mutex_);
    while (true) {
        aicpu_cv_.wait(lock, [&] { return !aicpu_running_ || !aicpu_queue_.empty(); });
        if (!aicpu_running_) return;
        const uint64_t handle = aicpu_queue_.front();
        aicpu_queue_.pop_front();
        Job& job = aicpu_jobs_[handle];
        ++aicpu_issues_;
        if (job.error.empty()) {
            std::vector<std::pair<uint32_t, WorkRequest>> requests;
            for (size_t i = 0; i < job.requests.size(); ++i) requests.emplace_back(job.peers[i], job.requests[i]);
            const CostModel& cost = device_->nic()->cost();
            lock.unlock();
            double done = 0;
            std::string error;
            ErrorKind kind = ErrorKind::kGeneric;
            try {
                // the AICPU's own bound on one issue: hcclExecTimeOut when the config sets it
                const double timeout_s = config_.hcclExecTimeOut > 0 ? double(config_.hcclExecTimeOut) : kDefaultExecTimeoutS;
                done = run_requests(aicpu_, requests, cost.aicpu_issue_ns, cost.aicpu_wqe_ns, aicpu_vtime_ns_, timeout_s);
            } catch (const Error& e) {
                error = e.what();
                kind = e.kind();
            }
            lock.lock();
            Job& j = aicpu_jobs_[handle];
            aicpu_vtime_ns_ = std::max(aicpu_vtime_ns_, done);
            j.done_vtime = done;
            j.error = error;
            j.error_kind = kind;
        }
        aicpu_jobs_[handle].done = true;
        aicpu_cv_.notify_all();
    }
}

double HcclComm::batch_write_wait(uint64_t handle, double timeout_s) {
    check_timeout(timeout_s);
    std::unique_lock<std::mutex> lock(aicpu_mutex_);
    auto it = aicpu_jobs_.find(handle);
    if (it == aicpu_jobs_.end()) fail(ErrorKind::kInvalidKey, "BatchWrite handle ", handle, " is unknown or already waited");
    if (!aicpu_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return it->second.done; }))
        fail(ErrorKind::kTimeout, "timed out after ", timeout_s, " s waiting for BatchWrite handle ", handle, " (",
             it->second.requests.size(), " items) on rank ", rank_, "; ", aicpu_queue_.size(), " issues queued");
    Job job = std::move(it->second);
    aicpu_jobs_.erase(it);
    if (!job.error.empty()) throw Error(job.error_kind, job.error);
    return job.done_vtime;
}

uint64_t HcclComm::next_magic() {
    std::lock_guard<std::mutex> guard(host_mutex_);
    return magic_base_ | (++magic_counter_ & 0xffffffffull);
}

void HcclComm::notify_record(uint32_t peer, uint32_t slot, uint64_t magic, double timeout_s) {
    check_connected("notify_record");
    check_peer(peer);
    if (slot >= kNotifySlots) fail(ErrorKind::kBounds, "notify slot ", slot, " is outside [0, ", kNotifySlots, ")");
    std::lock_guard<std::mutex> guard(host_mutex_);
    uint8_t* staged = scratch_->data() + uint64_t(slot) * 8;
    std::memcpy(staged, &magic, 8);
    WorkRequest r;
    r.local_addr = reinterpret_cast<uint64_t>(staged);
    r.lkey = scratch_->info().lkey;
    r.length = 8;
    r.remote_addr = peers_[peer].notify.addr + uint64_t(slot) * kNotifySlotBytes;
    r.rkey = peers_[peer].notify.rkey;
    host_vtime_ns_ = run_requests(host_, {{peer, r}}, device_->nic()->cost().host_submit_ns, 0.0, host_vtime_ns_, timeout_s);
}

uint64_t HcclComm::notify_value(uint32_t slot) const {
    if (slot >= kNotifySlots) fail(ErrorKind::kBounds, "notify slot ", slot, " is outside [0, ", kNotifySlots, ")");
    return reinterpret_cast<std::atomic<uint64_t>*>(notify_->data() + uint64_t(slot) * kNotifySlotBytes)
        ->load(std::memory_order_acquire);
}

void HcclComm::notify_wait(uint32_t slot, uint64_t magic, double timeout_s) const {
    if (!wait_until([&] { return notify_value(slot) == magic; }, timeout_s))
        fail(ErrorKind::kTimeout, "timed out after ", timeout_s, " s waiting for notify slot ", slot, " of rank ", rank_,
             " to hold magic ", hex(magic), "; it holds ", hex(notify_value(slot)),
             notify_value(slot) ? " (a stale flag from an earlier call)" : " (never written)");
}

}  // namespace adp::emu
