// MoE row exchange shared by the moe_dispatch and moe_combine kernels (fullmesh).
//
// Send phase: for each destination rank (destinations are shared out over the vector cores, so one QP
// has one poster), the core gathers the rows routed there from the row parts (x, scales, top-k, ...)
// through UB into one contiguous block of packed rows in the send window (windows_out), then
//   - AIV dataplane (capability bit 0x04): posts RDMA WRITEs of the block into the peer's receive window
//     (windows_in) on its own SQ, then one signaled 8-byte WRITE of this op's magic into the peer's
//     notify slot for this rank, behind the data on the same QP (RC: in order);
//   - AICPU dataplane: fills BatchWrite items (data pieces, then the notify) at fixed positions; after
//     SyncAll, core 0 alone hands the item array to the AICPU server and waits for it.
// Rows for this rank itself are packed straight into its own receive window.
// Receive phase: each core waits (bounded by timeout_cycles) until the notify slot of each of its
// source ranks holds that source's magic for this op (or the next: see notify_reached); the magic
// grows every op, so a stale flag is never taken as ready.
#pragma once

#include "adp/hccl_batch_write.h"
#include "adp/sq_poster.h"
#include "adp/transfer_kernels.h"
#include "adp/wqe_hns.h"
#include "kernel_operator.h"

namespace adp::moe {

using adp::aiv::flush;
using adp::aiv::gm_at;
using adp::aiv::relax;

#pragma pack(push, 1)
struct ExchangeTiling {
    uint32_t world;
    uint32_t rank;
    uint32_t num_in_parts;   // row parts gathered into a packed row (send side)
    uint32_t num_out_parts;  // row parts a packed row is unpacked into (dispatch receive side; 0 = none)
    uint32_t row_bytes;      // bytes of one packed row (sum of the parts' row bytes)
    uint32_t dataplane;      // kDataplaneAiv or kDataplaneAicpu
    uint32_t max_payload;    // largest piece one WQE / BatchWrite item carries
    uint32_t total_items;    // BatchWrite items of this op (AICPU dataplane)
    uint64_t timeout_cycles;  // bound of every wait, in GetSystemCycle() units
    uint64_t send_window;    // packed rows for destination d start at send_window + send_begin(d) * row_bytes
    uint64_t recv_window;    // this op's half of windows_in: rows from source s at + recv_begin(s) * row_bytes
    uint64_t notify_base;    // this rank's notify region; slot s (32 bytes) is written by source s
    uint64_t magic_staging;  // 8 bytes of registered memory holding `magic`, the source of notify writes
    uint64_t magic;          // what this rank raises in its peers' slots for this op
    uint64_t items;          // BatchWrite item array, registered with the communicator (AICPU dataplane)
    uint32_t send_lkey;      // lkey of the send window and the magic staging word
    uint32_t reserved;
    adp::xfer::EmulatorClock clock;  // the emulator's virtual clock (start of posting, cost of one WQE)
    adp::xfer::HcclTiling hccl;      // InitV2/SetCcTilingV2 tiling of core 0's BatchWrite (AICPU dataplane)
};

struct ExchangePeer {
    uint64_t remote_recv;    // where this rank's block lands in the peer's windows_in
    uint64_t remote_notify;  // the peer's notify slot for this rank
    uint32_t recv_rkey;
    uint32_t notify_rkey;
    uint32_t send_begin;     // first entry of send_index for this peer
    uint32_t send_count;     // rows sent to this peer
    uint32_t recv_begin;     // first row from this peer in recv_window
    uint32_t recv_count;     // rows from this peer
    uint32_t item_begin;     // first BatchWrite item of this peer
    uint32_t reserved;
    uint64_t expect_magic;   // the magic this peer raises in this rank's slot for this op
};
// A peer this op does not exchange with (a two-hop route skips it) has remote_notify == 0 and
// expect_magic == 0 (and no rows either way): no WQE, no item, no wait.

struct RowPart {
    uint64_t addr;       // row r of the part is at addr + r * row_bytes
    uint32_t row_bytes;
    uint32_t reserved;
};
#pragma pack(pop)

static_assert(sizeof(ExchangePeer) == 56, "ExchangePeer is 56 bytes");
static_assert(sizeof(RowPart) == 16, "RowPart is 16 bytes");

constexpr uint32_t kDataplaneAiv = 0;
constexpr uint32_t kDataplaneAicpu = 1;
constexpr uint32_t kMaxParts = 8;
constexpr uint32_t kNotifySlotBytes = 32;
constexpr uint32_t kCoreNotifyTimeout = 3;  // CoreStatus.code; CoreStatus.tail names the silent source

__aicore__ inline uint32_t align32(uint32_t bytes) { return (bytes + 31) / 32 * 32; }

// Copies `rows` rows between row-part layouts through UB: each part of each row goes GM -> UB (at a
// 32-byte aligned slot) -> GM with DataCopyPad, so no part needs 32-byte aligned lengths or addresses.
class RowMover {
   public:
    __aicore__ inline RowMover(AscendC::TPipe& pipe, const __gm__ RowPart* parts, uint32_t num_parts)
        : num_parts_(num_parts) {
        uint32_t ub_bytes = 0;
        for (uint32_t p = 0; p < num_parts; ++p) {
            parts_[p].addr = parts[p].addr;
            parts_[p].row_bytes = parts[p].row_bytes;
            ub_offset_[p] = ub_bytes;
            ub_bytes += align32(parts_[p].row_bytes);
        }
        pipe.InitBuffer(buf_, ub_bytes ? ub_bytes : 32);
    }

    // Part rows `src_row` of `parts` -> the packed row at `dst` (parts back to back).
    __aicore__ inline void Pack(uint64_t src_row, uint64_t dst) {
        uint64_t offset = 0;
        for (uint32_t p = 0; p < num_parts_; ++p) {
            const uint32_t n = parts_[p].row_bytes;
            Move(parts_[p].addr + src_row * n, dst + offset, p);
            offset += n;
        }
    }

    // The packed row at `src` -> part rows `dst_row` of `parts`.
    __aicore__ inline void Unpack(uint64_t src, uint64_t dst_row) {
        uint64_t offset = 0;
        for (uint32_t p = 0; p < num_parts_; ++p) {
            const uint32_t n = parts_[p].row_bytes;
            Move(src + offset, parts_[p].addr + dst_row * n, p);
            offset += n;
        }
    }

   private:
    __aicore__ inline void Move(uint64_t from, uint64_t to, uint32_t p) {
        const uint32_t n = parts_[p].row_bytes;
        if (n == 0) return;
        AscendC::LocalTensor<uint8_t> ub = buf_.Get<uint8_t>()[ub_offset_[p]];
        AscendC::DataCopyExtParams params(1, n, 0, 0, 0);
        AscendC::DataCopyPadExtParams<uint8_t> pad(false, 0, 0, 0);
        AscendC::DataCopyPad(ub, gm_at<uint8_t>(from, n), params, pad);
        AscendC::SetFlag<AscendC::HardEvent::MTE2_MTE3>(0);  // the row is in UB before MTE3 reads it
        AscendC::WaitFlag<AscendC::HardEvent::MTE2_MTE3>(0);
        AscendC::DataCopyPad(gm_at<uint8_t>(to, n), ub, params);
        AscendC::SetFlag<AscendC::HardEvent::MTE3_MTE2>(0);  // UB slot free before the next row lands in it
        AscendC::WaitFlag<AscendC::HardEvent::MTE3_MTE2>(0);
    }

    AscendC::TBuf<AscendC::TPosition::VECCALC> buf_;
    RowPart parts_[kMaxParts];
    uint32_t ub_offset_[kMaxParts];
    uint32_t num_parts_;
};

// The per-core outcome of an exchange, written to status[core] (adp::xfer::CoreStatus).
struct ExchangeOutcome {
    uint32_t code = adp::xfer::kCoreOk;
    uint32_t posted = 0;
    uint32_t detail = 0;  // the silent source (notify timeout) or the peer whose SQ stayed full
};

__aicore__ inline void write_status(GM_ADDR status, uint64_t core, const ExchangeOutcome& o) {
    AscendC::GlobalTensor<uint32_t> out = gm_at<uint32_t>(reinterpret_cast<uint64_t>(status) + core * 16, 4);
    out.SetValue(0, o.code);
    out.SetValue(1, o.posted);
    out.SetValue(2, 0);
    out.SetValue(3, o.detail);
    flush(out);
}

// True when any core of the launch reported a failure (call after SyncAll).
__aicore__ inline bool any_core_failed(GM_ADDR status) {
    const uint64_t cores = uint64_t(AscendC::GetBlockNum());
    for (uint64_t c = 0; c < cores; ++c) {
        AscendC::GlobalTensor<uint32_t> s = gm_at<uint32_t>(reinterpret_cast<uint64_t>(status) + c * 16, 4);
        flush(s);
        if (s.GetValue(0) != adp::xfer::kCoreOk) return true;
    }
    return false;
}

// Writes BatchWrite item `index` (source, destination, bytes, destination rank) through UB into `items`.
__aicore__ inline void put_item(const AscendC::LocalTensor<uint64_t>& ub, const AscendC::GlobalTensor<uint64_t>& items,
                                uint64_t index, uint64_t local, uint64_t remote, uint64_t length, uint64_t rank) {
    ub.SetValue(0, local);
    ub.SetValue(1, remote);
    ub.SetValue(2, length);  // INT8 items: count = bytes
    ub.SetValue(3, uint64_t(adp::xfer::kHcclDataTypeInt8) | (rank << 32));
    AscendC::SetFlag<AscendC::HardEvent::S_MTE3>(0);
    AscendC::WaitFlag<AscendC::HardEvent::S_MTE3>(0);
    AscendC::DataCopy(items[index * 4], ub, 4);
    AscendC::SetFlag<AscendC::HardEvent::MTE3_S>(0);
    AscendC::WaitFlag<AscendC::HardEvent::MTE3_S>(0);
}

// Send phase for the destinations of this core (d % cores == core), then, on the AICPU dataplane,
// SyncAll and core 0's BatchWrite. Every core reaches the SyncAll, also after a failure. Every pointer
// is into GM (the tiling, the peer table, the row parts, the send index and the queue descriptors).
__aicore__ inline void send_phase(const __gm__ ExchangeTiling& t, const __gm__ ExchangePeer* peers,
                                  const __gm__ RowPart* in_parts, const __gm__ int32_t* send_index,
                                  const __gm__ adp::xfer::AivQueue* queues, ExchangeOutcome* outcome) {
    const uint64_t core = uint64_t(AscendC::GetBlockIdx()), cores = uint64_t(AscendC::GetBlockNum());
    const uint64_t w = t.row_bytes;
    {
        AscendC::TPipe pipe;
        RowMover mover(pipe, in_parts, t.num_in_parts);
        AscendC::TBuf<AscendC::TPosition::VECCALC> item_buf;
        pipe.InitBuffer(item_buf, sizeof(adp::wqe::BatchWriteItem));
        AscendC::GlobalTensor<uint64_t> staging = gm_at<uint64_t>(t.magic_staging, 1);
        staging.SetValue(0, t.magic);  // every core stores the same word
        flush(staging);
        for (uint64_t d = core; d < t.world; d += cores) {
            const __gm__ ExchangePeer& peer = peers[d];
            const bool self = d == t.rank;
            const uint64_t block = self ? t.recv_window + uint64_t(peers[t.rank].recv_begin) * w
                                        : t.send_window + uint64_t(peer.send_begin) * w;
            for (uint32_t j = 0; j < peer.send_count; ++j)
                mover.Pack(uint64_t(send_index[peer.send_begin + j]), block + uint64_t(j) * w);
            if (self || peer.remote_notify == 0) continue;
            AscendC::SetFlag<AscendC::HardEvent::MTE3_S>(0);  // packed rows in GM before the WQEs name them
            AscendC::WaitFlag<AscendC::HardEvent::MTE3_S>(0);
            const uint64_t bytes = uint64_t(peer.send_count) * w;
            if (t.dataplane == kDataplaneAiv) {
                adp::aiv::SqPoster poster(queues + d, t.timeout_cycles, t.clock);
                bool ok = true;
                for (uint64_t off = 0; ok && off < bytes; off += t.max_payload) {
                    const uint32_t n = uint32_t(bytes - off < t.max_payload ? bytes - off : t.max_payload);
                    ok = poster.Post(block + off, t.send_lkey, peer.remote_recv + off, peer.recv_rkey, n, false);
                }
                // the notify rides behind the data on the same QP; it is the one signaled WQE per peer
                ok = ok && poster.Post(t.magic_staging, t.send_lkey, peer.remote_notify, peer.notify_rkey, 8, true);
                poster.Ring();
                outcome->posted += poster.posted();
                if (!ok && outcome->code == adp::xfer::kCoreOk) {
                    outcome->code = adp::xfer::kCoreSqTimeout;
                    outcome->detail = uint32_t(d);
                }
            } else {
                AscendC::LocalTensor<uint64_t> ub = item_buf.Get<uint64_t>();
                AscendC::GlobalTensor<uint64_t> items = gm_at<uint64_t>(t.items, uint64_t(t.total_items) * 4);
                uint64_t index = peer.item_begin;
                for (uint64_t off = 0; off < bytes; off += t.max_payload)
                    put_item(ub, items, index++, block + off, peer.remote_recv + off,
                             bytes - off < t.max_payload ? bytes - off : t.max_payload, d);
                put_item(ub, items, index++, t.magic_staging, peer.remote_notify, 8, d);
                outcome->posted += uint32_t(index - peer.item_begin);
            }
        }
    }
    AscendC::SyncAll();  // rows for this rank are in its window; the item array is complete
    if (t.dataplane == kDataplaneAicpu && core == 0 && t.total_items &&
        !adp::hccl::batch_write(&t.hccl, reinterpret_cast<GM_ADDR>(t.items), t.total_items))
        outcome->code = adp::xfer::kCoreBatchWriteFailed;
}

// A magic is tag << 56 | source << 32 | op counter. The slot may already hold the source's magic of the
// next op (the source finished this op, which needs every peer's notify of it, and raised the next
// one behind its data): a value of the same tag and source with a counter >= this op's means arrived.
// An older value, or zero, never does.
__aicore__ inline bool notify_reached(uint64_t value, uint64_t expect) {
    return (value >> 32) == (expect >> 32) && uint32_t(value) >= uint32_t(expect);
}

// Waits until source s has raised this op's magic (or a later one) in slot s (bounded); false on timeout.
__aicore__ inline bool wait_notify(const __gm__ ExchangeTiling& t, const __gm__ ExchangePeer& peer, uint64_t source) {
    AscendC::GlobalTensor<uint64_t> slot = gm_at<uint64_t>(t.notify_base + source * kNotifySlotBytes, 1);
    const int64_t start = AscendC::GetSystemCycle();
    while (true) {
        flush(slot);  // drop a stale cached copy: the NIC writes the slot behind the core's back
        if (notify_reached(slot.GetValue(0), peer.expect_magic)) return true;
        if (uint64_t(AscendC::GetSystemCycle() - start) > t.timeout_cycles) return false;
        relax();
    }
}

// Receive phase for the sources of this core (s % cores == core): wait for each source's notify, then,
// when `out_parts` is given, unpack its rows.
__aicore__ inline void receive_phase(const __gm__ ExchangeTiling& t, const __gm__ ExchangePeer* peers,
                                     const __gm__ RowPart* out_parts, ExchangeOutcome* outcome) {
    const uint64_t core = uint64_t(AscendC::GetBlockIdx()), cores = uint64_t(AscendC::GetBlockNum());
    AscendC::TPipe pipe;
    RowMover mover(pipe, out_parts, t.num_out_parts);
    for (uint64_t s = core; s < t.world; s += cores) {
        if (outcome->code != adp::xfer::kCoreOk) return;
        const __gm__ ExchangePeer& peer = peers[s];
        if (s != t.rank && peer.expect_magic != 0 && !wait_notify(t, peer, s)) {
            outcome->code = kCoreNotifyTimeout;
            outcome->detail = uint32_t(s);
            return;
        }
        if (t.num_out_parts == 0) continue;
        for (uint32_t j = 0; j < peer.recv_count; ++j)
            mover.Unpack(t.recv_window + uint64_t(peer.recv_begin + j) * t.row_bytes, uint64_t(peer.recv_begin + j));
    }
}

}  // namespace adp::moe
