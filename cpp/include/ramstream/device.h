// What CUDA this build has and what the machine offers. Safe with no GPU and no driver.
#pragma once
#include <string>

namespace ramstream {

bool built_with_cuda();
// CUDA runtime version the module was built with (e.g. 13000), 0 without CUDA.
int cuda_runtime_version();
// Number of usable GPUs: 0 without a CUDA build, a driver or a device (error 35 counts as none).
int cuda_device_count();
// Why cuda_device_count() is 0, or "" when GPUs exist.
std::string cuda_unavailable_reason();

}  // namespace ramstream
