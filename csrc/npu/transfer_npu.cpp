// NPU host path (HCCL one-sided puts) and kernel launchers, through torch_npu: `_C.npu_transfer`.
//
// Compiled only where CANN and torch_npu exist (setup.py adds csrc/npu/*.cpp and defines ADP_WITH_NPU); the
// kernels come from libadp_kernels through the ACLRT_LAUNCH_KERNEL headers ascendc_library generates. The HCOMM
// one-sided API (HcclRegisterGlobalMem, HcclCommBindMem, HcclCommPrepare, HcclBatchPut, ...) is newer than the
// hccl headers torch_npu bundles, so its types are declared here (layouts of cann-hcomm's hccl_mem_defs.h and
// hccl_one_sided_services.h) and its symbols are resolved with dlopen at first use: the module imports on a CANN
// that lacks them and reports them missing.
//
// NOTES: every ACL/HCCL call returns its raw code to Python (ascend_dualpath/transport/npu.py names and raises
// it), so the checks and their messages are tested on the CPU with a fake of this module. Work that must be
// ordered with queued kernels (the put, the event record, the launches) goes through torch_npu's task queue
// (OpCommand custom handler) and asks for the raw stream only inside the handler; a failing code there is kept
// for take_async_error() and also returned to the queue. Status: compile-checked against the torch_npu wheel's
// headers (tools/check_npu_host_compile.sh); not yet linked or run on hardware.
#ifdef ADP_WITH_NPU

#include <dlfcn.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "acl/acl.h"
#include "adp/transfer_kernels.h"
#include "torch_npu/csrc/core/npu/NPUStream.h"
#include "torch_npu/csrc/framework/OpCommand.h"

#ifdef ADP_WITH_ASCENDC_KERNELS
#include "aclrtlaunch_aiv_post_wqe.h"
#include "aclrtlaunch_hccl_stage.h"
#endif

namespace py = pybind11;

namespace adp::npu {
namespace {

// HcclMem (hccl_mem_defs.h): type 0 = HCCL_MEM_TYPE_DEVICE, 1 = HCCL_MEM_TYPE_HOST
struct HcclMemRange {
    int32_t type;
    void* addr;
    uint64_t size;
};
constexpr int32_t kHcclMemDevice = 0;
constexpr int32_t kHcclMemHost = 1;

// HcclOneSideOpDesc (hccl_one_sided_services.h)
struct OneSideOpDesc {
    void* local_addr;
    void* remote_addr;
    uint64_t count;
    int32_t data_type;
};

// HcclPrepareConfig (hccl_one_sided_services.h): topo 0 = HCCL_TOPO_FULLMESH, reserved words zero
struct PrepareConfig {
    int32_t topo_type;
    uint64_t rsvd0;
    uint64_t rsvd1;
    uint64_t rsvd2;
};

using RegisterGlobalMemFn = int32_t (*)(const HcclMemRange* mem, void** handle);
using DeregisterGlobalMemFn = int32_t (*)(void* handle);
using CommMemFn = int32_t (*)(void* comm, void* handle);  // HcclCommBindMem / HcclCommUnbindMem
using CommPrepareFn = int32_t (*)(void* comm, PrepareConfig* config, int32_t timeout_s);
using BatchPutFn = int32_t (*)(void* comm, uint32_t remote_rank, OneSideOpDesc* desc, uint32_t n, void* stream);

struct HcclSymbols {
    RegisterGlobalMemFn register_global_mem = nullptr;
    DeregisterGlobalMemFn deregister_global_mem = nullptr;
    CommMemFn comm_bind_mem = nullptr;
    CommMemFn comm_unbind_mem = nullptr;
    CommPrepareFn comm_prepare = nullptr;
    BatchPutFn batch_put = nullptr;
    std::vector<std::string> missing;
};

template <typename Fn>
void resolve(const std::vector<void*>& handles, const char* name, Fn& fn, std::vector<std::string>& missing) {
    for (void* handle : handles) {
        if (!fn) fn = reinterpret_cast<Fn>(dlsym(handle, name));
    }
    if (!fn) missing.emplace_back(name);
}

const HcclSymbols& hccl_symbols() {
    static HcclSymbols s;
    static std::once_flag once;
    std::call_once(once, [] {
        std::vector<void*> handles;
        for (const char* lib : {"libhcomm.so", "libhccl.so"}) {
            if (void* handle = dlopen(lib, RTLD_NOW | RTLD_GLOBAL)) handles.push_back(handle);
        }
        resolve(handles, "HcclRegisterGlobalMem", s.register_global_mem, s.missing);
        resolve(handles, "HcclDeregisterGlobalMem", s.deregister_global_mem, s.missing);
        resolve(handles, "HcclCommBindMem", s.comm_bind_mem, s.missing);
        resolve(handles, "HcclCommUnbindMem", s.comm_unbind_mem, s.missing);
        resolve(handles, "HcclCommPrepare", s.comm_prepare, s.missing);
        resolve(handles, "HcclBatchPut", s.batch_put, s.missing);
    });
    return s;
}

template <typename Fn>
Fn require(Fn fn, const char* name) {
    if (!fn) throw std::runtime_error(std::string(name) + " is not in libhcomm.so/libhccl.so of this CANN");
    return fn;
}

// The first failing code of work run by torch_npu's task queue: (call, code).
std::mutex g_async_mutex;
std::optional<std::pair<std::string, int64_t>> g_async_error;

int keep_async(const char* call, int64_t rc) {
    if (rc != 0) {
        std::lock_guard<std::mutex> lock(g_async_mutex);
        if (!g_async_error) g_async_error = std::make_pair(std::string(call), rc);
    }
    return int(rc);
}

// Run `work(stream)` in order with the work queued on the current NPU stream; the stream is captured now (the
// caller's current stream) and its raw handle taken inside the handler, where asking for it cannot overtake
// queued tasks.
template <typename Work>
void on_task_queue(const char* name, Work work) {
    c10_npu::NPUStream stream = c10_npu::getCurrentNPUStream();
    at_npu::native::OpCommand cmd;
    cmd.Name(name);
    cmd.SetCustomHandler([stream, work]() -> int { return work(stream.stream(false)); });
    cmd.Run();
}

void* as_ptr(int64_t value) { return reinterpret_cast<void*>(value); }
int64_t as_int(void* ptr) { return reinterpret_cast<int64_t>(ptr); }

std::vector<OneSideOpDesc> one_side_descs(const at::Tensor& descs) {
    if (descs.dim() != 2 || descs.size(1) != 3 || descs.scalar_type() != at::kLong || !descs.device().is_cpu())
        throw std::invalid_argument("descs must be an (n, 3) int64 CPU tensor of (local, remote, bytes)");
    if (descs.size(0) < 1 || descs.size(0) > int64_t(UINT32_MAX))
        throw std::invalid_argument("descs must have 1 to 2^32 - 1 rows, got " + std::to_string(descs.size(0)));
    auto rows = descs.contiguous();
    const int64_t* p = rows.data_ptr<int64_t>();
    std::vector<OneSideOpDesc> list(size_t(rows.size(0)));
    for (size_t i = 0; i < list.size(); ++i) {
        if (p[3 * i + 2] < 1) throw std::invalid_argument("descs row " + std::to_string(i) + " moves no bytes");
        list[i] = OneSideOpDesc{as_ptr(p[3 * i]), as_ptr(p[3 * i + 1]), uint64_t(p[3 * i + 2]),
                                int32_t(adp::xfer::kHcclDataTypeInt8)};
    }
    return list;
}

#ifdef ADP_WITH_ASCENDC_KERNELS
void* gm(const at::Tensor& t, const char* what) {
    if (!t.device().is_privateuseone()) throw std::invalid_argument(std::string(what) + " must be an NPU tensor");
    if (t.device().index() != c10_npu::getCurrentNPUStream().device_index())
        throw std::invalid_argument(std::string(what) + " is on another NPU than the current stream");
    return t.data_ptr();
}

// block_dim in [1, the device's vector cores]
void check_block_dim(int64_t block_dim) {
    int32_t device = -1;
    int64_t cores = 0;
    aclError rc = aclrtGetDevice(&device);
    if (rc == ACL_SUCCESS) rc = aclGetDeviceCapability(uint32_t(device), ACL_DEVICE_INFO_VECTOR_CORE_NUM, &cores);
    if (rc != ACL_SUCCESS)
        throw std::runtime_error("aclrtGetDevice/aclGetDeviceCapability returned " + std::to_string(rc));
    if (block_dim < 1 || block_dim > cores)
        throw std::invalid_argument("block_dim " + std::to_string(block_dim) + " is outside [1, " +
                                    std::to_string(cores) + "] vector cores of NPU " + std::to_string(device));
}
#endif

void register_hccl(py::module_& npu) {
    npu.def("missing_symbols", [] { return hccl_symbols().missing; },
            "HCOMM one-sided functions this CANN lacks (empty: the host path can run)");
    npu.def("register_global_mem", [](int64_t addr, int64_t nbytes, bool is_device) {
        const HcclMemRange mem{is_device ? kHcclMemDevice : kHcclMemHost, as_ptr(addr), uint64_t(nbytes)};
        void* handle = nullptr;
        const int32_t rc = require(hccl_symbols().register_global_mem, "HcclRegisterGlobalMem")(&mem, &handle);
        return std::make_pair(int64_t(rc), as_int(handle));
    });
    npu.def("deregister_global_mem", [](int64_t handle) {
        return int64_t(require(hccl_symbols().deregister_global_mem, "HcclDeregisterGlobalMem")(as_ptr(handle)));
    });
    npu.def("comm_bind_mem", [](int64_t comm, int64_t handle) {
        return int64_t(require(hccl_symbols().comm_bind_mem, "HcclCommBindMem")(as_ptr(comm), as_ptr(handle)));
    });
    npu.def("comm_unbind_mem", [](int64_t comm, int64_t handle) {
        return int64_t(require(hccl_symbols().comm_unbind_mem, "HcclCommUnbindMem")(as_ptr(comm), as_ptr(handle)));
    });
    // a blocking collective over every rank of the communicator: the GIL is released
    npu.def("comm_prepare", [](int64_t comm, int64_t timeout_s) {
        CommPrepareFn prepare = require(hccl_symbols().comm_prepare, "HcclCommPrepare");
        PrepareConfig config{0, 0, 0, 0};
        py::gil_scoped_release release;
        return int64_t(prepare(as_ptr(comm), &config, int32_t(timeout_s)));
    });
    // HcclBatchPut of descs, then aclrtRecordEvent(event) unless event is 0, in order on the current stream's task
    // queue
    npu.def("enqueue_batch_put", [](int64_t comm, int64_t remote_rank, at::Tensor descs, int64_t event) {
        BatchPutFn put = require(hccl_symbols().batch_put, "HcclBatchPut");
        auto list = std::make_shared<std::vector<OneSideOpDesc>>(one_side_descs(descs));
        on_task_queue("adp_hccl_batch_put", [=](aclrtStream stream) -> int {
            const int32_t rc = put(as_ptr(comm), uint32_t(remote_rank), list->data(), uint32_t(list->size()), stream);
            if (rc != 0 || event == 0) return keep_async("HcclBatchPut", rc);
            return keep_async("aclrtRecordEvent", aclrtRecordEvent(static_cast<aclrtEvent>(as_ptr(event)), stream));
        });
    });
    npu.def("take_async_error", []() -> std::optional<std::pair<std::string, int64_t>> {
        std::lock_guard<std::mutex> lock(g_async_mutex);
        auto out = g_async_error;
        g_async_error.reset();
        return out;
    });
}

void register_acl(py::module_& npu) {
    npu.def("current_device", [] {
        int32_t device = -1;
        const aclError rc = aclrtGetDevice(&device);
        return std::make_pair(int64_t(rc), int64_t(device));
    });
    npu.def("create_event", [] {
        aclrtEvent event = nullptr;
        const aclError rc = aclrtCreateEventWithFlag(&event, ACL_EVENT_SYNC);
        return std::make_pair(int64_t(rc), as_int(event));
    });
    npu.def("query_event", [](int64_t event) {
        aclrtEventRecordedStatus status = ACL_EVENT_RECORDED_STATUS_NOT_READY;
        const aclError rc = aclrtQueryEventStatus(static_cast<aclrtEvent>(as_ptr(event)), &status);
        return std::make_pair(int64_t(rc), status == ACL_EVENT_RECORDED_STATUS_COMPLETE);
    });
    npu.def("destroy_event", [](int64_t event) {
        return int64_t(aclrtDestroyEvent(static_cast<aclrtEvent>(as_ptr(event))));
    });
}

#ifdef ADP_WITH_ASCENDC_KERNELS
void register_launchers(py::module_& npu) {
    // segments: uint8 NPU tensor of n * 32 bytes (adp::xfer::Segment); queues: block_dim * 64 bytes
    // (adp::xfer::AivQueue, from the HCCL AIV channel resources); status: block_dim * 16 bytes; tiling: AivPostTiling.
    npu.def("aiv_post_wqe",
            [](at::Tensor segments, at::Tensor queues, at::Tensor status, at::Tensor tiling, int64_t block_dim) {
                check_block_dim(block_dim);
                void *s = gm(segments, "segments"), *q = gm(queues, "queues"), *st = gm(status, "status"),
                     *t = gm(tiling, "tiling");
                on_task_queue("adp_aiv_post_wqe", [=](aclrtStream stream) -> int {
                    return keep_async("aclrtlaunch_aiv_post_wqe",
                                      ACLRT_LAUNCH_KERNEL(aiv_post_wqe)(uint32_t(block_dim), stream, s, q, st, t));
                });
            });
    npu.def("hccl_stage", [](int64_t src_addr, at::Tensor window, at::Tensor tiling, int64_t block_dim) {
        check_block_dim(block_dim);
        void *dst = gm(window, "window"), *t = gm(tiling, "tiling");
        void* src = as_ptr(src_addr);
        on_task_queue("adp_hccl_stage", [=](aclrtStream stream) -> int {
            return keep_async("aclrtlaunch_hccl_stage",
                              ACLRT_LAUNCH_KERNEL(hccl_stage)(uint32_t(block_dim), stream, src, dst, t));
        });
    });
    // aicpu_batch_write needs GetHcclContext<0>(), which only the aclnn/MC2 launch path provides; the
    // kernel-launch path here cannot pass it, so this launcher is not offered yet.
}
#endif

}  // namespace

void register_npu_transfer(py::module_& m) {
    py::module_ npu = m.def_submodule("npu_transfer", "NPU host path and launchers (not yet run on hardware)");
    register_hccl(npu);
    register_acl(npu);
#ifdef ADP_WITH_ASCENDC_KERNELS
    register_launchers(npu);
#endif
}

}  // namespace adp::npu

#endif  // ADP_WITH_NPU
