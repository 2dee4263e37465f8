// AscendC's HCCL kernel API (lib/hccl/hccl.h, AICPU server) on the CPU emulator: the shape of the real
// class (unscoped HcclServerType, the HcclServerConfig template parameter, InitV2 and SetCcTilingV2,
// Init and SetCcTiling deprecated), so that what bisheng rejects does not compile here either (setup.py
// builds with -Werror=deprecated-declarations). BatchWrite goes to the emulator's AICPU server; the
// tiling words are not interpreted. Calls out of order raise ProtocolError: on hardware they hang or
// fail on the server.
#pragma once

#include "kernel_operator.h"

namespace AscendC {

using HcclHandle = int8_t;

enum HcclServerType {
    HCCL_SERVER_TYPE_AICPU = 0,
    HCCL_SERVER_TYPE_CCU,
    HCCL_SERVER_TYPE_END,
};

enum class CoreType : uint8_t { DEFAULT, ON_AIV, ON_AIC };

struct HcclServerConfig {
    CoreType type;
    int64_t blockId;
};

static constexpr HcclServerConfig DEFAULT_CFG = {CoreType::DEFAULT, 0};

template <int32_t index>
GM_ADDR GetHcclContext() {
    return static_cast<GM_ADDR>(emu_detail::rt::current_core().launch->hccl_context());
}

template <HcclServerType serverType = HcclServerType::HCCL_SERVER_TYPE_AICPU, const auto& config = DEFAULT_CFG>
class Hccl {
    static_assert(serverType == HCCL_SERVER_TYPE_AICPU, "the emulator has the AICPU server only");

   public:
    [[deprecated("It is obsolete and use InitV2 instead.")]] void Init(GM_ADDR context,
                                                                       __gm__ void* initTiling = nullptr) {
        InitV2(context, initTiling);
    }
    void InitV2(GM_ADDR context, const void* initTiling = nullptr) {
        (void)initTiling;
        context_ = context;
    }
    [[deprecated("It is obsolete and use SetCcTilingV2 instead.")]] int32_t SetCcTiling(__gm__ void* ccOpTilingData) {
        (void)ccOpTilingData;
        return SetCcTilingV2(0);
    }
    int32_t SetCcTilingV2(uint64_t offset) {
        (void)offset;
        require_init("SetCcTilingV2");
        return 0;
    }
    template <bool commit = false>
    HcclHandle BatchWrite(GM_ADDR batchWriteInfo, uint32_t itemNum, uint16_t queueID = 0U) {
        require_init("BatchWrite");
        if (queueID != 0)
            emu_detail::fail(emu_detail::ErrorKind::kConfig, "Hccl::BatchWrite: queueID ", queueID,
                             " unsupported; only 0");
        if (num_prepared_ == kMaxHandles)
            emu_detail::fail(emu_detail::ErrorKind::kCapacity, "Hccl: more than ", kMaxHandles, " prepared tasks");
        const HcclHandle h = HcclHandle(num_prepared_++);
        prepared_[h] = {reinterpret_cast<uint64_t>(batchWriteInfo), itemNum, 0, false};
        if (commit) Commit(h);
        return h;
    }
    void Commit(HcclHandle handleId) {
        Task& t = task(handleId);
        t.server_handle = emu_detail::rt::hccl_batch_write(context_, t.items, t.num_items, uint32_t(GetBlockIdx()));
        t.committed = true;
    }
    int32_t Wait(HcclHandle handleId) {
        Task& t = task(handleId);
        if (!t.committed)
            emu_detail::fail(emu_detail::ErrorKind::kProtocol, "Hccl::Wait on task ", int32_t(handleId),
                             " that was never committed: a hang on hardware");
        return emu_detail::rt::hccl_batch_write_wait(context_, t.server_handle);
    }
    template <bool sync = true>
    void Finalize() {}

   private:
    struct Task {
        uint64_t items;
        uint32_t num_items;
        uint64_t server_handle;
        bool committed;
    };
    void require_init(const char* api) const {
        if (context_ == nullptr)
            emu_detail::fail(emu_detail::ErrorKind::kProtocol, "Hccl::", api,
                             " before InitV2 (or InitV2 with a null context)");
    }
    Task& task(HcclHandle h) {
        if (h < 0 || h >= num_prepared_)
            emu_detail::fail(emu_detail::ErrorKind::kInvalidKey, "Hccl: unknown task handle ", int32_t(h));
        return prepared_[h];
    }
    static constexpr int32_t kMaxHandles = 64;
    GM_ADDR context_ = nullptr;
    Task prepared_[kMaxHandles] = {};
    int32_t num_prepared_ = 0;
};

}  // namespace AscendC
