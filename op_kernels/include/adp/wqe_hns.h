// RoCE v2 (hns) work-request formats shared by AscendC kernels, the host runtime and the emulator.
//
// The layout is the one CANN's AIV-direct paths write (ops-transformer MC2 A2 layered kernels,
// asc-devkit hcomm_aiv.h, hicann/shmem in-die RDMA backend): a 16-byte control segment, a 16-byte RC
// segment and one 16-byte SGE, 48 bytes in all, little-endian. Plain C++ only: no torch, no AscendC,
// so the same encoders serve kernels (AI core, or op_kernels/emu on the CPU) and csrc/; the helpers the
// kernels call are ADP_HOST_DEVICE.
#pragma once

#include <cstdint>

#include "adp/device.h"

namespace adp::wqe {

// ---- opcodes (byte_4 bits 0..4) -------------------------------------------------------------
constexpr uint32_t kOpcodeWrite = 3;
constexpr uint32_t kOpcodeWriteWithImm = 4;
constexpr uint32_t kOpcodeRead = 5;

// ---- byte_4 fields ----------------------------------------------------------------------------
constexpr uint32_t kOpcodeMask = 0x1f;
constexpr uint32_t kOwnerBit = 1u << 7;     // holds the INVERSE of owner = (head >> shift) & 1
constexpr uint32_t kSignaledBit = 1u << 8;  // request a CQE on success
// ---- byte_16 fields ---------------------------------------------------------------------------
constexpr uint32_t kNumSgeShift = 24;

constexpr uint32_t kWqeBytes = 48;  // ctrl (16) + RC segment (16) + one SGE (16)
constexpr uint32_t kMaxMessageBytes = 1u << 31;  // RoCE max message size (2 GiB)

#pragma pack(push, 1)
struct RcSendWqe {
    uint32_t byte_4;     // opcode | inverse owner << 7 | signaled << 8
    uint32_t msg_len;    // total bytes of the message
    uint32_t immtdata;   // immediate for WRITE_WITH_IMM
    uint32_t byte_16;    // num_sge << 24
    uint32_t byte_20;    // 0
    uint32_t rkey;       // remote key of the target memory region
    uint64_t remote_va;  // remote virtual address
    // single data segment
    uint32_t sge_len;    // bytes of this segment
    uint32_t sge_lkey;   // local key of the source/destination region
    uint64_t sge_va;     // local virtual address
};
#pragma pack(pop)
static_assert(sizeof(RcSendWqe) == kWqeBytes, "WQE+SGE must be 48 bytes");

// Owner value a poster computes for producer index `head` (shift = log2(SQ depth) in the kernels).
ADP_HOST_DEVICE uint32_t owner_for_index(uint32_t head, uint32_t shift) { return (head >> shift) & 1u; }

ADP_HOST_DEVICE RcSendWqe encode_rc_wqe(uint32_t opcode, uint32_t owner, bool signaled, uint32_t length,
                                        uint32_t rkey, uint64_t remote_va, uint32_t lkey, uint64_t local_va,
                                        uint32_t imm = 0) {
    RcSendWqe w{};
    w.byte_4 = (opcode & kOpcodeMask) | ((~owner << 7) & kOwnerBit) | (signaled ? kSignaledBit : 0u);
    w.msg_len = length;
    w.immtdata = imm;
    w.byte_16 = 1u << kNumSgeShift;
    w.byte_20 = 0;
    w.rkey = rkey;
    w.remote_va = remote_va;
    w.sge_len = length;
    w.sge_lkey = lkey;
    w.sge_va = local_va;
    return w;
}

// ---- SQ doorbell (64 bit) ---------------------------------------------------------------------
// qpn[0:23] | cmd[24:27] (0 = SQ doorbell) | producer index mod 65536 [32:47] | SL [48:50]
constexpr uint64_t kDoorbellCmdSq = 0;

ADP_HOST_DEVICE uint64_t encode_sq_doorbell(uint32_t qpn, uint32_t pi, uint32_t sl) {
    return (uint64_t(qpn) & 0xffffffu) | (kDoorbellCmdSq << 24) | ((uint64_t(pi) & 0xffffu) << 32) |
           ((uint64_t(sl) & 0x7u) << 48);
}
inline uint32_t doorbell_qpn(uint64_t db) { return uint32_t(db & 0xffffffu); }
inline uint32_t doorbell_cmd(uint64_t db) { return uint32_t((db >> 24) & 0xfu); }
inline uint32_t doorbell_pi(uint64_t db) { return uint32_t((db >> 32) & 0xffffu); }
inline uint32_t doorbell_sl(uint64_t db) { return uint32_t((db >> 48) & 0x7u); }

// ---- completion queue entry (32 bytes) ----------------------------------------------------------
// byte_4 follows hns v2: opcode[0:4], owner[7], status[8:15]. The emulator adds a syndrome byte
// [16:23] that says which check failed, and the virtual completion time; real CQEs carry neither.
constexpr uint32_t kCqeBytes = 32;
constexpr uint32_t kCqeOpcodeRecvWriteImm = 0x10;  // receive-side completion of WRITE_WITH_IMM

// hns v2 CQE status codes (linux drivers/infiniband/hw/hns/hns_roce_hw_v2.h)
enum CqeStatus : uint32_t {
    kStatusSuccess = 0x00,
    kStatusLocalLengthError = 0x01,
    kStatusLocalQpOperationError = 0x02,
    kStatusLocalProtectionError = 0x04,
    kStatusWrFlushError = 0x05,
    kStatusMwBindError = 0x06,
    kStatusBadResponseError = 0x10,
    kStatusLocalAccessError = 0x11,
    kStatusRemoteInvalidRequestError = 0x12,
    kStatusRemoteAccessError = 0x13,
    kStatusRemoteOperationError = 0x14,
    kStatusTransportRetryExceeded = 0x15,
    kStatusRnrRetryExceeded = 0x16,
    kStatusRemoteAbortedError = 0x22,
};

// Emulator syndrome: the precise reason behind a status.
enum Syndrome : uint32_t {
    kSynNone = 0,
    kSynBadLkey = 1,
    kSynLocalOutOfBounds = 2,
    kSynLocalPermission = 3,
    kSynBadRkey = 4,
    kSynRemoteOutOfBounds = 5,
    kSynRemotePermission = 6,
    kSynZeroLength = 7,
    kSynSlMismatch = 8,
    kSynBadOpcode = 9,
    kSynBadNumSge = 10,
    kSynOwnerMismatch = 11,
    kSynUnflushedWqe = 12,
    kSynLengthMismatch = 13,
    kSynNoRemoteQp = 14,
    kSynRemoteCqOverrun = 15,
    kSynFlushed = 16,
    kSynMessageTooLarge = 17,
    kSynBadDoorbell = 18,
};

inline uint32_t status_for(uint32_t syndrome) {
    switch (syndrome) {
        case kSynNone: return kStatusSuccess;
        case kSynBadLkey: case kSynLocalOutOfBounds: case kSynLocalPermission: return kStatusLocalProtectionError;
        case kSynBadRkey: case kSynRemoteOutOfBounds: case kSynRemotePermission: return kStatusRemoteAccessError;
        case kSynZeroLength: case kSynLengthMismatch: case kSynMessageTooLarge: return kStatusLocalLengthError;
        case kSynNoRemoteQp: return kStatusRemoteInvalidRequestError;
        case kSynRemoteCqOverrun: return kStatusRemoteOperationError;
        case kSynFlushed: return kStatusWrFlushError;
        default: return kStatusLocalQpOperationError;  // SL, opcode, SGE count, owner, flush, doorbell
    }
}

#pragma pack(push, 1)
struct Cqe {
    uint32_t byte_4;     // opcode[0:4] | owner << 7 | status << 8 | syndrome << 16
    uint32_t immtdata;   // immediate (receive completions)
    uint32_t qpn;        // queue pair number [0:23]
    uint32_t wqe_index;  // SQ index of the completed WQE (send completions)
    uint32_t byte_cnt;   // bytes transferred
    uint32_t reserved;
    uint64_t vtime_ns;   // emulator: virtual completion time
};
#pragma pack(pop)
static_assert(sizeof(Cqe) == kCqeBytes, "CQE must be 32 bytes");

// CQE owner bit for producer index `pi` of a power-of-two ring: 1 on the first pass over a zeroed ring.
inline uint32_t cqe_owner_for_index(uint32_t pi, uint32_t depth) { return (pi & depth) ? 0u : 1u; }

// ---- AICPU BatchWrite item (32 bytes; asc-devkit hccl BatchWriteItem) ----------------------------
#pragma pack(push, 1)
struct BatchWriteItem {
    uint64_t local_buf;       // source address (device GM)
    uint64_t remote_buf;      // destination address in the remote rank's window
    uint64_t count;           // number of elements
    uint32_t data_type;       // HcclDataType
    uint32_t remote_rank_id;  // destination rank
};
#pragma pack(pop)
static_assert(sizeof(BatchWriteItem) == 32, "BatchWrite items are 32 bytes");

}  // namespace adp::wqe
