// Emulated HCCL communicator: HcclCommConfig with its "not set" sentinels and environment fallback,
// windowsIn/windowsOut, the capability bitmap, the host one-sided API (HcclBatchPut/HcclBatchGet),
// the AICPU BatchWrite server, and notify flags with per-call magic.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "emulator/device.h"

namespace adp::emu {

constexpr uint32_t kConfigNotSet = 0xffffffffu;

// The fields of CANN's HcclCommConfig (hccl_types.h, VERSION 10) that the emulator honours.
struct HcclCommConfig {
    uint32_t hcclBufferSize = kConfigNotSet;        // MB; not set -> HCCL_BUFFSIZE -> product default (200)
    uint32_t hcclDeterministic = kConfigNotSet;
    std::string hcclCommName;
    std::string hcclUdi;
    uint32_t hcclOpExpansionMode = 0;               // 0 default, 1 host, 2 aicpu, 3 aiv
    uint32_t hcclRdmaTrafficClass = kConfigNotSet;  // not set -> HCCL_RDMA_TC -> 132
    uint32_t hcclRdmaServiceLevel = kConfigNotSet;  // not set -> HCCL_RDMA_SL -> 4
    uint32_t hcclWorldRankID = kConfigNotSet;
    uint64_t hcclJobID = 0;
    int32_t hcclExecTimeOut = -1;
};

// The values a communicator runs with, and where each came from ("config", "env", "default").
struct ResolvedCommConfig {
    uint64_t buffer_bytes;
    uint32_t traffic_class, service_level, expansion_mode;
    std::map<std::string, std::string> origin;
};

// Resolution as HCCL does it: explicit config field > environment variable > product default.
// Out-of-range values raise ConfigError naming the value, its source and the limit.
ResolvedCommConfig resolve_comm_config(const HcclCommConfig& config, const ProductProfile& profile,
                                       const std::function<const char*(const char*)>& getenv_fn);

uint32_t hccl_data_type_size(uint32_t data_type);  // bytes per element of an HcclDataType

struct OneSideDesc {  // HcclOneSideOpDesc
    uint64_t local_addr;
    uint64_t remote_addr;
    uint64_t count;
    uint32_t data_type;
};

struct RemoteMem {
    uint64_t addr, size;
    uint32_t rkey;
};

// What one rank publishes to the others at connect time (exchanged through a process group).
struct RankInfo {
    uint32_t rank = 0, device_id = 0;
    RemoteMem windows_in{}, windows_out{}, notify{};
    std::vector<uint32_t> host_qpns, aicpu_qpns, aiv_qpns;  // this rank's QP towards each peer, per poster
    std::string serialize() const;
    static RankInfo deserialize(const std::string& bytes);
};

class HcclComm {
   public:
    static constexpr uint32_t kNotifySlots = 1024;
    static constexpr double kDefaultExecTimeoutS = 30.0;  // AICPU server's bound per issue when hcclExecTimeOut is unset
    static constexpr uint32_t kNotifySlotBytes = 32;  // "32 B per notify" (CANN AIV communication resources)

    HcclComm(std::shared_ptr<Device> device, uint32_t rank, uint32_t world_size, HcclCommConfig config);
    ~HcclComm();
    void close();

    uint32_t rank() const { return rank_; }
    uint32_t world_size() const { return world_size_; }
    const ResolvedCommConfig& resolved() const { return resolved_; }
    uint32_t capability_bitmap() const { return device_->profile().capability_bitmap; }
    bool aiv_dataplane() const { return capability_bitmap() & 0x04; }
    const std::shared_ptr<Region>& windows_in() const { return windows_in_; }
    const std::shared_ptr<Region>& windows_out() const { return windows_out_; }
    const std::shared_ptr<Region>& notify_region() const { return notify_; }
    const std::shared_ptr<Device>& device() const { return device_; }
    const std::shared_ptr<QueuePair>& aiv_qp(uint32_t peer) const;

    RankInfo local_info() const;
    const RankInfo& peer_info(uint32_t peer) const;  // what connect() received for `peer`
    void connect(const std::vector<RankInfo>& peers);
    bool connected() const { return connected_; }

    // HcclRegisterMem: local memory usable as a source/destination of the one-sided API.
    void register_local(std::shared_ptr<Region> region);
    // HcclEnableMemAccess: a peer's registration (exchanged out of band) usable as a remote side.
    void add_remote_mem(uint32_t peer, RemoteMem mem);
    std::vector<RemoteMem> remote_mems(uint32_t peer) const;  // the peer's windows, notify area and added memory

    // HcclBatchPut / HcclBatchGet: all descriptors are validated before anything moves; returns the
    // virtual completion time in ns. Raises a typed error naming the descriptor that failed.
    double batch_put(uint32_t peer, const std::vector<OneSideDesc>& descs, double timeout_s);
    double batch_get(uint32_t peer, const std::vector<OneSideDesc>& descs, double timeout_s);

    // AICPU BatchWrite: `num_items` 32-byte items at `items_addr` (in registered local memory), handed
    // to the AICPU server by vector core `core_id` (only core 0 may). Returns a handle for wait().
    uint64_t batch_write(uint64_t items_addr, uint32_t num_items, uint32_t core_id);
    double batch_write_wait(uint64_t handle, double timeout_s);
    // What the one-sided API and the AICPU server check, for callers that must refuse a request before anything
    // moves: [addr, +bytes) inside the windows or memory registered with register_local (NotRegistered,
    // BoundsError naming `what`), and the remote range inside memory `peer` registered.
    void check_local_range(uint64_t addr, uint64_t bytes, const std::string& what) const;
    void check_one_sided(uint32_t peer, uint64_t local_addr, uint64_t remote_addr, uint64_t bytes,
                         const std::string& what) const;
    uint64_t batch_write_issues() const { return aicpu_issues_; }

    // Notify flags: a per-call magic that is never reused, so a stale flag is never taken as ready.
    uint64_t next_magic();
    void notify_record(uint32_t peer, uint32_t slot, uint64_t magic, double timeout_s);
    void notify_wait(uint32_t slot, uint64_t magic, double timeout_s) const;
    uint64_t notify_value(uint32_t slot) const;

   private:
    struct QpSet {
        std::shared_ptr<CompletionQueue> cq;
        std::vector<std::shared_ptr<QueuePair>> qps;
    };
    struct Job {
        std::vector<WorkRequest> requests;
        std::vector<uint32_t> peers;
        double done_vtime = 0;
        std::string error;
        ErrorKind error_kind = ErrorKind::kGeneric;
        bool done = false;
    };
    QpSet make_qp_set();
    void check_connected(const char* what) const;
    void check_peer(uint32_t peer) const;
    uint32_t local_lkey_for(uint64_t addr, uint64_t bytes, const std::string& what) const;
    uint32_t remote_rkey_for(uint32_t peer, uint64_t addr, uint64_t bytes, const std::string& what) const;
    double one_sided(uint32_t peer, const std::vector<OneSideDesc>& descs, uint32_t opcode, double timeout_s);
    double run_requests(QpSet& set, const std::vector<std::pair<uint32_t, WorkRequest>>& requests,
                        double submit_cost_ns, double per_wqe_cost_ns, double start_vtime, double timeout_s);
    void aicpu_server();

    std::shared_ptr<Device> device_;
    uint32_t rank_, world_size_;
    HcclCommConfig config_;
    ResolvedCommConfig resolved_;
    std::shared_ptr<Region> windows_in_, windows_out_, notify_, scratch_;
    QpSet host_, aicpu_, aiv_;
    std::vector<RankInfo> peers_;
    std::vector<std::vector<RemoteMem>> remote_mems_;
    std::vector<std::shared_ptr<Region>> local_mems_;
    bool connected_ = false;
    uint64_t magic_counter_ = 0;
    uint64_t magic_base_;
    mutable std::mutex host_mutex_;
    double host_vtime_ns_ = 0;
    // AICPU server
    std::mutex aicpu_mutex_;
    std::condition_variable aicpu_cv_;
    std::deque<uint64_t> aicpu_queue_;
    std::map<uint64_t, Job> aicpu_jobs_;
    uint64_t next_handle_ = 1;
    uint64_t aicpu_issues_ = 0;
    double aicpu_vtime_ns_ = 0;
    bool aicpu_running_ = true;
    std::thread aicpu_thread_;
};

}  // namespace adp::emu
