// Bindings for build facts, ISA dispatch and the thread pool.
#include <nanobind/stl/string.h>

#include "common.h"
#include "ramstream/cpu_features.h"
#include "ramstream/device.h"
#include "ramstream/thread_pool.h"

namespace ramstream::py {

void bind_system(nb::module_& m) {
  m.def("built_with_cuda", &built_with_cuda, "True when CUDA kernels were compiled in.");
  m.def("cuda_runtime_version", &cuda_runtime_version, "CUDART_VERSION built against, 0 if none.");
  m.def("cuda_device_count", &cuda_device_count,
        "GPUs the static CUDA runtime sees; 0 with no build, driver or device.");
  m.def("cuda_unavailable_reason", &cuda_unavailable_reason);
  m.def("active_isa", [] { return std::string(isa_name(active_isa())); },
        "ISA the host kernels use: 'scalar', 'avx2' or 'avx512'.");
  m.def("best_isa", [] { return std::string(isa_name(best_supported_isa())); });
  m.def("isa_env_error", [] { return std::string(isa_env_error()); },
        "Why RAMSTREAM_FORCE_ISA was ignored, or ''.");
  m.def(
      "set_isa",
      [](const std::string& name) {
        Isa isa;
        check(parse_isa(name.c_str(), &isa));
        check(set_active_isa(isa));
      },
      nb::arg("name"), "Force the host kernels' ISA (tests, benchmarks).");
  m.def("num_threads", [] { return global_pool().size(); }, "Threads of the host pool.");
  m.def(
      "set_num_threads",
      [](int n) {
        if (n < 0) raise_value_error("threads: must be >= 0 (0 = all cores), got " + std::to_string(n));
        nb::gil_scoped_release release;
        set_global_pool_size(n);
      },
      nb::arg("n"), "Resize the host pool (0 = RAMSTREAM_NUM_THREADS or all cores).");
}

}  // namespace ramstream::py
