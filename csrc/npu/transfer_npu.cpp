// NPU launchers of the layer-block transfer kernels and the host path, through torch_npu.
//
// Compiled only where CANN and torch_npu exist (setup.py adds csrc/npu/*.cpp and defines ADP_WITH_NPU);
// the kernels come from libadp_kernels (op_kernels/CMakeLists.txt) through the ACLRT_LAUNCH_KERNEL
// headers ascendc_library generates. HCCL/HCOMM symbols are resolved with dlopen at first use, so the
// module imports on a machine whose CANN lacks them and reports them unavailable instead.
// Status: written against the documented APIs; not yet compiled or run on hardware.
#ifdef ADP_WITH_NPU

#include <dlfcn.h>
#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include <mutex>
#include <stdexcept>
#include <string>

#include "adp/transfer_kernels.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

#ifdef ADP_WITH_ASCENDC_KERNELS
#include "aclrtlaunch_aicpu_batch_write.h"
#include "aclrtlaunch_aiv_post_wqe.h"
#include "aclrtlaunch_hccl_stage.h"
#endif

namespace py = pybind11;

namespace adp::npu {
namespace {

// HcclOneSideOpDesc (cann-hcomm hccl_one_sided_services.h)
struct OneSideOpDesc {
    void* local_addr;
    void* remote_addr;
    uint64_t count;
    int32_t data_type;
};
using HcclBatchPutFn = int32_t (*)(void* comm, uint32_t remote_rank, OneSideOpDesc* desc, uint32_t n, void* stream);

struct HcclSymbols {
    HcclBatchPutFn batch_put = nullptr;
    std::string missing;
};

const HcclSymbols& hccl_symbols() {
    static HcclSymbols symbols;
    static std::once_flag once;
    std::call_once(once, [] {
        for (const char* lib : {"libhcomm.so", "libhccl.so"}) {
            void* handle = dlopen(lib, RTLD_NOW | RTLD_GLOBAL);
            if (!handle) continue;
            if (!symbols.batch_put) symbols.batch_put = reinterpret_cast<HcclBatchPutFn>(dlsym(handle, "HcclBatchPut"));
        }
        if (!symbols.batch_put) symbols.missing = "HcclBatchPut (looked in libhcomm.so, libhccl.so)";
    });
    return symbols;
}

void* gm(const at::Tensor& t, const char* what) {
    if (!t.device().is_privateuseone()) throw std::invalid_argument(std::string(what) + " must be an NPU tensor");
    return t.data_ptr();
}

template <typename Launch>
void run_on_current_stream(const char* name, Launch launch) {
    at_npu::native::OpCommand cmd;
    cmd.Name(name);
    cmd.SetCustomHandler([launch]() -> int {
        launch(c10_npu::getCurrentNPUStream().stream(false));
        return 0;
    });
    cmd.Run();
}

}  // namespace

void register_npu_transfer(py::module_& m) {
    py::module_ npu =
        m.def_submodule("npu_transfer", "NPU launchers of the transfer kernels (not yet run on hardware)");

#ifdef ADP_WITH_ASCENDC_KERNELS
    // segments: uint8 NPU tensor of n * 32 bytes (adp::xfer::Segment); queues: block_dim * 64 bytes
    // (adp::xfer::AivQueue, from the HCCL AIV channel resources); status: block_dim * 16 bytes; tiling: AivPostTiling.
    npu.def("aiv_post_wqe",
            [](at::Tensor segments, at::Tensor queues, at::Tensor status, at::Tensor tiling, int64_t block_dim) {
                void *s = gm(segments, "segments"), *q = gm(queues, "queues"), *st = gm(status, "status"),
                     *t = gm(tiling, "tiling");
                run_on_current_stream("aiv_post_wqe", [=](void* stream) {
                    ACLRT_LAUNCH_KERNEL(aiv_post_wqe)(uint32_t(block_dim), stream, s, q, st, t);
                });
            });
    npu.def("hccl_stage", [](int64_t src_addr, at::Tensor window, at::Tensor tiling, int64_t block_dim) {
        void *dst = gm(window, "window"), *t = gm(tiling, "tiling");
        void* src = reinterpret_cast<void*>(src_addr);
        run_on_current_stream("hccl_stage", [=](void* stream) {
            ACLRT_LAUNCH_KERNEL(hccl_stage)(uint32_t(block_dim), stream, src, dst, t);
        });
    });
    // aicpu_batch_write needs GetHcclContext<0>(), which only the aclnn/MC2 launch path provides; the
    // kernel-launch path here cannot pass it, so this launcher is not offered yet.
#endif

    npu.def("hccl_available", [] { return hccl_symbols().missing.empty(); });
    // HcclBatchPut on the current stream. comm: the HcclComm handle from
    // pg._get_backend(torch.device("npu")).get_hccl_comm(rank); descs: (n, 3) int64 CPU tensor of
    // (local address, remote address, bytes), data type INT8.
    npu.def("batch_put", [](int64_t comm, int64_t remote_rank, at::Tensor descs) {
        const HcclSymbols& h = hccl_symbols();
        if (!h.missing.empty()) throw std::runtime_error("HCCL symbol unavailable: " + h.missing);
        if (descs.dim() != 2 || descs.size(1) != 3 || descs.scalar_type() != at::kLong || !descs.device().is_cpu())
            throw std::invalid_argument("descs must be an (n, 3) int64 CPU tensor");
        auto rows = descs.contiguous();
        std::vector<OneSideOpDesc> list(size_t(rows.size(0)));
        const int64_t* p = rows.data_ptr<int64_t>();
        for (size_t i = 0; i < list.size(); ++i)
            list[i] = OneSideOpDesc{reinterpret_cast<void*>(p[3 * i]), reinterpret_cast<void*>(p[3 * i + 1]),
                                    uint64_t(p[3 * i + 2]), adp::xfer::kHcclDataTypeInt8};
        const int32_t rc = h.batch_put(reinterpret_cast<void*>(comm), uint32_t(remote_rank), list.data(),
                                       uint32_t(list.size()), c10_npu::getCurrentNPUStream().stream(false));
        if (rc != 0) throw std::runtime_error("HcclBatchPut returned " + std::to_string(rc));
    });
}

}  // namespace adp::npu

#endif  // ADP_WITH_NPU
