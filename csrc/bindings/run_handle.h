// The Python handle of a kernel run on the emulated vector cores, shared by the transfer and MoE bindings:
// the kernel's name, the virtual time its HCCL work finished, and a bounded wait that releases the GIL
// while the cores run, then returns one status dict per core.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "adp/transfer_kernels.h"

namespace adp::bindings {

namespace py = pybind11;

// Binds `Run` as `class_name`. `Run` holds `launch` (a kernel::Launch) and `status` (one
// xfer::CoreStatus per core). Every core's dict has `code` and `posted`; `add_status_fields(dict, core_status)`
// adds the fields particular to the kernel. Returns the class so a caller can bind more of the run.
template <typename Run, typename AddStatusFields>
py::class_<Run, std::shared_ptr<Run>> bind_run_handle(py::module_& m, const char* class_name,
                                                      AddStatusFields add_status_fields, const char* wait_doc) {
    py::class_<Run, std::shared_ptr<Run>> cls(m, class_name);
    cls.def_property_readonly("name", [](const Run& r) { return r.launch->name(); })
        .def_property_readonly("hccl_done_vtime_ns", [](const Run& r) { return r.launch->hccl_done_vtime_ns(); })
        .def(
            "wait",
            [add_status_fields](Run& r, double timeout_s) {
                {
                    py::gil_scoped_release release;
                    r.launch->wait(timeout_s);
                }
                py::list out;
                for (const adp::xfer::CoreStatus& s : r.status) {
                    py::dict d;
                    d["code"] = s.code;
                    d["posted"] = s.posted;
                    add_status_fields(d, s);
                    out.append(d);
                }
                return out;
            },
            py::arg("timeout_s"), wait_doc);
    return cls;
}

}  // namespace adp::bindings
