// Bindings for the memory area (filled in by its feature).
#include "common.h"

namespace ramstream::py {

void bind_memory(nb::module_& m) { (void)m; }

}  // namespace ramstream::py
