// CUDA launcher: AdamW over flat device buffers, moments possibly in mapped pinned host memory.
#pragma once
#include <cuda_runtime_api.h>

#include "ramstream/adamw.h"
#include "ramstream/status.h"

namespace ramstream::cuda {

// One AdamW step over b.n elements, the numerics of ramstream/adamw.h (docs/NUMERICS.md rule 3)
// using the vector-body formula for every element (no scalar tail), and the same stochastic
// rounding of bf16 moments (rule 2), so results equal the host kernel's except in the host's last
// n % 16 elements. The update uses the float moments; only their stored copies are rounded.
// b.param, b.grad and b.out are device pointers. b.exp_avg / b.exp_avg_sq are device pointers:
// device memory, or the device alias of mapped pinned host memory (cudaHostGetDevicePointer),
// which the kernel then reads and writes over PCIe ("gpu" optimizer mode).
// Coefficients are computed here in double and passed to the kernel as floats.
// Asynchronous on `stream`; thread-safe for disjoint buffers; no GIL involved.
Status adamw(const AdamWBuffers& b, const AdamWHyper& h, cudaStream_t stream);

}  // namespace ramstream::cuda
