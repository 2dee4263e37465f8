// MoE normal dispatch (fullmesh): the vector cores pack, per destination rank, the rows routed there
// contiguously into the send window and move them into the peer's receive window (AIV-direct WQEs or
// AICPU BatchWrite, see moe_exchange.h), raise this op's notify magic in every peer, then wait for every
// peer's notify and unpack the received rows (grouped by source rank, ascending source token) into the
// output parts.
#include "adp/moe_exchange.h"

using namespace AscendC;

extern "C" __global__ __aicore__ void moe_dispatch(GM_ADDR tiling, GM_ADDR peers, GM_ADDR in_parts, GM_ADDR out_parts,
                                                   GM_ADDR send_index, GM_ADDR queues, GM_ADDR status) {
    KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIV_1_0);  // SyncAll in send_phase
    const __gm__ adp::moe::ExchangeTiling& t = *reinterpret_cast<__gm__ adp::moe::ExchangeTiling*>(tiling);
    const auto* peer_table = reinterpret_cast<__gm__ adp::moe::ExchangePeer*>(peers);
    adp::moe::ExchangeOutcome outcome;
    adp::moe::send_phase(t, peer_table, reinterpret_cast<__gm__ adp::moe::RowPart*>(in_parts),
                         reinterpret_cast<__gm__ int32_t*>(send_index),
                         reinterpret_cast<__gm__ adp::xfer::AivQueue*>(queues), &outcome);
    adp::moe::receive_phase(t, peer_table, reinterpret_cast<__gm__ adp::moe::RowPart*>(out_parts), &outcome);
    adp::moe::write_status(status, uint64_t(GetBlockIdx()), outcome);
}
