// Argument layouts of the layer-block transfer kernels (aiv_post_wqe, hccl_stage, aicpu_batch_write),
// shared by the kernels, their NPU launchers (csrc/npu) and the emulator's launcher (csrc/bindings).
// Plain structs, little-endian, packed: the host fills them in GM, the kernels read them with scalar loads.
#pragma once

#include <cstdint>

#include "adp/device.h"

namespace adp::xfer {

#pragma pack(push, 1)
// One contiguous piece of a transfer: local source -> remote destination, at most one WQE.
struct Segment {
    uint64_t local_addr;
    uint64_t remote_addr;
    uint32_t length;  // bytes, 1 .. max single AIV payload
    uint32_t lkey;
    uint32_t rkey;
    uint32_t reserved;
};

// The queue pair a vector core posts to (one per core): the addresses of its ring and control words
// inside registered device GM, as csrc/emulator/device.h and the HCCL AIV resources lay them out.
struct AivQueue {
    uint64_t sq_addr;
    uint64_t head_addr;
    uint64_t tail_addr;
    uint64_t doorbell_addr;
    uint64_t post_vtime_addr;  // emulator only: virtual time of the doorbell (ignored on hardware)
    uint32_t depth;            // power of two
    uint32_t wqe_size;         // slot stride in bytes (>= 48)
    uint32_t owner_shift;      // log2(depth)
    uint32_t qpn;
    uint32_t sl;
    uint32_t reserved;
};

// The emulator's virtual clock, carried in the tilings of the posting kernels. The AI core has no double
// and hardware has no virtual time: on the device these are 16 bytes the kernels never read.
struct EmulatorClock {
#if defined(ADP_EMULATOR)
    double start_vtime_ns;  // virtual time at which the cores start posting
    double submit_ns;       // virtual cost of building, flushing and posting one WQE
#else
    uint64_t unused[2];
#endif
};

struct AivPostTiling {
    uint32_t num_segments;
    uint32_t doorbell_batch;  // ring the doorbell after this many WQEs (and whenever the SQ is full)
    uint64_t timeout_cycles;  // bound of each wait for SQ space, in GetSystemCycle() units
    EmulatorClock clock;
};

// What Hccl::InitV2 and SetCcTilingV2 read (kernel_tiling.h: Mc2InitTiling, then one Mc2CcTiling), filled
// on the host by CANN's Mc2CcTilingConfig::GetTiling; the kernels copy it out of GM before InitV2.
struct HcclTiling {
    uint8_t init[64];  // Mc2InitTiling
    uint8_t cc[280];   // Mc2CcTiling of the BatchWrite (offsetof(HcclTiling, cc) goes to SetCcTilingV2)
};

struct StageTiling {
    uint64_t total_bytes;
    uint32_t chunk_bytes;  // bytes per UB buffer: a multiple of 32
    uint32_t buffer_num;   // UB buffers in flight (2 = double buffering)
};

struct BatchWriteTiling {
    uint32_t num_segments;
    uint32_t remote_rank;
    uint32_t items_per_round;  // items built in UB per DataCopy to GM
    uint32_t reserved;
    HcclTiling hccl;  // all zero on the emulator, whose Hccl ignores it
};

// Written by each core at exit.
struct CoreStatus {
    uint32_t code;    // kCoreOk, kCoreSqTimeout, kCoreBatchWriteFailed
    uint32_t posted;  // WQEs posted (aiv_post_wqe) or items written (aicpu_batch_write)
    uint32_t head;    // producer index of the core's SQ at exit
    uint32_t tail;    // consumer index last seen
};
#pragma pack(pop)

static_assert(sizeof(Segment) == 32, "Segment is 32 bytes");
static_assert(sizeof(AivQueue) == 64, "AivQueue is 64 bytes");
static_assert(sizeof(CoreStatus) == 16, "CoreStatus is 16 bytes");
static_assert(sizeof(EmulatorClock) == 16, "EmulatorClock has one layout on the emulator and the device");
static_assert(sizeof(HcclTiling) == 344, "HcclTiling is Mc2InitTiling (64) + Mc2CcTiling (280)");

constexpr uint32_t kCoreOk = 0;
constexpr uint32_t kCoreSqTimeout = 1;
constexpr uint32_t kCoreBatchWriteFailed = 2;

constexpr uint32_t kHcclDataTypeInt8 = 0;  // HcclDataType INT8: BatchWrite counts are bytes

// Contiguous share [begin, end) of `total` items for core `idx` of `num` cores.
ADP_HOST_DEVICE void core_share(uint64_t total, uint64_t idx, uint64_t num, uint64_t* begin, uint64_t* end) {
    *begin = total * idx / num;
    *end = total * (idx + 1) / num;
}

}  // namespace adp::xfer
