// Bindings of the layer-block transfer kernels on the emulated vector cores: launchers that build the
// kernels' GM arguments, start `block_dim` emulated AIV cores and hand back a KernelRun to wait on.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <utility>
#include <vector>

#include "adp/transfer_kernels.h"
#include "emulator/hccl_comm.h"
#include "emulator/kernel_runner.h"
#include "run_handle.h"

namespace py = pybind11;
using namespace adp::emu;
namespace xfer = adp::xfer;

extern "C" void aiv_post_wqe(uint8_t* segments, uint8_t* queues, uint8_t* status, uint8_t* tiling);
extern "C" void hccl_stage(uint8_t* src, uint8_t* dst, uint8_t* tiling);
extern "C" void aicpu_batch_write(uint8_t* segments, uint8_t* items, uint8_t* status, uint8_t* tiling);
extern "C" void emu_probe(uint8_t* mode, uint8_t* queue, uint8_t* segment);

namespace {

using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;
using U32Array = py::array_t<uint32_t, py::array::c_style | py::array::forcecast>;

// The kernel's GM arguments and its launch; the arguments live as long as the run.
struct KernelRun {
    std::vector<xfer::Segment> segments;
    std::vector<xfer::AivQueue> queues;
    std::vector<xfer::CoreStatus> status;
    std::vector<uint8_t> tiling;
    std::vector<std::shared_ptr<QueuePair>> qps;  // kept open while the cores post to them
    std::shared_ptr<HcclComm> comm;               // kept alive while core 0 talks to its AICPU server
    std::vector<uint64_t> registered_rings;
    std::unique_ptr<kernel::Launch> launch;

    ~KernelRun() {
        launch.reset();  // joins the cores first
        for (uint64_t ring : registered_rings) kernel::unregister_sq_ring(ring);
    }
    template <typename T>
    T* tiling_as() {
        tiling.assign(sizeof(T), 0);
        return reinterpret_cast<T*>(tiling.data());
    }
    void register_rings() {
        for (const auto& qp : qps) {
            kernel::register_sq_ring(qp->sq_addr(), qp->depth(), qp->wqe_size(), qp->dirty_addr(), qp->doorbell_addr(),
                                     qp->tail_addr());
            registered_rings.push_back(qp->sq_addr());
        }
    }
};

xfer::AivQueue queue_of(const QueuePair& qp) {
    xfer::AivQueue q{};
    q.sq_addr = qp.sq_addr();
    q.head_addr = qp.head_addr();
    q.tail_addr = qp.tail_addr();
    q.doorbell_addr = qp.doorbell_addr();
    q.post_vtime_addr = qp.post_vtime_addr();
    q.depth = qp.depth();
    q.wqe_size = qp.wqe_size();
    q.owner_shift = qp.owner_shift();
    q.qpn = qp.qpn();
    q.sl = qp.sl();
    return q;
}

std::vector<xfer::Segment> pack_segments(const U64Array& local_addrs, const U64Array& remote_addrs,
                                         const U64Array& lengths, const U32Array& lkeys, const U32Array& rkeys) {
    const size_t n = size_t(lengths.size());
    if (size_t(local_addrs.size()) != n || size_t(remote_addrs.size()) != n || size_t(lkeys.size()) != n ||
        size_t(rkeys.size()) != n)
        fail(ErrorKind::kConfig, "segment arrays must have equal lengths: ", local_addrs.size(), " local, ",
             remote_addrs.size(), " remote, ", n, " lengths, ", lkeys.size(), " lkeys, ", rkeys.size(), " rkeys");
    if (n == 0) fail(ErrorKind::kConfig, "a transfer needs at least 1 segment");
    if (n > 0xffffffffull) fail(ErrorKind::kCapacity, n, " segments exceed 2^32-1");
    auto la = local_addrs.unchecked<1>(), ra = remote_addrs.unchecked<1>(), ln = lengths.unchecked<1>();
    auto lk = lkeys.unchecked<1>(), rk = rkeys.unchecked<1>();
    std::vector<xfer::Segment> out(n);
    for (size_t i = 0; i < n; ++i) {
        if (ln(i) == 0 || ln(i) > adp::wqe::kMaxMessageBytes)
            fail(ErrorKind::kPayloadTooLarge, "segment ", i, " has ", ln(i), " bytes; a WQE carries 1 .. ",
                 adp::wqe::kMaxMessageBytes);
        out[i] = xfer::Segment{la(i), ra(i), uint32_t(ln(i)), lk(i), rk(i), 0};
    }
    return out;
}

void check_block_dim(uint32_t block_dim, uint32_t limit) {
    if (block_dim == 0 || block_dim > limit)
        fail(ErrorKind::kConfig, "block_dim ", block_dim, " is outside [1, ", limit, "] vector cores");
}

// The library error of a failed access check: the class Python maps the same CQE syndrome to.
ErrorKind access_error(uint32_t syndrome) {
    switch (syndrome) {
        case adp::wqe::kSynBadLkey: return ErrorKind::kNotRegistered;
        case adp::wqe::kSynBadRkey: return ErrorKind::kInvalidKey;
        case adp::wqe::kSynLocalOutOfBounds:
        case adp::wqe::kSynRemoteOutOfBounds: return ErrorKind::kBounds;
        default: return ErrorKind::kAccess;
    }
}

// The checks the NIC makes per WQE, made for every segment before a kernel starts, so that a refused request
// moves nothing: the local range inside the live registration its lkey names, in protection domain `pd`
// (with LOCAL_WRITE when the range is written); with `remote`, the remote range inside its rkey's registration
// with REMOTE_WRITE.
void check_segments(const Fabric& fabric, uint32_t pd, const std::vector<xfer::Segment>& segments, bool local_write,
                    bool remote, const char* what) {
    for (size_t i = 0; i < segments.size(); ++i) {
        const xfer::Segment& s = segments[i];
        AccessCheck c = fabric.check_local(s.lkey, pd, s.local_addr, s.length, local_write);
        if (c.ok() && remote) c = fabric.check_remote(s.rkey, s.remote_addr, s.length, kRemoteWrite);
        if (!c.ok()) fail(access_error(c.syndrome), what, " ", i, ": ", c.detail);
    }
}

// The fabric and protection domain the queue pairs post in (they must share one).
std::pair<const Fabric*, uint32_t> domain_of(const std::vector<std::shared_ptr<QueuePair>>& qps) {
    const Region& first = *qps.front()->region();
    for (const auto& qp : qps)
        if (qp->region()->info().pd != first.info().pd)
            fail(ErrorKind::kConfig, "the queue pairs of one launch must share a protection domain: qpn ", qp->qpn(),
                 " is in ", qp->region()->info().pd, ", qpn ", qps.front()->qpn(), " in ", first.info().pd);
    return {first.fabric().get(), first.info().pd};
}

}  // namespace

#ifdef ADP_WITH_NPU
namespace adp::npu {
void register_npu_transfer(py::module_& m);  // csrc/npu/transfer_npu.cpp
}
#endif

void register_transfer(py::module_& m) {
#ifdef ADP_WITH_NPU
    adp::npu::register_npu_transfer(m);
#endif
    m.attr("CORE_OK") = xfer::kCoreOk;
    m.attr("CORE_SQ_TIMEOUT") = xfer::kCoreSqTimeout;
    m.attr("CORE_BATCH_WRITE_FAILED") = xfer::kCoreBatchWriteFailed;
    m.attr("SYSTEM_CYCLE_HZ") = kernel::kSystemCycleHz;
    m.attr("NOTIFY_SLOTS") = HcclComm::kNotifySlots;

    m.def(
        "check_segments",
        [](const std::shared_ptr<Device>& device, U64Array local_addrs, U64Array remote_addrs, U64Array lengths,
           U32Array lkeys, U32Array rkeys, bool remote) {
            check_segments(*device->fabric(), device->pd(), pack_segments(local_addrs, remote_addrs, lengths, lkeys, rkeys),
                           false, remote, "segment");
        },
        py::arg("device"), py::arg("local_addrs"), py::arg("remote_addrs"), py::arg("lengths"), py::arg("lkeys"),
        py::arg("rkeys"), py::arg("remote"),
        "Raise the library error of the first segment whose local range is not inside the live registration its "
        "lkey names on `device` (and, with `remote`, whose remote range is not inside a writable registration of "
        "its rkey); moves nothing.");

    adp::bindings::bind_run_handle<KernelRun>(
        m, "KernelRun",
        [](py::dict& d, const xfer::CoreStatus& s) {
            d["head"] = s.head;
            d["tail"] = s.tail;
        },
        "Wait (bounded) for every core; returns per-core status dicts or raises the first core's error.")
        .def_property_readonly("block_dim", [](const KernelRun& r) { return r.launch->block_dim(); })
        .def_property_readonly("done", [](const KernelRun& r) { return r.launch->done(); });

    m.def(
        "launch_aiv_post_wqe",
        [](const std::vector<std::shared_ptr<QueuePair>>& qps, U64Array local_addrs, U64Array remote_addrs,
           U64Array lengths, U32Array lkeys, U32Array rkeys, uint32_t doorbell_batch, double start_vtime_ns,
           double submit_ns, uint32_t ub_bytes, double timeout_s) {
            auto run = std::make_shared<KernelRun>();
            run->segments = pack_segments(local_addrs, remote_addrs, lengths, lkeys, rkeys);
            if (qps.empty()) fail(ErrorKind::kConfig, "aiv_post_wqe needs one queue pair per vector core, got none");
            if (doorbell_batch == 0) fail(ErrorKind::kConfig, "doorbell_batch must be >= 1");
            const auto [fabric, pd] = domain_of(qps);
            check_segments(*fabric, pd, run->segments, false, true, "aiv_post_wqe segment");
            run->qps = qps;
            for (const auto& qp : qps) run->queues.push_back(queue_of(*qp));
            run->status.assign(qps.size(), xfer::CoreStatus{});
            auto* t = run->tiling_as<xfer::AivPostTiling>();
            t->num_segments = uint32_t(run->segments.size());
            t->doorbell_batch = doorbell_batch;
            t->timeout_cycles = uint64_t(timeout_s * kernel::kSystemCycleHz);
            t->clock.start_vtime_ns = start_vtime_ns;
            t->clock.submit_ns = submit_ns;
            run->register_rings();
            KernelRun* raw = run.get();
            run->launch = std::make_unique<kernel::Launch>(
                "aiv_post_wqe", uint32_t(qps.size()), ub_bytes, timeout_s, nullptr, [raw] {
                    aiv_post_wqe(reinterpret_cast<uint8_t*>(raw->segments.data()),
                                 reinterpret_cast<uint8_t*>(raw->queues.data()),
                                 reinterpret_cast<uint8_t*>(raw->status.data()), raw->tiling.data());
                });
            return run;
        },
        py::arg("qps"), py::arg("local_addrs"), py::arg("remote_addrs"), py::arg("lengths"), py::arg("lkeys"),
        py::arg("rkeys"), py::arg("doorbell_batch"), py::arg("start_vtime_ns"), py::arg("submit_ns"),
        py::arg("ub_bytes"), py::arg("timeout_s"),
        "Start aiv_post_wqe on len(qps) vector cores (core i posts to qps[i]); returns a KernelRun.");

    m.def(
        "launch_hccl_stage",
        [](const std::shared_ptr<Device>& device, uint64_t src_addr, uint32_t src_lkey, uint64_t dst_addr,
           uint32_t dst_lkey, uint64_t total_bytes, uint32_t block_dim, uint32_t chunk_bytes, uint32_t buffer_num,
           uint32_t ub_bytes, double timeout_s) {
            check_block_dim(block_dim, 1024);
            if (total_bytes == 0) fail(ErrorKind::kConfig, "hccl_stage needs at least 1 byte");
            if (chunk_bytes == 0 || chunk_bytes % 32 != 0)
                fail(ErrorKind::kAlignment, "chunk_bytes ", chunk_bytes, " must be a positive multiple of 32");
            // the cores copy through raw GM pointers: both ranges must lie in live registrations of this device
            auto check = [&](const char* side, uint64_t addr, uint32_t lkey, bool write) {
                const AccessCheck c = device->fabric()->check_local(lkey, device->pd(), addr, total_bytes, write);
                if (!c.ok()) fail(access_error(c.syndrome), "hccl_stage ", side, ": ", c.detail);
            };
            check("source", src_addr, src_lkey, false);
            check("destination", dst_addr, dst_lkey, true);
            auto run = std::make_shared<KernelRun>();
            auto* t = run->tiling_as<xfer::StageTiling>();
            t->total_bytes = total_bytes;
            t->chunk_bytes = chunk_bytes;
            t->buffer_num = buffer_num;
            KernelRun* raw = run.get();
            run->launch = std::make_unique<kernel::Launch>(
                "hccl_stage", block_dim, ub_bytes, timeout_s, nullptr, [raw, src_addr, dst_addr] {
                    hccl_stage(reinterpret_cast<uint8_t*>(src_addr), reinterpret_cast<uint8_t*>(dst_addr),
                               raw->tiling.data());
                });
            return run;
        },
        py::arg("device"), py::arg("src_addr"), py::arg("src_lkey"), py::arg("dst_addr"), py::arg("dst_lkey"),
        py::arg("total_bytes"), py::arg("block_dim"), py::arg("chunk_bytes"), py::arg("buffer_num"),
        py::arg("ub_bytes"), py::arg("timeout_s"),
        "Start hccl_stage: copy total_bytes from src_addr (under src_lkey) to dst_addr (under dst_lkey, writable), "
        "both registered on `device`; refused before any core starts otherwise.");

    m.def(
        "launch_aicpu_batch_write",
        [](std::shared_ptr<HcclComm> comm, uint64_t items_addr, U64Array local_addrs, U64Array remote_addrs,
           U64Array lengths, uint32_t remote_rank, uint32_t block_dim, uint32_t items_per_round, uint32_t ub_bytes,
           double timeout_s) {
            check_block_dim(block_dim, 1024);
            if (items_per_round == 0) fail(ErrorKind::kConfig, "items_per_round must be >= 1");
            auto run = std::make_shared<KernelRun>();
            const size_t n = size_t(lengths.size());
            U32Array zeros(std::vector<py::ssize_t>{py::ssize_t(n)});
            std::fill(zeros.mutable_data(), zeros.mutable_data() + n, 0u);
            run->segments = pack_segments(local_addrs, remote_addrs, lengths, zeros, zeros);
            // the cores write the items through a raw pointer and the server rejects a bad item only when it
            // serves the issue: check the item array and every item's ranges (as the server will) before the start
            comm->check_local_range(items_addr, uint64_t(n) * sizeof(adp::wqe::BatchWriteItem), "BatchWrite item array");
            for (size_t i = 0; i < n; ++i) {
                const xfer::Segment& s = run->segments[i];
                comm->check_one_sided(remote_rank, s.local_addr, s.remote_addr, s.length, cat("BatchWrite item ", i));
            }
            run->status.assign(block_dim, xfer::CoreStatus{});
            run->comm = comm;
            auto* t = run->tiling_as<xfer::BatchWriteTiling>();
            t->num_segments = uint32_t(n);
            t->remote_rank = remote_rank;
            t->items_per_round = items_per_round;
            KernelRun* raw = run.get();
            run->launch = std::make_unique<kernel::Launch>(
                "aicpu_batch_write", block_dim, ub_bytes, timeout_s, comm.get(), [raw, items_addr] {
                    aicpu_batch_write(reinterpret_cast<uint8_t*>(raw->segments.data()),
                                      reinterpret_cast<uint8_t*>(items_addr),
                                      reinterpret_cast<uint8_t*>(raw->status.data()), raw->tiling.data());
                });
            return run;
        },
        py::arg("comm"), py::arg("items_addr"), py::arg("local_addrs"), py::arg("remote_addrs"), py::arg("lengths"),
        py::arg("remote_rank"), py::arg("block_dim"), py::arg("items_per_round"), py::arg("ub_bytes"),
        py::arg("timeout_s"),
        "Start aicpu_batch_write: the cores write 32-byte items at items_addr (registered), core 0 submits them.");

    m.def(
        "launch_emu_probe",
        [](uint32_t mode, std::shared_ptr<QueuePair> qp, uint64_t local_addr, uint32_t lkey, uint64_t remote_addr,
           uint32_t rkey, uint32_t length, uint32_t ub_bytes, double timeout_s) {
            auto run = std::make_shared<KernelRun>();
            run->tiling.assign(64, 0);
            std::memcpy(run->tiling.data(), &mode, sizeof(mode));
            run->segments = {xfer::Segment{local_addr, remote_addr, length, lkey, rkey, 0}};
            if (qp) {
                run->qps = {qp};
                run->queues = {queue_of(*qp)};
                run->register_rings();
            }
            KernelRun* raw = run.get();
            // modes 3/4 read the queue and the segment; mode 1 copies from the GM buffer at local_addr
            run->launch = std::make_unique<kernel::Launch>("emu_probe", 1, ub_bytes, timeout_s, nullptr, [raw] {
                emu_probe(raw->tiling.data(),
                          raw->queues.empty() ? nullptr : reinterpret_cast<uint8_t*>(raw->queues.data()),
                          raw->segments[0].local_addr && raw->queues.empty()
                              ? reinterpret_cast<uint8_t*>(raw->segments[0].local_addr)
                              : reinterpret_cast<uint8_t*>(raw->segments.data()));
            });
            return run;
        },
        py::arg("mode"), py::arg("qp") = nullptr, py::arg("local_addr") = 0, py::arg("lkey") = 0,
        py::arg("remote_addr") = 0, py::arg("rkey") = 0, py::arg("length") = 0, py::arg("ub_bytes") = 196608,
        py::arg("timeout_s") = 10.0,
        "Emulator self-test kernels (1 unaligned DataCopy, 2 UB overflow, 3 doorbell before flush, 4 flushed, "
        "5 WaitFlag without SetFlag).");
}
