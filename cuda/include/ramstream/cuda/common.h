// Helpers shared by the CUDA launchers: cudaError_t -> Status, launch checks. No nanobind here.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ramstream/status.h"

namespace ramstream::cuda {

// Ok for cudaSuccess; otherwise kCudaError naming `what` and the CUDA error string.
Status from_cuda(cudaError_t err, const char* what);
// The status of the last kernel launch on this thread (cudaGetLastError), naming `kernel`.
Status launch_status(const char* kernel);
// A grid size for n items with `per_block` items per block, capped at a few waves of the GPU.
unsigned grid_for(std::int64_t n, int per_block);

inline cudaStream_t as_stream(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

}  // namespace ramstream::cuda
