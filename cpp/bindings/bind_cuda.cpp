// Bindings for the cuda area (filled in by its feature).
#include "common.h"

namespace ramstream::py {

void bind_cuda(nb::module_& m) { (void)m; }

}  // namespace ramstream::py
