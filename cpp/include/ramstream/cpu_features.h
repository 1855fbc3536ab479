// Run-time ISA dispatch: scalar, AVX2+FMA+F16C, AVX-512 (F/BW/VL/DQ). Chosen once per process
// from the CPU and the RAMSTREAM_FORCE_ISA environment variable; thread-safe.
#pragma once
#include "ramstream/status.h"

namespace ramstream {

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

const char* isa_name(Isa isa);
// Parses "scalar", "avx2", "avx512"; kInvalidArgument for anything else.
Status parse_isa(const char* name, Isa* out);
// The best ISA this CPU (and this build) supports.
Isa best_supported_isa();
// The ISA kernels use: RAMSTREAM_FORCE_ISA if set (an unsupported or unknown value is reported
// by isa_env_error() and ignored), else best_supported_isa(). Read once, then cached.
Isa active_isa();
// Message about a bad RAMSTREAM_FORCE_ISA value, or "" when it was fine or unset.
const char* isa_env_error();
// Overrides the active ISA (tests and benchmarks). kUnsupported when the CPU lacks it.
Status set_active_isa(Isa isa);

}  // namespace ramstream
