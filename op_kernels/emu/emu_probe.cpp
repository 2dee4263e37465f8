// Emulator self-test kernels: each commits one mistake that hardware punishes, so the tests can show
// that the emulated AscendC layer punishes it too. Compiled into the CPU build only (never for CANN).
#include "adp/transfer_kernels.h"
#include "adp/wqe_hns.h"
#include "kernel_operator.h"

using namespace AscendC;

namespace {
constexpr uint32_t kProbeUnalignedCopy = 1;   // DataCopy of 48 bytes
constexpr uint32_t kProbeUbOverflow = 2;      // 200 KB of UB buffers on a 192 KB core
constexpr uint32_t kProbeUnflushedWqe = 3;    // WQE written by scalar stores, doorbell without a flush
constexpr uint32_t kProbeFlushedWqe = 4;      // the same WQE, flushed: the control case
constexpr uint32_t kProbeWaitWithoutSet = 5;  // WaitFlag with no SetFlag
}  // namespace

extern "C" __global__ __aicore__ void emu_probe(GM_ADDR mode_addr, GM_ADDR queue_addr, GM_ADDR segment_addr) {
    const uint32_t mode = *reinterpret_cast<__gm__ uint32_t*>(mode_addr);
    TPipe pipe;
    if (mode == kProbeUnalignedCopy) {
        TBuf<TPosition::VECCALC> buf;
        pipe.InitBuffer(buf, 64);
        GlobalTensor<uint8_t> gm;
        gm.SetGlobalBuffer(segment_addr, 64);
        LocalTensor<uint8_t> ub = buf.Get<uint8_t>();
        DataCopy(ub, gm, 48);
    } else if (mode == kProbeUbOverflow) {
        TQue<TPosition::VECIN, 2> que;
        pipe.InitBuffer(que, 2, 100 * 1024);
    } else if (mode == kProbeUnflushedWqe || mode == kProbeFlushedWqe) {
        const __gm__ adp::xfer::AivQueue& q = *reinterpret_cast<__gm__ adp::xfer::AivQueue*>(queue_addr);
        const __gm__ adp::xfer::Segment& s = *reinterpret_cast<__gm__ adp::xfer::Segment*>(segment_addr);
        GlobalTensor<uint32_t> sq, head;
        GlobalTensor<uint64_t> doorbell;
        sq.SetGlobalBuffer(reinterpret_cast<__gm__ uint32_t*>(q.sq_addr), uint64_t(q.depth) * q.wqe_size / 4);
        head.SetGlobalBuffer(reinterpret_cast<__gm__ uint32_t*>(q.head_addr), 1);
        doorbell.SetGlobalBuffer(reinterpret_cast<__gm__ uint64_t*>(q.doorbell_addr), 1);
        const uint32_t index = head.GetValue(0);
        const adp::wqe::RcSendWqe w =
            adp::wqe::encode_rc_wqe(adp::wqe::kOpcodeWrite, adp::wqe::owner_for_index(index, q.owner_shift), true,
                                    s.length, s.rkey, s.remote_addr, s.lkey, s.local_addr);
        const uint64_t slot = uint64_t(index % q.depth) * q.wqe_size / 4;
        for (uint32_t i = 0; i < adp::wqe::kWqeBytes / 4; ++i)
            sq.SetValue(slot + i, reinterpret_cast<const uint32_t*>(&w)[i]);
        if (mode == kProbeFlushedWqe)
            DataCacheCleanAndInvalid<uint32_t, CacheLine::SINGLE_CACHE_LINE, DcciDst::CACHELINE_OUT>(sq[slot]);
        head.SetValue(0, index + 1);
        doorbell.SetValue(0, adp::wqe::encode_sq_doorbell(q.qpn, index + 1, q.sl));
    } else if (mode == kProbeWaitWithoutSet) {
        WaitFlag<HardEvent::MTE2_MTE3>(0);
    }
}
