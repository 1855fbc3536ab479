// Bindings for the adamw area (filled in by its feature).
#include "common.h"

namespace ramstream::py {

void bind_adamw(nb::module_& m) { (void)m; }

}  // namespace ramstream::py
