// pybind11 module ascend_dualpath._C: the emulated device runtime as classes with explicit lifetimes.
// Every blocking call releases the GIL and is bounded by a timeout; C++ errors become the Python
// classes of ascend_dualpath/errors.py.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "adp/wqe_hns.h"
#include "emulator/hccl_comm.h"

namespace py = pybind11;
using namespace adp::emu;

void register_transfer(py::module_& m);  // csrc/bindings/transfer.cpp
void register_moe(py::module_& m);       // csrc/bindings/moe.cpp
namespace wqe = adp::wqe;

namespace {

const char* error_class(ErrorKind kind) {
    switch (kind) {
        case ErrorKind::kBounds: return "BoundsError";
        case ErrorKind::kAccess: return "AccessDenied";
        case ErrorKind::kInvalidKey: return "InvalidKey";
        case ErrorKind::kNotRegistered: return "NotRegistered";
        case ErrorKind::kAlignment: return "AlignmentError";
        case ErrorKind::kPayloadTooLarge: return "PayloadTooLarge";
        case ErrorKind::kCapacity: return "CapacityError";
        case ErrorKind::kConfig: return "ConfigError";
        case ErrorKind::kQueue: return "QueueError";
        case ErrorKind::kProtocol: return "ProtocolError";
        case ErrorKind::kTimeout: return "WaitTimeout";
        default: return "AdpError";
    }
}

void check_field(const char* name, uint64_t value, uint64_t limit) {
    if (value > limit) throw Error(ErrorKind::kConfig, cat(name, " ", value, " exceeds its field's maximum ", limit));
}

py::bytes encode_rdma_wqe(uint32_t opcode, uint32_t owner, bool signaled, uint64_t length, uint32_t rkey,
                          uint64_t remote_addr, uint32_t lkey, uint64_t local_addr, uint32_t imm) {
    check_field("opcode", opcode, wqe::kOpcodeMask);
    check_field("owner", owner, 1);
    check_field("length", length, 0xffffffffu);
    const wqe::RcSendWqe w =
        wqe::encode_rc_wqe(opcode, owner, signaled, uint32_t(length), rkey, remote_addr, lkey, local_addr, imm);
    return py::bytes(reinterpret_cast<const char*>(&w), sizeof(w));
}

py::dict decode_rdma_wqe(const py::bytes& data) {
    const std::string s = data;
    if (s.size() < wqe::kWqeBytes)
        throw Error(ErrorKind::kConfig, cat("a WQE is ", wqe::kWqeBytes, " bytes, got ", s.size()));
    wqe::RcSendWqe w;
    std::memcpy(&w, s.data(), sizeof(w));
    py::dict d;
    d["opcode"] = w.byte_4 & wqe::kOpcodeMask;
    d["owner"] = (~(w.byte_4 >> 7)) & 1u;  // bit 7 holds the inverse
    d["owner_bit"] = (w.byte_4 >> 7) & 1u;
    d["signaled"] = bool(w.byte_4 & wqe::kSignaledBit);
    d["length"] = w.msg_len;
    d["imm"] = w.immtdata;
    d["num_sge"] = w.byte_16 >> wqe::kNumSgeShift;
    d["rkey"] = w.rkey;
    d["remote_addr"] = w.remote_va;
    d["sge_length"] = w.sge_len;
    d["lkey"] = w.sge_lkey;
    d["local_addr"] = w.sge_va;
    return d;
}

py::dict resolved_to_dict(const ResolvedCommConfig& r) {
    py::dict d;
    d["buffer_bytes"] = r.buffer_bytes;
    d["traffic_class"] = r.traffic_class;
    d["service_level"] = r.service_level;
    d["expansion_mode"] = r.expansion_mode;
    d["origin"] = r.origin;
    return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "ascend_dualpath native runtime: the emulated Ascend device (and NPU code where built)";

    py::module_::import("ascend_dualpath.errors");  // fail at import, not at the first error, if it is missing
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const Error& e) {
            py::object cls = py::module_::import("ascend_dualpath.errors").attr(error_class(e.kind()));
            PyErr_SetString(cls.ptr(), e.what());
        }
    });

    register_transfer(m);
    register_moe(m);

    m.def("compiled_backends", [] {
        std::vector<std::string> out{"emulator"};
#ifdef ADP_WITH_NPU
        out.push_back("npu");
#endif
        return out;
    });

    // ---- formats ------------------------------------------------------------------------------
    m.attr("WQE_BYTES") = wqe::kWqeBytes;
    m.attr("CQE_BYTES") = wqe::kCqeBytes;
    m.attr("OPCODE_WRITE") = wqe::kOpcodeWrite;
    m.attr("OPCODE_WRITE_WITH_IMM") = wqe::kOpcodeWriteWithImm;
    m.attr("OPCODE_READ") = wqe::kOpcodeRead;
    m.attr("OPCODE_RECV_WRITE_IMM") = wqe::kCqeOpcodeRecvWriteImm;
    m.attr("CONFIG_NOT_SET") = kConfigNotSet;
    m.def("encode_rdma_wqe", &encode_rdma_wqe, py::arg("opcode"), py::arg("owner"), py::arg("signaled"), py::arg("length"),
          py::arg("rkey"), py::arg("remote_addr"), py::arg("lkey"), py::arg("local_addr"), py::arg("imm") = 0);
    m.def("decode_rdma_wqe", &decode_rdma_wqe, py::arg("data"));
    m.def("encode_sq_doorbell", [](uint32_t qpn, uint32_t pi, uint32_t sl) {
        check_field("qpn", qpn, 0xffffff);
        check_field("sl", sl, 7);
        return wqe::encode_sq_doorbell(qpn, pi, sl);
    }, py::arg("qpn"), py::arg("pi"), py::arg("sl"));
    m.def("decode_sq_doorbell", [](uint64_t db) {
        py::dict d;
        d["qpn"] = wqe::doorbell_qpn(db);
        d["cmd"] = wqe::doorbell_cmd(db);
        d["pi"] = wqe::doorbell_pi(db);
        d["sl"] = wqe::doorbell_sl(db);
        return d;
    }, py::arg("value"));
    m.def("hccl_data_type_size", &hccl_data_type_size);

    py::enum_<MemKind>(m, "MemKind").value("DEVICE_GM", MemKind::kDeviceGm).value("HOST_DRAM", MemKind::kHostDram);
    py::enum_<QpState>(m, "QpState").value("READY_TO_SEND", QpState::kReadyToSend).value("ERROR", QpState::kError);
    m.attr("ACCESS_LOCAL_WRITE") = uint32_t(kLocalWrite);
    m.attr("ACCESS_REMOTE_WRITE") = uint32_t(kRemoteWrite);
    m.attr("ACCESS_REMOTE_READ") = uint32_t(kRemoteRead);

    // ---- models -------------------------------------------------------------------------------
    py::class_<CostModel>(m, "CostModel")
        .def(py::init<>())
        .def_readwrite("aiv_submit_ns", &CostModel::aiv_submit_ns)
        .def_readwrite("aicpu_issue_ns", &CostModel::aicpu_issue_ns)
        .def_readwrite("aicpu_wqe_ns", &CostModel::aicpu_wqe_ns)
        .def_readwrite("host_submit_ns", &CostModel::host_submit_ns)
        .def_readwrite("nic_wqe_ns", &CostModel::nic_wqe_ns)
        .def_readwrite("link_bytes_per_ns", &CostModel::link_bytes_per_ns)
        .def_readwrite("link_latency_ns", &CostModel::link_latency_ns)
        .def_readwrite("pcie_bytes_per_ns", &CostModel::pcie_bytes_per_ns)
        .def_readwrite("pcie_latency_ns", &CostModel::pcie_latency_ns)
        .def_readwrite("local_bytes_per_ns", &CostModel::local_bytes_per_ns)
        .def("check", &check_cost_model, "ConfigError naming the first field out of its range.");

    py::class_<ProductProfile>(m, "ProductProfile")
        .def(py::init(&product_profile), py::arg("name"))
        .def_readwrite("name", &ProductProfile::name)
        .def_readwrite("soc_version", &ProductProfile::soc_version)
        .def_readwrite("cube_cores", &ProductProfile::cube_cores)
        .def_readwrite("vector_cores", &ProductProfile::vector_cores)
        .def_readwrite("ub_bytes", &ProductProfile::ub_bytes)
        .def_readwrite("hccl_buffsize_mb", &ProductProfile::hccl_buffsize_mb)
        .def_readwrite("default_expansion_mode", &ProductProfile::default_expansion_mode)
        .def_readwrite("capability_bitmap", &ProductProfile::capability_bitmap)
        .def_readwrite("rdma_tc", &ProductProfile::rdma_tc)
        .def_readwrite("rdma_sl", &ProductProfile::rdma_sl)
        .def_readwrite("sq_depth", &ProductProfile::sq_depth)
        .def_readwrite("hbm_bytes", &ProductProfile::hbm_bytes)
        .def("check", &check_product_profile, "ConfigError naming the first field a device cannot run with.");

    // ---- fabric and memory --------------------------------------------------------------------
    py::class_<RegionInfo>(m, "RegionInfo")
        .def_readonly("lkey", &RegionInfo::lkey)
        .def_readonly("rkey", &RegionInfo::rkey)
        .def_readonly("access", &RegionInfo::access)
        .def_readonly("pd", &RegionInfo::pd)
        .def_readonly("device_id", &RegionInfo::device_id)
        .def_readonly("owner_pid", &RegionInfo::owner_pid)
        .def_readonly("kind", &RegionInfo::kind)
        .def_readonly("addr", &RegionInfo::base_va)
        .def_readonly("size", &RegionInfo::size)
        .def_readonly("shm_name", &RegionInfo::shm_name);

    py::class_<Fabric, std::shared_ptr<Fabric>>(m, "Fabric")
        .def_static("create", &Fabric::create, py::arg("name"), py::arg("max_regions") = Fabric::kDefaultMaxRegions,
                    py::arg("max_qps") = Fabric::kDefaultMaxQps)
        .def_static("attach", &Fabric::attach, py::arg("name"), py::arg("timeout_s"),
                    py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("name", &Fabric::name)
        .def_property_readonly("is_creator", &Fabric::is_creator)
        .def("close", &Fabric::close)
        .def_property_readonly("closed", &Fabric::closed)
        .def_property_readonly("creator_pid", &Fabric::creator_pid)
        .def_property_readonly("num_live_regions", &Fabric::num_live_regions)
        .def("reap_dead_owners", &Fabric::reap_dead_owners)
        .def_static("reap_stale_shm", &Fabric::reap_stale_shm, py::arg("shm_dir") = "/dev/shm")
        .def("lookup_rkey", [](const Fabric& f, uint32_t rkey) -> py::object {
            RegionInfo info;
            if (!f.lookup_rkey(rkey, &info) || !f.region_shm_name(info, &info.shm_name)) return py::none();
            return py::cast(info);
        })
        .def("check_remote", [](const Fabric& f, uint32_t rkey, uint64_t va, uint64_t len, uint32_t access) {
            AccessCheck c = f.check_remote(rkey, va, len, access);
            return py::make_tuple(c.syndrome, c.detail);
        })
        .def("check_local", [](const Fabric& f, uint32_t lkey, uint32_t pd, uint64_t va, uint64_t len, bool need_write) {
            AccessCheck c = f.check_local(lkey, pd, va, len, need_write);
            return py::make_tuple(c.syndrome, c.detail);
        });

    py::class_<Region, std::shared_ptr<Region>>(m, "Region", py::buffer_protocol())
        .def_buffer([](Region& r) {
            return py::buffer_info(r.data(), 1, py::format_descriptor<uint8_t>::format(), 1, {size_t(r.info().size)},
                                   {size_t(1)});
        })
        .def_property_readonly("addr", &Region::addr)
        .def_property_readonly("size", [](const Region& r) { return r.info().size; })
        .def_property_readonly("lkey", [](const Region& r) { return r.info().lkey; })
        .def_property_readonly("rkey", [](const Region& r) { return r.info().rkey; })
        .def_property_readonly("kind", [](const Region& r) { return r.info().kind; })
        .def_property_readonly("access", [](const Region& r) { return r.info().access; })
        .def_property_readonly("device_id", [](const Region& r) { return r.info().device_id; })
        .def_property_readonly("shm_name", [](const Region& r) { return r.info().shm_name; })
        .def_property_readonly("registered", &Region::registered)
        .def_property_readonly("info", &Region::info)
        .def("check_range", [](const Region& r, uint64_t va, uint64_t len) { r.at(va, len); }, py::arg("addr"),
             py::arg("length"))
        .def("close", &Region::close)
        .def("__enter__", [](py::object self) { return self; })
        .def("__exit__", [](Region& r, py::args) { r.close(); });

    // ---- queues -------------------------------------------------------------------------------
    py::class_<Completion>(m, "Completion")
        .def_property_readonly("opcode", &Completion::opcode)
        .def_property_readonly("owner", &Completion::owner)
        .def_property_readonly("status", &Completion::status)
        .def_property_readonly("syndrome", &Completion::syndrome)
        .def_property_readonly("qpn", [](const Completion& c) { return c.cqe.qpn; })
        .def_property_readonly("wqe_index", [](const Completion& c) { return c.cqe.wqe_index; })
        .def_property_readonly("byte_cnt", [](const Completion& c) { return c.cqe.byte_cnt; })
        .def_property_readonly("imm", [](const Completion& c) { return c.cqe.immtdata; })
        .def_property_readonly("vtime_ns", [](const Completion& c) { return c.cqe.vtime_ns; })
        .def_property_readonly("raw", [](const Completion& c) {
            return py::bytes(reinterpret_cast<const char*>(&c.cqe), sizeof(c.cqe));
        })
        .def_readonly("detail", &Completion::detail);

    py::class_<CompletionQueue, std::shared_ptr<CompletionQueue>>(m, "CompletionQueue")
        .def_property_readonly("depth", &CompletionQueue::depth)
        .def_property_readonly("lkey", &CompletionQueue::lkey)
        .def_property_readonly("consumer_index", &CompletionQueue::consumer_index)
        .def_property_readonly("region", &CompletionQueue::region)
        .def_property_readonly("closed", &CompletionQueue::closed)
        .def("poll", &CompletionQueue::poll, py::arg("max_entries"), py::arg("timeout_s"),
             py::call_guard<py::gil_scoped_release>())
        .def("close", &CompletionQueue::close);

    py::class_<WorkRequest>(m, "WorkRequest")
        .def(py::init([](uint32_t opcode, uint64_t local_addr, uint32_t lkey, uint32_t length, uint64_t remote_addr,
                         uint32_t rkey, bool signaled, uint32_t imm) {
                 return WorkRequest{opcode, local_addr, lkey, length, remote_addr, rkey, signaled, imm};
             }),
             py::arg("opcode"), py::arg("local_addr"), py::arg("lkey"), py::arg("length"), py::arg("remote_addr"),
             py::arg("rkey"), py::arg("signaled") = true, py::arg("imm") = 0)
        .def_readwrite("opcode", &WorkRequest::opcode)
        .def_readwrite("local_addr", &WorkRequest::local_addr)
        .def_readwrite("lkey", &WorkRequest::lkey)
        .def_readwrite("length", &WorkRequest::length)
        .def_readwrite("remote_addr", &WorkRequest::remote_addr)
        .def_readwrite("rkey", &WorkRequest::rkey)
        .def_readwrite("signaled", &WorkRequest::signaled)
        .def_readwrite("imm", &WorkRequest::imm);

    py::class_<QueuePair, std::shared_ptr<QueuePair>>(m, "QueuePair")
        .def_property_readonly("qpn", &QueuePair::qpn)
        .def_property_readonly("depth", &QueuePair::depth)
        .def_property_readonly("wqe_size", &QueuePair::wqe_size)
        .def_property_readonly("sl", &QueuePair::sl)
        .def_property_readonly("owner_shift", &QueuePair::owner_shift)
        .def_property_readonly("dest_qpn", &QueuePair::dest_qpn)
        .def_property_readonly("state", &QueuePair::state)
        .def_property_readonly("head", &QueuePair::head)
        .def_property_readonly("tail", &QueuePair::tail)
        .def_property_readonly("region", &QueuePair::region)
        .def_property_readonly("send_cq", &QueuePair::send_cq)
        .def_property_readonly("sq_addr", &QueuePair::sq_addr)
        .def_property_readonly("head_addr", &QueuePair::head_addr)
        .def_property_readonly("tail_addr", &QueuePair::tail_addr)
        .def_property_readonly("doorbell_addr", &QueuePair::doorbell_addr)
        .def_property_readonly("post_vtime_addr", &QueuePair::post_vtime_addr)
        .def_property_readonly("dirty_addr", &QueuePair::dirty_addr)
        .def_property("poster_vtime_ns", &QueuePair::poster_vtime_ns, &QueuePair::set_poster_vtime_ns)
        .def("connect", &QueuePair::connect, py::arg("dest_qpn"))
        .def("post", &QueuePair::post, py::arg("requests"), py::arg("submit_cost_ns"), py::arg("timeout_s"),
             py::arg("sl") = -1, py::call_guard<py::gil_scoped_release>())
        .def("post_segments", [](QueuePair& qp, uint32_t opcode, py::array_t<uint64_t, py::array::c_style> local_addrs,
                                 uint32_t lkey, py::array_t<uint64_t, py::array::c_style> remote_addrs, uint32_t rkey,
                                 py::array_t<uint64_t, py::array::c_style> lengths, uint32_t signal_every,
                                 double submit_cost_ns, double timeout_s) {
            const size_t n = size_t(lengths.size());
            if (size_t(local_addrs.size()) != n || size_t(remote_addrs.size()) != n)
                throw Error(ErrorKind::kConfig, cat("post_segments needs equal-length arrays, got ", local_addrs.size(),
                                                    " local, ", remote_addrs.size(), " remote, ", n, " lengths"));
            if (signal_every == 0) throw Error(ErrorKind::kConfig, "signal_every must be >= 1");
            std::vector<WorkRequest> reqs(n);
            auto la = local_addrs.unchecked<1>(), ra = remote_addrs.unchecked<1>(), ln = lengths.unchecked<1>();
            for (size_t i = 0; i < n; ++i) {
                if (ln(i) > 0xffffffffull)
                    throw Error(ErrorKind::kPayloadTooLarge, cat("segment ", i, " of ", ln(i), " bytes exceeds 2^32-1"));
                // the last segment is always signaled so the caller can wait for the whole list
                reqs[i] = WorkRequest{opcode, la(i), lkey, uint32_t(ln(i)), ra(i), rkey,
                                      (i + 1) % signal_every == 0 || i + 1 == n, 0};
            }
            py::gil_scoped_release release;
            return qp.post(reqs, submit_cost_ns, timeout_s);
        }, py::arg("opcode"), py::arg("local_addrs"), py::arg("lkey"), py::arg("remote_addrs"), py::arg("rkey"),
           py::arg("lengths"), py::arg("signal_every") = 1, py::arg("submit_cost_ns") = 0.0, py::arg("timeout_s") = 30.0,
           "Post one WQE per segment (uint64 arrays), signaling every `signal_every`-th and the last.")
        .def("write_wqe_bytes", [](QueuePair& qp, uint32_t index, const py::bytes& data) {
            const std::string s = data;
            qp.write_wqe_bytes(index, reinterpret_cast<const uint8_t*>(s.data()), uint32_t(s.size()));
        }, py::arg("index"), py::arg("data"))
        .def("set_head", &QueuePair::set_head, py::arg("head"))
        .def("ring_doorbell", &QueuePair::ring_doorbell, py::arg("value"), py::arg("post_vtime_ns") = 0.0)
        .def("drain", &QueuePair::drain, py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
        .def("reset", &QueuePair::reset, py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
        .def("close", &QueuePair::close)
        .def("__enter__", [](py::object self) { return self; })
        .def("__exit__", [](QueuePair& q, py::args) { q.close(); });

    py::class_<Nic, std::shared_ptr<Nic>>(m, "Nic")
        .def_property_readonly("virtual_time_ns", &Nic::virtual_time_ns)
        .def_property_readonly("wqes_executed", &Nic::wqes_executed)
        .def_property_readonly("bytes_moved", &Nic::bytes_moved)
        .def_property_readonly("cost", &Nic::cost)
        .def_property("sl_weights", &Nic::sl_weights, &Nic::set_sl_weights)
        .def("set_paused", &Nic::set_paused, py::arg("paused"));

    py::class_<Device, std::shared_ptr<Device>>(m, "Device")
        .def(py::init<std::shared_ptr<Fabric>, uint32_t, ProductProfile, CostModel>(), py::arg("fabric"),
             py::arg("device_id"), py::arg("profile"), py::arg("cost"))
        .def_property_readonly("device_id", &Device::device_id)
        .def_property_readonly("pd", &Device::pd)
        .def_property_readonly("profile", &Device::profile)
        .def_property_readonly("fabric", &Device::fabric)
        .def_property_readonly("nic", &Device::nic)
        .def("alloc_region", &Device::alloc_region, py::arg("size"), py::arg("kind"), py::arg("access"))
        .def("create_cq", &Device::create_cq, py::arg("depth"))
        .def("create_qp", &Device::create_qp, py::arg("send_cq"), py::arg("recv_cq"), py::arg("depth"), py::arg("sl"),
             py::arg("wqe_size") = 64)
        .def("close", &Device::close, py::call_guard<py::gil_scoped_release>())
        .def("__enter__", [](py::object self) { return self; })
        .def("__exit__", [](Device& d, py::args) { py::gil_scoped_release release; d.close(); });

    // ---- HCCL communicator --------------------------------------------------------------------
    py::class_<HcclCommConfig>(m, "HcclCommConfig")
        .def(py::init<>())
        .def_readwrite("hcclBufferSize", &HcclCommConfig::hcclBufferSize)
        .def_readwrite("hcclDeterministic", &HcclCommConfig::hcclDeterministic)
        .def_readwrite("hcclCommName", &HcclCommConfig::hcclCommName)
        .def_readwrite("hcclUdi", &HcclCommConfig::hcclUdi)
        .def_readwrite("hcclOpExpansionMode", &HcclCommConfig::hcclOpExpansionMode)
        .def_readwrite("hcclRdmaTrafficClass", &HcclCommConfig::hcclRdmaTrafficClass)
        .def_readwrite("hcclRdmaServiceLevel", &HcclCommConfig::hcclRdmaServiceLevel)
        .def_readwrite("hcclWorldRankID", &HcclCommConfig::hcclWorldRankID)
        .def_readwrite("hcclJobID", &HcclCommConfig::hcclJobID)
        .def_readwrite("hcclExecTimeOut", &HcclCommConfig::hcclExecTimeOut);
    m.def("resolve_comm_config", [](const HcclCommConfig& c, const ProductProfile& p) {
        return resolved_to_dict(resolve_comm_config(c, p, [](const char* n) { return std::getenv(n); }));
    }, py::arg("config"), py::arg("profile"));

    py::class_<RemoteMem>(m, "RemoteMem")
        .def(py::init([](uint64_t addr, uint64_t size, uint32_t rkey) { return RemoteMem{addr, size, rkey}; }),
             py::arg("addr"), py::arg("size"), py::arg("rkey"))
        .def_readonly("addr", &RemoteMem::addr)
        .def_readonly("size", &RemoteMem::size)
        .def_readonly("rkey", &RemoteMem::rkey);

    py::class_<RankInfo>(m, "RankInfo")
        .def_readonly("rank", &RankInfo::rank)
        .def_readonly("device_id", &RankInfo::device_id)
        .def_readonly("windows_in", &RankInfo::windows_in)
        .def_readonly("windows_out", &RankInfo::windows_out)
        .def_readonly("notify", &RankInfo::notify)
        .def_readonly("aiv_qpns", &RankInfo::aiv_qpns)
        .def("serialize", [](const RankInfo& r) { return py::bytes(r.serialize()); })
        .def_static("deserialize", [](const py::bytes& b) { return RankInfo::deserialize(std::string(b)); });

    py::class_<OneSideDesc>(m, "OneSideDesc")
        .def(py::init([](uint64_t local_addr, uint64_t remote_addr, uint64_t count, uint32_t data_type) {
                 return OneSideDesc{local_addr, remote_addr, count, data_type};
             }),
             py::arg("local_addr"), py::arg("remote_addr"), py::arg("count"), py::arg("data_type"));

    py::class_<HcclComm, std::shared_ptr<HcclComm>>(m, "HcclComm")
        .def(py::init<std::shared_ptr<Device>, uint32_t, uint32_t, HcclCommConfig>(), py::arg("device"), py::arg("rank"),
             py::arg("world_size"), py::arg("config"))
        .def_property_readonly("rank", &HcclComm::rank)
        .def_property_readonly("world_size", &HcclComm::world_size)
        .def_property_readonly("resolved", [](const HcclComm& c) { return resolved_to_dict(c.resolved()); })
        .def_property_readonly("capability_bitmap", &HcclComm::capability_bitmap)
        .def_property_readonly("aiv_dataplane", &HcclComm::aiv_dataplane)
        .def_property_readonly("windows_in", &HcclComm::windows_in)
        .def_property_readonly("windows_out", &HcclComm::windows_out)
        .def_property_readonly("notify_region", &HcclComm::notify_region)
        .def_property_readonly("device", &HcclComm::device)
        .def_property_readonly("connected", &HcclComm::connected)
        .def_property_readonly("batch_write_issues", &HcclComm::batch_write_issues)
        .def("aiv_qp", &HcclComm::aiv_qp, py::arg("peer"))
        .def("local_info", &HcclComm::local_info)
        .def("peer_info", &HcclComm::peer_info, py::arg("peer"))
        .def("connect", &HcclComm::connect, py::arg("peers"))
        .def("register_local", &HcclComm::register_local, py::arg("region"))
        .def("add_remote_mem", &HcclComm::add_remote_mem, py::arg("peer"), py::arg("mem"))
        .def("remote_mems", &HcclComm::remote_mems, py::arg("peer"))
        .def("batch_put", &HcclComm::batch_put, py::arg("peer"), py::arg("descs"), py::arg("timeout_s"),
             py::call_guard<py::gil_scoped_release>())
        .def("batch_get", &HcclComm::batch_get, py::arg("peer"), py::arg("descs"), py::arg("timeout_s"),
             py::call_guard<py::gil_scoped_release>())
        .def("batch_write", &HcclComm::batch_write, py::arg("items_addr"), py::arg("num_items"), py::arg("core_id"))
        .def("batch_write_wait", &HcclComm::batch_write_wait, py::arg("handle"), py::arg("timeout_s"),
             py::call_guard<py::gil_scoped_release>())
        .def("next_magic", &HcclComm::next_magic)
        .def("notify_record", &HcclComm::notify_record, py::arg("peer"), py::arg("slot"), py::arg("magic"),
             py::arg("timeout_s"), py::call_guard<py::gil_scoped_release>())
        .def("notify_wait", &HcclComm::notify_wait, py::arg("slot"), py::arg("magic"), py::arg("timeout_s"),
             py::call_guard<py::gil_scoped_release>())
        .def("notify_value", &HcclComm::notify_value, py::arg("slot"))
        .def("close", &HcclComm::close, py::call_guard<py::gil_scoped_release>())
        .def("__enter__", [](py::object self) { return self; })
        .def("__exit__", [](HcclComm& c, py::args) { py::gil_scoped_release release; c.close(); });
}
