// Bindings of the MoE dispatch/combine kernels on the emulated vector cores: build the kernels' GM
// arguments (tiling, per-peer table, row parts, send index, one AIV queue per peer), start the cores
// and hand back a run to wait on. The Python side (ascend_dualpath/moe/strategies/aiv.py) computes the
// tables from the exchanged counts.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "adp/moe_exchange.h"
#include "adp/transfer_kernels.h"
#include "emulator/hccl_comm.h"
#include "emulator/kernel_runner.h"
#include "run_handle.h"

namespace py = pybind11;
using namespace adp::emu;
namespace moe = adp::moe;
namespace xfer = adp::xfer;

extern "C" void moe_dispatch(uint8_t* tiling, uint8_t* peers, uint8_t* in_parts, uint8_t* out_parts,
                             uint8_t* send_index, uint8_t* queues, uint8_t* status);
extern "C" void moe_combine(uint8_t* tiling, uint8_t* peers, uint8_t* in_parts, uint8_t* reduce, uint8_t* send_index,
                            uint8_t* queues, uint8_t* status);

namespace {

constexpr size_t kPeerColumns = 10;  // remote_recv, remote_notify, recv_rkey, notify_rkey, send_begin,
                                     // send_count, recv_begin, recv_count, item_begin, expect_magic

#pragma pack(push, 1)
struct ReduceArgs {  // moe_combine.cpp's ReduceTiling
    uint32_t tokens, hidden, topk, dtype;
    uint64_t slots, out_x, out_w, bias[2];
};
#pragma pack(pop)

struct MoeRun {
    moe::ExchangeTiling tiling{};
    std::vector<moe::ExchangePeer> peers;
    std::vector<moe::RowPart> in_parts, out_parts;
    std::vector<int32_t> send_index;
    std::vector<xfer::AivQueue> queues;
    std::vector<xfer::CoreStatus> status;
    ReduceArgs reduce{};
    std::vector<std::shared_ptr<QueuePair>> qps;
    std::shared_ptr<HcclComm> comm;
    std::vector<uint64_t> rings;
    std::unique_ptr<kernel::Launch> launch;

    ~MoeRun() {
        launch.reset();  // joins the cores first
        for (uint64_t ring : rings) kernel::unregister_sq_ring(ring);
    }
};

std::vector<moe::RowPart> to_parts(const std::vector<std::pair<uint64_t, uint32_t>>& parts, const char* what) {
    if (parts.size() > moe::kMaxParts)
        fail(ErrorKind::kCapacity, what, ": ", parts.size(), " row parts exceed the kernel's ", moe::kMaxParts);
    std::vector<moe::RowPart> out;
    for (const auto& [addr, row_bytes] : parts) out.push_back(moe::RowPart{addr, row_bytes, 0});
    if (out.empty()) out.push_back(moe::RowPart{0, 0, 0});  // the kernel reads num_parts entries only
    return out;
}

template <typename T>
T field(const py::dict& d, const char* name) {
    if (!d.contains(name)) fail(ErrorKind::kConfig, "MoE kernel parameter '", name, "' is missing");
    return d[name].cast<T>();
}

}  // namespace

void register_moe(py::module_& m) {
    m.attr("MOE_DATAPLANE_AIV") = moe::kDataplaneAiv;
    m.attr("MOE_DATAPLANE_AICPU") = moe::kDataplaneAicpu;
    m.attr("CORE_NOTIFY_TIMEOUT") = moe::kCoreNotifyTimeout;

    adp::bindings::bind_run_handle<MoeRun>(
        m, "MoeKernelRun", [](py::dict& d, const xfer::CoreStatus& s) { d["detail"] = s.tail; },
        "Wait (bounded) for every core; per-core dicts (code, posted, detail) or the first core's error.");

    m.def(
        "launch_moe_exchange",
        [](const std::string& kernel_name, std::shared_ptr<HcclComm> comm, const py::dict& params,
           py::array_t<int64_t, py::array::c_style | py::array::forcecast> peer_table,
           const std::vector<std::pair<uint64_t, uint32_t>>& in_parts,
           const std::vector<std::pair<uint64_t, uint32_t>>& out_parts,
           py::array_t<int32_t, py::array::c_style | py::array::forcecast> send_index, const py::object& reduce,
           uint32_t block_dim, uint32_t ub_bytes, double timeout_s) {
            const bool combine = kernel_name == "moe_combine";
            if (!combine && kernel_name != "moe_dispatch")
                fail(ErrorKind::kConfig, "unknown MoE kernel '", kernel_name, "' (moe_dispatch or moe_combine)");
            const uint32_t world = comm->world_size();
            if (peer_table.ndim() != 2 || size_t(peer_table.shape(0)) != world ||
                size_t(peer_table.shape(1)) != kPeerColumns)
                fail(ErrorKind::kConfig, "peer_table must be int64 [", world, ", ", kPeerColumns, "]");
            if (block_dim == 0 || block_dim > comm->device()->profile().vector_cores)
                fail(ErrorKind::kConfig, "block_dim ", block_dim, " is outside [1, ",
                     comm->device()->profile().vector_cores, "] vector cores");
            auto run = std::make_shared<MoeRun>();
            run->comm = comm;
            moe::ExchangeTiling& t = run->tiling;
            t.world = world;
            t.rank = comm->rank();
            t.num_in_parts = uint32_t(in_parts.size());
            t.num_out_parts = uint32_t(out_parts.size());
            t.row_bytes = field<uint32_t>(params, "row_bytes");
            t.dataplane = comm->aiv_dataplane() ? moe::kDataplaneAiv : moe::kDataplaneAicpu;
            t.max_payload = field<uint32_t>(params, "max_payload");
            t.total_items = field<uint32_t>(params, "total_items");
            t.timeout_cycles = uint64_t(timeout_s * kernel::kSystemCycleHz);
            t.send_window = field<uint64_t>(params, "send_window");
            t.recv_window = field<uint64_t>(params, "recv_window");
            t.notify_base = comm->notify_region()->addr();
            t.magic_staging = field<uint64_t>(params, "magic_staging");
            t.magic = field<uint64_t>(params, "magic");
            t.items = field<uint64_t>(params, "items");
            t.send_lkey = comm->windows_out()->info().lkey;
            t.clock.start_vtime_ns = field<double>(params, "start_vtime_ns");
            t.clock.submit_ns = field<double>(params, "submit_ns");
            if (t.max_payload == 0) fail(ErrorKind::kConfig, "max_payload must be >= 1 byte");
            auto table = peer_table.unchecked<2>();
            for (uint32_t p = 0; p < world; ++p) {
                moe::ExchangePeer e{};
                e.remote_recv = uint64_t(table(p, 0));
                e.remote_notify = uint64_t(table(p, 1));
                e.recv_rkey = uint32_t(table(p, 2));
                e.notify_rkey = uint32_t(table(p, 3));
                e.send_begin = uint32_t(table(p, 4));
                e.send_count = uint32_t(table(p, 5));
                e.recv_begin = uint32_t(table(p, 6));
                e.recv_count = uint32_t(table(p, 7));
                e.item_begin = uint32_t(table(p, 8));
                e.expect_magic = uint64_t(table(p, 9));
                if (p != comm->rank() && (e.remote_notify == 0 || e.expect_magic == 0) &&
                    (e.send_count || e.recv_count || e.remote_notify || e.expect_magic))
                    fail(ErrorKind::kConfig, "peer ", p, " is skipped (no notify address or no expected magic) but ",
                         "has ", e.send_count, " rows to send and ", e.recv_count, " to receive");
                if (uint64_t(e.send_begin) + e.send_count > uint64_t(send_index.size()))
                    fail(ErrorKind::kBounds, "peer ", p, " sends rows [", e.send_begin, ", +", e.send_count,
                         ") of a send index of ", send_index.size());
                run->peers.push_back(e);
            }
            run->in_parts = to_parts(in_parts, "send side");
            run->out_parts = to_parts(out_parts, "receive side");
            run->send_index.assign(send_index.data(), send_index.data() + send_index.size());
            run->send_index.push_back(0);  // never empty: the kernel gets a valid address
            if (t.dataplane == moe::kDataplaneAiv) {
                for (uint32_t p = 0; p < world; ++p) {
                    const auto& qp = comm->aiv_qp(p);
                    xfer::AivQueue q{};
                    q.sq_addr = qp->sq_addr();
                    q.head_addr = qp->head_addr();
                    q.tail_addr = qp->tail_addr();
                    q.doorbell_addr = qp->doorbell_addr();
                    q.post_vtime_addr = qp->post_vtime_addr();
                    q.depth = qp->depth();
                    q.wqe_size = qp->wqe_size();
                    q.owner_shift = qp->owner_shift();
                    q.qpn = qp->qpn();
                    q.sl = qp->sl();
                    run->queues.push_back(q);
                    run->qps.push_back(qp);
                    kernel::register_sq_ring(qp->sq_addr(), qp->depth(), qp->wqe_size(), qp->dirty_addr(),
                                             qp->doorbell_addr(), qp->tail_addr());
                    run->rings.push_back(qp->sq_addr());
                }
            } else {
                run->queues.resize(world);  // unused: the AICPU server posts
            }
            if (combine) {
                if (reduce.is_none()) fail(ErrorKind::kConfig, "moe_combine needs the reduce parameters");
                const py::dict r = reduce.cast<py::dict>();
                run->reduce.tokens = field<uint32_t>(r, "tokens");
                run->reduce.hidden = field<uint32_t>(r, "hidden");
                run->reduce.topk = field<uint32_t>(r, "topk");
                run->reduce.dtype = field<uint32_t>(r, "dtype");
                run->reduce.slots = field<uint64_t>(r, "slots");
                run->reduce.out_x = field<uint64_t>(r, "out_x");
                run->reduce.out_w = field<uint64_t>(r, "out_w");
                run->reduce.bias[0] = field<uint64_t>(r, "bias0");
                run->reduce.bias[1] = field<uint64_t>(r, "bias1");
            }
            run->status.assign(block_dim, xfer::CoreStatus{});
            MoeRun* raw = run.get();
            auto ptr = [](auto& v) { return reinterpret_cast<uint8_t*>(v.data()); };
            run->launch = std::make_unique<kernel::Launch>(
                kernel_name, block_dim, ub_bytes, timeout_s, comm.get(), [raw, combine, ptr] {
                    auto* tiling = reinterpret_cast<uint8_t*>(&raw->tiling);
                    if (combine)
                        moe_combine(tiling, ptr(raw->peers), ptr(raw->in_parts),
                                    reinterpret_cast<uint8_t*>(&raw->reduce), ptr(raw->send_index), ptr(raw->queues),
                                    ptr(raw->status));
                    else
                        moe_dispatch(tiling, ptr(raw->peers), ptr(raw->in_parts), ptr(raw->out_parts),
                                     ptr(raw->send_index), ptr(raw->queues), ptr(raw->status));
                });
            return run;
        },
        py::arg("kernel_name"), py::arg("comm"), py::arg("params"), py::arg("peer_table"), py::arg("in_parts"),
        py::arg("out_parts"), py::arg("send_index"), py::arg("reduce"), py::arg("block_dim"), py::arg("ub_bytes"),
        py::arg("timeout_s"),
        "Start moe_dispatch or moe_combine on block_dim vector cores of comm's device; returns a MoeKernelRun.");
}
