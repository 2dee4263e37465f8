// Virtual clock and cost model of the emulated device, and the product profiles it defaults from.
//
// Bytes move for real (memcpy at wall-clock speed); the virtual clock says how long the same work
// would take on the modelled hardware. Every figure is a default that callers can override; the
// sources are listed once, in docs/cost_model.md, and summarized here.
#pragma once

#include <cstdint>
#include <string>

namespace adp::emu {

enum class Poster : uint32_t { kAiv = 0, kAicpu = 1, kHost = 2 };

struct CostModel {
    double aiv_submit_ns = 1000.0;     // one RDMA WQE build + flush + doorbell from a vector core (~1 us, DualPath paper)
    double aicpu_issue_ns = 1500.0;    // fixed cost per BatchWrite issue to the AICPU server (1-2 us, MC2 design doc)
    double aicpu_wqe_ns = 200.0;       // AICPU posting one WQE of a BatchWrite
    double host_submit_ns = 6000.0;    // a host-submitted transfer (cudaMemcpyAsync 5-7 us, DualPath paper)
    double nic_wqe_ns = 50.0;          // NIC per-WQE processing
    double link_bytes_per_ns = 25.0;   // RoCE port, 200 GbE = 25 GB/s = 25 bytes/ns
    double link_latency_ns = 2000.0;   // one-way RoCE latency incl. switch
    double pcie_bytes_per_ns = 26.0;   // PCIe Gen4 x16 effective (host DRAM <-> NIC)
    double pcie_latency_ns = 800.0;
    double local_bytes_per_ns = 100.0; // NIC loopback between two regions of the same device
};

// What the emulated device reports as its product; figures from public Ascend product documentation.
struct ProductProfile {
    std::string name;              // "A2" or "A3"
    std::string soc_version;       // SOC_VERSION as the build and npu-smi name it
    uint32_t cube_cores = 24;
    uint32_t vector_cores = 48;    // 1 AIC : 2 AIV per AI Core
    uint32_t ub_bytes = 196608;    // 192 KB unified buffer per vector core
    uint32_t hccl_buffsize_mb = 200;
    uint32_t default_expansion_mode = 1;  // HcclCommConfig encoding: 0 default, 1 host, 2 aicpu, 3 aiv
    uint32_t capability_bitmap = 0x04;    // bit 0x04: AIV dataplane (HDK >= 25.0.RC1.1)
    uint32_t rdma_tc = 132;
    uint32_t rdma_sl = 4;
    uint32_t sq_depth = 4096;
    uint64_t hbm_bytes = 64ull << 30;
};

// ConfigError naming the first field out of its range: bandwidths and latencies finite and > 0, per-operation
// costs finite and >= 0 (a free step is a valid model); a NaN or infinite figure would put NaN, 0 or 2^63 on
// the virtual clock. Device checks both at construction.
void check_cost_model(const CostModel& cost);
// ConfigError naming the first field a device cannot run with (e.g. sq_depth 0, vector_cores 0).
void check_product_profile(const ProductProfile& profile);

inline ProductProfile product_profile(const std::string& name) {
    ProductProfile p;
    p.name = name;
    if (name == "A2") {
        p.soc_version = "Ascend910B1";
        p.default_expansion_mode = 1;  // HOST is A2's default expansion
    } else if (name == "A3") {
        p.soc_version = "Ascend910_9391";
        p.default_expansion_mode = 2;  // AI_CPU is A3's default expansion
    }
    return p;
}

}  // namespace adp::emu
