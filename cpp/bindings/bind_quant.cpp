// Bindings for the quant area (filled in by its feature).
#include "common.h"

namespace ramstream::py {

void bind_quant(nb::module_& m) { (void)m; }

}  // namespace ramstream::py
