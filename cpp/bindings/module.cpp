// ramstream._C: the one compiled module. Each area registers its functions from its own file.
#include "common.h"

NB_MODULE(_C, m) {
  m.doc() = "ramstream native core (C++17 host kernels, pinned arena, optional CUDA kernels)";
  ramstream::py::bind_system(m);
  ramstream::py::bind_memory(m);
  ramstream::py::bind_adamw(m);
  ramstream::py::bind_quant(m);
  ramstream::py::bind_cuda(m);
  ramstream::py::bind_disk(m);
}
