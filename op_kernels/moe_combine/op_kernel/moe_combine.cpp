// MoE normal combine (fullmesh): the reverse exchange of moe_dispatch (each received row goes back to
// its source rank, into the slot it was sent from), then each core reduces its share of the tokens:
// float32 sum of the token's rows over destination ranks 0..R-1, then bias 0, then bias 1, rounded to
// nearest-even into the output dtype; the top-k weights (float32) are summed the same way.
#include "adp/moe_exchange.h"

using namespace AscendC;

namespace {

constexpr uint32_t kBf16 = 0, kFp16 = 1, kFp32 = 2;

#pragma pack(push, 1)
struct ReduceTiling {
    uint32_t tokens;
    uint32_t hidden;
    uint32_t topk;      // 0 = no weights in the rows
    uint32_t dtype;     // kBf16, kFp16, kFp32 (x, biases and the output)
    uint64_t slots;     // int32 [tokens, world]: row of (token, destination) in recv_window, -1 = not sent
    uint64_t out_x;     // [tokens, hidden] of dtype
    uint64_t out_w;     // float32 [tokens, topk]
    uint64_t bias[2];   // [tokens, hidden] of dtype, 0 = absent
};
#pragma pack(pop)

__aicore__ inline uint32_t element_bytes(uint32_t dtype) { return dtype == kFp32 ? 4 : 2; }

// float <-> its bits, through a union (the AI core has no memcpy; AscendC's own scalar casts do the same).
union FloatBits {
    float f;
    uint32_t u;
};

__aicore__ inline float load_element(const LocalTensor<uint8_t>& row, uint32_t i, uint32_t dtype) {
    if (dtype == kFp32) return row.ReinterpretCast<float>().GetValue(i);
    if (dtype == kFp16) return float(row.ReinterpretCast<half>().GetValue(i));
    FloatBits v;
    v.u = uint32_t(row.ReinterpretCast<uint16_t>().GetValue(i)) << 16;  // bfloat16: the high half of a float
    return v.f;
}

__aicore__ inline void store_element(const LocalTensor<uint8_t>& row, uint32_t i, float value, uint32_t dtype) {
    if (dtype == kFp32) {
        row.ReinterpretCast<float>().SetValue(i, value);
        return;
    }
    if (dtype == kFp16) {
        row.ReinterpretCast<half>().SetValue(i, half(value));
        return;
    }
    FloatBits v;
    v.f = value;
    // round to nearest-even, as torch's float -> bfloat16 conversion does
    const uint16_t bits = value != value ? uint16_t(0x7fc0) : uint16_t((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
    row.ReinterpretCast<uint16_t>().SetValue(i, bits);
}

class Reducer {
   public:
    // Both tilings stay in GM and are read through these references; the fields of the per-element loops
    // are read once, here.
    __aicore__ inline Reducer(const __gm__ adp::moe::ExchangeTiling& t, const __gm__ ReduceTiling& r)
        : t_(t), r_(r), hidden_(r.hidden), topk_(r.topk), dtype_(r.dtype) {
        x_bytes_ = hidden_ * element_bytes(dtype_);
        pipe_.InitBuffer(acc_, r.hidden * 4);
        pipe_.InitBuffer(row_, adp::moe::align32(x_bytes_));
        pipe_.InitBuffer(acc_w_, adp::moe::align32(r.topk * 4) + 32);
        pipe_.InitBuffer(row_w_, adp::moe::align32(r.topk * 4) + 32);
    }

    __aicore__ inline void Token(uint64_t token) {
        LocalTensor<float> acc = acc_.Get<float>(), acc_w = acc_w_.Get<float>();
        LocalTensor<uint8_t> row = row_.Get<uint8_t>();
        for (uint32_t i = 0; i < hidden_; ++i) acc.SetValue(i, 0.0f);
        for (uint32_t k = 0; k < topk_; ++k) acc_w.SetValue(k, 0.0f);
        const __gm__ int32_t* slots = reinterpret_cast<__gm__ int32_t*>(r_.slots) + token * t_.world;
        for (uint32_t d = 0; d < t_.world; ++d) {
            if (slots[d] < 0) continue;
            const uint64_t src = t_.recv_window + uint64_t(slots[d]) * t_.row_bytes;
            Load(row, src, x_bytes_);
            for (uint32_t i = 0; i < hidden_; ++i) acc.SetValue(i, acc.GetValue(i) + load_element(row, i, dtype_));
            if (topk_) {
                LocalTensor<uint8_t> row_w = row_w_.Get<uint8_t>();
                Load(row_w, src + x_bytes_, topk_ * 4);
                LocalTensor<float> w = row_w.ReinterpretCast<float>();
                for (uint32_t k = 0; k < topk_; ++k) acc_w.SetValue(k, acc_w.GetValue(k) + w.GetValue(k));
            }
        }
        for (uint32_t b = 0; b < 2; ++b) {
            const uint64_t bias = r_.bias[b];
            if (!bias) continue;
            Load(row, bias + token * x_bytes_, x_bytes_);
            for (uint32_t i = 0; i < hidden_; ++i) acc.SetValue(i, acc.GetValue(i) + load_element(row, i, dtype_));
        }
        for (uint32_t i = 0; i < hidden_; ++i) store_element(row, i, acc.GetValue(i), dtype_);
        Store(r_.out_x + token * x_bytes_, row, x_bytes_);
        if (topk_) Store(r_.out_w + token * topk_ * 4, acc_w.ReinterpretCast<uint8_t>(), topk_ * 4);
    }

   private:
    __aicore__ inline void Load(const LocalTensor<uint8_t>& ub, uint64_t addr, uint32_t bytes) {
        DataCopyExtParams params(1, bytes, 0, 0, 0);
        DataCopyPadExtParams<uint8_t> pad(false, 0, 0, 0);
        DataCopyPad(ub, adp::moe::gm_at<uint8_t>(addr, bytes), params, pad);
        SetFlag<HardEvent::MTE2_S>(0);  // the row is in UB before the scalar unit reads it
        WaitFlag<HardEvent::MTE2_S>(0);
    }
    __aicore__ inline void Store(uint64_t addr, const LocalTensor<uint8_t>& ub, uint32_t bytes) {
        SetFlag<HardEvent::S_MTE3>(0);  // scalar results in UB before MTE3 reads them
        WaitFlag<HardEvent::S_MTE3>(0);
        DataCopyExtParams params(1, bytes, 0, 0, 0);
        DataCopyPad(adp::moe::gm_at<uint8_t>(addr, bytes), ub, params);
        SetFlag<HardEvent::MTE3_S>(0);  // MTE3 done before the scalar unit overwrites UB
        WaitFlag<HardEvent::MTE3_S>(0);
    }

    const __gm__ adp::moe::ExchangeTiling& t_;
    const __gm__ ReduceTiling& r_;
    TPipe pipe_;
    TBuf<TPosition::VECCALC> acc_, row_, acc_w_, row_w_;
    uint32_t hidden_, topk_, dtype_;
    uint32_t x_bytes_ = 0;
};

}  // namespace

extern "C" __global__ __aicore__ void moe_combine(GM_ADDR tiling, GM_ADDR peers, GM_ADDR in_parts, GM_ADDR reduce,
                                                  GM_ADDR send_index, GM_ADDR queues, GM_ADDR status) {
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIV_1_0);  // SyncAll below and in send_phase
    const __gm__ adp::moe::ExchangeTiling& t = *reinterpret_cast<__gm__ adp::moe::ExchangeTiling*>(tiling);
    const __gm__ ReduceTiling& r = *reinterpret_cast<__gm__ ReduceTiling*>(reduce);
    const auto* peer_table = reinterpret_cast<__gm__ adp::moe::ExchangePeer*>(peers);
    const uint64_t core = uint64_t(GetBlockIdx()), cores = uint64_t(GetBlockNum());
    adp::moe::ExchangeOutcome outcome;
    adp::moe::send_phase(t, peer_table, reinterpret_cast<__gm__ adp::moe::RowPart*>(in_parts),
                         reinterpret_cast<__gm__ int32_t*>(send_index),
                         reinterpret_cast<__gm__ adp::xfer::AivQueue*>(queues), &outcome);
    adp::moe::receive_phase(t, peer_table, nullptr, &outcome);
    adp::moe::write_status(status, core, outcome);
    SyncAll();  // every source's rows are in the window (or some core gave up waiting)
    if (adp::moe::any_core_failed(status)) return;
    uint64_t begin, end;
    adp::xfer::core_share(r.tokens, core, cores, &begin, &end);
    Reducer reducer(t, r);
    for (uint64_t token = begin; token < end; ++token) reducer.Token(token);
}
