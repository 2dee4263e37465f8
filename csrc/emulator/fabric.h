// The fabric: a registry of memory regions and queue pairs in named POSIX shared memory, so that
// emulated devices in several processes can find each other's registrations by key, as RDMA NICs do.
//
// NOTES: the registry is a fixed table; entries are written under a process-shared robust mutex and
// read lock-free by NIC threads (state is published last with release order, and a reader re-checks
// the generation after copying). Keys encode the slot and a generation byte, so a key that outlives
// its registration is rejected rather than aliasing a newer one.
#pragma once

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "emulator/common.h"

namespace adp::emu {

enum class MemKind : uint32_t { kDeviceGm = 0, kHostDram = 1 };

// Access flags of a registration, as ibv_access_flags.
enum Access : uint32_t { kLocalWrite = 1u, kRemoteWrite = 2u, kRemoteRead = 4u };

struct RegionInfo {
    uint32_t slot = 0;
    uint32_t generation = 0;
    uint32_t lkey = 0;
    uint32_t rkey = 0;
    uint32_t access = 0;
    uint32_t pd = 0;         // protection domain (one per emulated device)
    uint32_t device_id = 0;  // emulated device the memory belongs to
    uint32_t owner_pid = 0;  // process that allocated and mapped it
    MemKind kind = MemKind::kDeviceGm;
    uint64_t base_va = 0;    // address of the first byte in the owner process
    uint64_t size = 0;
    std::string shm_name;  // filled by register_region and region_shm_name only
};

struct QpInfo {
    uint32_t qpn = 0;
    uint32_t owner_pid = 0;
    uint32_t device_id = 0;
    uint32_t recv_cq_depth = 0;  // 0: the QP has no receive CQ
    uint32_t recv_cq_lkey = 0;   // registration of the receive CQ's ring (reachable from other processes)
};

// Result of an access check: a syndrome (adp::wqe::Syndrome; 0 = ok) and a message that names the
// offending value and the limit it broke.
struct AccessCheck {
    uint32_t syndrome = 0;
    std::string detail;
    RegionInfo region;
    bool ok() const { return syndrome == 0; }
};

class Fabric {
   public:
    static constexpr uint32_t kDefaultMaxRegions = 4096;
    static constexpr uint32_t kDefaultMaxQps = 4096;

    // Creates a fresh fabric named `name` (fails if it exists); the creator unlinks it on close.
    static std::shared_ptr<Fabric> create(const std::string& name, uint32_t max_regions = kDefaultMaxRegions,
                                          uint32_t max_qps = kDefaultMaxQps);
    // Attaches to a fabric another process created.
    static std::shared_ptr<Fabric> attach(const std::string& name, double timeout_s);
    ~Fabric();
    Fabric(const Fabric&) = delete;
    Fabric& operator=(const Fabric&) = delete;

    const std::string& name() const { return name_; }
    bool is_creator() const { return creator_; }
    // Removes the fabric's name (creator only) so no process can attach any more, and closes this
    // handle: registering regions or queue pairs through it raises QueueError. Regions and queue pairs
    // already registered keep working; the memory goes with the last of them.
    void close();
    bool closed() const { return closed_.load(); }
    uint32_t creator_pid() const;
    uint32_t allocate_pd();
    uint32_t max_regions() const;
    uint32_t num_live_regions() const;

    RegionInfo register_region(const std::string& shm_name, MemKind kind, uint64_t base_va, uint64_t size,
                               uint32_t access, uint32_t pd, uint32_t device_id);
    void deregister_region(uint32_t slot, uint32_t generation);

    // Lock-free lookups; false when the key names no live registration.
    bool lookup_rkey(uint32_t rkey, RegionInfo* out) const;
    bool lookup_lkey(uint32_t lkey, RegionInfo* out) const;

    // Bounds-checked lookup as the NIC does it for a WQE's remote side: the key must be live, the
    // region must grant `need_access` and [va, va + len) must lie inside it.
    AccessCheck check_remote(uint32_t rkey, uint64_t va, uint64_t len, uint32_t need_access) const;
    // ... and for the local SGE: the key must be live and belong to protection domain `pd`.
    AccessCheck check_local(uint32_t lkey, uint32_t pd, uint64_t va, uint64_t len, bool need_write) const;

    uint32_t register_qp(uint32_t device_id, uint32_t recv_cq_lkey, uint32_t recv_cq_depth);
    void deregister_qp(uint32_t qpn);
    bool lookup_qp(uint32_t qpn, QpInfo* out) const;
    // Deregisters every region and QP whose owner process has died (and unlinks that memory), so
    // their keys fail at once instead of pointing at orphaned memory, and unlinks the fabric's own name
    // when its creator has died. Returns how many were reaped (the name counts as one).
    uint32_t reap_dead_owners();
    // What dead processes left in `shm_dir` (/dev/shm): every fabric found is reaped as above (its name
    // goes when its creator died), then every region object named by a dead process is unlinked.
    // Processes using a fabric must share a pid namespace. Returns the names removed.
    static std::vector<std::string> reap_stale_shm(const std::string& shm_dir);
    // The shared-memory name of a live registration (left out of hot-path lookups: it allocates).
    bool region_shm_name(const RegionInfo& region, std::string* out) const;

   private:
    struct Header;
    struct RegionEntry;
    struct QpEntry;
    Fabric() = default;
    void map(int fd, size_t bytes);
    void check_open(const char* what) const;
    bool read_region(uint32_t slot, RegionInfo* out, bool with_name) const;
    RegionEntry* regions() const;
    QpEntry* qps() const;

    std::string name_;
    bool creator_ = false;
    bool unlinked_ = false;
    std::atomic<bool> closed_{false};
    void* base_ = nullptr;
    size_t bytes_ = 0;
    Header* header_ = nullptr;
};

// A process-local view of remote memory: maps other processes' regions by their shared-memory name
// once, and translates virtual addresses of the owner process into local pointers.
class RegionMapper {
   public:
    uint8_t* translate(const Fabric& fabric, const RegionInfo& region, uint64_t va);
    ~RegionMapper();

   private:
    const uint32_t pid_ = uint32_t(::getpid());  // getpid() is a system call per use in current glibc
    struct Mapping {
        uint32_t generation;
        uint8_t* ptr;
        size_t size;
    };
    std::mutex mutex_;
    std::unordered_map<uint32_t, Mapping> by_slot_;
};

// Memory registered on a fabric and owned by this process. Backed by its own shared-memory object
// so that NICs in other processes can reach it. close() deregisters it (its keys die at once); the
// mapping stays valid until the last reference goes, so views handed to Python never dangle.
class Region {
   public:
    Region(std::shared_ptr<Fabric> fabric, MemKind kind, uint64_t size, uint32_t access, uint32_t pd,
           uint32_t device_id);
    ~Region();
    Region(const Region&) = delete;
    Region& operator=(const Region&) = delete;

    void close();
    bool registered() const { return registered_.load(std::memory_order_acquire); }
    uint8_t* data() const { return data_; }
    uint64_t addr() const { return reinterpret_cast<uint64_t>(data_); }
    const RegionInfo& info() const { return info_; }
    const std::shared_ptr<Fabric>& fabric() const { return fabric_; }
    // Owner-side bounds check of [va, va+len): throws BoundsError naming the range and the region.
    uint8_t* at(uint64_t va, uint64_t len) const;

   private:
    std::shared_ptr<Fabric> fabric_;
    RegionInfo info_;
    uint8_t* data_ = nullptr;
    size_t mapped_bytes_ = 0;
    std::atomic<bool> registered_{false};  // read by NIC threads of this process (a closed CQ takes no CQE)
};

}  // namespace adp::emu
