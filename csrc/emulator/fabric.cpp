#include "emulator/fabric.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>
#include <string>

#include "adp/wqe_hns.h"

namespace adp::emu {

namespace {
constexpr uint64_t kMagic = 0x4144505f46414231ull;  // "ADP_FAB1"
constexpr uint32_t kVersion = 2;  // 2: the creator's pid in the header
constexpr uint32_t kStateFree = 0, kStateLive = 1;
constexpr uint32_t kRemoteKeyBit = 0x80000000u;  // lkeys and rkeys differ, so one is never taken for the other

uint32_t make_key(uint32_t slot, uint32_t generation, bool remote) {
    return ((slot + 1) << 8) | (generation & 0xffu) | (remote ? kRemoteKeyBit : 0u);
}
uint32_t key_slot(uint32_t key) { return ((key & ~kRemoteKeyBit) >> 8) - 1; }

std::string shm_path(const std::string& name) { return name[0] == '/' ? name : "/" + name; }

std::string errno_text() { return std::strerror(errno); }

bool process_dead(uint32_t pid) { return pid != 0 && ::kill(pid_t(pid), 0) != 0 && errno == ESRCH; }
}  // namespace

struct Fabric::Header {
    std::atomic<uint64_t> magic;  // written last by the creator
    uint32_t version;
    uint32_t max_regions;
    uint32_t max_qps;
    uint32_t creator_pid;  // whose death orphans the fabric's name (reap_dead_owners unlinks it then)
    std::atomic<uint32_t> next_pd;
    std::atomic<uint32_t> num_live_regions;
    pthread_mutex_t mutex;  // process-shared, robust: guards all entry writes
};

struct Fabric::RegionEntry {
    std::atomic<uint32_t> state;
    std::atomic<uint32_t> generation;
    uint32_t access, pd, device_id, owner_pid, kind, pad;
    uint64_t base_va, size;
    char shm_name[64];
};

struct Fabric::QpEntry {
    std::atomic<uint32_t> state;
    uint32_t device_id, owner_pid, recv_cq_depth, recv_cq_lkey;
};

namespace {
class RegistryLock {
   public:
    explicit RegistryLock(pthread_mutex_t* m) : m_(m) {
        int rc = pthread_mutex_lock(m_);
        if (rc == EOWNERDEAD) pthread_mutex_consistent(m_);  // a process died holding it; entries stay valid
        else if (rc != 0) fail(ErrorKind::kGeneric, "fabric registry lock failed: ", std::strerror(rc));
    }
    ~RegistryLock() { pthread_mutex_unlock(m_); }

   private:
    pthread_mutex_t* m_;
};
}  // namespace

Fabric::RegionEntry* Fabric::regions() const {
    return reinterpret_cast<RegionEntry*>(static_cast<uint8_t*>(base_) + sizeof(Header));
}
Fabric::QpEntry* Fabric::qps() const {
    return reinterpret_cast<QpEntry*>(reinterpret_cast<uint8_t*>(regions()) + sizeof(RegionEntry) * header_->max_regions);
}

void Fabric::map(int fd, size_t bytes) {
    base_ = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (base_ == MAP_FAILED) {
        base_ = nullptr;
        fail(ErrorKind::kGeneric, "mmap of fabric ", name_, " (", bytes, " bytes) failed: ", errno_text());
    }
    bytes_ = bytes;
    header_ = static_cast<Header*>(base_);
}

std::shared_ptr<Fabric> Fabric::create(const std::string& name, uint32_t max_regions, uint32_t max_qps) {
    if (name.empty() || name.size() > 48 || name.find('/') != std::string::npos)
        fail(ErrorKind::kConfig, "fabric name must be 1..48 characters without '/', got '", name, "'");
    if (max_regions == 0 || max_regions > (1u << 22) || max_qps == 0 || max_qps > (1u << 20))
        fail(ErrorKind::kConfig, "fabric table sizes out of range: max_regions=", max_regions, " (1..4194304), max_qps=",
             max_qps, " (1..1048576)");
    std::shared_ptr<Fabric> f(new Fabric());
    f->name_ = name;
    const size_t bytes = sizeof(Header) + sizeof(RegionEntry) * max_regions + sizeof(QpEntry) * max_qps;
    int fd = shm_open(shm_path("adp." + name).c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) fail(ErrorKind::kConfig, "cannot create fabric '", name, "': ", errno_text());
    if (ftruncate(fd, off_t(bytes)) != 0) {
        ::close(fd);
        shm_unlink(shm_path("adp." + name).c_str());
        fail(ErrorKind::kCapacity, "cannot size fabric '", name, "' to ", bytes, " bytes: ", errno_text());
    }
    f->creator_ = true;
    f->map(fd, bytes);
    Header* h = f->header_;
    h->version = kVersion;
    h->max_regions = max_regions;
    h->max_qps = max_qps;
    h->creator_pid = uint32_t(getpid());
    h->next_pd.store(1);
    h->num_live_regions.store(0);
    pthread_mutexattr_t attr;
    pthread_mutexattr_init(&attr);
    pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&h->mutex, &attr);
    pthread_mutexattr_destroy(&attr);
    h->magic.store(kMagic, std::memory_order_release);
    return f;
}

std::shared_ptr<Fabric> Fabric::attach(const std::string& name, double timeout_s) {
    std::shared_ptr<Fabric> f(new Fabric());
    f->name_ = name;
    const std::string path = shm_path("adp." + name);
    int fd = -1;
    struct stat st {};
    // The creator may still be sizing and initializing the table: wait (bounded) for the magic.
    bool found = wait_until([&] {
        if (fd < 0) fd = shm_open(path.c_str(), O_RDWR, 0600);
        return fd >= 0 && fstat(fd, &st) == 0 && size_t(st.st_size) >= sizeof(Header);
    }, timeout_s);
    if (!found) {
        if (fd >= 0) ::close(fd);
        fail(ErrorKind::kTimeout, "timed out after ", timeout_s, " s waiting for fabric '", name,
             "' to be created by another process");
    }
    f->map(fd, size_t(st.st_size));
    if (!wait_until([&] { return f->header_->magic.load(std::memory_order_acquire) == kMagic; }, timeout_s))
        fail(ErrorKind::kTimeout, "timed out after ", timeout_s, " s waiting for fabric '", name, "' to be initialized");
    if (f->header_->version != kVersion)
        fail(ErrorKind::kConfig, "fabric '", name, "' has layout version ", f->header_->version, ", this build reads ",
             kVersion);
    return f;
}

void Fabric::close() {
    if (creator_ && !unlinked_) shm_unlink(shm_path("adp." + name_).c_str());
    unlinked_ = true;
    closed_.store(true);
}

void Fabric::check_open(const char* what) const {
    if (closed_.load()) fail(ErrorKind::kQueue, "fabric '", name_, "' is closed: cannot ", what);
}

uint32_t Fabric::creator_pid() const { return header_->creator_pid; }

Fabric::~Fabric() {
    close();
    if (base_) munmap(base_, bytes_);
}

uint32_t Fabric::allocate_pd() {
    check_open("open a device");
    return header_->next_pd.fetch_add(1);
}
uint32_t Fabric::max_regions() const { return header_->max_regions; }
uint32_t Fabric::num_live_regions() const { return header_->num_live_regions.load(); }

RegionInfo Fabric::register_region(const std::string& shm_name, MemKind kind, uint64_t base_va, uint64_t size,
                                   uint32_t access, uint32_t pd, uint32_t device_id) {
    if (shm_name.size() >= sizeof(RegionEntry::shm_name))
        fail(ErrorKind::kConfig, "shared-memory name '", shm_name, "' longer than ", sizeof(RegionEntry::shm_name) - 1);
    check_open("register a region");
    RegistryLock lock(&header_->mutex);
    RegionEntry* table = regions();
    for (uint32_t slot = 0; slot < header_->max_regions; ++slot) {
        RegionEntry& e = table[slot];
        if (e.state.load(std::memory_order_relaxed) != kStateFree) continue;
        const uint32_t generation = e.generation.load(std::memory_order_relaxed) + 1;
        e.generation.store(generation, std::memory_order_relaxed);
        e.access = access;
        e.pd = pd;
        e.device_id = device_id;
        e.owner_pid = uint32_t(getpid());
        e.kind = uint32_t(kind);
        e.base_va = base_va;
        e.size = size;
        std::memset(e.shm_name, 0, sizeof(e.shm_name));
        std::memcpy(e.shm_name, shm_name.data(), shm_name.size());
        e.state.store(kStateLive, std::memory_order_release);
        header_->num_live_regions.fetch_add(1);
        RegionInfo info;
        read_region(slot, &info, true);
        return info;
    }
    fail(ErrorKind::kCapacity, "fabric '", name_, "' registry is full: ", header_->max_regions, " regions live");
}

void Fabric::deregister_region(uint32_t slot, uint32_t generation) {
    RegistryLock lock(&header_->mutex);
    RegionEntry& e = regions()[slot];
    if (e.state.load() == kStateLive && e.generation.load() == generation) {
        e.state.store(kStateFree, std::memory_order_release);
        header_->num_live_regions.fetch_sub(1);
    }
}

bool Fabric::read_region(uint32_t slot, RegionInfo* out, bool with_name) const {
    if (slot >= header_->max_regions) return false;
    const RegionEntry& e = regions()[slot];
    if (e.state.load(std::memory_order_acquire) != kStateLive) return false;
    const uint32_t generation = e.generation.load(std::memory_order_acquire);
    out->slot = slot;
    out->generation = generation;
    out->access = e.access;
    out->pd = e.pd;
    out->device_id = e.device_id;
    out->owner_pid = e.owner_pid;
    out->kind = MemKind(e.kind);
    out->base_va = e.base_va;
    out->size = e.size;
    if (with_name) out->shm_name.assign(e.shm_name, strnlen(e.shm_name, sizeof(e.shm_name)));
    out->lkey = make_key(slot, generation, false);
    out->rkey = make_key(slot, generation, true);
    std::atomic_thread_fence(std::memory_order_acquire);
    // a concurrent deregistration (and reuse) between the two loads invalidates what we copied
    return e.state.load(std::memory_order_relaxed) == kStateLive && e.generation.load(std::memory_order_relaxed) == generation;
}

bool Fabric::lookup_rkey(uint32_t rkey, RegionInfo* out) const {
    if (!(rkey & kRemoteKeyBit) || (rkey & ~kRemoteKeyBit) < 0x100) return false;
    return read_region(key_slot(rkey), out, false) && out->rkey == rkey;
}

bool Fabric::lookup_lkey(uint32_t lkey, RegionInfo* out) const {
    if ((lkey & kRemoteKeyBit) || lkey < 0x100) return false;
    return read_region(key_slot(lkey), out, false) && out->lkey == lkey;
}

namespace {
bool range_inside(uint64_t va, uint64_t len, const RegionInfo& r) {
    return va >= r.base_va && len <= r.size && va - r.base_va <= r.size - len;
}
std::string access_text(uint32_t a) {
    std::string s;
    if (a & kLocalWrite) s += "LOCAL_WRITE|";
    if (a & kRemoteWrite) s += "REMOTE_WRITE|";
    if (a & kRemoteRead) s += "REMOTE_READ|";
    return s.empty() ? "NONE" : s.substr(0, s.size() - 1);
}
}  // namespace

AccessCheck Fabric::check_remote(uint32_t rkey, uint64_t va, uint64_t len, uint32_t need_access) const {
    AccessCheck c;
    if (!lookup_rkey(rkey, &c.region)) {
        c.syndrome = wqe::kSynBadRkey;
        c.detail = cat("rkey ", hex(rkey), " names no live registration on fabric '", name_, "'");
    } else if (!range_inside(va, len, c.region)) {
        c.syndrome = wqe::kSynRemoteOutOfBounds;
        c.detail = cat("remote range [", hex(va), ", +", len, ") is outside region rkey ", hex(rkey), " [",
                       hex(c.region.base_va), ", +", c.region.size, ")");
    } else if ((c.region.access & need_access) != need_access) {
        c.syndrome = wqe::kSynRemotePermission;
        c.detail = cat("region rkey ", hex(rkey), " grants ", access_text(c.region.access), ", the operation needs ",
                       access_text(need_access));
    }
    return c;
}

AccessCheck Fabric::check_local(uint32_t lkey, uint32_t pd, uint64_t va, uint64_t len, bool need_write) const {
    AccessCheck c;
    if (!lookup_lkey(lkey, &c.region)) {
        c.syndrome = wqe::kSynBadLkey;
        c.detail = cat("lkey ", hex(lkey), " names no live registration (unregistered memory)");
    } else if (c.region.pd != pd) {
        c.syndrome = wqe::kSynBadLkey;
        c.detail = cat("lkey ", hex(lkey), " belongs to protection domain ", c.region.pd, ", the queue pair's is ", pd);
    } else if (!range_inside(va, len, c.region)) {
        c.syndrome = wqe::kSynLocalOutOfBounds;
        c.detail = cat("local range [", hex(va), ", +", len, ") is outside region lkey ", hex(lkey), " [",
                       hex(c.region.base_va), ", +", c.region.size, ")");
    } else if (need_write && !(c.region.access & kLocalWrite)) {
        c.syndrome = wqe::kSynLocalPermission;
        c.detail = cat("region lkey ", hex(lkey), " grants ", access_text(c.region.access),
                       ", writing into it (the local side of a READ, a stage destination) needs LOCAL_WRITE");
    }
    return c;
}

uint32_t Fabric::register_qp(uint32_t device_id, uint32_t recv_cq_lkey, uint32_t recv_cq_depth) {
    check_open("register a queue pair");
    RegistryLock lock(&header_->mutex);
    QpEntry* table = qps();
    for (uint32_t slot = 0; slot < header_->max_qps; ++slot) {
        QpEntry& e = table[slot];
        if (e.state.load(std::memory_order_relaxed) != kStateFree) continue;
        e.device_id = device_id;
        e.owner_pid = uint32_t(getpid());
        e.recv_cq_depth = recv_cq_depth;
        e.recv_cq_lkey = recv_cq_lkey;
        e.state.store(kStateLive, std::memory_order_release);
        return slot + 1;  // qpn 0 is reserved, as in InfiniBand
    }
    fail(ErrorKind::kCapacity, "fabric '", name_, "' queue-pair table is full: ", header_->max_qps, " QPs live");
}

void Fabric::deregister_qp(uint32_t qpn) {
    if (qpn == 0 || qpn > header_->max_qps) return;
    RegistryLock lock(&header_->mutex);
    qps()[qpn - 1].state.store(kStateFree, std::memory_order_release);
}

bool Fabric::lookup_qp(uint32_t qpn, QpInfo* out) const {
    if (qpn == 0 || qpn > header_->max_qps) return false;
    const QpEntry& e = qps()[qpn - 1];
    if (e.state.load(std::memory_order_acquire) != kStateLive) return false;
    out->qpn = qpn;
    out->owner_pid = e.owner_pid;
    out->device_id = e.device_id;
    out->recv_cq_depth = e.recv_cq_depth;
    out->recv_cq_lkey = e.recv_cq_lkey;
    return true;
}

uint32_t Fabric::reap_dead_owners() {
    auto dead = process_dead;
    uint32_t reaped = 0;
    RegistryLock lock(&header_->mutex);
    // nobody is left to unlink the name of a fabric whose creator died: every later attach would find a
    // fabric that no creator will close
    if (!creator_ && dead(header_->creator_pid) && shm_unlink(shm_path("adp." + name_).c_str()) == 0) ++reaped;
    for (uint32_t slot = 0; slot < header_->max_regions; ++slot) {
        RegionEntry& e = regions()[slot];
        if (e.state.load() != kStateLive || !dead(e.owner_pid)) continue;
        shm_unlink(shm_path(std::string(e.shm_name, strnlen(e.shm_name, sizeof(e.shm_name)))).c_str());
        e.state.store(kStateFree, std::memory_order_release);
        header_->num_live_regions.fetch_sub(1);
        ++reaped;
    }
    for (uint32_t slot = 0; slot < header_->max_qps; ++slot) {
        QpEntry& e = qps()[slot];
        if (e.state.load() != kStateLive || !dead(e.owner_pid)) continue;
        e.state.store(kStateFree, std::memory_order_release);
        ++reaped;
    }
    return reaped;
}

namespace {
// `adp.<fabric>.<pid>.<counter>`, as Region names its objects: the pid, or 0 for any other name.
uint32_t region_object_pid(const std::string& name) {
    const size_t last = name.rfind('.');
    const size_t pid_start = last == std::string::npos || last == 0 ? std::string::npos : name.rfind('.', last - 1);
    if (pid_start == std::string::npos || pid_start < 4) return 0;
    const std::string counter = name.substr(last + 1), pid = name.substr(pid_start + 1, last - pid_start - 1);
    auto digits = [](const std::string& t) { return !t.empty() && t.size() <= 10 && t.find_first_not_of("0123456789") == std::string::npos; };
    return digits(counter) && digits(pid) ? uint32_t(std::stoul(pid)) : 0;
}

// The fabric part of a region object's name (`adp.<fabric>.<pid>.<counter>`), or "" for any other name.
std::string region_object_fabric(const std::string& name) {
    if (region_object_pid(name) == 0) return "";
    const size_t pid_start = name.rfind('.', name.rfind('.') - 1);
    return name.substr(4, pid_start - 4);
}

constexpr const char* kClaimPrefix = "adpclaim.";  // `adpclaim.<fabric>.<pid>`: a live process's claim on a fabric
}  // namespace

std::vector<std::string> Fabric::reap_stale_shm(const std::string& shm_dir) {
    std::vector<std::string> names, claims, removed;
    if (DIR* dir = opendir(shm_dir.c_str())) {
        while (const dirent* entry = readdir(dir)) {
            if (std::strncmp(entry->d_name, "adp.", 4) == 0) names.emplace_back(entry->d_name);
            if (std::strncmp(entry->d_name, kClaimPrefix, std::strlen(kClaimPrefix)) == 0) claims.emplace_back(entry->d_name);
        }
        closedir(dir);
    }
    // a fabric a live process claimed (it waits to attach, or works in it) is left alone, its region objects too:
    // only what is provably dead goes, and never under a live waiter
    std::set<std::string> claimed;
    for (const std::string& claim : claims) {
        const size_t last = claim.rfind('.');
        const std::string fabric = claim.substr(std::strlen(kClaimPrefix), last - std::strlen(kClaimPrefix));
        const std::string pid = claim.substr(last + 1);
        if (pid.empty() || pid.size() > 10 || pid.find_first_not_of("0123456789") != std::string::npos) continue;
        if (!process_dead(uint32_t(std::stoul(pid)))) claimed.insert(fabric);
        else if (shm_unlink(shm_path(claim).c_str()) == 0) removed.push_back(claim);
    }
    std::vector<std::string> regions;
    for (const std::string& name : names) {
        if (claimed.count(name.substr(4)) || claimed.count(region_object_fabric(name))) continue;
        std::shared_ptr<Fabric> fabric;
        try {  // a fabric file, complete and of this layout; anything else is a region object
            fabric = attach(name.substr(4), 0.0);
        } catch (const Error&) {
            regions.push_back(name);
            continue;
        }
        // a live fabric loses its dead owners' entries (their objects are unlinked below or here), a dead one its name
        fabric->reap_dead_owners();
        if (process_dead(fabric->creator_pid())) removed.push_back(name);
    }
    for (const std::string& name : regions)
        if (process_dead(region_object_pid(name)) && shm_unlink(shm_path(name).c_str()) == 0) removed.push_back(name);
    return removed;
}

bool Fabric::region_shm_name(const RegionInfo& region, std::string* out) const {
    RegionInfo fresh;
    if (!read_region(region.slot, &fresh, true) || fresh.generation != region.generation) return false;
    *out = std::move(fresh.shm_name);
    return true;
}

// ---- RegionMapper ---------------------------------------------------------------------------

uint8_t* RegionMapper::translate(const Fabric& fabric, const RegionInfo& region, uint64_t va) {
    if (region.owner_pid == pid_) return reinterpret_cast<uint8_t*>(va);  // our own mapping
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = by_slot_.find(region.slot);
    if (it == by_slot_.end() || it->second.generation != region.generation) {
        if (it != by_slot_.end()) {
            munmap(it->second.ptr, it->second.size);
            by_slot_.erase(it);
        }
        std::string name;
        if (!fabric.region_shm_name(region, &name)) return nullptr;  // deregistered meanwhile
        int fd = shm_open(shm_path(name).c_str(), O_RDWR, 0600);
        if (fd < 0) return nullptr;  // owner already deregistered and unlinked it
        void* p = mmap(nullptr, region.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        ::close(fd);
        if (p == MAP_FAILED) return nullptr;
        it = by_slot_.emplace(region.slot, Mapping{region.generation, static_cast<uint8_t*>(p), region.size}).first;
    }
    return it->second.ptr + (va - region.base_va);
}

RegionMapper::~RegionMapper() {
    for (auto& [slot, m] : by_slot_) munmap(m.ptr, m.size);
}

// ---- Region ---------------------------------------------------------------------------------

namespace {
std::atomic<uint64_t> g_region_counter{0};
}

Region::Region(std::shared_ptr<Fabric> fabric, MemKind kind, uint64_t size, uint32_t access, uint32_t pd,
               uint32_t device_id)
    : fabric_(std::move(fabric)) {
    if (size == 0) fail(ErrorKind::kConfig, "region size must be > 0 bytes");
    if (access & ~uint32_t(kLocalWrite | kRemoteWrite | kRemoteRead))
        fail(ErrorKind::kConfig, "unknown access flags ", hex(access), " (allowed: 0x1 | 0x2 | 0x4)");
    const std::string name = cat("/adp.", fabric_->name(), ".", getpid(), ".", g_region_counter.fetch_add(1));
    int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) fail(ErrorKind::kCapacity, "cannot create shared memory ", name, ": ", errno_text());
    if (ftruncate(fd, off_t(size)) != 0) {
        ::close(fd);
        shm_unlink(name.c_str());
        fail(ErrorKind::kCapacity, "cannot allocate region of ", size, " bytes: ", errno_text());
    }
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) {
        shm_unlink(name.c_str());
        fail(ErrorKind::kCapacity, "cannot map region of ", size, " bytes: ", errno_text());
    }
    data_ = static_cast<uint8_t*>(p);
    mapped_bytes_ = size;
    try {
        info_ = fabric_->register_region(name, kind, addr(), size, access, pd, device_id);
    } catch (...) {
        munmap(data_, mapped_bytes_);
        shm_unlink(name.c_str());
        throw;
    }
    registered_ = true;
}

void Region::close() {
    if (!registered_) return;
    fabric_->deregister_region(info_.slot, info_.generation);
    shm_unlink(info_.shm_name.c_str());
    registered_ = false;
}

Region::~Region() {
    close();
    if (data_) munmap(data_, mapped_bytes_);
}

uint8_t* Region::at(uint64_t va, uint64_t len) const {
    if (!(va >= info_.base_va && len <= info_.size && va - info_.base_va <= info_.size - len))
        fail(ErrorKind::kBounds, "range [", hex(va), ", +", len, ") is outside region [", hex(info_.base_va), ", +",
             info_.size, ")");
    return reinterpret_cast<uint8_t*>(va);
}

}  // namespace adp::emu
